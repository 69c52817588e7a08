"""Horovod's grouped collectives and ``reducescatter``: one fused collective for many tensors.

``grouped_allreduce(tensors)`` reduces a list of tensors as one operation, as Horovod's
tensor fusion does (horovod/torch/mpi_ops.py ``grouped_allreduce``: the tensors of a group
are negotiated and fused together). Inside ``@hvd.jit`` the list is one ``psum`` over all of
them, which XLA compiles to one all-reduce with one operand per tensor;
``grouped_allgather`` and ``grouped_reducescatter`` pack the tensors of a dtype into one
flat buffer (Horovod's fusion buffer) and run one all-gather / one reduce-scatter on it.
Eagerly (process-local values) each tensor is its own program.

``reducescatter(tensor, op=hvd.Average)`` reduces over the ranks and leaves part ``i`` of the
first dimension on rank ``i``; Horovod's default op is Average (horovod/tensorflow/__init__.py
``reducescatter(..., op=Average)``), which this keeps. Eagerly a process holding K ranks gets
its K ranks' parts, concatenated (its share of the first dimension).

Example:
  >>> import numpy as np, parallax.horovod as hvd
  >>> a, b = hvd.grouped_allreduce([np.ones(2), np.zeros(3)], op=hvd.Sum)
  >>> a.tolist(), b.tolist()
  ([8.0, 8.0], [0.0, 0.0, 0.0])

References:
  Horovod ``grouped_allreduce``, ``grouped_allgather``, ``grouped_reducescatter``,
  ``reducescatter`` (horovod/torch/mpi_ops.py, horovod/tensorflow/__init__.py); Sergeev &
  Del Balso 2018 (tensor fusion); ``MPI_Reduce_scatter_block``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallax.distributed import local_arrays
from parallax.horovod import collectives
from parallax.horovod import process_sets as sets
from parallax.horovod.ops import (Compression, ReduceOp, check_average_dtype,
                                  check_compression, check_op, integer_average,
                                  is_integer, scale)
from parallax.horovod.process_sets import global_process_set
from parallax.horovod.ranks import AXIS, per_process
from parallax.horovod.timeline import scoped


def _check_list(api: str, tensors) -> list:
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{api}: tensors must be a list of tensors, got "
                        f"{type(tensors).__name__}; for one tensor call the ungrouped op.")
    return list(tensors)


def _by_dtype(tensors) -> dict:
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(jnp.result_type(t), []).append(i)
    return groups


@scoped("grouped_allreduce")
def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set=global_process_set, *, axis_name: str = AXIS) -> list:
    """Reduces every tensor of the list over the ranks as one fused operation.

    Args:
      tensors: a list of arrays (each like ``hvd.allreduce``'s ``tensor``).
      average, name, compression, op, prescale_factor, postscale_factor, process_set,
        axis_name: as :func:`parallax.horovod.allreduce`.

    Returns:
      The list of reduced tensors.

    Example:
      >>> import numpy as np, parallax.horovod as hvd
      >>> [t.tolist() for t in hvd.grouped_allreduce([np.ones(1), np.full(2, 3.0)])]
      [[1.0], [3.0, 3.0]]
    """
    del name
    api = "hvd.grouped_allreduce"
    tensors = _check_list(api, tensors)
    op = check_op(api, op if op is not None else (ReduceOp.Sum if average is False
                                                  else ReduceOp.Average))
    wire = check_compression(api, compression)
    ranks = sets.members(api, process_set)
    collectives.check_set_op(api, op, ranks)
    if not tensors:
        return []
    if not collectives.in_program(api, tensors, axis_name):
        counts = sets.eager_counts(ranks)
        return [collectives.eager_reduce(api, t, op, wire, counts, prescale_factor,
                                         postscale_factor) for t in tensors]
    scaled = [scale(t, prescale_factor) for t in tensors]
    if op in (ReduceOp.Adasum, ReduceOp.Product):  # no fused form: one at a time
        return [collectives.reduce_in_program(t, op, wire, axis_name, ranks, postscale_factor)
                for t in scaled]
    for t in scaled:
        check_average_dtype(api, op, t.dtype)
    reduce = {ReduceOp.Sum: lax.psum, ReduceOp.Average: lax.psum, ReduceOp.Min: lax.pmin,
              ReduceOp.Max: lax.pmax}[op]
    n = lax.axis_size(axis_name)
    groups = None if ranks is None else sets.groups(ranks, n)
    sent = [t.astype(wire.wire_dtype(t.dtype)) for t in scaled]
    out = reduce(sent, axis_name, axis_index_groups=groups)  # one all-reduce
    count = n if ranks is None else len(ranks)

    def finish(o, t):  # Average (Horovod's integer mean truncates), then the postscale
        if op is ReduceOp.Average and is_integer(t.dtype):
            return integer_average(o.astype(t.dtype), count, postscale_factor)
        if op is ReduceOp.Average:
            o = o.astype(wire.accumulate_dtype(t.dtype)) / count
        return scale(o.astype(t.dtype), postscale_factor)

    out = [finish(o, t) for o, t in zip(out, scaled)]
    if ranks is not None:
        member = sets.is_member(ranks, axis_name)
        out = [jnp.where(member, o, t) for o, t in zip(out, scaled)]
    return out


@scoped("grouped_allgather")
def grouped_allgather(tensors, name=None, process_set=global_process_set, *,
                      axis_name: str = AXIS) -> list:
    """Allgathers every tensor of the list (one all-gather per dtype inside a program).

    Example:
      >>> import numpy as np, parallax.horovod as hvd
      >>> [t.shape for t in hvd.grouped_allgather([np.ones(1), np.ones((2, 3))])]
      [(8,), (16, 3)]
    """
    del name
    api = "hvd.grouped_allgather"
    tensors = _check_list(api, tensors)
    if not collectives.in_program(api, tensors, axis_name):
        return [collectives.allgather(t, process_set=process_set, axis_name=axis_name)
                for t in tensors]
    ranks = sets.members(api, process_set)
    for t in tensors:
        if jnp.ndim(t) == 0:
            raise ValueError(f"{api}: a scalar tensor (shape ()); allgather concatenates along "
                             "the first dimension, so pass at least one dimension.")
    out: list = [None] * len(tensors)
    for indices in _by_dtype(tensors).values():
        flat = jnp.concatenate([jnp.ravel(tensors[i]) for i in indices])
        if ranks is None:
            every = lax.all_gather(flat, axis_name, axis=0, tiled=False)  # one all-gather
        else:
            every = sets.gather_members(flat, ranks, axis_name)
        start = 0
        for i in indices:
            shape, size = jnp.shape(tensors[i]), int(np.prod(jnp.shape(tensors[i])))
            part = every[:, start:start + size].reshape((every.shape[0],) + shape)
            out[i] = part.reshape((-1,) + shape[1:])
            start += size
    return out


def _parts(api: str, t, count: int) -> None:
    if jnp.ndim(t) == 0 or jnp.shape(t)[0] % count:
        raise ValueError(f"{api}: the first dimension of shape {tuple(jnp.shape(t))} does not "
                         f"split into {count} equal parts (one per rank taking part); pad it "
                         "to a multiple, or use hvd.allreduce.")


@scoped("grouped_reducescatter")
def grouped_reducescatter(tensors, compression=Compression.none, op=ReduceOp.Average,
                          process_set=global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0, *, axis_name: str = AXIS) -> list:
    """Reduce-scatters every tensor of the list (one reduce-scatter per dtype in a program).

    Args:
      tensors: a list of arrays whose first dimension splits into one part per rank.
      compression, prescale_factor, postscale_factor: as :func:`parallax.horovod.allreduce`.
      op: ``hvd.Average`` (Horovod's default) or ``hvd.Sum``.
      process_set: the ranks taking part; a rank outside it gets its first part unreduced.

    Returns:
      The list of this rank's parts (eagerly: this process's ranks' parts).

    Example:
      >>> import numpy as np, parallax.horovod as hvd
      >>> [t.tolist() for t in hvd.grouped_reducescatter([np.arange(8.0)])]
      [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]]
    """
    api = "hvd.grouped_reducescatter"
    tensors = _check_list(api, tensors)
    op = check_op(api, op)
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"{api}: op={op} must be hvd.Average (the default) or hvd.Sum.")
    wire = check_compression(api, compression)
    ranks = sets.members(api, process_set)
    scaled = [t * prescale_factor if prescale_factor != 1.0 else t for t in tensors]
    if not collectives.in_program(api, tensors, axis_name):
        out = [_eager_reducescatter(api, t, op, wire, ranks) for t in scaled]
    else:
        out = [None] * len(tensors)
        n = lax.axis_size(axis_name)
        m = n if ranks is None else len(ranks)
        for t in scaled:
            _parts(api, t, m)
        for indices in _by_dtype(scaled).values():
            dtype = jnp.result_type(scaled[indices[0]])
            rows = jnp.concatenate([scaled[i].reshape(m, -1) for i in indices], axis=1)
            rows = rows.astype(wire.wire_dtype(dtype))
            if ranks is None:  # one reduce-scatter of the fused buffer
                mine = lax.psum_scatter(rows, axis_name, scatter_dimension=0, tiled=True)[0]
            else:
                summed = lax.psum(rows, axis_name, axis_index_groups=sets.groups(ranks, n))
                mine = jnp.where(sets.is_member(ranks, axis_name),
                                 summed[sets.position(ranks, axis_name, n)], rows[0])
            mine = mine.astype(wire.accumulate_dtype(dtype))
            if op is ReduceOp.Average:
                mine = mine / m
            start = 0
            for i in indices:
                shape = jnp.shape(scaled[i])
                size = int(np.prod(shape)) // m
                out[i] = mine[start:start + size].reshape((shape[0] // m,) + shape[1:]).astype(
                    dtype)
                start += size
    return [o * postscale_factor if postscale_factor != 1.0 else o for o in out]


def _eager_reducescatter(api: str, t, op: ReduceOp, wire, ranks):
    """The reduction over every process, cut to this process's ranks' parts."""
    counts = sets.eager_counts(ranks)
    members = list(range(sum(counts))) if ranks is None else list(ranks)
    _parts(api, np.asarray(t), len(members))
    reduced = np.asarray(collectives.eager_reduce(api, t, op, wire, counts))
    first = jax.process_index() * per_process()
    mine = [i for i, r in enumerate(members) if first <= r < first + per_process()]
    if not mine:
        return t  # outside the process set
    part = reduced.shape[0] // len(members)
    return local_arrays.like(np.concatenate([reduced[i * part:(i + 1) * part] for i in mine]), t)


@scoped("reducescatter")
def reducescatter(tensor, name=None, compression=Compression.none, op=ReduceOp.Average,
                  process_set=global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0, *, axis_name: str = AXIS):
    """Reduces ``tensor`` over the ranks; rank ``i`` keeps part ``i`` of the first dimension.

    Args:
      tensor: an array whose first dimension splits into one part per rank taking part.
      name: accepted for Horovod's signature.
      compression, process_set, prescale_factor, postscale_factor: as
        :func:`grouped_reducescatter`.
      op: ``hvd.Average`` (Horovod's default) or ``hvd.Sum``.

    Returns:
      This rank's part (eagerly: this process's ranks' parts, concatenated).

    Example:
      >>> import numpy as np, parallax.horovod as hvd
      >>> hvd.reducescatter(np.arange(8.0), op=hvd.Sum).tolist()   # 8 ranks, one process
      [0.0, 8.0, 16.0, 24.0, 32.0, 40.0, 48.0, 56.0]
    """
    del name
    return grouped_reducescatter([tensor], compression, op, process_set, prescale_factor,
                                 postscale_factor, axis_name=axis_name)[0]
