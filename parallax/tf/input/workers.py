"""Feeding the replicas of several workers from an auto-sharded :class:`~parallax.tf.Dataset`.

Two shapes of input, after :mod:`parallax.tf.input.auto_shard`'s policies:

* **DATA**: every worker reads the same global batches. Each global batch of ``p`` rows is
  cut into ``N`` mini-batches by TF's legacy rebatch (``ceil(p / N)`` rows each) and replica
  ``r`` of worker ``k`` takes mini-batch ``k + r * W`` (:func:`data_sharded`). A step is one
  global batch, as with a plain iterable; only which rows land on which replica differs
  (a plain iterable's replica ``i`` takes the ``i``-th block of rows).
* **FILE, OFF, HINT**: each worker reads its own stream of batches of ``G`` rows and
  rebatches it into mini-batches of ``worker_batch_sizes(G, W, R, k)``; each step its ``R``
  replicas take the next ``R`` of them (:func:`per_worker_stream`). The workers' streams
  may end at different steps, so, as TensorFlow does with an all-reduce, every step the
  workers exchange how many rows each replica has (one small all-gather between the
  processes); the step runs while any replica has rows, the others get empty (zero-padded)
  batches, and ``PerReplica.rows`` holds the true counts.

References:
  TensorFlow ``tensorflow/python/distribute/input_lib.py``
  (``_create_cloned_datasets_from_dataset``, ``_make_rebatch_fn``, ``_get_next_as_optional``
  with ``_calculate_replicas_with_values``).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

import jax
import numpy as np

from parallax.tf.input import auto_shard, partial_batches


def workers_of(strategy) -> tuple[int, int]:
    """``(W, k)``: the worker processes holding the strategy's replicas, and this one's index."""
    processes = sorted({d.process_index for d in strategy.devices})
    return len(processes), processes.index(jax.process_index())


def prefetched(iterator: Iterator, buffer_size: int) -> Iterator:
    """``iterator``'s items, each produced ``buffer_size`` items before it is handed out.

    Producing an item splits a batch and starts its (asynchronous) transfer to the devices,
    so the transfers of the next ``buffer_size`` steps overlap the current one.

    Example:
      >>> list(prefetched(iter(range(4)), 2))
      [0, 1, 2, 3]
    """
    buffer = collections.deque()
    for item in iterator:
        buffer.append(item)
        if len(buffer) > buffer_size:
            yield buffer.popleft()
    yield from buffer


def data_sharded(strategy, batches: Iterator, rows_of, api: str) -> Iterator:
    """DATA: each global batch split by TF's legacy rebatch, mini-batch ``k + r * W`` per replica.

    Args:
      strategy: the strategy (``W`` workers of ``R`` replicas).
      batches: the global batches (the same on every worker).
      rows_of: ``rows_of(element, index) -> (numpy element, rows)``.
      api: the API to name.
    """
    num_workers, _ = workers_of(strategy)
    replicas = strategy.num_replicas_in_sync
    order = auto_shard.data_shard_minibatches(num_workers, replicas // num_workers)
    for index, element in enumerate(batches):
        element, rows = rows_of(element, index)
        if rows == 0:
            continue
        sizes = auto_shard.legacy_rebatch_sizes(rows, replicas)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        take = np.concatenate([np.arange(starts[m], starts[m + 1]) for m in order])
        split = tuple(sizes[m] for m in order)
        yield jax.tree.map(
            lambda a, take=take, split=split: strategy.distribute_global_batch(a[take], split),
            element)


def worker_minibatches(batches: Iterator, rows_of, global_batch: int | None, num_workers: int,
                 replicas_per_worker: int, worker: int) -> Iterator:
    """Worker ``worker``'s stream rebatched by TF's ``batch_sizes_for_worker`` sizes."""
    sizes = None
    for index, element in enumerate(batches):
        element, rows = rows_of(element, index)
        if sizes is None:  # TF reads G from the dataset's batch(); else the first batch
            sizes = auto_shard.worker_batch_sizes(global_batch or rows, num_workers,
                                                  replicas_per_worker, worker)
        start = 0
        for size in auto_shard.rebatch(rows, sizes):
            yield jax.tree.map(lambda a, s=start, n=size: a[s:s + n], element)
            start += size


def _all_rows(local_rows: list[int], num_workers: int) -> tuple[int, ...]:
    """Every replica's row count, in replica order (an all-gather when several processes)."""
    if num_workers == 1:
        return tuple(local_rows)
    from jax.experimental import multihost_utils  # noqa: PLC0415 (only multi-process)
    gathered = multihost_utils.process_allgather(np.asarray(local_rows, np.int32))
    return tuple(int(r) for r in np.asarray(gathered).reshape(-1))


def per_worker_stream(strategy, batches: Iterator, rows_of, global_batch: int | None,
                      api: str) -> Iterator:
    """FILE / OFF / HINT: this worker's own batches, rebatched, ``R`` mini-batches per step.

    Raises:
      ValueError: the workers agree on a step in which this worker never had any data to
        take the shape of an empty batch from.
    """
    num_workers, worker = workers_of(strategy)
    local = strategy.num_local_replicas
    stream = worker_minibatches(batches, rows_of, global_batch, num_workers, local, worker)
    template = None
    while True:
        group = [mb for _, mb in zip(range(local), stream)]
        if group:
            template = group[0]
        local_rows = [jax.tree.leaves(mb)[0].shape[0] for mb in group] + [0] * (local - len(group))
        rows = _all_rows(local_rows, num_workers)
        if not any(rows):
            return
        if template is None:
            raise ValueError(
                f"{api}: this worker's input had no elements while other workers still have "
                f"data (rows per replica this step: {list(rows)}); give every worker at least "
                "one element (FILE sharding: at least one non-empty file per worker).")
        width = max(rows)

        def pad(a, width=width):
            return np.pad(a, [(0, width - a.shape[0])] + [(0, 0)] * (a.ndim - 1))

        padded = [jax.tree.map(pad, mb) for mb in group]
        empty = jax.tree.map(lambda a: np.zeros((width,) + a.shape[1:], a.dtype), template)
        padded += [empty] * (local - len(group))
        yield jax.tree.map(
            lambda *xs: strategy.distribute_local_components(
                np.stack(xs), partial_batches.padding_of(rows)), *padded)
