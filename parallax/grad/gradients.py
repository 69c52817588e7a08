"""``px.value_and_grad``: gradients produced and synchronised as the strategy says.

Outside ``px.train_step`` it is ``jax.value_and_grad`` (plus optional micro-batching).
Inside, with a strategy that splits the batch in the ``"explicit"`` style, it opens a
``shard_map`` that is manual over the batch axes only (tensor axes stay with GSPMD) and
writes the data-parallel collectives itself (ZeRO's all-gather, local gradients, then
reduce-scatter and ``psum`` or the strategy's ``grad_sync``: :mod:`parallax.grad.explicit`);
in the ``"gspmd"`` style XLA inserts them, and ZeRO's gradient layout is a constraint.

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
from flax import nnx
from jax import lax

from parallax import context, layout, loss_scale
from parallax import finite_check
from parallax.grad import backward_records
from parallax.grad.aux_outputs import restore_static
from parallax.grad.explicit import explicit_value_and_grad
from parallax.step.batch import check_batch_tree
from parallax.grad.slice_loss import SliceLoss
from parallax.mesh import axis_size
from parallax.grad.microbatches import check_count, check_microbatches
from parallax.grad.module_state import StateOptions, Target
from parallax.grad.producer import GradRequest, gradient_producer, split_target
from parallax.grad.sliced_rng import WHOLE

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
                          hooks=strategy.model_hooks.before_loss if strategy is not None else (),
                          precision=policy, scale=scale)
        produce, split = gradient_producer(local, strategy, microbatches)
        check_records(parts, split, strategy)
        check_microbatches(batch, split, API, axis_size(ctx.mesh, axes) if axes else 1)
        if explicit:
            (loss, res), grads = explicit_value_and_grad(produce, parts, batch, ctx, axes,
                                                         target)
        else:
            (loss, res), grads = produce(parts.params, batch, parts.state, WHOLE)
            grads = constrain_grads(grads, parts.params, ctx, target)
        loss, grads = finish_precision(policy, scale, loss, grads)
        parts.write_back(target, res.state, res.new)
        if strategy is not None and parts.is_module:
            for hook in strategy.model_hooks.after_grad:
                hook(target)
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


def check_records(parts: Target, split: int, strategy) -> None:
    """State the backward pass writes (:mod:`parallax.grad.backward_records`) holds one
    value per step, which neither micro-batches (each sees a part of the loss) nor a
    strategy's own producer (pipelines) carry."""
    if not parts.is_module:
        return
    records, _ = backward_records.split_records(parts.state)
    if not backward_records.has_records(records):
        return
    producer = strategy is not None and strategy.grad_fn is not None
    if split > 1 or producer:
        path = ".".join(map(str, nnx.to_flat_state(records)[0][0]))
        how = (f"{split} micro-batches" if split > 1
               else f"the gradient producer of {strategy.name}")
        raise ValueError(
            f"{API}: the model holds state its backward pass writes ({path}, e.g. "
            f"px.Float8(delayed=True)'s gradient amaxes), which is recorded once per step "
            f"over the whole batch; {how} would split that step. Use microbatches=None and "
            "no pipeline with it, or px.Float8() (current scaling).")


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
