"""``px.value_and_grad``: gradients produced and synchronised as the strategy says.

Outside ``px.train_step`` it is ``jax.value_and_grad`` (plus optional micro-batching).
Inside, with a strategy that splits the batch in the ``"explicit"`` style, it opens a
``shard_map`` that is manual over the batch axes only (tensor axes stay with GSPMD) and
writes the data-parallel collectives itself:

1. ZeRO 3: each parameter shard is ``all_gather``-ed over the ZeRO axis;
2. every device computes the loss and gradients of its slice of the batch, with no
   communication (parameters are first cast to *varying* over the batch axes, so JAX's
   autodiff inserts no implicit ``psum``);
3. gradients are reduced: ``psum_scatter`` over the ZeRO axis for stages 2 and 3 (each
   device keeps the reduced slice it owns), ``psum`` over the other batch axes (or the
   strategy's ``grad_sync``, e.g. DDP's buckets), then divided by the number of batch
   shards. The loss is averaged the same way.

The loss function must return a mean over the examples of its batch (equal weights), which
makes the mean over equal shards exactly the full batch's value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec

from parallax import context, layout
from parallax.local_shards import auto_axes, group_on_local_shards, on_local_shards
from parallax.mesh import axis_size
from parallax.microbatch import accumulate, check_microbatches
from parallax.vma import to_varying

API = "px.value_and_grad"


def value_and_grad(
    loss_fn: Callable,
    *,
    microbatches: int | None = None,
    has_aux: bool = False,
) -> Callable:
    """Like ``jax.value_and_grad``, with the strategy's gradient production and sync.

    Args:
      loss_fn: ``loss_fn(model_or_params, batch, *args) -> loss`` (or ``(loss, aux)`` with
        ``has_aux``). ``loss`` must be a scalar mean over the batch's examples. An NNX
        module is differentiated with respect to its ``nnx.Param`` state.
      microbatches: split each device's batch into this many micro-batches and accumulate
        (``lax.scan``); numerically the full batch's result.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; floating aux values are averaged over
        batch shards and micro-batches, integer ones summed.

    Returns:
      ``fn(model_or_params, batch, *args) -> (loss, grads)`` (or ``((loss, aux), grads)``),
      where ``grads`` has the structure of the parameters (an ``nnx.State`` for a module).
      Under ZeRO 2/3 the gradients come out sharded over the ZeRO axis.

    Example:
      >>> import jax.numpy as jnp, parallax as px
      >>> loss = lambda w, batch: jnp.mean((batch["x"] @ w) ** 2)
      >>> batch = {"x": jnp.ones((8, 3))}
      >>> value, grads = px.value_and_grad(loss, microbatches=2)(jnp.ones(3), batch)
      >>> float(value)
      9.0
    """

    def wrapped(target, batch, *args):
        params, rebuild = split_target(target)
        ctx = context.current()
        strategy = ctx.strategy if ctx is not None else None
        request = GradRequest.of(loss_fn, rebuild, args, has_aux)
        produce, split = gradient_producer(request, strategy, microbatches)
        axes = batch_axes(ctx)
        check_microbatches(batch, split, API, axis_size(ctx.mesh, axes) if axes else 1)
        if axes and strategy.sync_style == "explicit":
            (loss, aux), grads = explicit_value_and_grad(produce, params, batch, ctx, axes)
        else:
            (loss, aux), grads = produce(params, batch)
            grads = constrain_grads(grads, params, ctx)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


class GradRequest(NamedTuple):
    """What a strategy's gradient producer (``Strategy.grad_fn``) is asked to compute.

    ``grad_fn(request, params, batch) -> ((loss, aux), grads)`` runs on each device's slice
    of the batch (inside the data-parallel ``shard_map`` in the explicit style) and must not
    synchronise over the batch axes: ``px.value_and_grad`` does that afterwards.

    Attributes:
      value_and_grad: ``(params, batch) -> ((loss, aux), grads)``, the plain computation.
      loss_fn: the user's loss function (a producer may look inside it, e.g. a pipeline
        reads the stages of a ``parallax.pipeline`` loss).
      rebuild: ``params -> what loss_fn takes`` (the NNX module, or the params themselves).
      args: the extra arguments passed to ``loss_fn`` after the batch.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    """

    value_and_grad: Callable
    loss_fn: Callable
    rebuild: Callable
    args: tuple
    has_aux: bool

    @classmethod
    def of(cls, loss_fn: Callable, rebuild: Callable, args: tuple, has_aux: bool):
        def local_loss(p, b):
            out = loss_fn(rebuild(p), b, *args)
            return out if has_aux else (out, None)

        return cls(jax.value_and_grad(local_loss, has_aux=True), loss_fn, rebuild, args,
                   has_aux)


def split_target(target):
    """(params, rebuild): an NNX module is differentiated w.r.t. its ``nnx.Param`` state."""
    if isinstance(target, nnx.Module):
        graphdef, params, rest = nnx.split(target, nnx.Param, ...)
        return params, lambda p: nnx.merge(graphdef, p, rest)
    return target, lambda p: p


def gradient_producer(request: GradRequest, strategy, microbatches: int | None):
    """``(produce, split)``: the strategy's producer, or plain accumulation over ``split``
    micro-batches; ``produce(params, batch) -> ((loss, aux), grads)`` on one batch slice."""
    hook = strategy.grad_fn if strategy is not None else None
    if microbatches is not None and hook is not None:
        raise ValueError(
            f"{API}: microbatches={microbatches} was given, but the strategy "
            f"{strategy.name} already decides how gradients are produced; pass one of them."
        )
    if hook is not None:
        return (lambda p, b: hook(request, p, b)), strategy.microbatches
    split = microbatches or (strategy.microbatches if strategy is not None else 1)
    return (lambda p, b: accumulate(request.value_and_grad, p, b, split, api=API)), split


def batch_axes(ctx) -> tuple[str, ...]:
    """The mesh axes that split the batch in the active step (none outside a step)."""
    if ctx is None:
        return ()
    return tuple(a for a in ctx.strategy.batch_axes if a in ctx.mesh.shape)


def constrain_grads(grads, params, ctx):
    """GSPMD style: gradients constrained to ZeRO's layout (stages 2 and 3)."""
    if ctx is None or ctx.strategy.zero is None or not ctx.strategy.zero.shards("grad"):
        return grads
    lays = layout.param_layouts(params, ctx.strategy, ctx.mesh, API)
    leaves, treedef = jax.tree.flatten(grads)
    leaves = [lax.with_sharding_constraint(g, lay.spec("grad")) for g, lay in zip(leaves, lays)]
    return jax.tree.unflatten(treedef, leaves)


