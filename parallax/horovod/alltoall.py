"""Horovod's ``alltoall``: part ``j`` of each rank's tensor goes to rank ``j``.

Inside ``@hvd.jit`` it is XLA's all-to-all over the Horovod axis (with ``splits=``, padded
blocks and the true sizes: :mod:`parallax.horovod.uneven`; with a process set, the members'
parts picked from one all-gather). Eagerly (process-local values, one device per process)
the parts travel in one jitted program over the processes' devices, ``splits=`` included;
with a process set that program spans the set's processes only
(:mod:`parallax.horovod.eager`), so, as in Horovod, only the members call it and a
non-member's call raises."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallax import comm
from parallax.distributed import local_arrays
from parallax.horovod import eager, uneven
from parallax.horovod import process_sets as sets
from parallax.horovod.collectives import in_program
from parallax.horovod.process_sets import global_process_set
from parallax.horovod.ranks import AXIS, per_process
from parallax.horovod.timeline import scoped


@scoped("alltoall")
def alltoall(tensor, splits=None, name=None, process_set=global_process_set, *,
             axis_name: str = AXIS):
    """Sends part ``j`` of ``tensor`` (along dim 0) to rank ``j``; returns what every rank
    sent here, concatenated in rank order (Horovod's ``alltoall``).

    Args:
      tensor: this rank's array.
      splits: rows sent to each rank of the set, in rank order (length ``size()``, or the
        process set's size), adding up to at most the first dimension (the rows after
        them are not sent); by default equal parts. 32-bit integers, as Horovod requires:
        a list of ints, or an int32 array (an int64 array is refused, as Horovod refuses
        torch's default integer tensors).
      name: accepted for Horovod's signature.
      process_set: the ranks taking part; ``tensor`` holds one part per member. Inside a
        program every rank runs it and a rank outside the set gets its tensor back (with
        ``splits``, zeros and counts 0: :mod:`parallax.horovod.uneven`); eagerly
        only the members call it, and a non-member's call raises ``ValueError`` (Horovod's
        "Rank ... is not a member of the provided process set").
      axis_name: the mesh axis of the ranks inside a program (equal parts only there).

    Returns:
      The received array; with ``splits``, ``(received, received_splits)`` as Horovod
      0.21+ returns them (``received_splits[i]``: the rows the set's ``i``-th rank sent here,
      int32 as Horovod's; inside a program one padded block per sender:
      :mod:`parallax.horovod.uneven`).

    Example:
      >>> import numpy as np, parallax.horovod as hvd
      >>> hvd.alltoall(np.arange(4))  # doctest: +SKIP
      array([0, 1, 2, 3])

      (Eagerly with one device per process; a process of several ranks calls it inside
      ``@hvd.jit``.)

    References:
      ``MPI_Alltoallv``; Horovod's ``alltoall`` (horovod/torch/mpi_ops.py: ``splits`` and the
      returned ``received_splits``; horovod/common/operations.cc ``EnqueueTensorAlltoall``:
      one split per rank of the process set, 32-bit splits adding up to at most the first
      dimension, non-members refused).
    """
    del name
    api = "hvd.alltoall"
    ranks = sets.members(api, process_set)
    splits = None if splits is None else uneven.as_splits(api, splits)  # Horovod's int32
    if in_program(api, tensor, axis_name):
        if splits is not None:
            if ranks is not None:
                return uneven.alltoall_splits_set(api, tensor, splits, ranks, axis_name)
            return uneven.alltoall_splits(api, tensor, splits, axis_name)
        if ranks is None:
            return comm.all_to_all(tensor, axis_name, split_dim=0, concat_dim=0)
        return jax.tree.map(lambda x: _alltoall_set(api, x, ranks, axis_name), tensor)
    if per_process() > 1:
        first = jax.process_index() * per_process()
        raise ValueError(
            f"{api}: this process holds ranks {first} .. {first + per_process() - 1} "
            f"({per_process()} devices), and each of them would receive different parts, "
            "which one process-local result cannot hold. Call hvd.alltoall inside @hvd.jit "
            "(each device is a rank there), or run one device per process.")
    processes = tuple(range(jax.process_count())) if ranks is None else ranks
    if jax.process_index() not in processes:  # Horovod: a non-member's call is an error
        raise ValueError(
            f"{api}: rank {jax.process_index()} is not a member of the process set "
            f"{list(processes)}; as in Horovod, only the set's ranks call a collective on it "
            "(with one part, or split, for each of the set's ranks).")
    out, received = _eager(api, tensor, splits, processes)
    return out if splits is None else (out, received)


def _eager(api: str, tensor, splits, processes: tuple[int, ...]):
    """Eager alltoall among ``processes`` (one rank each): a program on their devices only."""
    x = np.asarray(tensor)
    count, me = len(processes), processes.index(jax.process_index())
    within = "" if count == jax.process_count() else f" (the process set {list(processes)})"
    if splits is None:
        if np.ndim(x) == 0 or x.shape[0] % count:
            raise ValueError(f"{api}: the first dimension of shape {x.shape} does not split "
                             f"into {count} equal parts{within}; pass splits=[rows for each "
                             "rank].")
        sent = np.full(count, x.shape[0] // count, np.int64)
    else:  # Horovod: int32 counts, one per rank, adding up to at most the first dimension
        sent = np.asarray(splits, np.int64)
        if sent.shape != (count,) or (sent < 0).any() or sent.sum() > x.shape[0]:
            raise ValueError(f"{api}: splits={sent.tolist()} must be {count} counts >= 0, one "
                             f"per rank{within}, adding up to at most the first dimension "
                             f"{x.shape[0]}.")
    where = eager.members_mesh(processes)
    matrix = eager.gather_bytes(sent, where)  # [source, destination]
    width = max(int(matrix.max()), 1)
    chunks = np.zeros((count, width) + x.shape[1:], x.dtype)
    starts = np.concatenate([[0], np.cumsum(sent)])
    for j in range(count):
        chunks[j, : sent[j]] = x[starts[j]:starts[j + 1]]
    mine = eager.exchange(chunks, where)  # [source, width, ...]
    received = np.concatenate([mine[s, : matrix[s, me]] for s in range(count)])
    return local_arrays.like(received, tensor), matrix[:, me].astype(np.int32)  # Horovod's


def _alltoall_set(api: str, x, ranks, axis_name: str):
    """Alltoall among the set's members: member ``j``'s part ``i`` goes to member ``i``."""
    m = len(ranks)
    if x.ndim == 0 or x.shape[0] % m:
        raise ValueError(f"{api}: the first dimension of shape {x.shape} does not split into "
                         f"{m} equal parts (one per rank of the process set {list(ranks)}).")
    every = sets.gather_members(x, ranks, axis_name)  # [m, m * part, ...]
    every = every.reshape((m, m, x.shape[0] // m) + x.shape[1:])
    mine = jnp.take(every, sets.position(ranks, axis_name, lax.axis_size(axis_name)), axis=1)
    return jnp.where(sets.is_member(ranks, axis_name), mine.reshape(x.shape), x)
