"""Distributed input: global batches split over the replicas, or one pipeline per worker.

``strategy.experimental_distribute_dataset(iterable)`` takes an iterable of *global* batches
(pytrees of arrays whose leading dimension is the global batch) and yields them as
``PerReplica`` values: replica ``i`` holds rows ``[i * b, (i + 1) * b)`` with ``b`` the
per-replica batch, each row sent straight to its device. ``distribute_datasets_from_function``
calls a function with an :class:`InputContext` once per input pipeline (one per worker
process) and takes the per-replica batches it yields, one per local replica in turn.

Any Python iterable works (a list, a generator function's result, a ``tf.data.Dataset``
through ``.as_numpy_iterator()``, a Grain loader); it is iterated afresh each epoch.

References:
  TensorFlow ``tf.distribute.Strategy.experimental_distribute_dataset``,
  ``distribute_datasets_from_function``, ``tf.distribute.InputContext``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np


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


def split_global_batch(api: str, element, n: int, index: int):
    """Checks every leaf of a global batch divides over ``n`` replicas; returns numpy leaves."""

    def check(path, leaf):
        array = np.asarray(leaf)
        rows = array.shape[0] if array.ndim else None
        if rows is None or rows % n:
            raise ValueError(
                f"{api}: element {index} of the dataset has a global batch of "
                f"{'no rows (a scalar)' if rows is None else f'{rows} rows'} at "
                f"{jax.tree_util.keystr(path) or 'its root'}, not divisible by the {n} "
                f"replicas (num_replicas_in_sync); batch the data with a global batch size "
                f"that is a multiple of {n} and drop the last partial batch "
                "(drop_remainder=True).")
        return array

    return jax.tree_util.tree_map_with_path(check, element)


@dataclasses.dataclass(frozen=True)
class DistributedDataset:
    """Global batches, yielded as ``PerReplica`` values (TF's ``DistributedDataset``).

    Attributes:
      strategy: the strategy whose replicas receive the rows.
      dataset: an iterable of global batches (pytrees of arrays, leading dim = batch).

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

    def __iter__(self) -> Iterator:
        api = "px.tf.MirroredStrategy.experimental_distribute_dataset"
        n = self.strategy.num_replicas_in_sync
        for index, element in enumerate(self.dataset):
            element = split_global_batch(api, element, n, index)
            yield jax.tree.map(self.strategy.distribute_global_batch, element)


@dataclasses.dataclass(frozen=True)
class DistributedDatasetsFromFunction:
    """Per-replica batches from one pipeline per worker (TF's ``distribute_datasets_from_function``).

    Attributes:
      strategy: the strategy.
      dataset_fn: ``dataset_fn(InputContext) -> iterable`` of per-replica batches (batch
        size ``ctx.get_per_replica_batch_size(global_batch)``).

    Each step takes the next element for each of this worker's replicas, in replica order;
    a last incomplete group (fewer elements than replicas) is dropped.

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

    def __iter__(self) -> Iterator:
        api = "px.tf.MirroredStrategy.distribute_datasets_from_function"
        local = self.strategy.num_local_replicas
        iterator = iter(self.dataset_fn(self.strategy.input_context()))
        while True:
            group = []
            for element in iterator:
                group.append(jax.tree.map(np.asarray, element))
                if len(group) == local:
                    break
            if len(group) < local:
                return
            shapes = [jax.tree.map(np.shape, g) for g in group]
            if any(s != shapes[0] for s in shapes):
                raise ValueError(
                    f"{api}: the {local} per-replica elements of one step differ in structure "
                    f"or shape ({shapes[0]} vs {next(s for s in shapes if s != shapes[0])}); "
                    "every replica needs the same batch shape (drop_remainder=True).")
            yield jax.tree.map(lambda *xs: self.strategy.distribute_local_components(
                np.stack(xs)), *group)
