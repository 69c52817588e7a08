"""Horovod's collectives: ``allreduce``, ``allgather``, ``broadcast``, ``alltoall``.

Each works in two places, like Horovod's ops inside and outside ``tf.function``:

- **eagerly, on process-local values** (numpy, Python numbers, arrays on this process's
  devices): each value becomes its process's row of a global array
  (:mod:`parallax.distributed.local_arrays`) and one jitted program reduces, gathers or
  selects rows; XLA runs the collective (gloo on CPU, NCCL on GPU). A rank is a device
  (:mod:`parallax.horovod.ranks`), so a process's value stands for each of its K ranks: a
  Sum counts it K times, an allgather repeats it K times, as for a replicated argument of
  ``@hvd.jit``. Results come back in the input's kind.
- **inside a program over the Horovod axis** (``@hvd.jit``, or any ``shard_map`` binding the
  axis ``"data"``): the ranks are the devices along that axis, and the ops are
  ``parallax.comm``'s collectives (``psum``, ``all_gather``, ...), or Adasum's ppermute rounds.

Called on traced values anywhere else (plain ``jax.jit``), they raise: a process-local jit
has no other ranks to talk to.

Every op takes ``process_set=`` (:mod:`parallax.horovod.process_sets`); ``alltoall`` is in
:mod:`parallax.horovod.alltoall`, the grouped ops and ``reducescatter`` in
:mod:`parallax.horovod.grouped`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils

from parallax import comm
from parallax.comm import checks
from parallax.distributed import local_arrays
from parallax.horovod import eager, join, uneven
from parallax.horovod import process_sets as sets
from parallax.horovod.adasum import adasum_all_reduce
from parallax.horovod.ops import (Compression, ReduceOp, check_average_dtype,
                                  check_compression, check_op, integer_average,
                                  is_integer, scale)
from parallax.horovod.process_sets import global_process_set
from parallax.horovod.ranks import AXIS as AXIS
from parallax.horovod.ranks import owner
from parallax.horovod.timeline import scoped


def in_program(api: str, tree, axis_name: str) -> bool:
    """True inside a program that binds ``axis_name``; False for eager process-local values."""
    if axis_name in checks.available_axes():
        return True
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree)):
        raise ValueError(
            f"{api}: called on traced values where the Horovod axis {axis_name!r} is not bound "
            "(inside a plain jax.jit each process runs alone, with no other ranks). Run the "
            "step with @hvd.jit (one program over every device of every process), or call "
            f"{api} outside jit on process-local arrays.")
    return False


def reduce_in_program(x, op: ReduceOp, wire, axis_name: str, ranks=None,
                      postscale: float = 1.0):
    """``x`` reduced over the axis (or the process set ``ranks``; others keep ``x``), times
    ``postscale`` (an integer Average: :func:`integer_average`)."""
    check_average_dtype("hvd.allreduce", op, x.dtype)
    members = None if ranks is None else sets.is_member(ranks, axis_name)
    count = lax.axis_size(axis_name) if ranks is None else len(ranks)
    if op is ReduceOp.Average and is_integer(x.dtype):
        total = reduce_in_program(x, ReduceOp.Sum, wire, axis_name, ranks)
        out = integer_average(total, count, postscale)
        return out if members is None else jnp.where(members, out, x)
    if ranks is None:
        if op is ReduceOp.Adasum:
            return scale(adasum_all_reduce(x, axis_name), postscale)
        name = {ReduceOp.Sum: "sum", ReduceOp.Average: "mean", ReduceOp.Min: "min",
                ReduceOp.Max: "max", ReduceOp.Product: "prod"}[op]
        return scale(comm.all_reduce(x, axis_name, name, compression=wire), postscale)
    if op is ReduceOp.Product:  # XLA's all-reduce has no product: gather the members
        out = jnp.prod(sets.gather_members(x, ranks, axis_name), axis=0)
    else:
        reduce = {ReduceOp.Sum: lax.psum, ReduceOp.Average: lax.psum, ReduceOp.Min: lax.pmin,
                  ReduceOp.Max: lax.pmax}[op]
        groups = sets.groups(ranks, lax.axis_size(axis_name))
        out = reduce(x.astype(wire.wire_dtype(x.dtype)), axis_name,
                     axis_index_groups=groups).astype(wire.accumulate_dtype(x.dtype))
        out = (out / count if op is ReduceOp.Average else out).astype(x.dtype)
    return jnp.where(members, scale(out, postscale), x)


def check_set_op(api: str, op: ReduceOp, ranks) -> None:
    if ranks is not None and op is ReduceOp.Adasum:
        raise NotImplementedError(f"{api}: op=hvd.Adasum on a process set is not supported "
                                  "(nor in Horovod); use the global process set.")


def eager_reduce(api: str, x, op: ReduceOp, wire, counts, prescale: float = 1.0,
                 postscale: float = 1.0):
    """This process's copy of the reduction of every process's ``x`` (``counts`` per process).

    An integer Average is Horovod's: the sum, then ``sum * postscale / size`` truncated
    toward zero on the host in float64, Horovod's own arithmetic (:func:`integer_average`).
    """
    if not isinstance(x, (jax.Array, np.ndarray)):
        x = np.asarray(x, jax.dtypes.canonicalize_dtype(np.result_type(x)))
    check_average_dtype(api, op, x.dtype)
    integer_mean = op is ReduceOp.Average and is_integer(x.dtype)
    op = ReduceOp.Sum if integer_mean else op
    wide = wire.accumulate_dtype(x.dtype)
    sent = np.asarray(x * prescale if prescale != 1.0 else x).astype(wire.wire_dtype(x.dtype))
    exact = jax.dtypes.canonicalize_dtype(x.dtype) == x.dtype
    join.announce(api, op, sent, wide, counts, followable=exact)  # for joined processes
    if exact:
        out = np.asarray(eager.run(eager.program("reduce", op, wide, counts), sent,
                                   out_like=sent))
    else:  # 64-bit without jax_enable_x64: gather exactly, reduce on the host
        out = eager.reduce_on_host(api, sent, op, wide, counts)
    if counts[jax.process_index()] == 0:
        return x  # outside the process set: its own value back
    if integer_mean:
        out = np.trunc(np.asarray(out, np.float64) * postscale / sum(counts))
    else:
        out = out * postscale if postscale != 1.0 else out
    return local_arrays.like(np.asarray(out).astype(x.dtype), x)


@scoped("allreduce")
def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set=global_process_set, *, axis_name: str = AXIS):
    """Reduces ``tensor`` over every rank and gives each the result (Horovod's ``allreduce``).

    Args:
      tensor: an array (or pytree of arrays), this rank's value; same shape on every rank.
      average: Horovod's old flag (True: ``op=Average``, False: ``op=Sum``).
      name: accepted for Horovod's signature (JAX orders collectives itself).
      compression: ``hvd.Compression.none|fp16|bf16``: the values travel in 16 bits.
      op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Adasum``, ``hvd.Min``, ``hvd.Max``,
        ``hvd.Product``. The Average of an integer tensor is an integer tensor, the mean
        truncated toward zero, as Horovod computes it (``[3, 31] / 2 ranks -> [1, 15]``).
      prescale_factor, postscale_factor: multiply before and after the reduction (an
        integer tensor is truncated back to its dtype, as Horovod's ``ScaleBuffer`` does).
      process_set: the ranks taking part (``hvd.add_process_set``); Average divides by its
        size. A rank outside it gets its own value back.
      axis_name: the mesh axis of the ranks inside a program (``@hvd.jit``'s ``"data"``).

    Returns:
      The reduction, of the input's kind, shape and dtype.

    Example:
      >>> import numpy as np, parallax.horovod as hvd
      >>> hvd.allreduce(np.array([1.0, 2.0]))                   # the average over the ranks
      array([1., 2.])
      >>> bool((hvd.allreduce(np.ones(2), op=hvd.Sum) == hvd.size()).all())   # one per rank
      True

    References:
      Sergeev & Del Balso 2018, "Horovod"; ``MPI_Allreduce``; Horovod's Average as a
      postscale of ``1 / size`` (horovod/common/ops/gloo_operations.cc) written into the
      tensor's own dtype (collective_operations.h ``ScaleBufferCPUImpl``), tested for
      integers in test/parallel/test_torch.py ``test_horovod_allreduce_average``.
    """
    del name
    api = "hvd.allreduce"
    op = check_op(api, op if op is not None else (ReduceOp.Sum if average is False
                                                  else ReduceOp.Average))
    wire = check_compression(api, compression)
    ranks = sets.members(api, process_set)
    check_set_op(api, op, ranks)
    if in_program(api, tensor, axis_name):
        return jax.tree.map(lambda x: reduce_in_program(
            scale(x, prescale_factor), op, wire, axis_name, ranks, postscale_factor), tensor)
    counts = sets.eager_counts(ranks)
    return jax.tree.map(lambda x: eager_reduce(api, x, op, wire, counts, prescale_factor,
                                               postscale_factor), tensor)


def _shapes(api: str, x) -> np.ndarray:
    """Every process's shape of ``x`` (same rank required), one row each."""
    ndims = np.asarray(multihost_utils.process_allgather(np.int32(np.ndim(x)))).reshape(-1)
    if len(set(ndims.tolist())) != 1:
        raise ValueError(f"{api}: the ranks passed tensors of different ranks (ndim by rank: "
                         f"{ndims.tolist()}); every rank must pass the same number of dims.")
    shape = np.asarray(np.shape(x), np.int64).reshape(-1)
    return np.asarray(multihost_utils.process_allgather(shape)).reshape(len(ndims), -1)


@scoped("allgather")
def allgather(tensor, name=None, process_set=global_process_set, *, valid_rows=None,
              axis_name: str = AXIS):
    """Concatenates every rank's ``tensor`` along the first dimension (Horovod's ``allgather``).

    Eagerly the ranks' first dimensions may differ (the others must match), and a process's
    tensor appears once per rank it holds; inside a program they are equal. With
    ``process_set`` only the set's ranks are concatenated (every rank receives that).
    Inside a program, ``valid_rows=n`` (this rank's true row count) gathers padded buffers
    and returns ``(gathered, counts)`` (:mod:`parallax.horovod.uneven`).

    Example:
      >>> import numpy as np, parallax.horovod as hvd
      >>> hvd.allgather(np.arange(3)).shape == (3 * hvd.size(),)  # this process's, per rank
      True

    References:
      ``MPI_Allgatherv``; Horovod ``allgather``.
    """
    del name
    api = "hvd.allgather"
    ranks = sets.members(api, process_set)
    if in_program(api, tensor, axis_name):
        if valid_rows is not None:
            if ranks is not None:
                raise NotImplementedError(f"{api}: valid_rows= with a process set is not yet "
                                          "supported; use the global process set.")
            return uneven.allgather_valid(api, tensor, valid_rows, axis_name)
        if ranks is None:
            return comm.all_gather(tensor, axis_name, dim=0, tiled=True)
        return jax.tree.map(lambda x: sets.gather_members(x, ranks, axis_name).reshape(
            (-1,) + x.shape[1:]), tensor)
    if valid_rows is not None:  # eagerly the shapes may differ: gather the valid rows
        mine = np.asarray(tensor)[: int(valid_rows)]
        counts = allgather(np.array([mine.shape[0]], np.int64), process_set=process_set)
        return allgather(mine, process_set=process_set), counts
    x = tensor if isinstance(tensor, jax.Array) else np.asarray(tensor)
    if np.ndim(x) == 0:
        raise ValueError(f"{api}: tensor is a scalar; allgather concatenates along the first "
                         "dimension, so pass at least one dimension (e.g. x[None]).")
    counts = sets.eager_counts(ranks)
    if jax.process_count() == 1:
        return local_arrays.like(np.concatenate([np.asarray(x)] * counts[0]), tensor)
    shapes = _shapes(api, x)
    if (shapes[:, 1:] != shapes[0, 1:]).any():
        raise ValueError(f"{api}: the ranks' tensors differ beyond the first dimension: shapes "
                         f"by rank {[tuple(s) for s in shapes.tolist()]}.")
    x = np.asarray(x)
    rows = int(shapes[:, 0].max())
    padded = np.zeros((rows,) + x.shape[1:], x.dtype)
    padded[: x.shape[0]] = x
    every = eager.gather_bytes(padded)
    out = np.concatenate([every[p, :n] for p, n in enumerate(shapes[:, 0])
                          for _ in range(counts[p])])  # a process's tensor per rank
    return local_arrays.like(out, tensor)


def _same_shape(api: str, x) -> None:
    shapes = _shapes(api, x)
    if (shapes != shapes[0]).any():
        raise ValueError(f"{api}: the ranks passed different shapes "
                         f"{[tuple(s) for s in shapes.tolist()]}; they must be equal.")


@scoped("broadcast")
def broadcast(tensor, root_rank: int, name=None, process_set=global_process_set, *,
              axis_name: str = AXIS):
    """Every rank gets ``root_rank``'s ``tensor`` (Horovod's ``broadcast``).

    Example:
      >>> import numpy as np, parallax.horovod as hvd
      >>> hvd.broadcast(np.array([3.0]), root_rank=0)
      array([3.])

    References:
      ``MPI_Bcast``; Horovod ``broadcast``.
    """
    del name
    api = "hvd.broadcast"
    ranks = sets.members(api, process_set)
    root_process = owner(api, root_rank)
    if ranks is not None and root_rank not in ranks:
        raise ValueError(f"{api}: root_rank={root_rank} is not in the process set "
                         f"{list(ranks)}; the root must be one of its ranks.")
    if in_program(api, tensor, axis_name):
        out = comm.broadcast(tensor, axis_name, root=root_rank)
        if ranks is None:
            return out
        member = sets.is_member(ranks, axis_name)
        return jax.tree.map(lambda o, x: jnp.where(member, o, x), out, tensor)
    outside = sets.eager_counts(ranks)[jax.process_index()] == 0

    def one(x):
        _same_shape(api, x)
        value = np.asarray(x)
        picked = eager.run(eager.program("pick", root_process), local_arrays.as_bytes(value),
                           out_like=np.zeros(0))
        if outside:  # takes part (every process runs the program), keeps its own value
            return x
        return local_arrays.like(local_arrays.from_bytes(picked, value.dtype, value.shape), x)

    return jax.tree.map(one, tensor)
