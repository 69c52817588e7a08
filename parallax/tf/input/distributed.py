"""Distributed input: global batches split over the replicas, or one pipeline per worker.

``strategy.experimental_distribute_dataset(iterable)`` takes an iterable of *global* batches
(pytrees of arrays whose leading dimension is the global batch) and yields them as
``PerReplica`` values: replica ``i`` holds the next ``b_i`` rows, each row sent straight to
its device, with TensorFlow's ``b_i`` (:mod:`parallax.tf.input.partial_batches`): ``G / n`` each
when the global batch ``G`` divides over the ``n`` replicas, else one more row for the first
``G % n``; the last, partial batch of a data set fills the replicas in order (the last ones
get fewer rows or none) and arrives padded with zero rows, the true counts in
``PerReplica.rows``. ``distribute_datasets_from_function`` calls a function with an
:class:`InputContext` once per input pipeline (one per worker process) and takes the
per-replica batches it yields, one per local replica in turn; a last, short group leaves the
remaining replicas empty, as TensorFlow does.

Any Python iterable works (a list, a generator function's result, a ``tf.data.Dataset``
through ``.as_numpy_iterator()``, a Grain loader); it is iterated afresh each epoch. A
:class:`~parallax.tf.Dataset` carries an auto-sharding policy, applied over several workers
(:mod:`parallax.tf.input.auto_shard`, :mod:`parallax.tf.input.workers`); ``InputOptions``
(:mod:`parallax.tf.input.options`) choose per-replica pipelines and how many steps are split
ahead.

References:
  TensorFlow ``tf.distribute.Strategy.experimental_distribute_dataset``,
  ``distribute_datasets_from_function``, ``tf.distribute.InputContext``;
  ``tensorflow/python/distribute/input_lib.py`` (partial batches).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from parallax.tf.input import partial_batches, workers
from parallax.tf.input.auto_shard import AutoShardPolicy
from parallax.tf.input.options import InputOptions, InputReplicationMode
from parallax.tf.input.dataset import Dataset


@dataclasses.dataclass(frozen=True)
class InputContext:
    """What a dataset function needs to know to build its worker's part of the input.

    Attributes:
      num_input_pipelines: input pipelines in the job (one per worker process).
      input_pipeline_id: this pipeline's index, ``0 .. num_input_pipelines - 1``; shard
        the data by it (``dataset.shard(num_input_pipelines, input_pipeline_id)``).
      num_replicas_in_sync: replicas over all workers.

    Example:
      >>> ctx = InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=8)
      >>> ctx.get_per_replica_batch_size(64)
      8

    References:
      TensorFlow, ``tf.distribute.InputContext``.
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size / num_replicas_in_sync``, which must divide exactly.

        Raises:
          ValueError: the global batch does not divide over the replicas.
        """
        n = self.num_replicas_in_sync
        if global_batch_size % n:
            raise ValueError(
                f"px.tf.InputContext.get_per_replica_batch_size: the global batch size "
                f"{global_batch_size} is not divisible by num_replicas_in_sync={n}; use a "
                f"multiple of {n}, e.g. {(global_batch_size // n + 1) * n}.")
        return global_batch_size // n


@dataclasses.dataclass(frozen=True)
class ValueContext:
    """Which replica ``experimental_distribute_values_from_function`` builds a value for.

    Attributes:
      replica_id_in_sync_group: the replica, ``0 .. num_replicas_in_sync - 1``.
      num_replicas_in_sync: the number of replicas.

    Example:
      >>> ValueContext(3, 8).replica_id_in_sync_group
      3

    References:
      TensorFlow, ``tf.distribute.experimental.ValueContext``.
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


