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
   shards. The loss is averaged the same way; auxiliary values, the module's state after
   the forward pass and sown values are reduced by kind (:mod:`parallax.grad.aux_outputs`).

An NNX module is rebuilt inside the differentiated function, so a forward pass may write
its non-parameter state (BatchNorm statistics, RNG counters): that state comes back
written into the module passed in, as with ``nnx.value_and_grad``
(:mod:`parallax.grad.module_state`, :mod:`parallax.grad.slice_loss`).

The loss function must return a mean over the examples of its batch (equal weights), which
makes the mean over equal shards exactly the full batch's value.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from parallax import context, layout, loss_scale
from parallax import finite_check
from parallax.grad.aux_outputs import join_examples, over_shards, restore_static, split_examples
from parallax.step.batch import check_batch_tree
from parallax.grad.slice_loss import LocalResult, SliceLoss, leading_size
from parallax.grad.local_shards import auto_axes, group_on_local_shards, on_local_shards
from parallax.mesh import axis_size
from parallax.grad.microbatches import check_count, check_microbatches
from parallax.grad.module_state import StateOptions, Target
from parallax.grad.producer import GradRequest, gradient_producer, split_target
from parallax.grad.sliced_rng import WHOLE, Position
from parallax.comm.varying import to_varying

__all__ = ["GradRequest", "split_target", "value_and_grad"]

API = "px.value_and_grad"


def value_and_grad(
    loss_fn: Callable,
    *,
    microbatches: int | None = None,
    has_aux: bool = False,
    batch_stats: str = "global",
    rng: str = "global",
) -> Callable:
    """Like ``jax.value_and_grad``, with the strategy's gradient production and sync.

    Args:
      loss_fn: ``loss_fn(model_or_params, batch, *args) -> loss`` (or ``(loss, aux)`` with
        ``has_aux``). ``loss`` must be a scalar mean over the batch's examples. An NNX
        module is differentiated with respect to its ``nnx.Param`` state; the rest of its
        state (BatchNorm statistics, RNG counters, variables, sown values) as the forward
        pass leaves it is written back into the module, as ``nnx.value_and_grad`` does.
      microbatches: split each device's batch into this many micro-batches and accumulate
        (``lax.scan``); numerically the full batch's result.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; aux values are reduced by kind over
        batch shards and micro-batches: per-example arrays (leading dimension = the batch)
        concatenated, other floats averaged, integers and keys passed through when equal
        on every shard (an error otherwise), non-array values passed through.
      batch_stats: which examples a BatchNorm's statistics cover: ``"global"`` (the
        whole batch, one device's semantics; the default), ``"per_replica"`` (each batch
        shard's, DDP's) or ``"per_microbatch"`` (each micro-batch's, GPipe's). See
        :mod:`parallax.grad.module_state` for what each costs.
      rng: ``"global"`` (the default: draws from the module's RNG streams are one
        device's, on every shard and micro-batch) or ``"per_shard"`` (an independent
        stream per slice).

    Returns:
      ``fn(model_or_params, batch, *args) -> (loss, grads)`` (or ``((loss, aux), grads)``),
      where ``grads`` has the structure of the parameters (an ``nnx.State`` for a module).
      Under ZeRO 2/3 the gradients come out sharded over the ZeRO axis.

    Raises:
      TypeError: ``loss_fn`` is not callable, or returns a non-array / non-float loss.
      ValueError: a bad ``microbatches``, ``batch_stats`` or ``rng``; a non-scalar loss.

    Example:
      >>> import jax.numpy as jnp, parallax as px
      >>> loss = lambda w, batch: jnp.mean((batch["x"] @ w) ** 2)
      >>> batch = {"x": jnp.ones((8, 3))}
      >>> value, grads = px.value_and_grad(loss, microbatches=2)(jnp.ones(3), batch)
      >>> float(value)
      9.0

    References:
      Ioffe & Szegedy, "Batch Normalization", 2015 (and PyTorch's ``SyncBatchNorm``);
      Huang et al., "GPipe", 2019 (micro-batches, per-micro-batch statistics).
    """
    if not callable(loss_fn):
        raise TypeError(f"{API}: loss_fn must be callable as loss_fn(model, batch); got "
                        f"{type(loss_fn).__name__}: {loss_fn!r}.")
    if microbatches is not None:
        check_count(microbatches, API)
    options = StateOptions(batch_stats, rng)

    def wrapped(target, batch, *args):
        check_batch_tree(batch, API)
        ctx = context.current()
        strategy = ctx.strategy if ctx is not None else None
        parts = Target.of(target)
        axes = batch_axes(ctx)
        explicit = bool(axes) and strategy.sync_style == "explicit"
        check_options(options, ctx, axes, explicit)
        policy = strategy.precision if strategy is not None else None
        scale = precision_scale(policy, parts.params)
        local = SliceLoss(loss_fn, parts, args, has_aux, options,
                          axes=axes if explicit else (), check=finite_check.active(),
                          hooks=strategy.module_hooks if strategy is not None else (),
                          precision=policy, scale=scale)
        produce, split = gradient_producer(local, strategy, microbatches)
        check_microbatches(batch, split, API, axis_size(ctx.mesh, axes) if axes else 1)
        if explicit:
            (loss, res), grads = explicit_value_and_grad(produce, parts, batch, ctx, axes,
                                                         target)
        else:
            (loss, res), grads = produce(parts.params, batch, parts.state, WHOLE)
            grads = constrain_grads(grads, parts.params, ctx, target)
        loss, grads = finish_precision(policy, scale, loss, grads)
        parts.write_back(target, res.state, res.new)
        finite_check.extend(list(res.checks.items()))
        finite_check.record("loss", loss)
        finite_check.record("gradient ", grads)
        statics = local.statics.get("aux")  # set while the slice's loss was traced
        aux = res.aux if statics is None or not has_aux else restore_static(res.aux, statics)
        return ((loss, aux) if has_aux else loss), grads

    return wrapped


