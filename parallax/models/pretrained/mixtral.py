"""Mixtral in Hugging Face's layout (``MixtralForCausalLM``) and ours (an MoE ``Llama``).

Attention, norms, embedding and head are the Llama's (:mod:`.llama`); the MLP of every
block is a :class:`parallax.nn.MoE` (``LlamaConfig(moe=...)``), whose stacked weights are
the checkpoint's per-expert tensors (E of each per layer):

| Hugging Face | ours | how |
|---|---|---|
| ``model.layers.i.block_sparse_moe.gate.weight [E, D]`` | ``blocks.mlp.router [L, D, E]`` | transposed |
| ``... experts.j.w1.weight [F, D]`` | ``blocks.mlp.w_gate [L, E, D, F]`` | stacked over experts; transposed |
| ``... experts.j.w3.weight [F, D]`` | ``blocks.mlp.w_up [L, E, D, F]`` | the same |
| ``... experts.j.w2.weight [D, F]`` | ``blocks.mlp.w_down [L, E, F, D]`` | the same |

Each device reads only its experts (expert parallelism) and its columns of each
(tensor parallelism, FSDP) with :class:`Stacked` pieces: no full copy of a layer's experts
exists anywhere. This is the layout of the released checkpoints and of transformers 5's
``save_pretrained`` (which converts its fused in-memory ``gate_up_proj`` back to it).

The config's semantics, from ``configuration_mixtral.py`` and ``modeling_mixtral.py``:

- routing: softmax over all experts in float32, top-2, the two weights renormalised to
  sum 1 (``MixtralTopKRouter``), every token reaching its experts (no capacity):
  ``MoEConfig(top_k=2, capacity_factor=None)``; ``num_experts_per_tok`` other than 2 is
  refused (parallax's top-1 keeps the softmax probability, where Mixtral renormalises it
  to 1);
- auxiliary loss: ``router_aux_loss_coef`` times ``load_balancing_loss_func``, added only
  when ``output_router_logits`` is true: ``MoEConfig(aux_loss="mixtral",
  balance_coef=router_aux_loss_coef)`` then, ``balance_coef=0`` otherwise; no z-loss;
- defaults where a key is absent: ``rope_theta`` 1e6, ``rms_norm_eps`` 1e-5,
  ``max_position_embeddings`` 131072;
- ``sliding_window``: parallax attends causally over the whole sequence, which is the
  windowed attention for sequences up to the window, so ``max_seq_len`` is capped at it;
- ``router_jitter_noise`` and ``attention_dropout`` (training-time noise parallax's model
  lacks) load with a warning that names them.

References:
  Jiang et al. 2024, "Mixtral of Experts"; Hugging Face transformers,
  ``models/mixtral/configuration_mixtral.py`` and ``modeling_mixtral.py``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from parallax.models.llama import Llama
from parallax.models.llama_config import LlamaConfig
from parallax.models.pretrained import llama
from parallax.models.pretrained.pieces import Piece, Stacked
from parallax.nn.moe_config import MoEConfig

API = llama.API
MODEL = Llama
ARCHITECTURE = "MixtralForCausalLM"
DEFAULTS = {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096 * 32}
EXPERTS = "block_sparse_moe.experts"


def writes(c: LlamaConfig) -> bool:
    """Whether ``save_pretrained`` writes a Llama of config ``c`` as this family (MoE)."""
    return c.moe is not None


def moe_from_hf(hf: Mapping) -> MoEConfig:
    """Mixtral's routing and auxiliary loss as a ``MoEConfig``."""
    k = hf.get("num_experts_per_tok", 2)
    if k != 2:
        raise ValueError(
            f"{API}: Mixtral config num_experts_per_tok={k} is not supported; parallax's MoE "
            "routes Mixtral's way (softmax, top-k renormalised) for top-2 only (its top-1 "
            "keeps the probability as the gate, where Mixtral renormalises it to 1).")
    coef = float(hf.get("router_aux_loss_coef", 0.001))
    return MoEConfig(num_experts=int(hf.get("num_local_experts", 8)), top_k=2,
                     capacity_factor=None, aux_loss="mixtral",
                     balance_coef=coef if hf.get("output_router_logits", False) else 0.0)


