"""Uneven first dimensions inside ``@hvd.jit``: padded buffers and the true sizes.

Horovod's ``allgather`` concatenates tensors whose first dimensions differ by rank, and
``alltoall(tensor, splits)`` sends a different number of rows to each rank; the results'
shapes depend on the data. Inside one SPMD program every rank has the same static shapes,
so each rank passes a buffer padded to a common number of rows together with its true
count, and gets back a padded result with the true counts:

- ``hvd.allgather(buffer, valid_rows=n)`` -> ``(gathered, counts)``: ``gathered`` is
  ``[size * rows, ...]``, rank ``r``'s block ``r * rows .. r * rows + counts[r]`` holds its
  valid rows and the rest is zeros;
- ``hvd.alltoall(buffer, splits=s)`` (``s``: rows for each rank, traced, summing to at most
  the buffer's rows) -> ``(received, received_splits)``: ``received`` is ``[size * rows, ...]``,
  block ``j`` holds the ``received_splits[j]`` rows rank ``j`` sent here, then zeros. Each
  block is as long as the whole buffer (any split may be that long), so the exchange moves
  ``size`` times the buffer.

With a process set of ``m`` ranks, ``alltoall(buffer, splits=s, process_set=ps)`` takes one
count per member and returns ``m`` blocks (a rank outside the set gets zeros and counts 0);
the exchange still runs over the whole axis.

Eagerly (process-local values) the shapes may simply differ: no padding needed.

Example:
  >>> import jax.numpy as jnp, numpy as np, parallax.horovod as hvd
  >>> @hvd.jit(check_outputs="never")
  ... def gather(x):
  ...     n = hvd.rank() % 2 + 1                     # rank r has 1 or 2 valid rows
  ...     out, counts = hvd.allgather(x, valid_rows=n)
  ...     return out, counts
  >>> out, counts = gather(np.ones((16, 1), np.float32))
  >>> counts.tolist(), float(out.sum())
  ([1, 2, 1, 2, 1, 2, 1, 2], 12.0)

References:
  Horovod ``allgather`` (first dimensions may differ) and ``alltoall(splits=)``
  (horovod/torch/mpi_ops.py); ``MPI_Allgatherv``, ``MPI_Alltoallv``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def as_splits(api: str, splits):
    """``splits`` as Horovod takes them: 32-bit integers, one dimension.

    Horovod's core refuses any other element type ("alltoall expects splits to contain
    32-bit integer elements": horovod/common/operations.cc ``EnqueueTensorAlltoall``;
    test_torch.py ``test_horovod_alltoall_splits_type_error``), and its frontends turn a
    Python list into an int32 tensor (horovod/torch/mpi_ops.py ``_alltoall_async``;
    TensorFlow's ``convert_to_tensor`` of a list). So a list or tuple of ints is accepted
    and becomes int32; an array must already be int32 (torch's and NumPy's default
    integers, int64, are refused, as Horovod refuses a torch.LongTensor).

    Example:
      >>> as_splits("demo", [1, 2]).dtype
      dtype('int32')
    """
    if isinstance(splits, (list, tuple)):
        if not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool)
                   for s in splits):
            raise TypeError(f"{api}: splits must be integers, got {list(splits)!r}.")
        return np.asarray(splits, np.int32)
    dtype = getattr(splits, "dtype", None)
    if dtype is None or np.dtype(dtype) != np.int32:
        raise TypeError(
            f"{api}: splits must hold 32-bit integers, as Horovod requires (its core refuses "
            f"other element types); got "
            f"{type(splits).__name__ if dtype is None else np.dtype(dtype).name}. Pass a "
            "list of ints or an int32 array (np.asarray(splits, np.int32)).")
    if jnp.ndim(splits) != 1:
        raise ValueError(f"{api}: splits must be one-dimensional (one count per rank), got "
                         f"shape {tuple(jnp.shape(splits))}.")
    return splits if isinstance(splits, jax.Array) else np.asarray(splits)


def _rows_mask(rows: int, count, like):
    keep = jnp.arange(rows) < count
    return keep.reshape((rows,) + (1,) * (like.ndim - 1))


def allgather_valid(api: str, x, valid_rows, axis_name: str):
    """``(gathered, counts)``: every rank's first ``valid_rows`` rows, padded with zeros."""
    if jnp.ndim(x) == 0:
        raise ValueError(f"{api}: valid_rows= needs a tensor with a first dimension.")
    count = jnp.asarray(valid_rows, jnp.int32)
    if count.ndim:
        raise ValueError(f"{api}: valid_rows must be one number per rank (a scalar), got "
                         f"shape {count.shape}.")
    x = jnp.where(_rows_mask(x.shape[0], count, x), x, jnp.zeros_like(x))
    gathered = lax.all_gather(x, axis_name, axis=0, tiled=True)
    return gathered, lax.all_gather(count, axis_name)


def alltoall_splits(api: str, x, splits, axis_name: str):
    """``(received, received_splits)``: the rows each rank sent here, one padded block each."""
    n = lax.axis_size(axis_name)
    splits = jnp.asarray(as_splits(api, splits))
    if splits.shape != (n,) or jnp.ndim(x) == 0:
        raise ValueError(f"{api}: splits must hold one count per rank (shape ({n},)), got "
                         f"shape {splits.shape}, for a tensor with a first dimension.")
    rows = x.shape[0]
    starts = jnp.cumsum(splits) - splits
    index = starts[:, None] + jnp.arange(rows)[None, :]  # [destination, row]
    chunks = x[jnp.clip(index, 0, rows - 1)]  # [n, rows, ...]
    keep = (jnp.arange(rows)[None, :] < splits[:, None]) & (index < rows)
    chunks = jnp.where(keep.reshape(keep.shape + (1,) * (x.ndim - 1)), chunks,
                       jnp.zeros_like(chunks))
    received = lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)
    counts = lax.all_to_all(jnp.minimum(splits, rows)[:, None], axis_name, 0, 0, tiled=True)
    return received.reshape((n * rows,) + x.shape[1:]), counts.reshape(n)


def alltoall_splits_set(api: str, x, splits, ranks: tuple[int, ...], axis_name: str):
    """:func:`alltoall_splits` among the process set ``ranks`` (``splits``: one count per
    member): members exchange through the whole axis, sending nothing to the other ranks,
    and keep the members' blocks; a rank outside the set receives nothing (zeros, counts 0).
    """
    n, m = lax.axis_size(axis_name), len(ranks)
    splits = jnp.asarray(as_splits(api, splits))
    if splits.shape != (m,) or jnp.ndim(x) == 0:
        raise ValueError(f"{api}: splits must hold one count per rank of the process set "
                         f"{list(ranks)} (shape ({m},)), got shape {splits.shape}, for a "
                         "tensor with a first dimension.")
    members = jnp.asarray(ranks)
    member = jnp.isin(lax.axis_index(axis_name), members)
    every = jnp.zeros((n,), jnp.int32).at[members].set(jnp.where(member, splits, 0))
    received, counts = alltoall_splits(api, x, every, axis_name)
    rows = x.shape[0]
    blocks = received.reshape((n, rows) + x.shape[1:])[members]
    blocks = jnp.where(member, blocks, jnp.zeros_like(blocks))
    return blocks.reshape((m * rows,) + x.shape[1:]), jnp.where(member, counts[members], 0)
