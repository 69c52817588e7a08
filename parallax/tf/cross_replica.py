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
import numpy as np
from jax import lax

from parallax.tf.merge_call import MergedValue
from parallax.tf.reduce_op import ReduceOp, as_reduce_op
from parallax.tf.values import Mirrored, PerReplica


def is_distributed(x) -> bool:
    """A ``PerReplica`` or ``Mirrored`` value, or a per-replica value inside ``merge_call``."""
    return isinstance(x, (PerReplica, Mirrored, MergedValue))


def check_axis(api: str, axis: int, ndim: int, where: str) -> int:
    """``axis`` normalised to ``0 .. ndim - 1``, or a clear error."""
    if not -ndim <= axis < ndim:
        raise ValueError(f"{api}: axis={axis} is out of range for {where}, whose per-replica "
                         f"components have rank {ndim}.")
    return axis % ndim


def check_padded(api: str, x: PerReplica, axis: int | None, where: str) -> None:
    """Refuses what TensorFlow cannot do with components of different lengths either.

    A padded partial batch (``x.rows``) stands for components of different lengths: only
    reductions and concatenations over that (batch) dimension are defined.
    """
    if x.rows is not None and axis != 0:
        raise ValueError(
            f"{api}: {where} is a partial batch whose replicas hold {list(x.rows)} rows "
            f"(components of different lengths, as in TensorFlow), so axis={axis} is "
            "undefined; use axis=0 (over the global batch).")


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
        if isinstance(x, MergedValue):
            dim = None if axis is None else check_axis(api, axis, len(x.shape), where)
            return x.reduce(api, op, dim)
        if isinstance(x, PerReplica):
            stacked = place(api, x, where)
            dim = None if axis is None else check_axis(api, axis, len(x.shape), where)
            check_padded(api, x, dim, where)
            return _reduce_program(strategy, op, dim, x.rows, stacked)
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
        if isinstance(x, MergedValue):
            return x.gather(api, check_axis(api, axis, len(x.shape), where))
        if isinstance(x, PerReplica):
            stacked = place(api, x, where)
            dim = check_axis(api, axis, len(x.shape), where)
            check_padded(api, x, dim, where)
            gathered = _gather_program(strategy, dim, stacked)
            if x.rows is None:
                return gathered
            width = x.shape[0]  # keep each replica's real rows only, as TF's components
            keep = np.concatenate([np.arange(r) + i * width for i, r in enumerate(x.rows)])
            return jnp.take(gathered, jnp.asarray(keep), axis=0)
        array = place(api, x, where)
        dim = check_axis(api, axis, array.ndim, where)
        return jnp.concatenate([array] * strategy.num_replicas_in_sync, axis=dim)

    return jax.tree_util.tree_map_with_path(one, value, is_leaf=is_distributed)


def local_results(value, count: int) -> tuple:
    """One pytree per local replica (``count`` of them); a plain value gives ``(value,)``."""
    leaves, treedef = jax.tree.flatten(value, is_leaf=is_distributed)
    if not any(is_distributed(x) for x in leaves):
        return (value,)
    merged = [x for x in leaves if isinstance(x, MergedValue)]
    if merged:  # inside merge_call, in one program: every replica's component
        count = merged[0].context.num_replicas_in_sync
        parts = [x.components() if isinstance(x, MergedValue) else
                 (x.value if isinstance(x, Mirrored) else x,) * count for x in leaves]
    else:
        parts = [x.values if is_distributed(x) else (x,) * count for x in leaves]
    return tuple(jax.tree.unflatten(treedef, [p[i] for p in parts]) for i in range(count))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _reduce_program(strategy, op: ReduceOp, axis: int | None, rows, stacked):
    """Sums (over ``axis``, then across replicas with the strategy's op); MEAN divides.

    ``rows``: real rows per replica of a padded batch (``axis`` is then 0): padding is left
    out of the sum and of MEAN's count.
    """

    def body(x):
        x = x[0]
        if rows is not None:
            real = jnp.asarray(rows)[lax.axis_index(strategy.replica_axes)]
            mask = (jnp.arange(x.shape[0]) < real).reshape((-1,) + (1,) * (x.ndim - 1))
            x = jnp.where(mask, x, jnp.zeros_like(x))
        local = x if axis is None else jnp.sum(x, axis=axis)
        (total,) = strategy.cross_device_ops.all_reduce(
            [local], strategy.replica_axes, ReduceOp.SUM, strategy.mesh)
        return total

    total = jax.shard_map(body, mesh=strategy.mesh, in_specs=strategy.batch_spec,
                          out_specs=jax.P(), check_vma=False)(stacked)
    if op is ReduceOp.MEAN:
        count = strategy.num_replicas_in_sync * (1 if axis is None else stacked.shape[axis + 1])
        total = total / (count if rows is None else sum(rows))
    return total


@functools.partial(jax.jit, static_argnums=(0, 1))
def _gather_program(strategy, axis: int, stacked):
    body = functools.partial(_all_gather, axes=strategy.replica_axes, axis=axis)
    return jax.shard_map(body, mesh=strategy.mesh, in_specs=strategy.batch_spec,
                         out_specs=jax.P(), check_vma=False)(stacked)


def _all_gather(x, axes, axis):
    return lax.all_gather(x[0], axes, axis=axis, tiled=True)
