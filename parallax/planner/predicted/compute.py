"""Predicted compute of a training step: matmul FLOPs, bytes through memory, the bubble.

The roofline's terms besides the collectives (:mod:`parallax.planner.predicted.traffic`):
FLOPs are ``flops_per_token`` (PaLM's ``6 N + 12 L T D``) per device, plus what the
model's remat policy recomputes (:mod:`parallax.models.remat`), the logits the chunked
loss recomputes in its backward, and the forwards a pipeline recomputes; the bytes one device moves through its memory come from the predicted
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
from parallax.models.remat import recomputed_flops_per_token
from parallax.planner.predicted.memory import (Estimate, activation_bytes, local_param_bytes,
                                               loss_chunks, state_bytes)
from parallax.planner.setting import StepSetting


def _arithmetic(config):
    """(param_count, flops_per_token) of the model's family."""
    if isinstance(config, LlamaConfig):
        return llama_param_count, llama_flops_per_token
    return param_count, flops_per_token


def _block_params(c) -> int:
    count = _arithmetic(c)[0]
    return (count(dataclasses.replace(c, num_layers=2))
            - count(dataclasses.replace(c, num_layers=1)))


def remat_flops_per_token(config, seq_len: int) -> int:
    """The matmul flops per token the model's ``remat`` policy adds (0 for ``"none"``).

    Example:
      >>> from parallax.models import GPTConfig
      >>> remat_flops_per_token(GPTConfig.tiny(remat="dots"), 64)  # attention once more
      32768
    """
    c, policy = config, getattr(config, "remat", "none")
    if policy == "none":
        return 0
    width = c.num_heads * c.head_dim
    return recomputed_flops_per_token(policy, c.num_layers * _block_params(c),
                                      c.num_layers * c.mlp_dim * c.embed_dim,
                                      4 * c.num_layers * seq_len * width)


def loss_flops_per_token(config, seq_len: int) -> int:
    """The matmul flops per token the models' chunked loss recomputes: its backward forms
    each chunk's logits again (``2 V D``), none when the logits are computed at once
    (``loss_chunks=1``, or a vocabulary no wider than the hidden states).

    Example:
      >>> from parallax.models import GPTConfig
      >>> loss_flops_per_token(GPTConfig.tiny(), 64), loss_flops_per_token(
      ...     GPTConfig.tiny(loss_chunks=1), 64)
      (32768, 0)
    """
    return 0 if loss_chunks(config, seq_len) == 1 else \
        2 * config.padded_vocab_size * config.embed_dim


def model_flops(s: StepSetting) -> float | None:
    """PaLM's model flops per device per step (``6 N + 12 L T D`` per token, nothing
    recomputed), or None for models other than the GPT and the Llama."""
    found = flops(s, recomputed=False)
    return None if found is None else found.value


def flops(s: StepSetting, recomputed: bool = True) -> Estimate | None:
    """Matmul flops per device per step for a GPT or Llama (None for other models): the model
    flops, plus what the remat policy, the chunked loss and a pipeline recompute.

    ``recomputed=False`` leaves out everything recomputed (remat, the loss's logits, a
    pipeline's forwards): the model's flops, which MFU divides (PaLM's definition; with them
    it is the hardware flops).

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
      >>> flops(s, recomputed=False).value == px.models.flops_per_token(config) * 64  # 1 row
      True
      >>> flops(s).value - flops(s, recomputed=False).value   # the chunked loss's logits again
      2097152.0
    """
    c = s.config
    if c is None or s.seq_len is None:
        return None
    tokens = s.batch_rows * s.seq_len
    ways = s.size(s.batch_axes) * s.tensor * s.stages * s.context
    per_token = _arithmetic(c)[1]
    remat = remat_flops_per_token(c, s.seq_len) if recomputed else 0
    loss_again = loss_flops_per_token(c, s.seq_len) if recomputed else 0
    total = (per_token(c, s.seq_len) + remat + loss_again) * tokens
    policy = getattr(c, "remat", "none")
    how = "(6 N + 12 L T D" + (f" + remat={policy!r}'s recomputation" if remat else "") + (
        " + the chunked loss's logits again" if loss_again else "") + ") x tokens / devices" + (
        f" (N active: top-{c.moe.top_k} of {c.moe.num_experts} experts"
        + (" + the shared expert" if c.moe.shared_mlp_dim else "") + ")"
        if getattr(c, "moe", None) is not None else "")
    p = s.pipeline
    if recomputed and p is not None and p.remat_fraction:
        block = _block_params(c)
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
