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
from parallax.mesh import axis_size
from parallax.vma import to_varying
from parallax.rules import as_tuple
from parallax.strategies.accumulate import accumulate, check_microbatches

API = "px.value_and_grad"


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


def _split_target(target):
    """(params, rebuild): differentiate NNX modules w.r.t. their ``nnx.Param`` state."""
    if isinstance(target, nnx.Module):
        graphdef, params, rest = nnx.split(target, nnx.Param, ...)
        return params, lambda p: nnx.merge(graphdef, p, rest)
    return target, lambda p: p


def _mean_over(x, axes, shards):
    total = lax.psum(x, axes)
    if jnp.issubdtype(x.dtype, jnp.floating):
        return total / shards
    return total  # integer aux values (token counts) are summed


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
        params, rebuild = _split_target(target)

        def local_loss(p, b):
            out = loss_fn(rebuild(p), b, *args)
            return out if has_aux else (out, None)

        ctx = context.current()
        strategy = ctx.strategy if ctx is not None else None
        hook = strategy.grad_fn if strategy is not None else None
        if microbatches is not None and hook is not None:
            raise ValueError(
                f"{API}: microbatches={microbatches} was given, but the strategy "
                f"{strategy.name} already decides how gradients are produced; pass one of them."
            )
        split = microbatches or (strategy.microbatches if strategy is not None else 1)
        request = GradRequest(
            jax.value_and_grad(local_loss, has_aux=True), loss_fn, rebuild, args, has_aux
        )

        def produce(p, b):
            if hook is not None:
                return hook(request, p, b)
            return accumulate(request.value_and_grad, p, b, split, api=API)

        axes = tuple(a for a in (strategy.batch_axes if strategy else ()) if a in ctx.mesh.shape)
        shards = axis_size(ctx.mesh, axes) if axes else 1
        check_microbatches(batch, split, API, shards)
        if not axes or strategy.sync_style == "gspmd":
            (loss, aux), grads = produce(params, batch)
            if ctx is not None and strategy.zero_stage >= 2:
                grads = _constrain_grads(grads, params, ctx)
        else:
            (loss, aux), grads = _explicit(produce, params, batch, ctx, axes, shards)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


def _constrain_grads(grads, params, ctx):
    strategy = ctx.strategy
    lays = layout.param_layouts(params, strategy, ctx.mesh, API)
    leaves, treedef = jax.tree.flatten(grads)
    leaves = [
        lax.with_sharding_constraint(g, lay.spec(True, strategy.shard_axis))
        for g, lay in zip(leaves, lays)
    ]
    return jax.tree.unflatten(treedef, leaves)


def _on_local_shards(fn, x, lay, manual_axes):
    """``fn(x, lay)`` on the local shard of the leaf's GSPMD (auto) axes, too.

    Inside a ``shard_map`` that is manual over the batch axes only, a collective on an array
    whose other dimensions are sharded over auto axes (tensor parallel) makes XLA gather
    those dimensions first. Running the collective in a nested ``shard_map`` over the leaf's
    auto axes keeps it on the local tensor-parallel shard.
    """
    auto = _auto_axes([lay], manual_axes)
    if not auto:
        return fn(x, lay)
    spec = _local_spec(lay, manual_axes)
    return jax.shard_map(
        lambda v: fn(v, lay), in_specs=spec, out_specs=spec, axis_names=frozenset(auto)
    )(x)


def _local_spec(lay, manual_axes) -> PartitionSpec:
    return PartitionSpec(*(
        None if e is None else tuple(a for a in as_tuple(e) if a not in manual_axes) or None
        for e in lay.base
    ))


def _auto_axes(lays, manual_axes) -> tuple[str, ...]:
    """The automatic (GSPMD) mesh axes that any of the leaves is sharded over."""
    return tuple(sorted({a for lay in lays for e in lay.base if e is not None
                         for a in as_tuple(e) if a not in manual_axes}))


