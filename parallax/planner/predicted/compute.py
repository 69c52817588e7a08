"""Predicted compute of a training step: matmul FLOPs, bytes through memory, the bubble.

The roofline's terms besides the collectives (:mod:`parallax.planner.predicted.traffic`):
FLOPs are ``flops_per_token`` (PaLM's ``6 N + 12 L T D``) per device, plus the forwards a
pipeline recomputes; the bytes one device moves through its memory come from the predicted
state and activations (:mod:`parallax.planner.predicted.memory`); the bubble is the
pipeline schedule's.

References:
  Chowdhery et al., "PaLM", 2022, appendix B; Williams et al., "Roofline", CACM 2009;
  Narayanan et al., SC 2021.
"""

from __future__ import annotations

import dataclasses

from parallax.models.gpt_config import flops_per_token, param_count
from parallax.models.llama_config import LlamaConfig, llama_flops_per_token, llama_param_count
from parallax.planner.predicted.memory import (Estimate, activation_bytes, local_param_bytes,
                                               state_bytes)
from parallax.planner.setting import StepSetting


def _arithmetic(config):
    """(param_count, flops_per_token) of the model's family."""
    if isinstance(config, LlamaConfig):
        return llama_param_count, llama_flops_per_token
    return param_count, flops_per_token


def flops(s: StepSetting, recomputed: bool = True) -> Estimate | None:
    """Matmul flops per device per step for a GPT or Llama (None for other models).

    ``recomputed=False`` leaves out the forwards a pipeline recomputes: the model's flops,
    which MFU divides (PaLM's definition; with them it is the hardware flops).

    Example:
      >>> import jax, jax.numpy as jnp, optax, parallax as px
      >>> from flax import nnx
      >>> from parallax.planner.setting import read_setting
      >>> config = px.models.GPTConfig.tiny()
      >>> state = jax.eval_shape(lambda: px.TrainState.create(
      ...     px.models.GPT(config, rngs=nnx.Rngs(0)), optax.sgd(0.1)))
      >>> tokens = jax.ShapeDtypeStruct((8, 65), jnp.int32)
      >>> s = read_setting(px.make_mesh(data=8), px.DataParallel("data"), state,
      ...                  {"tokens": tokens})
      >>> flops(s).value == px.models.flops_per_token(config) * 64   # 1 row of 64 tokens
      True
    """
    c = s.config
    if c is None or s.seq_len is None:
        return None
    tokens = s.batch_rows * s.seq_len
    ways = s.size(s.batch_axes) * s.tensor * s.stages * s.context
    count, per_token = _arithmetic(c)
    total = per_token(c, s.seq_len) * tokens
    how = "(6 N + 12 L T D) x tokens / devices" + (
        f" (N active: top-{c.moe.top_k} of {c.moe.num_experts} experts"
        + (" + the shared expert" if c.moe.shared_mlp_dim else "") + ")"
        if getattr(c, "moe", None) is not None else "")
    p = s.pipeline
    if recomputed and p is not None and p.remat_fraction:
        block = (count(dataclasses.replace(c, num_layers=2))
                 - count(dataclasses.replace(c, num_layers=1)))
        forward = (2 * block + 4 * s.seq_len * c.embed_dim) * c.num_layers * tokens
        total += p.remat_fraction * forward
        how += " + recomputed forwards"
    return Estimate(total / ways, how)


def bubble(s: StepSetting) -> Estimate | None:
    """The pipeline schedule's bubble fraction (the papers' measure at F = B = W = 1), or None.

    Idle time over every stage's makespan (``Schedule.bubble_fraction``); at equal costs it
    is also what parallax's lock-step runtime pays.

    Example:
      >>> import jax.numpy as jnp, parallax as px
      >>> from parallax.planner.setting import read_setting
      >>> none = read_setting(px.make_mesh(data=8), px.DataParallel("data"),
      ...                     {"w": jnp.ones(8)}, {"x": jnp.ones((8, 2))})
      >>> bubble(none) is None
      True
    """
    if s.pipeline is None:
        return None
    sched = s.pipeline.schedule
    return Estimate(sched.bubble_fraction(), f"{sched.name}: idle / makespan at F = B = W "
                    f"({sched.ticks} ticks)")


def hbm_bytes(s: StepSetting, activations: float | None = None) -> Estimate:
    """Bytes one device moves through its memory per step (the roofline's memory term).

    The forward and backward read the parameters as used (``Ψ``, gathered under ZeRO 3)
    and write and read the activations ``A``; the backward writes the local gradients
    ``Ψ``, the sync reads them; the optimizer reads the sharded gradients ``G_s``, reads and
    writes its parameters ``P_s`` and moments ``O_s``:
    ``2 Ψ + 2 A + 2 Ψ + 2 P_s + G_s + 2 O_s``. ``activations`` replaces the GPT formula's
    ``A`` (for other models).
    """
    state = state_bytes(s)
    if activations is None:
        act = activation_bytes(s)
        activations = act.value if act else 0.0
    psi = local_param_bytes(s)
    moved = (4 * psi + 2 * activations + 2 * state["parameters"].value
             + state["gradients"].value + 2 * state["optimizer state"].value)
    return Estimate(moved, "2 Ψ + 2 A + 2 Ψ + 2 P_s + G_s + 2 O_s")
