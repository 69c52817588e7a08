"""A mixture-of-experts layer in Flax NNX: router, stacked SwiGLU experts, capacity or dropless.

``MoE(x)`` returns ``(y, stats)``: the layer's output and its router statistics (the two
auxiliary losses, the dropped fraction, the load per expert) for the step to add to its
loss (:func:`aux_loss`). The experts are one stacked weight per projection whose leading
dimension is named ``"expert"``; a strategy maps that name to a mesh axis.

Two ways to reach the experts:

- with a capacity (``capacity_factor``): GShard's dispatch and combine tensors move each
  sequence's tokens into ``[E, C]`` slots, the experts run as one batched matmul over E,
  and the outputs are combined back with the gates; choices past an expert's capacity are
  dropped (their MoE output is zero);
- dropless (``capacity_factor=None``): the ``N k`` choices are sorted by expert and the
  experts run as grouped matmuls with ``jax.lax.ragged_dot`` (MegaBlocks' idea); under
  expert parallelism, each expert's routed tokens reach it through
  ``jax.lax.ragged_all_to_all`` on GPUs and TPUs (``parallax.nn.moe_ragged``), or on CPU,
  which lacks that op, in rounds of each expert's even share of slots, as many as the
  busiest expert needs (``parallax.nn.moe_dropless``; ``px.ExpertParallel``'s
  ``dropless_exchange`` picks); in the GSPMD style the same, in a ``shard_map`` of the
  exchange (``parallax.nn.moe_gspmd``); where ``ragged_dot`` is missing, or in a pipeline
  stage, every expert gets ``S`` slots per sequence (padded: nothing can drop, at ``E / k``
  times the compute and traffic).

Under a strategy with an expert axis (``px.ExpertParallel``) the ``[G, E, C, D]`` slots go
through the strategy's exchange (two all-to-alls, ``parallax.strategies.expert_dispatch``),
read from the step context: this file names no mesh axis.

References:
  Lepikhin et al. 2020, "GShard" (dispatch/combine einsums, capacity); Fedus et al. 2021,
  "Switch Transformers"; Shazeer 2020, "GLU Variants Improve Transformer" (SwiGLU);
  Gale et al. 2022, "MegaBlocks" (dropless grouped matmuls); DeepSeek-AI 2024,
  "DeepSeekMoE" / "DeepSeek-V3" (shared expert, sigmoid scores).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from parallax import context
from parallax.comm.varying import to_varying
from parallax.nn.layers import annotated_param
from parallax.nn.moe_config import MoEConfig
from parallax.nn.moe_dropless import dropless_in_rounds
from parallax.nn.moe_experts import grouped_experts, swiglu_experts, swiglu_grouped
from parallax.nn.moe_gspmd import dropless_in_shard_map
from parallax.nn.moe_ragged import dropless_ragged
from parallax.nn.moe_routing import dispatch_tensors, route, router_stats
from parallax.strategies.expert_dispatch import mesh_platform

Initializer = nnx.initializers.Initializer


class MoE(nnx.Module):
    """Top-k routed SwiGLU experts (and an optional shared expert) on ``[B, S, D]``.

    Args:
      embed_dim: D, the input and output width.
      config: a :class:`MoEConfig`.
      mlp_dim: each expert's hidden width when ``config.mlp_dim`` is None.
      rngs: the ``nnx.Rngs`` for the weights.
      out_init: init of the down projections (the GPT scales it with depth).
      dtype: compute dtype (the router always computes in float32).
      param_dtype: storage dtype.

    Returns:
      Calling the layer on ``x [B, S, D]`` gives ``(y [B, S, D], stats)``; ``stats`` holds
      ``load_balance_loss``, ``router_z_loss``, ``dropped_fraction`` (scalars) and
      ``expert_load`` (``[E]``), each over the whole batch; ``layer(x, token_mask)`` (bool
      ``[B, S]``) counts only the masked-in tokens in them (padding routes as usual).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.nn import MoE, MoEConfig
      >>> moe = MoE(8, MoEConfig(num_experts=4, top_k=2, mlp_dim=16), rngs=nnx.Rngs(0))
      >>> y, stats = moe(jnp.ones((2, 6, 8)))
      >>> y.shape, stats["expert_load"].shape
      ((2, 6, 8), (4,))

    References:
      GShard (Lepikhin et al. 2020), Switch (Fedus et al. 2021), DeepSeek-V3 (2024).
    """

    def __init__(self, embed_dim: int, config: MoEConfig, *, rngs: nnx.Rngs,
                 mlp_dim: int | None = None,
                 out_init: Initializer = nnx.initializers.normal(0.02),
                 dtype=None, param_dtype=jnp.float32):
        if not isinstance(config, MoEConfig):
            raise TypeError(f"parallax.nn.MoE: config must be a MoEConfig, got "
                            f"{type(config).__name__}.")
        f = config.mlp_dim or mlp_dim
        if f is None:
            raise ValueError("parallax.nn.MoE: give the experts' width: MoEConfig(mlp_dim=F) "
                             "or MoE(..., mlp_dim=F).")
        e, d, init = config.num_experts, embed_dim, nnx.initializers.normal(0.02)
        self.config, self.dtype = config, dtype
        self.router = annotated_param(init, rngs.params(), (d, e), ("embed", None), param_dtype)
        stacked_in, stacked_out = ("expert", "embed", "mlp"), ("expert", "mlp", "embed")
        self.w_gate = annotated_param(init, rngs.params(), (e, d, f), stacked_in, param_dtype)
        self.w_up = annotated_param(init, rngs.params(), (e, d, f), stacked_in, param_dtype)
        self.w_down = annotated_param(out_init, rngs.params(), (e, f, d), stacked_out,
                                      param_dtype)
        fs = config.shared_mlp_dim
        if fs:
            self.shared_gate = annotated_param(init, rngs.params(), (d, fs), ("embed", "mlp"),
                                               param_dtype)
            self.shared_up = annotated_param(init, rngs.params(), (d, fs), ("embed", "mlp"),
                                             param_dtype)
            self.shared_down = annotated_param(out_init, rngs.params(), (fs, d),
                                               ("mlp", "embed"), param_dtype)
        else:
            self.shared_gate = self.shared_up = self.shared_down = None

    def __call__(self, x: jax.Array, token_mask: jax.Array | None = None
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        if x.ndim != 3:
            raise ValueError(f"parallax.nn.MoE: x must be [batch, seq, embed], got "
                             f"{list(x.shape)}.")
        if token_mask is not None and tuple(token_mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"parallax.nn.MoE: token_mask must be [batch, seq] like x's "
                             f"first two dimensions {list(x.shape[:2])}, got "
                             f"{list(token_mask.shape)}.")
        c, dtype = self.config, self.dtype or x.dtype
        x = x.astype(dtype)
        logits = jnp.einsum("gsd,de->gse", x.astype(jnp.float32),
                            self.router[...].astype(jnp.float32))
        routing = route(logits, c.top_k, c.score)
        weights = [w[...].astype(dtype) for w in (self.w_gate, self.w_up, self.w_down)]
        exchange = expert_exchange(c.num_experts)
        run = lambda t: swiglu_experts(t, *weights)  # noqa: E731 - the local experts
        axis = manual_expert_axis()
        if c.dropless and (axis is not None or gspmd_experts() is not None):
            y = exchanged_dropless(x, routing, weights, c.num_experts, axis)
            kept = jnp.ones(routing.experts.shape, bool)
        elif c.dropless and exchange is None and hasattr(lax, "ragged_dot"):
            y = grouped_experts(x, routing, weights)
            kept = jnp.ones(routing.experts.shape, bool)
        else:
            capacity = c.capacity(x.shape[1])
            dispatch, combine, kept = dispatch_tensors(routing, c.num_experts, capacity)
            slots = jnp.einsum("gsec,gsd->gecd", dispatch.astype(dtype), x)
            out = run(slots) if exchange is None else exchange(slots, run)
            y = jnp.einsum("gsec,gecd->gsd", combine.astype(dtype), out)
        if self.shared_gate is not None:
            gate = x @ self.shared_gate[...].astype(dtype)
            up = x @ self.shared_up[...].astype(dtype)
            y = y + (jax.nn.silu(gate) * up) @ self.shared_down[...].astype(dtype)
        stats = router_stats(logits, routing, kept, c.num_experts, batch_mean(), token_mask)
        return y, stats


def expert_exchange(num_experts: int):
    """The active strategy's token exchange, or None (the experts run where the tokens are).

    Warns once per trace when a step on several devices has no expert axis: the experts
    then run replicated on every device.
    """
    ctx = context.current()
    if ctx is None:
        return None
    experts = ctx.strategy.experts
    if experts is None:
        if ctx.mesh.size > 1:
            warnings.warn(
                f"parallax.nn.MoE: the strategy {ctx.strategy.name} has no expert axis, so "
                f"all {num_experts} experts are replicated on each of the {ctx.mesh.size} "
                "devices and every device runs them on its own tokens (correct, but no "
                "expert parallelism); compose px.ExpertParallel('expert') with a mesh "
                "axis expert=N to split them.", stacklevel=3)
        return None
    if not ctx.manual_axes:  # the GSPMD style: sharding constraints, XLA's all-to-alls
        batch_axes = tuple(ctx.strategy.batch_axes)
        return lambda slots, run: experts.constrained(slots, run, ctx.mesh, batch_axes)
    if experts.axis not in ctx.manual_axes:
        return None
    return lambda slots, run: experts.exchange(slots, run)


def manual_expert_axis() -> str | None:
    """The expert axis when this trace is manual over it (the explicit style), else None.

    None in a pipeline stage too: there dropless pads (the rounds' conditional did not
    trace through the pipeline runtime's replay of a stage, jax 0.10).
    """
    ctx = context.current()
    experts = None if ctx is None else ctx.strategy.experts
    if experts is None or experts.axis not in ctx.manual_axes:
        return None
    if ctx.strategy.rule_table.get("layers") in ctx.manual_axes:
        return None
    return experts.axis


def gspmd_experts():
    """The strategy's ``ExpertExchange`` in the GSPMD style (no axis manual), else None."""
    ctx = context.current()
    experts = None if ctx is None else ctx.strategy.experts
    if experts is None or ctx.manual_axes or not hasattr(experts, "dropless_exchange"):
        return None
    return experts


def exchanged_dropless(x: jax.Array, routing, weights, num_experts: int,
                       axis: str | None) -> jax.Array:
    """Dropless through the strategy's exchange, ragged or in rounds (``dropless_exchange``);
    in the GSPMD style (``axis`` None) inside a ``shard_map`` over the batch axes."""
    ctx = context.current()
    experts, ragged = ctx.strategy.experts, ragged_collective(ctx)
    if axis is None:
        return dropless_in_shard_map(x, routing.experts, routing.gates, weights, experts,
                                     ctx.mesh, tuple(ctx.strategy.batch_axes), num_experts,
                                     ragged)
    if ragged is not None:  # exact bytes: each expert gets its routed tokens
        grouped = lambda rows, sizes: swiglu_grouped(rows, sizes, weights)  # noqa: E731
        return dropless_ragged(x, routing.experts, routing.gates, grouped, axis, num_experts,
                               ragged)
    run = lambda t: swiglu_experts(t, *weights)  # noqa: E731
    return dropless_in_rounds(x, routing.experts, routing.gates, run, experts.exchange, axis,
                              num_experts, manual_batch_axes())[0]


def ragged_collective(ctx):
    """The ragged all-to-all the dropless exchange uses here, or None for the rounds.

    Warns once per trace when ``dropless_exchange="ragged"`` asks for the real op on a mesh
    of CPU devices, whose XLA cannot run it (the program can still be lowered for a GPU).
    """
    experts = ctx.strategy.experts
    if not hasattr(experts, "dropless_exchange"):  # another ExpertSharding: the rounds
        return None
    if experts.dropless_exchange(ctx.mesh) != "ragged":
        return None
    platform = mesh_platform(ctx.mesh)
    if experts.ragged_collective is None and platform == "cpu":
        warnings.warn(
            f"parallax.nn.MoE: px.ExpertParallel({experts.axis!r}, dropless_exchange="
            f"'ragged') on a mesh of {platform} devices: XLA:CPU cannot run "
            "jax.lax.ragged_all_to_all, so this step lowers for a GPU or TPU "
            "(step.lower(..., platforms=('cuda',))) but does not compile here; use "
            "dropless_exchange='auto' or 'rounds' to run on CPU.", stacklevel=4)
    return experts.ragged_all_to_all()


def manual_batch_axes() -> tuple[str, ...]:
    """The active step's batch axes that this trace is manual over (none outside a step)."""
    ctx = context.current()
    if ctx is None:
        return ()
    return tuple(a for a in ctx.strategy.batch_axes if a in ctx.manual_axes)


def batch_mean():
    """``x -> x`` averaged over the batch shards of the active step (identity otherwise).

    The identity in a pipeline stage too: there the statistics are per shard and micro-batch.
    """
    ctx, axes = context.current(), manual_batch_axes()
    if not axes:
        return lambda x: x
    shards = 1
    for a in axes:
        shards *= ctx.mesh.shape[a]
    if ctx.strategy.rule_table.get("layers") in ctx.manual_axes:
        # In a pipeline stage the statistics are each batch shard's and micro-batch's own
        # (Megatron-LM's default): the runtime stashes a layer's residuals as varying over
        # the batch axes, which a mean made the same on every shard is not.
        return lambda x: x
    return lambda x: lax.psum(to_varying(x, axes), axes) / shards


def aux_loss(stats: dict[str, jax.Array], config: MoEConfig) -> jax.Array:
    """``balance_coef * load_balance_loss + z_coef * router_z_loss``, to add to the loss.

    ``z_coef`` is the one in effect (:attr:`MoEConfig.router_z_coef`: none under Mixtral's
    convention). ``stats`` are a model's, over its layers, as its loss gives them.

    Example:
      >>> import jax.numpy as jnp
      >>> round(float(aux_loss({"load_balance_loss": jnp.float32(1.0),
      ...                       "router_z_loss": jnp.float32(2.0)}, MoEConfig())), 6)
      0.012
    """
    return (config.balance_coef * stats["load_balance_loss"]
            + config.router_z_coef * stats["router_z_loss"])
