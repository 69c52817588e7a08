"""Predicted bytes per device of a training step, from the published formulas.

Each value is an :class:`Estimate` (bytes and the formula in words), computed from a
:class:`parallax.planner.setting.StepSetting`:

- **parameters, optimizer state, gradients**: ZeRO's accounting (Rajbhandari et al., table
  1) on top of the strategy's rules. Every leaf is split over the mesh axes its logical
  names map to (Megatron's tensor split, the pipeline's stacked layers), then divided by the
  ZeRO axis size ``N`` when its role is sharded: optimizer state from stage 1, gradients
  from stage 2, parameters at stage 3. The formula divides *every* leaf by ``N``; the real
  layout keeps a leaf with no dimension divisible by ``N`` whole (the difference is
  reported).
- **activations** (``px.models.GPT`` only): the tensors autodiff keeps for the backward,
  per layer (Korthikanti et al. 2022, section 4, without dropout):
  ``s b h (2/σ + 2 + 4/t) + 2 s b F / t + a s² b / t`` elements, ``σ = t`` under sequence
  parallelism, plus the probabilities of the loss (``s b V / t`` float32); ``b`` is a
  micro-batch's rows per device. A pipeline stage holds the schedule's peak in flight of
  micro-batches for its ``L / p`` layers (only each one's input when it is
  rematerialised, plus the one being computed). Under context parallelism every term is
  taken at ``T / n`` positions and the scores are not kept
  (:mod:`parallax.planner.predicted.context_parallel`).
- **temporaries**: activations, the unsynchronised gradients, and under ZeRO 3 in the
  explicit style the gathered parameters (held for the whole step, see docs/design.md).

References:
  Rajbhandari et al., "ZeRO", SC 2020. Korthikanti et al., "Reducing Activation
  Recomputation in Large Transformer Models", 2022. Narayanan et al., "Efficient
  Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC 2021.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from parallax.planner.predicted import context_parallel
from parallax.planner.setting import StepSetting

_ZERO_FROM = {"param": 3, "grad": 2, "opt": 1}


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A predicted quantity and how it was computed."""

    value: float
    how: str


def _divisor(s: StepSetting, role: str) -> int:
    stage = s.zero_stage
    return s.size(s.zero_axis) if stage and stage >= _ZERO_FROM[role] else 1


def state_bytes(s: StepSetting) -> dict[str, Estimate]:
    """Parameters, optimizer state, other state (step counters) and gradients per device.

    Example:
      >>> import jax, jax.numpy as jnp, optax, parallax as px
      >>> from parallax.planner.setting import read_setting
      >>> params = {"w": jnp.ones((64, 64))}
      >>> state = (params, optax.adam(1e-3).init(params))
      >>> s = read_setting(px.make_mesh(fsdp=8), px.ZeRO(1, "fsdp"), state,
      ...                  {"x": jnp.ones((8, 4))})
      >>> state_bytes(s)["optimizer state"].value     # 2 moments of 16 KiB, over 8
      4096.0
    """
    n = s.size(s.zero_axis) if s.zero_axis else 1
    totals = {"param": 0.0, "opt": 0.0, "other": 0.0}
    for leaf in s.leaves:
        role = leaf.role
        totals[role] += leaf.nbytes / leaf.rule_ways / (_divisor(s, role) if role != "other" else 1)
    grads = sum(x.nbytes / x.rule_ways for x in s.leaves if x.role == "param") / _divisor(s, "grad")
    split = "/ rules' split (TP, PP)"
    return {
        "parameters": Estimate(totals["param"], f"Σ Ψ_leaf {split}"
                               + (f" / N={n} (ZeRO 3)" if _divisor(s, "param") > 1 else "")),
        "optimizer state": Estimate(totals["opt"], f"Σ moments {split}"
                                    + (f" / N={n} (ZeRO ≥ 1)" if _divisor(s, "opt") > 1 else "")),
        "other state": Estimate(totals["other"], "step counters, replicated"),
        "gradients": Estimate(grads, f"Σ Ψ_leaf {split}"
                              + (f" / N={n} (ZeRO ≥ 2)" if _divisor(s, "grad") > 1 else "")),
    }