def precision_scale(policy, params):
    """The loss scale of the step (None without one), after checking the policy's params."""
    if policy is None:
        return None
    policy.check_params(params, API)
    scale = loss_scale.current()
    if policy.loss_scale == "dynamic" and scale is None:
        raise ValueError(
            f"{API}: the precision policy ({policy.describe()}) scales the loss dynamically, "
            "but the step's state holds no loss scale. Wrap the optimizer: "
            "px.TrainState.create(model, px.dynamic_loss_scale(optax.adam(...))), or pass "
            "px.MixedPrecision(..., loss_scale=None).")
    return scale if policy.loss_scale == "dynamic" else None


def finish_precision(policy, scale, loss, grads):
    """The loss and gradients unscaled (in float32) and the gradients in ``grads`` dtype."""
    if policy is None:
        return loss, grads
    if scale is not None:
        loss = loss / scale
        grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
    return loss, jax.tree.map(lambda g: g.astype(policy.grads), grads)


def check_options(options: StateOptions, ctx, axes, explicit: bool) -> None:
    """Per-replica statistics need the shards to be manual (the explicit style)."""
    if options.batch_stats == "per_replica" and axes and not explicit:
        raise ValueError(
            f"{API}: batch_stats='per_replica' computes statistics on each batch shard, "
            f"which the gspmd style does not see (it runs on the global batch); use "
            f"{ctx.strategy.name} in the default style='explicit', or batch_stats='global'.")


def batch_axes(ctx) -> tuple[str, ...]:
    """The mesh axes that split the batch in the active step (none outside a step).

    Axes of size 1 split nothing and are left out: XLA's CPU backend keeps an all-reduce
    over one device, which copies every gradient and holds the optimizer back until the
    whole backward is done (measured in ``docs/distributed.md``)."""
    if ctx is None:
        return ()
    return tuple(a for a in ctx.strategy.batch_axes if ctx.mesh.shape.get(a, 1) > 1)


def constrain_grads(grads, params, ctx, source=None):
    """GSPMD style: gradients constrained to ZeRO's layout (stages 2 and 3)."""
    if ctx is None or ctx.strategy.zero is None or not ctx.strategy.zero.shards("grad"):
        return grads
    lays = layout.param_layouts(params, ctx.strategy, ctx.mesh, API, source=source)
    leaves, treedef = jax.tree.flatten(grads)
    leaves = [lax.with_sharding_constraint(g, lay.spec("grad")) for g, lay in zip(leaves, lays)]
    return jax.tree.unflatten(treedef, leaves)


