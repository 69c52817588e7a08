"""Cross-replica reads of distributed values: ``reduce``, ``gather``, local results.

What ``strategy.reduce`` / ``gather`` / ``experimental_local_results`` do, for any strategy
of :mod:`parallax.tf`. ``reduce`` and ``gather`` are small compiled programs over the
strategy's replica mesh (a ``shard_map`` whose reduction is the strategy's cross-device op,
or an ``all-gather``), so they also run inside ``jax.jit`` next to ``run``; their results
are replicated, readable on every process.

References:
  TensorFlow, ``tf.distribute.Strategy.reduce``, ``gather``, ``experimental_local_results``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from parallax.tf.reduce_op import ReduceOp, as_reduce_op
from parallax.tf.values import Mirrored, PerReplica


def is_distributed(x) -> bool:
    """A ``PerReplica`` or ``Mirrored`` value."""
    return isinstance(x, (PerReplica, Mirrored))


def check_axis(api: str, axis: int, ndim: int, where: str) -> int:
    """``axis`` normalised to ``0 .. ndim - 1``, or a clear error."""
    if not -ndim <= axis < ndim:
        raise ValueError(f"{api}: axis={axis} is out of range for {where}, whose per-replica "
                         f"components have rank {ndim}.")
    return axis % ndim


def reduce(strategy, api: str, reduce_op, value, axis: int | None, place: Callable):
    """``strategy.reduce``: see :meth:`parallax.tf.MirroredStrategy.reduce`.

    ``place(api, x, where)`` checks a value belongs to ``strategy`` and returns its array.
    """
    op = as_reduce_op(api, reduce_op)
    if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
        raise TypeError(f"{api}: axis must be None or an int; got {axis!r}.")
    n = strategy.num_replicas_in_sync

    def one(path, x):
        where = f"value{jax.tree_util.keystr(path)}"
        if isinstance(x, PerReplica):
            stacked = place(api, x, where)
            dim = None if axis is None else check_axis(api, axis, len(x.shape), where)
            return _reduce_program(strategy, op, dim, stacked)
        if axis is not None:
            raise ValueError(
                f"{api}: axis={axis} reduces over the global batch of a per-replica value, "
                f"but {where} is a {type(x).__name__}, not a PerReplica value; pass "
                "axis=None, or reduce what strategy.run returned.")
        if isinstance(x, Mirrored):
            array = place(api, x, where)
            return array if op is ReduceOp.MEAN else array * n
        if op is ReduceOp.MEAN or n == 1:
            return jnp.asarray(x)
        raise ValueError(
            f"{api}: {where} is a {type(x).__name__}, not a PerReplica or Mirrored value, "
            f"so SUM over {n} replicas is undefined (TensorFlow refuses it too); reduce "
            "what strategy.run returned, or use MEAN.")

    return jax.tree_util.tree_map_with_path(one, value, is_leaf=is_distributed)


def gather(strategy, api: str, value, axis: int, place: Callable):
    """``strategy.gather``: see :meth:`parallax.tf.MirroredStrategy.gather`."""
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"{api}: axis must be an int; got {axis!r}.")

    def one(path, x):
        where = f"value{jax.tree_util.keystr(path)}"
        if isinstance(x, PerReplica):
            stacked = place(api, x, where)
            return _gather_program(strategy, check_axis(api, axis, len(x.shape), where),
                                   stacked)
        array = place(api, x, where)
        dim = check_axis(api, axis, array.ndim, where)
        return jnp.concatenate([array] * strategy.num_replicas_in_sync, axis=dim)

    return jax.tree_util.tree_map_with_path(one, value, is_leaf=is_distributed)


def local_results(value, count: int) -> tuple:
    """One pytree per local replica (``count`` of them); a plain value gives ``(value,)``."""
    leaves, treedef = jax.tree.flatten(value, is_leaf=is_distributed)
    if not any(is_distributed(x) for x in leaves):
        return (value,)
    parts = [x.values if is_distributed(x) else (x,) * count for x in leaves]
    return tuple(jax.tree.unflatten(treedef, [p[i] for p in parts]) for i in range(count))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _reduce_program(strategy, op: ReduceOp, axis: int | None, stacked):
    """Sums (over ``axis``, then across replicas with the strategy's op); MEAN divides."""

    def body(x):
        local = x[0] if axis is None else jnp.sum(x[0], axis=axis)
        (total,) = strategy.cross_device_ops.all_reduce(
            [local], strategy.replica_axes, ReduceOp.SUM, strategy.mesh)
        return total

    total = jax.shard_map(body, mesh=strategy.mesh, in_specs=strategy.batch_spec,
                          out_specs=jax.P(), check_vma=False)(stacked)
    if op is ReduceOp.MEAN:
        count = strategy.num_replicas_in_sync * (1 if axis is None else stacked.shape[axis + 1])
        total = total / count
    return total


@functools.partial(jax.jit, static_argnums=(0, 1))
def _gather_program(strategy, axis: int, stacked):
    body = functools.partial(_all_gather, axes=strategy.replica_axes, axis=axis)
    return jax.shard_map(body, mesh=strategy.mesh, in_specs=strategy.batch_spec,
                         out_specs=jax.P(), check_vma=False)(stacked)


def _all_gather(x, axes, axis):
    return lax.all_gather(x[0], axes, axis=axis, tiled=True)
