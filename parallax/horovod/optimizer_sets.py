"""``DistributedOptimizer(process_set=)``: gradients summed over the set's ranks only.

Horovod 0.23 added ``process_set=`` to ``DistributedOptimizer``: the gradients are
all-reduced among the set's ranks, and a rank outside the set does not communicate and
steps with its own gradient (horovod/torch/optimizer.py registers no hooks and returns
from ``synchronize`` when ``not process_set.included()``; horovod/tensorflow/__init__.py
``_allreduce_cond`` returns the tensor unchanged). Here:

- inside ``@hvd.jit`` each fusion bucket (or explicit group) is one
  ``lax.psum(..., axis_index_groups=[members, [r], ...])``: XLA's all-reduce with the set's
  ranks in one replica group and every other rank alone, so non-members' gradients come
  back as they were (checked in the compiled HLO by tests/horovod/test_optimizer_sets.py);
- eagerly the members' gradients are summed by one program over the members' processes
  only (:mod:`parallax.horovod.eager`); a process holding none of the set's ranks
  makes no collective call and gets its gradient back.

Example:
  >>> import jax, jax.numpy as jnp, parallax.horovod as hvd
  >>> from jax.sharding import AxisType
  >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
  >>> f = jax.jit(jax.shard_map(lambda g: program_sum(
  ...     [g], (0, 1), "data", hvd.Compression.none, None, None)[0], mesh=mesh,
  ...     in_specs=jax.P("data"), out_specs=jax.P("data"), check_vma=False))
  >>> f(jnp.arange(8.0)).ravel().tolist()      # ranks 0 and 1 sum, the others keep theirs
  [1.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]

References:
  Horovod ``DistributedOptimizer(process_set=)`` (horovod/torch/optimizer.py,
  horovod/tensorflow/__init__.py, Horovod 0.23 release notes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallax.comm.bucket import over_buckets
from parallax.horovod import eager
from parallax.horovod import process_sets as sets
from parallax.horovod.ops import ReduceOp


def program_sum(leaves: list, ranks: tuple[int, ...], axis_name: str, wire,
                bucket_bytes: int | None, groups: list[list[int]] | None) -> list:
    """Inside a program: each leaf summed over the set's ranks (members), or kept (others).

    One all-reduce per fusion bucket of ``bucket_bytes`` (or per explicit group), with the
    set's replica groups.
    """
    index_groups = sets.groups(ranks, lax.axis_size(axis_name))

    def psum(flat):
        sent = flat.astype(wire.wire_dtype(flat.dtype))
        summed = lax.psum(sent, axis_name, axis_index_groups=index_groups)
        return summed.astype(wire.accumulate_dtype(flat.dtype)).astype(flat.dtype)

    if groups is None:
        summed = over_buckets(list(leaves), psum, bucket_bytes=bucket_bytes)
    else:
        summed = list(leaves)
        for group in groups:
            out = over_buckets([leaves[i] for i in group], psum, bucket_bytes=None)
            for i, o in zip(group, out):
                summed[i] = o
    member = sets.is_member(ranks, axis_name)
    return [jnp.where(member, s, g) for s, g in zip(summed, leaves)]


@functools.cache
def _weighted_sum(mesh, weights: tuple[int, ...], wide: tuple, out: tuple):
    def fn(rows):  # row p counts for the weights[p] ranks of the set its process holds
        return [jnp.sum(r.astype(w) * np.asarray(weights, w).reshape((-1,) + (1,) * (r.ndim - 1)),
                        axis=0).astype(o) for r, w, o in zip(rows, wide, out)]
    return eager.jit(fn, mesh)


def eager_sum(leaves: list, ranks: tuple[int, ...], wire) -> list | None:
    """Eagerly: each leaf summed over the set's ranks (a process's value counted once per
    rank of the set it holds); None on a process holding none of them (no call made)."""
    counts = sets.eager_counts(ranks)
    if counts[jax.process_index()] == 0:
        return None
    processes = tuple(p for p, c in enumerate(counts) if c)
    mesh = eager.members_mesh(processes)
    sent = [np.asarray(g).astype(wire.wire_dtype(g.dtype)) for g in leaves]
    wide = tuple(wire.accumulate_dtype(g.dtype) for g in leaves)
    program = _weighted_sum(mesh, tuple(counts[p] for p in processes), wide,
                            tuple(g.dtype for g in leaves))
    summed = program([eager.stack(s, mesh) for s in sent])
    return [jnp.asarray(np.asarray(s.addressable_data(0))) for s in summed]


def reduce(grads, mode: str, op: ReduceOp, wire, predivide: float,
           fusion_bytes: int, axis_name: str, groups, ranks):
    """``DistributedOptimizer``'s reduction over a set: the members get the set's sum (mean
    for Average), the other ranks their own gradients."""
    leaves, treedef = jax.tree.flatten(grads)
    scaled = [g / predivide for g in leaves] if predivide != 1.0 else leaves
    summed = (program_sum(scaled, ranks, axis_name, wire, fusion_bytes, groups)
              if mode == "program" else eager_sum(scaled, ranks, wire))
    if summed is None:  # eagerly, a process holding none of the set's ranks: no call made
        return grads
    if op is ReduceOp.Average:
        summed = [s * (predivide / len(ranks)) for s in summed]
    if mode == "program":  # a rank outside the set keeps its own gradient
        member = sets.is_member(ranks, axis_name)
        summed = [jnp.where(member, s, g) for s, g in zip(summed, leaves)]
    return jax.tree.unflatten(treedef, summed)


def check(api: str, process_set, op: ReduceOp, algorithm: str) -> None:
    """A registered set, with a reduction the set's replica groups can run."""
    if sets.members(api, process_set) is None:
        return
    if op is ReduceOp.Adasum:
        raise NotImplementedError(f"{api}: op=hvd.Adasum with a process_set is not supported "
                                  "(nor in Horovod); use hvd.Average or hvd.Sum.")
    if algorithm != "xla":
        raise ValueError(f"{api}: algorithm={algorithm!r} sums over the whole Horovod axis by "
                         "point-to-point exchanges; with a process_set pass algorithm='xla' "
                         "(XLA's all-reduce over the set's replica groups).")
