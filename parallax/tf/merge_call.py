"""The values of ``ReplicaContext.merge_call``: cross-replica code inside a replica function.

TensorFlow's ``merge_call(merge_fn, args)`` pauses every replica thread, hands ``merge_fn``
the strategy and each argument as a ``PerReplica`` value (one component per replica), runs
it once in cross-replica context, and gives each replica its own part of the result back
(``distribute_lib.py``, ``ReplicaContext.merge_call`` and ``_merge_call``; Keras' optimizers
aggregate gradients and update variables this way). In parallax the replicas are one SPMD
program, so nothing pauses: ``merge_fn`` is traced once, inside the program, with each
argument wrapped as a :class:`MergedValue` (this replica's component, the replicas' values
together), and the cross-replica calls it makes on them (``strategy.reduce``, ``gather``,
``experimental_local_results``, ``strategy.extended.reduce_to`` / ``batch_reduce_to`` /
``update``) become collectives over the replica axes. What ``merge_fn`` returns is unwrapped
as TensorFlow unwraps it: a ``MergedValue`` gives this replica its component, a reduced
(``Mirrored``) value the common value.

References:
  TensorFlow, ``tf.distribute.ReplicaContext.merge_call`` (``python/distribute/
  distribute_lib.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from parallax.tf.reduce_op import ReduceOp
from parallax.tf.values import Mirrored, PerReplica


@dataclasses.dataclass(frozen=True)
class MergedValue:
    """A per-replica value inside ``merge_fn``: this replica's ``component`` of all of them.

    TensorFlow passes ``merge_fn`` a ``PerReplica`` value holding every replica's tensor; in
    one SPMD program each device holds its own, and reading the others is a collective.
    """

    component: jax.Array
    context: Any  # the ReplicaContext of the run that called merge_call

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.component.shape)

    def reduce(self, api: str, op: ReduceOp, axis: int | None) -> jax.Array:
        """``strategy.reduce`` of the replicas' components (and over ``axis`` of each)."""
        ctx, x = self.context, self.component
        count = ctx.num_replicas_in_sync
        if axis is not None:
            rows = x.shape[axis]
            if ctx.batch_rows is not None and axis == 0 and rows == max(ctx.batch_rows):
                mask = ctx.example_mask(rows).reshape((-1,) + (1,) * (x.ndim - 1))
                x = jnp.where(mask, x, jnp.zeros_like(x))
                count = sum(ctx.batch_rows)
            else:
                count *= rows
            x = jnp.sum(x, axis=axis)
        total = ctx.all_reduce(ReduceOp.SUM, x)
        return total / count if op is ReduceOp.MEAN else total

    def gather(self, api: str, axis: int) -> jax.Array:
        """``strategy.gather``: every replica's component concatenated along ``axis``."""
        if self.context.batch_rows is not None:
            raise ValueError(
                f"{api}: inside merge_call of a step whose batch is a padded partial batch "
                f"(the replicas hold {list(self.context.batch_rows)} rows), the gathered "
                "value's length would depend on the data; gather after run instead "
                "(strategy.gather on what run returned), or reduce inside merge_call.")
        return self.context.all_gather(self.component, axis)

    def components(self) -> tuple[jax.Array, ...]:
        """Every replica's component (``experimental_local_results``), via one all-gather."""
        ctx = self.context
        if not ctx.replica_axes:
            return (self.component,)
        stacked = lax.all_gather(self.component, ctx.replica_axes, axis=0, tiled=False)
        return tuple(stacked[i] for i in range(ctx.num_replicas_in_sync))


def _is_value(x) -> bool:
    return isinstance(x, (MergedValue, Mirrored, PerReplica, nnx.Variable, nnx.Module))


def wrap(context, tree):
    """Every traced array of ``tree`` as a :class:`MergedValue` of ``context``.

    Variables and modules (the same objects on every replica: TensorFlow's regrouping makes
    them mirrored variables) and ``Mirrored`` values stay what they are.
    """

    def one(x):
        if isinstance(x, (Mirrored, nnx.Variable, nnx.Module)):
            return x
        if isinstance(x, jax.Array):  # traced: may differ per replica
            return MergedValue(x, context)
        return x  # a Python or NumPy constant: the same object on every replica

    return jax.tree.map(one, tree, is_leaf=_is_value)


def unwrap(tree):
    """What a replica gets back: its component of each ``MergedValue``, Mirrored's value."""

    def one(x):
        if isinstance(x, MergedValue):
            return x.component
        if isinstance(x, Mirrored):
            return x.value
        return x

    return jax.tree.map(one, tree, is_leaf=_is_value)