def config_from_hf(hf: Mapping, **overrides: Any) -> LlamaConfig:
    """Our ``LlamaConfig(moe=...)`` from a Mixtral ``config.json``."""
    for key in ("router_jitter_noise", "attention_dropout"):
        if hf.get(key):
            warnings.warn(f"{API}: Mixtral config {key}={hf[key]} asks for training-time noise "
                          "that parallax's Llama does not have; the model loads without it "
                          "(its outputs in evaluation are the same, a fine-tune differs).",
                          stacklevel=3)
    has_theta = "rope_theta" in hf or "rope_theta" in (hf.get("rope_parameters") or {})
    filled = dict(hf) | {key: hf.get(key, value) for key, value in DEFAULTS.items()
                         if key != "rope_theta" or not has_theta}
    window = hf.get("sliding_window")
    if window is not None:
        longest = overrides.get("max_seq_len", filled["max_position_embeddings"])
        if longest > window and "max_seq_len" in overrides:
            raise ValueError(
                f"{API}: max_seq_len={longest} exceeds the Mixtral config's sliding_window="
                f"{window}; parallax attends over the whole sequence, which is the windowed "
                f"attention only up to the window; use max_seq_len <= {window}.")
        filled["max_position_embeddings"] = min(longest, window)
    overrides = {"moe": moe_from_hf(hf)} | overrides
    return llama.config_from_hf(filled, **overrides)


def config_to_hf(c: LlamaConfig) -> dict:
    """A Mixtral ``config.json`` for ``c``; refuses MoE layers Mixtral cannot express."""
    m = c.moe
    for field, mixtral in (("top_k", 2), ("score", "softmax"), ("shared_mlp_dim", 0)):
        if getattr(m, field) != mixtral:
            raise ValueError(
                f"px.models.save_pretrained: MoEConfig({field}={getattr(m, field)!r}) has no "
                f"Mixtral equivalent (Mixtral's is {mixtral!r}); transformers would compute "
                "another model from the files.")
    if c.qkv_bias:
        raise ValueError("px.models.save_pretrained: LlamaConfig(qkv_bias=True) has no Mixtral "
                         "equivalent (Mixtral's attention has no biases).")
    # Mixtral has no dense MLP: its intermediate_size is the experts' width.
    out = llama.config_to_hf(dataclasses.replace(c, mlp_dim=m.mlp_dim or c.mlp_dim))
    for key in ("attention_bias", "mlp_bias"):
        del out[key]
    pooled = m.aux_loss == "mixtral" and m.balance_coef > 0
    return out | {
        "model_type": "mixtral", "architectures": [ARCHITECTURE],
        "num_local_experts": m.num_experts, "num_experts_per_tok": m.top_k,
        "output_router_logits": pooled,
        "router_aux_loss_coef": m.balance_coef if pooled else 0.001,
        "router_jitter_noise": 0.0, "sliding_window": None, "attention_dropout": 0.0}


def pieces(c: LlamaConfig, names) -> tuple[dict[str, Piece], dict]:
    """Our leaves -> their pieces: the Llama's, the MLP's replaced by the experts'."""
    top, dense = llama.pieces(dataclasses.replace(c, moe=None), names)
    d, e, f = c.embed_dim, c.moe.num_experts, c.moe.mlp_dim or c.mlp_dim

    def layer(i: int) -> dict[str, Piece]:
        b = f"model.layers.{i}.block_sparse_moe."
        experts = {ours: Stacked(tuple(Piece(f"{b}experts.{j}.{theirs}.weight", rows, cols, True)
                                       for j in range(e)), 0)
                   for ours, theirs, rows, cols in (("w_gate", "w1", (d,), (f,)),
                                                    ("w_up", "w3", (d,), (f,)),
                                                    ("w_down", "w2", (f,), (d,)))}
        attention = {name: piece for name, piece in dense[i].items()
                     if not name.startswith("blocks.mlp.")}
        return attention | {"blocks.mlp.router": Piece(f"{b}gate.weight", (d,), (e,), True)} | {
            f"blocks.mlp.{name}": piece for name, piece in experts.items()}

    return top, {i: layer(i) for i in range(c.num_layers)}


def ignored(name: str) -> bool:
    """Rotary caches of old files; the head when tied."""
    return llama.ignored(name)


def export(c: LlamaConfig, leaves: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our leaves -> Mixtral's tensors (per expert), as transformers saves them."""
    out = llama.export(c, leaves)
    for i in range(c.num_layers):
        b = f"model.layers.{i}.block_sparse_moe."
        out[f"{b}gate.weight"] = leaves["blocks.mlp.router"][i].T
        for ours, theirs in (("w_gate", "w1"), ("w_up", "w3"), ("w_down", "w2")):
            for j, kernel in enumerate(leaves[f"blocks.mlp.{ours}"][i]):
                out[f"{b}experts.{j}.{theirs}.weight"] = kernel.T
    return out
