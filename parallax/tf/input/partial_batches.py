"""How a global batch is split over the replicas: TensorFlow's rule, padded for one program.

TensorFlow's ``experimental_distribute_dataset`` rebatches the dataset with
``dataset.rebatch(batch_sizes_for_worker(G, W, R, w))``, ``G`` being the batch size the
dataset's ``batch()`` names (``input_lib.py``, ``_make_rebatch_fn``). The sizes give each of
the ``N = W * R`` replicas ``G // N`` rows, one more for the first ``G % N`` of them
(``batch_sizes_for_worker``), and ``rebatch`` is "unbatch, then batch with the sizes in turn"
(``rebatch_op.py``). So a full global batch splits by those sizes, and the last, partial one
(``p < G`` rows, the data set not a multiple of ``G``) fills the replicas in order: replica
``i`` takes ``min(size_i, rows left)``, the last replicas may get fewer rows or none. A
replica without data gets an empty batch (zeros with a leading dimension of 0, ``input_lib.py``
``_dummy_tensor_fn``), and the step runs as long as any replica has data
(``_calculate_replicas_with_values``).

One SPMD program needs one shape on every replica, so here each replica's component is
padded with zero rows to the largest replica's count, and the true counts travel with the
value (``PerReplica.rows``): ``strategy.run`` tells the replica function which rows are real
(:meth:`parallax.tf.ReplicaContext.example_mask`, used by ``compute_average_loss``), and
``reduce``, ``gather`` and ``experimental_local_results`` read only the real rows.

References:
  TensorFlow ``tensorflow/python/data/experimental/ops/distribute.py``
  (``batch_sizes_for_worker``), ``tensorflow/python/data/ops/rebatch_op.py``,
  ``tensorflow/python/distribute/input_lib.py`` (``_make_rebatch_fn``,
  ``_get_value_or_dummy``, ``_dummy_tensor_fn``, ``_calculate_replicas_with_values``).
"""

from __future__ import annotations

import numpy as np


def replica_batch_sizes(global_batch_size: int, num_replicas: int) -> tuple[int, ...]:
    """Rows per replica of a full global batch, in replica order (TF's ``batch_sizes_for_worker``).

    Args:
      global_batch_size: rows of a full global batch (``G``).
      num_replicas: replicas over all workers (``N``).

    Returns:
      ``N`` sizes summing to ``G``: ``G // N + 1`` for the first ``G % N`` replicas, else
      ``G // N``.

    Example:
      >>> replica_batch_sizes(7, 4)
      (2, 2, 2, 1)
    """
    floor, extra = divmod(global_batch_size, num_replicas)
    return tuple(floor + (i < extra) for i in range(num_replicas))


def split_rows(rows: int, global_batch_size: int, num_replicas: int) -> tuple[int, ...]:
    """Rows each replica receives from a global batch of ``rows`` (TF's rebatch of it).

    Args:
      rows: rows of this element of the data set.
      global_batch_size: the data set's global batch size (``G``); an element with more rows
        is split as a full batch of its own size.
      num_replicas: replicas over all workers.

    Returns:
      One count per replica: the full split for ``rows >= G``; for a partial batch the
      replicas filled in order, each up to its full-batch size.

    Example:
      >>> split_rows(5, 8, 4)          # the last batch of a 13-row data set, batch 8
      (2, 2, 1, 0)
    """
    sizes = replica_batch_sizes(max(rows, global_batch_size), num_replicas)
    out, left = [], rows
    for size in sizes:
        take = min(size, left)
        out.append(take)
        left -= take
    return tuple(out)


def pad_components(array: np.ndarray, rows: tuple[int, ...]) -> np.ndarray:
    """``[num_replicas, max(rows), ...]``: replica ``i``'s ``rows[i]`` rows, then zero rows.

    Args:
      array: ``[sum(rows), ...]``, the rows in replica order.
      rows: rows per replica.

    Returns:
      The stacked, zero-padded components.

    Example:
      >>> pad_components(np.arange(5.0), (2, 2, 1, 0)).tolist()
      [[0.0, 1.0], [2.0, 3.0], [4.0, 0.0], [0.0, 0.0]]
    """
    width = max(rows)
    out = np.zeros((len(rows), width) + array.shape[1:], array.dtype)
    start = 0
    for i, count in enumerate(rows):
        out[i, :count] = array[start:start + count]
        start += count
    return out


def padding_of(rows: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """``rows`` when some replica's component is padded, else ``None`` (nothing to mask)."""
    if rows is None or len(set(rows)) == 1:
        return None
    return tuple(int(r) for r in rows)


def refuse_unmasked(api: str, batch_rows: tuple[int, ...] | None, masked: bool) -> None:
    """Refuses a padded partial batch whose padding rows the replica function never masked.

    TensorFlow's replicas see batches of their own lengths; here they see zero rows after
    their real ones, which would silently enter every loss, metric and statistic that does
    not leave them out.

    Args:
      api: the API to name.
      batch_rows: the real rows per replica of ``run``'s batch, or None (not padded).
      masked: whether tracing the replica function asked which rows are real.

    Raises:
      ValueError: a padded batch that was not masked.
    """
    if batch_rows is None or masked:
        return
    raise ValueError(
        f"{api}: this step's batch is a partial last batch split over the replicas as "
        f"TensorFlow splits it (real rows per replica: {list(batch_rows)}); in one "
        f"compiled program every replica holds {max(batch_rows)} rows, the missing ones "
        "zero padding, and the replica function never asked which rows are real. Compute "
        "the loss with px.tf.compute_average_loss(per_example_loss, ...) (it leaves the "
        "padding out), or mask with px.tf.get_replica_context().example_mask(rows); or drop "
        "the partial batch (dataset.batch(global_batch_size, drop_remainder=True)). The "
        "NNX objects keep their values from before the call.")