def explicit_value_and_grad(produce, parts: Target, batch, ctx, axes, source=None):
    """The explicit style: local gradients inside ``shard_map`` over ``axes``, then the
    data-parallel collectives, each a named step below. ``source`` (the module) names
    parameters a tensor-parallel plan lays out."""
    strategy, mesh = ctx.strategy, ctx.mesh
    shards = axis_size(mesh, axes)
    params = parts.params
    lays = layout.param_layouts(params, strategy, mesh, API, source=source)
    p_leaves, p_def = jax.tree.flatten(params)
    b_leaves, b_def = jax.tree.flatten(batch)

    # A point-to-point sync returns equal sums typed varying, which JAX cannot check.
    checked = not getattr(strategy.grad_sync, "varying_results", False)

    def body(p_local, state, b_local):
        with jax.named_scope("parallax/zero_gather"):  # names the collectives in profiles
            full = gather_params(p_local, lays, axes, cast=checked)
        position = Position(lax.axis_index(axes), shards)
        with context.manual(axes):
            (loss, res), grads = produce(jax.tree.unflatten(p_def, full),
                                         jax.tree.unflatten(b_def, b_local), state, position)
        with jax.named_scope("parallax/grad_sync"):
            synced = sync_grads(jax.tree.leaves(grads), lays, axes, strategy.grad_sync,
                                strategy.precision)
        shared, examples = reduce_results(loss, res, leading_size(b_local), axes, shards,
                                          typed=checked)
        return shared, examples, [g / shards for g in synced]

    b_spec = PartitionSpec(axes if len(axes) > 1 else axes[0])
    mapped = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=([lay.manual_spec("param", axes) for lay in lays], PartitionSpec(),
                  [b_spec] * len(b_leaves)),
        # Per-example values leave with the batch's spec: concatenated in batch order.
        out_specs=(PartitionSpec(), b_spec, [lay.manual_spec("grad", axes) for lay in lays]),
        axis_names=frozenset(axes),
        check_vma=checked,
    )
    (loss, aux, new, state, checks), (aux_examples, new_examples), g_leaves = mapped(
        p_leaves, parts.state, b_leaves)
    result = LocalResult(join_examples(aux, aux_examples), state,
                         join_examples(new, new_examples), checks)
    return (loss, result), jax.tree.unflatten(p_def, g_leaves)


def reduce_results(loss, res: LocalResult, rows: int, axes, shards: int, typed: bool = True):
    """``(shared, examples)``: the loss, aux values, sown values, module state and checks
    of one shard reduced over the batch axes by kind (:mod:`parallax.grad.aux_outputs`), and the
    per-example values, which ``shard_map`` concatenates. ``typed``: the map checks varying
    axes, so a leaf invariant over the batch axes is known to be shared."""
    known = axes if typed else ()
    aux, aux_examples = split_examples(res.aux, rows, known)
    new, new_examples = split_examples(res.new, rows, known)
    checks = {name: lax.pmin(to_varying(ok.astype(jnp.int32), axes), axes) > 0
              for name, ok in res.checks.items()}
    shared = (mean_over(loss, axes, shards),
              over_shards(aux, axes, shards, api=API, what="auxiliary value"),
              over_shards(new, axes, shards, api=API, what="sown value"),
              over_shards(res.state, axes, shards, api=API, what="module variable"),
              checks)
    return shared, (aux_examples, new_examples)


def gather_params(leaves, lays, axes, cast: bool = True):
    """Each parameter cast to varying over the batch axes (so autodiff inserts no implicit
    ``psum``; not needed, and not wanted, in an unchecked ``shard_map``, which has no types
    to insert it by) and, under ZeRO 3, all-gathered from its shards."""

    def gather(x, lay):
        x = to_varying(x, axes) if cast else x
        return lay.zero.gather(x, lay.shard_dim) if lay.is_sharded("param") else x

    return [on_local_shards(gather, x, lay, axes) for x, lay in zip(leaves, lays)]


def scatter_grad(g, lay):
    """ZeRO 2/3: the gradient reduce-scattered over the ZeRO axis (each device keeps the
    summed slice it owns); unchanged otherwise."""
    return lay.zero.scatter(g, lay.shard_dim) if lay.is_sharded("grad") else g


def remaining_axes(lay, axes) -> tuple[str, ...]:
    """The batch axes a gradient is still to be summed over after ZeRO's reduce-scatter.

    Never an axis the rules split the leaf over (expert parallelism's experts): each
    device's shard holds other parameters, whose gradients already gathered every shard's
    tokens through the exchange's all-to-alls; they are summed only over the axes that
    replicate them."""
    split = lay.split_over(axes)
    axes = tuple(a for a in axes if a not in split)
    return tuple(a for a in axes if a != lay.zero.axis) if lay.is_sharded("grad") else axes


def sync_grads(leaves, lays, axes, grad_sync, policy=None):
    """Gradients summed over the batch axes: ZeRO's reduce-scatter, then one ``psum`` per
    leaf over the remaining axes, or the strategy's ``grad_sync`` per group (DDP buckets).
    With a precision policy the sum travels in its ``reduce`` dtype and comes back in its
    ``grads`` dtype."""
    if policy is not None:
        leaves = [g.astype(policy.reduce) for g in leaves]
        summed = sync_grads(leaves, lays, axes, grad_sync)
        return [g.astype(policy.grads) for g in summed]
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
    """The loss averaged over the batch shards (a mean of equal shards' means)."""
    return lax.psum(x, axes) / shards
