"""Horovod's ``alltoall``: part ``j`` of each rank's tensor goes to rank ``j``.

Inside ``@hvd.jit`` it is XLA's all-to-all over the Horovod axis (with ``splits=``, padded
blocks and the true sizes: :mod:`parallax.horovod.uneven`; with a process set, the members'
parts picked from one all-gather). Eagerly (process-local values, one device per process)
every process's parts travel in one jitted program, ``splits=`` included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils

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
      splits: rows sent to each rank (length ``size()``); by default equal parts.
      name: accepted for Horovod's signature.
      process_set: the ranks taking part: ``tensor`` holds one part per member (inside a
        program; a rank outside the set gets its tensor back). Eagerly only the global set.
      axis_name: the mesh axis of the ranks inside a program (equal parts only there).

    Returns:
      The received array; with ``splits``, ``(received, received_splits)`` as Horovod's
      (inside a program one padded block per sender: :mod:`parallax.horovod.uneven`).

    Example:
      >>> import numpy as np, parallax.horovod as hvd
      >>> hvd.alltoall(np.arange(4))  # doctest: +SKIP
      array([0, 1, 2, 3])

      (Eagerly with one device per process; a process of several ranks calls it inside
      ``@hvd.jit``.)

    References:
      ``MPI_Alltoallv``; Horovod ``alltoall``.
    """
    del name
    api = "hvd.alltoall"
    ranks = sets.members(api, process_set)
    if in_program(api, tensor, axis_name):
        if splits is not None:
            if ranks is not None:
                raise NotImplementedError(f"{api}: splits= with a process set inside a "
                                          "program is not yet supported.")
            return uneven.alltoall_splits(api, tensor, splits, axis_name)
        if ranks is None:
            return comm.all_to_all(tensor, axis_name, split_dim=0, concat_dim=0)
        return jax.tree.map(lambda x: _alltoall_set(api, x, ranks, axis_name), tensor)
    if ranks is not None:
        raise NotImplementedError(f"{api}: process_set= on process-local arrays is not yet "
                                  "supported; call it inside @hvd.jit (each device a rank).")
    x = np.asarray(tensor)
    if per_process() > 1:
        first = jax.process_index() * per_process()
        raise ValueError(
            f"{api}: this process holds ranks {first} .. {first + per_process() - 1} "
            f"({per_process()} devices), and each of them would receive different parts, "
            "which one process-local result cannot hold. Call hvd.alltoall inside @hvd.jit "
            "(each device is a rank there), or run one device per process.")
    count, me = jax.process_count(), jax.process_index()
    if splits is None:
        if np.ndim(x) == 0 or x.shape[0] % count:
            raise ValueError(f"{api}: the first dimension of shape {x.shape} does not split "
                             f"into {count} equal parts; pass splits=[rows for each rank].")
        sent = np.full(count, x.shape[0] // count, np.int64)
    else:
        sent = np.asarray(splits, np.int64).reshape(-1)
        if sent.shape != (count,) or (sent < 0).any() or sent.sum() != x.shape[0]:
            raise ValueError(f"{api}: splits={sent.tolist()} must be {count} counts >= 0 "
                             f"adding up to the first dimension {x.shape[0]}.")
    matrix = np.asarray(multihost_utils.process_allgather(sent)).reshape(count, count)
    width = max(int(matrix.max()), 1)
    chunks = np.zeros((count, width) + x.shape[1:], x.dtype)
    starts = np.concatenate([[0], np.cumsum(sent)])
    for j in range(count):
        chunks[j, : sent[j]] = x[starts[j]:starts[j + 1]]
    # rows [source, destination, width, ...] -> [destination, source, ...], split by destination
    mine = local_arrays.local_copy(eager.by_destination()(local_arrays.stack(
        local_arrays.as_bytes(chunks))))[0]
    mine = local_arrays.from_bytes(mine, x.dtype, (count, width) + x.shape[1:])
    received = np.concatenate([mine[s, : matrix[s, me]] for s in range(count)])
    out = local_arrays.like(received, tensor)
    if splits is None:
        return out
    return out, matrix[:, me].copy()


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