def _hook_on_local_shards(hook, leaves, lays, over, manual_axes):
    """``hook(leaves, over)`` on the local shards of the leaves' automatic (TP) axes.

    One nested ``shard_map`` for the whole group, so that a bucketing hook sees every
    leaf at once (see :func:`_on_local_shards` for why collectives run on local shards).
    """
    auto = _auto_axes(lays, manual_axes)
    if not auto:
        return list(hook(list(leaves), over))
    specs = [_local_spec(lay, manual_axes) for lay in lays]
    return list(jax.shard_map(lambda ls: list(hook(ls, over)), in_specs=(specs,),
                              out_specs=specs, axis_names=frozenset(auto))(list(leaves)))


def _explicit(produce, params, batch, ctx, axes, shards):
    """Local gradients inside ``shard_map`` over ``axes``, then explicit collectives."""
    strategy, mesh = ctx.strategy, ctx.mesh
    stage, zero_axis = strategy.zero_stage, strategy.shard_axis
    lays = layout.param_layouts(params, strategy, mesh, API)
    p_leaves, p_def = jax.tree.flatten(params)
    b_leaves, b_def = jax.tree.flatten(batch)
    p_specs = [lay.manual_spec(stage >= 3, zero_axis) for lay in lays]
    g_specs = [lay.manual_spec(stage >= 2, zero_axis) for lay in lays]
    b_spec = PartitionSpec(axes if len(axes) > 1 else axes[0])
    rest_axes = tuple(a for a in axes if a != zero_axis)

    def gather(x, lay):
        x = to_varying(x, axes)
        if stage >= 3 and lay.shard_dim is not None:
            x = lax.all_gather(x, zero_axis, axis=lay.shard_dim, tiled=True)
        return x

    def scattered(lay):
        return stage >= 2 and lay.shard_dim is not None

    def remaining(lay):  # the batch axes left to sum over after ZeRO's reduce-scatter
        return rest_axes if scattered(lay) else axes

    def scatter(g, lay):
        if scattered(lay):
            return lax.psum_scatter(g, zero_axis, scatter_dimension=lay.shard_dim, tiled=True)
        return g

    def reduce(g, lay):
        g, over = scatter(g, lay), remaining(lay)
        return (lax.psum(g, over) if over else g) / shards

    def sync(g_leaves):
        if strategy.grad_sync is None:
            return [_on_local_shards(reduce, g, lay, axes) for g, lay in zip(g_leaves, lays)]
        g_leaves = [_on_local_shards(scatter, g, lay, axes) for g, lay in zip(g_leaves, lays)]
        # One hook call per group of leaves with the same axes still to sum over and the
        # same automatic (TP) axes: a bucket must not mix leaves that are sharded over
        # "tensor" with leaves replicated over it.
        groups = {}
        for i, lay in enumerate(lays):
            groups.setdefault((remaining(lay), _auto_axes([lay], axes)), []).append(i)
        for (over, _), idx in groups.items():
            if over:
                summed = _hook_on_local_shards(strategy.grad_sync, [g_leaves[i] for i in idx],
                                               [lays[i] for i in idx], over, axes)
                for i, g in zip(idx, summed):
                    g_leaves[i] = g
        return [g / shards for g in g_leaves]

    def body(p_local, b_local):
        full = [_on_local_shards(gather, x, lay, axes) for x, lay in zip(p_local, lays)]
        with context.manual(axes):
            (loss, aux), grads = produce(
                jax.tree.unflatten(p_def, full), jax.tree.unflatten(b_def, b_local)
            )
        synced = sync(jax.tree.leaves(grads))
        loss = _mean_over(loss, axes, shards)
        aux = jax.tree.map(lambda a: _mean_over(to_varying(a, axes), axes, shards), aux)
        return loss, aux, synced

    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(p_specs, [b_spec] * len(b_leaves)),
        out_specs=(PartitionSpec(), PartitionSpec(), g_specs),
        axis_names=frozenset(axes),
    )
    loss, aux, g_leaves = mapped(p_leaves, b_leaves)
    return (loss, aux), jax.tree.unflatten(p_def, g_leaves)