def global_batch_rows(api: str, element, index: int) -> tuple[Any, int]:
    """``element``'s leaves as numpy arrays and their common number of rows.

    Raises:
      ValueError: a scalar leaf, or leaves with different numbers of rows.
    """
    element = jax.tree.map(np.asarray, element)
    found = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(element):
        where = jax.tree_util.keystr(path) or "its root"
        if leaf.ndim == 0:
            raise ValueError(
                f"{api}: element {index} of the dataset has a scalar at {where}; every leaf "
                "needs a leading batch dimension (batch the dataset, e.g. "
                "dataset.batch(global_batch_size)).")
        found.setdefault(leaf.shape[0], where)
    if len(found) > 1:
        raise ValueError(
            f"{api}: element {index} of the dataset has leaves with different numbers of rows "
            f"({', '.join(f'{r} at {w}' for r, w in found.items())}); every leaf of a global "
            "batch needs the same leading (batch) dimension.")
    return element, next(iter(found), 0)


@dataclasses.dataclass(frozen=True)
class DistributedDataset:
    """Global batches, yielded as ``PerReplica`` values (TF's ``DistributedDataset``).

    Attributes:
      strategy: the strategy whose replicas receive the rows.
      dataset: an iterable of global batches (pytrees of arrays, leading dim = batch), or a
        :class:`~parallax.tf.Dataset`, sharded over several workers by its policy.
      options: the :class:`~parallax.tf.InputOptions` (None: split each batch when asked).

    Example:
      >>> import parallax as px
      >>> strategy = px.tf.MirroredStrategy()
      >>> batches = [np.arange(16.0).reshape(16, 1)]
      >>> first = next(iter(strategy.experimental_distribute_dataset(batches)))
      >>> first.shape, first.values[1].tolist()
      ((2, 1), [[2.0], [3.0]])

    References:
      TensorFlow, ``tf.distribute.DistributedDataset``.
    """

    strategy: Any
    dataset: Iterable
    options: InputOptions | None = None

    def __iter__(self) -> Iterator:
        return workers.prefetched(self._batches(), _buffer_size(self.options))

    def _batches(self) -> Iterator:
        api = "px.tf.MirroredStrategy.experimental_distribute_dataset"
        rows_of = functools.partial(global_batch_rows, api)
        if not isinstance(self.dataset, Dataset):
            yield from self._split(api, self.dataset)
            return
        num_workers, worker = workers.workers_of(self.strategy)
        policy = self.dataset.policy
        elements = self.dataset.elements_for_worker(api, num_workers, worker)
        if num_workers == 1:
            yield from self._split(api, elements)
        elif policy is AutoShardPolicy.DATA:
            yield from workers.data_sharded(self.strategy, elements, rows_of, api)
        else:
            yield from workers.per_worker_stream(self.strategy, elements, rows_of,
                                                      self.dataset.batch_size, api)

    def _split(self, api: str, batches: Iterable) -> Iterator:
        """Every worker reads the same global batches and takes its replicas' rows."""
        n = self.strategy.num_replicas_in_sync
        global_batch = None
        for index, element in enumerate(batches):
            element, rows = global_batch_rows(api, element, index)
            if global_batch is None:  # TF reads it from the dataset's batch(): the first one
                global_batch = rows
            if rows == 0:
                continue  # no replica has data: TF ends the step too (no empty step runs)
            split = partial_batches.split_rows(rows, global_batch, n)
            yield jax.tree.map(
                lambda a, split=split: self.strategy.distribute_global_batch(a, split), element)