def local_param_bytes(s: StepSetting, stacked: bool | None = None) -> float:
    """Parameter bytes after the rules' split (before ZeRO), optionally only (non-)stacked."""
    return sum(x.nbytes / x.rule_ways for x in s.leaves
               if x.role == "param" and (stacked is None or x.stacked == stacked))


def microbatch_rows(s: StepSetting) -> float:
    """Rows of one micro-batch on one device (the batch over the batch axes and micro-batches)."""
    split = s.pipeline.microbatches if s.pipeline else s.accumulation
    return s.rows_per_device / split


@dataclasses.dataclass(frozen=True)
class LayerActivations:
    """Bytes one layer saves for ``rows`` examples per device (Korthikanti's terms):
    ``rest`` (``s b h (2/σ + 2 + 4/t) + 2 s b F/t`` elements), ``scores`` (the attention
    probabilities, ``a s² b / t``), and the loss head's ``head`` (``s b V / t`` float32
    probabilities and its ``s b h`` input)."""

    rest: float
    scores: float
    head: float

    @property
    def layer(self) -> float:
        return self.rest + self.scores


def layer_activations(s: StepSetting, rows: float | None = None) -> LayerActivations | None:
    """:class:`LayerActivations` of a GPT or Llama for ``rows`` examples per device (a
    micro-batch's by default); None for other models."""
    c = s.config
    if c is None or s.seq_len is None:
        return None
    b = microbatch_rows(s) if rows is None else rows
    t, seq = s.tensor, s.local_seq_len
    sigma = t if s.sequence_parallel else 1
    h, f, a = c.embed_dim, c.mlp_dim, c.num_heads
    e = jnp.dtype(c.dtype).itemsize
    rest = e * (seq * b * h * (2 / sigma + 2 + 4 / t) + 2 * seq * b * f / t)
    return LayerActivations(rest, e * a * seq * seq * b / t,
                            4 * seq * b * c.padded_vocab_size / t + e * seq * b * h)


def activation_bytes(s: StepSetting) -> Estimate | None:
    """The activations a GPT step keeps for its backward pass, per device (None otherwise)."""
    terms = layer_activations(s)
    if terms is None:
        return None
    c, b, seq = s.config, microbatch_rows(s), s.local_seq_len
    sigma = s.tensor if s.sequence_parallel else 1
    e, h = jnp.dtype(c.dtype).itemsize, c.embed_dim
    rest, per_layer, head = terms.rest, terms.layer, terms.head
    how = "L (s b h (2/σ + 2 + 4/t) + 2 s b F/t + a s² b/t) + s b V/t"
    if s.context_axis is not None:  # pipelines with context parallelism are refused
        return Estimate(*context_parallel.activation_bytes(s, rest, head))
    if s.pipeline is None:
        return Estimate(c.num_layers * per_layer + head, how)
    p = s.pipeline
    layers = c.num_layers / p.stages
    peak = p.schedule.peak
    if p.remat_fraction > 0:
        held = peak * e * seq * b * h / sigma + layers / p.virtual_stages * per_layer
        how = f"peak {peak} inputs x s b h + one chunk's layers ({how})"
    else:
        held = peak * layers / p.virtual_stages * per_layer
        how = f"peak in flight {peak} x (L / p v) layers ({how})"
    return Estimate(held + head, how)


def temporary_bytes(s: StepSetting) -> Estimate | None:
    """What the step needs besides its arguments: activations, unsynchronised gradients and,
    under ZeRO 3 (explicit style), the gathered parameters."""
    act = activation_bytes(s)
    if act is None:
        return None
    grads = local_param_bytes(s)
    gathered = grads if s.zero_stage == 3 and s.strategy.sync_style == "explicit" else 0.0
    how = "activations + local gradients" + (" + gathered parameters" if gathered else "")
    working = 0.0
    if s.context_axis is not None:
        working, what = context_parallel.working_set_bytes(s)
        how += f" + {what}"
    return Estimate(act.value + grads + gathered + working, how)