def explicit_value_and_grad(produce, params, batch, ctx, axes):
    """The explicit style: local gradients inside ``shard_map`` over ``axes``, then the
    data-parallel collectives, each a named step below."""
    strategy, mesh = ctx.strategy, ctx.mesh
    shards = axis_size(mesh, axes)
    lays = layout.param_layouts(params, strategy, mesh, API)
    p_leaves, p_def = jax.tree.flatten(params)
    b_leaves, b_def = jax.tree.flatten(batch)

    def body(p_local, b_local):
        full = gather_params(p_local, lays, axes)
        with context.manual(axes):
            (loss, aux), grads = produce(
                jax.tree.unflatten(p_def, full), jax.tree.unflatten(b_def, b_local))
        synced = sync_grads(jax.tree.leaves(grads), lays, axes, strategy.grad_sync)
        loss = mean_over(loss, axes, shards)
        aux = jax.tree.map(lambda a: mean_over(to_varying(a, axes), axes, shards), aux)
        return loss, aux, [g / shards for g in synced]

    b_spec = PartitionSpec(axes if len(axes) > 1 else axes[0])
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=([lay.manual_spec("param") for lay in lays], [b_spec] * len(b_leaves)),
        out_specs=(PartitionSpec(), PartitionSpec(), [lay.manual_spec("grad") for lay in lays]),
        axis_names=frozenset(axes),
    )
    loss, aux, g_leaves = mapped(p_leaves, b_leaves)
    return (loss, aux), jax.tree.unflatten(p_def, g_leaves)


def gather_params(leaves, lays, axes):
    """Each parameter cast to varying over the batch axes (so autodiff inserts no implicit
    ``psum``) and, under ZeRO 3, all-gathered from its shards."""

    def gather(x, lay):
        x = to_varying(x, axes)
        return lay.zero.gather(x, lay.shard_dim) if lay.is_sharded("param") else x

    return [on_local_shards(gather, x, lay, axes) for x, lay in zip(leaves, lays)]


def scatter_grad(g, lay):
    """ZeRO 2/3: the gradient reduce-scattered over the ZeRO axis (each device keeps the
    summed slice it owns); unchanged otherwise."""
    return lay.zero.scatter(g, lay.shard_dim) if lay.is_sharded("grad") else g


def remaining_axes(lay, axes) -> tuple[str, ...]:
    """The batch axes a gradient is still to be summed over after ZeRO's reduce-scatter."""
    return tuple(a for a in axes if a != lay.zero.axis) if lay.is_sharded("grad") else axes


def sync_grads(leaves, lays, axes, grad_sync):
    """Gradients summed over the batch axes: ZeRO's reduce-scatter, then one ``psum`` per
    leaf over the remaining axes, or the strategy's ``grad_sync`` per group (DDP buckets)."""
    if grad_sync is None:
        def reduce(g, lay):
            g, over = scatter_grad(g, lay), remaining_axes(lay, axes)
            return lax.psum(g, over) if over else g

        return [on_local_shards(reduce, g, lay, axes) for g, lay in zip(leaves, lays)]
    leaves = [on_local_shards(scatter_grad, g, lay, axes) for g, lay in zip(leaves, lays)]
    return sync_groups(leaves, lays, axes, grad_sync)


def sync_groups(leaves, lays, axes, grad_sync):
    """``grad_sync`` once per group of leaves with the same axes still to sum over and the
    same automatic (TP) axes: a bucket must not mix leaves sharded over ``"tensor"`` with
    leaves replicated over it (``shard_map`` would refuse the replicated outputs)."""
    leaves = list(leaves)
    groups: dict[tuple, list[int]] = {}
    for i, lay in enumerate(lays):
        groups.setdefault((remaining_axes(lay, axes), auto_axes([lay], axes)), []).append(i)
    for (over, _), idx in groups.items():
        if over:
            summed = group_on_local_shards(lambda ls, over=over: grad_sync(ls, over),
                                           [leaves[i] for i in idx], [lays[i] for i in idx],
                                           axes)
            for i, g in zip(idx, summed):
                leaves[i] = g
    return leaves


def mean_over(x, axes, shards):
    """A loss or float aux value averaged over the batch shards; integer values summed."""
    total = lax.psum(x, axes)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return total / shards
    return total  # integer aux values (token counts) are summed