@dataclasses.dataclass(frozen=True)
class DistributedDatasetsFromFunction:
    """Per-replica batches from one pipeline per worker (TF's ``distribute_datasets_from_function``).

    Attributes:
      strategy: the strategy.
      dataset_fn: ``dataset_fn(InputContext) -> iterable`` of per-replica batches (batch
        size ``ctx.get_per_replica_batch_size(global_batch)``).
      options: the :class:`~parallax.tf.InputOptions`; ``PER_REPLICA`` calls ``dataset_fn``
        once per replica, as TensorFlow's ``MirroredStrategy`` does.

    Each step takes the next element for each of this worker's replicas, in replica order.
    As in TensorFlow (``input_lib.py``, ``_get_value_or_dummy``), elements may be shorter than
    the others (a partial last batch) and when the pipeline ends inside a group the remaining
    replicas get no rows; the components are padded with zero rows to the longest
    (``PerReplica.rows`` holds the true counts). Over several processes the padded shape and
    the end of the data would have to be agreed on by every worker each step (TensorFlow
    all-reduces them): there, a short or uneven group is refused, naming the fix.

    Example:
      >>> import parallax as px
      >>> strategy = px.tf.MirroredStrategy()
      >>> def dataset_fn(ctx):
      ...     b = ctx.get_per_replica_batch_size(16)
      ...     return [np.full((b,), i, np.float32) for i in range(8)]
      >>> first = next(iter(strategy.distribute_datasets_from_function(dataset_fn)))
      >>> first.values[7].tolist()
      [7.0, 7.0]

    References:
      TensorFlow, ``tf.distribute.Strategy.distribute_datasets_from_function``.
    """

    strategy: Any
    dataset_fn: Callable
    options: InputOptions | None = None

    def __iter__(self) -> Iterator:
        return workers.prefetched(self._steps(), _buffer_size(self.options))

    def _steps(self) -> Iterator:
        api = "px.tf.MirroredStrategy.distribute_datasets_from_function"
        local = self.strategy.num_local_replicas
        if (self.options is not None and self.options.experimental_replication_mode
                is InputReplicationMode.PER_REPLICA):
            yield from self._per_replica(api, local)
            return
        iterator = iter(self.dataset_fn(self.strategy.input_context()))
        index = 0
        while True:
            group = []
            for element in iterator:
                group.append(global_batch_rows(api, element, index))
                index += 1
                if len(group) == local:
                    break
            if not group:
                return
            yield self._distribute(api, local, group + [None] * (local - len(group)))

    def _per_replica(self, api: str, local: int) -> Iterator:
        """One pipeline per replica (TF's ``PER_REPLICA``): replica ``i`` reads pipeline ``i``.

        The step runs while any pipeline has an element; the others get empty batches.
        """
        n = self.strategy.num_replicas_in_sync
        iterators = [iter(self.dataset_fn(InputContext(n, i, n)))
                     for i in self.strategy.local_replica_ids()]
        for index in itertools.count():
            group = [next(it, None) for it in iterators]
            if all(e is None for e in group):
                return
            yield self._distribute(api, local, [
                None if e is None else global_batch_rows(api, e, index) for e in group])

    def _distribute(self, api: str, local: int, group: list):
        """One step: ``group[i]`` is local replica ``i``'s ``(element, rows)``, or None."""
        elements = [g[0] for g in group if g is not None]
        rows = tuple(0 if g is None else g[1] for g in group)
        trailing = [jax.tree.map(lambda a: (a.shape[1:], a.dtype), e) for e in elements]
        if any(t != trailing[0] for t in trailing):
            odd = next(t for t in trailing if t != trailing[0])
            raise ValueError(
                f"{api}: the per-replica elements of one step differ in structure, dtype or "
                f"shape beyond the batch dimension ({trailing[0]} vs {odd}); only the number of "
                "rows may differ (a partial last batch).")
        padded = partial_batches.padding_of(rows)
        if padded is not None and jax.process_count() > 1:
            raise ValueError(
                f"{api}: this worker's per-replica elements of one step have rows {rows} "
                f"(a partial last batch, or the pipeline ended within the step) while "
                f"{jax.process_count()} processes must agree on one padded shape; batch each "
                "pipeline with drop_remainder=True and give every worker the same number of "
                "steps (TensorFlow agrees on them with an all-reduce each step; parallax "
                "does not re-create that across processes).")
        width = max(rows)

        def pad(a):  # zero rows after the real ones, as TF's empty dummy batches are zeros
            return np.pad(a, [(0, width - a.shape[0])] + [(0, 0)] * (a.ndim - 1))

        empty = jax.tree.map(lambda a: np.zeros((width,) + a.shape[1:], a.dtype), elements[0])
        padded_elements = [empty if g is None else jax.tree.map(pad, g[0]) for g in group]
        return jax.tree.map(lambda *xs: self.strategy.distribute_local_components(
            np.stack(xs), padded), *padded_elements)


def _buffer_size(options: InputOptions | None) -> int:
    """Steps prefetched: the option's, or 0 without options (split each batch when asked)."""
    return 0 if options is None else options.experimental_per_replica_buffer_size
