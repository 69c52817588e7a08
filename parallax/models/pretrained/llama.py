"""Llama in Hugging Face's layout (``LlamaForCausalLM``) and ours (``px.models.Llama``).

| Hugging Face | ours | how |
|---|---|---|
| ``model.embed_tokens.weight [V, D]`` | ``embed [V', D]`` | padded rows zero |
| ``model.layers.i.input_layernorm.weight`` | ``blocks.attn_norm.scale`` | |
| ``model.layers.i.self_attn.q_proj.weight [H*K, D]`` | ``blocks.attn.query.kernel [L, D, H, K]`` | ``nn.Linear`` stores ``[out, in]``: transposed |
| ``... k_proj / v_proj [G*K, D]`` | ``blocks.attn.key_value.kernel [L, D, 2, G, K]`` | stacked k, v; transposed; RoPE's "rotate half" pairing is transformers' own, so no permutation |
| ``... o_proj [D, H*K]`` | ``blocks.attn.out.kernel [L, H, K, D]`` | transposed |
| ``model.layers.i.post_attention_layernorm.weight`` | ``blocks.mlp_norm.scale`` | |
| ``... mlp.gate_proj / up_proj [F, D]`` | ``blocks.mlp.gate_up.kernel [L, D, 2, F]`` | stacked gate, up; transposed |
| ``... mlp.down_proj [D, F]`` | ``blocks.mlp.down.kernel [L, F, D]`` | transposed |
| ``model.norm.weight`` | ``norm.scale`` | |
| ``lm_head.weight [V, D]`` | ``head [D, V']`` (untied) | transposed; absent when tied |

Our fused kernels (k with v, gate with up) are the checkpoint's separate tensors stacked on
an axis of their own: each device reads only its slice of each (:class:`Stacked`) and saving
splits them again.

RoPE settings are read from ``rope_scaling`` (transformers 4) or ``rope_parameters``
(transformers 5): ``rope_type`` ``default`` or ``llama3``.

References:
  Hugging Face transformers, ``models/llama/modeling_llama.py`` and
  ``configuration_llama.py``; ``modeling_rope_utils._compute_llama3_parameters``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from parallax.models.llama import Llama
from parallax.models.llama_config import LlamaConfig
from parallax.models.pretrained.config_warnings import warn_lacking
from parallax.models.pretrained.pieces import Piece, Stacked
from parallax.nn.rope import RopeScaling

API = "px.models.from_pretrained"
MODEL = Llama
ARCHITECTURE = "LlamaForCausalLM"
LACKING = {"attention_dropout": (0.0, "parallax's Llama has no dropout, so it trains "
                                      "without the attention dropout")}


def _rope(hf: Mapping) -> tuple[float, RopeScaling | None]:
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    merged = params | scaling
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"{API}: Llama rope_type {kind!r} is not supported; parallax's Llama "
                         "computes the 'default' and 'llama3' RoPE frequencies only.")
    return theta, RopeScaling(
        factor=float(merged["factor"]), low_freq_factor=float(merged["low_freq_factor"]),
        high_freq_factor=float(merged["high_freq_factor"]),
        original_max_position_embeddings=int(merged["original_max_position_embeddings"]))


def writes(c: LlamaConfig) -> bool:
    """Whether ``save_pretrained`` writes a Llama of config ``c`` as this family (dense, no
    q/k/v biases: those are Qwen2's)."""
    return c.moe is None and not c.qkv_bias


def config_from_hf(hf: Mapping, **overrides: Any) -> LlamaConfig:
    """Our ``LlamaConfig`` from a Llama ``config.json``."""
    if overrides.get("moe") is not None and hf.get("model_type", "llama") == "llama":
        raise ValueError(f"{API}: moe= given for a dense Llama checkpoint, whose MLP weights "
                         "have no experts; load a 'mixtral' checkpoint for MoE blocks.")
    for key, allowed, default in (("hidden_act", ("silu",), "silu"),
                                  ("attention_bias", (False,), False),
                                  ("mlp_bias", (False,), False)):
        if hf.get(key, default) not in allowed:
            raise ValueError(f"{API}: Llama config {key}={hf.get(key)!r} is not supported; "
                             f"parallax's Llama has {key} in {allowed} only.")
    warn_lacking("Llama", hf, LACKING)
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, d // h):
        raise ValueError(f"{API}: Llama config head_dim={hf['head_dim']} differs from "
                         f"hidden_size / num_attention_heads = {d // h}; parallax's Llama "
                         "derives the head size from them.")
    theta, scaling = _rope(hf)
    sizes = dict(vocab_size=hf["vocab_size"], max_seq_len=hf.get("max_position_embeddings", 2048),
                 num_layers=hf["num_hidden_layers"], num_heads=h,
                 num_kv_heads=hf.get("num_key_value_heads") or h, embed_dim=d,
                 mlp_dim=hf["intermediate_size"], rope_theta=theta, rope_scaling=scaling,
                 norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                 tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    return LlamaConfig(**(sizes | overrides))


def config_to_hf(c: LlamaConfig) -> dict:
    """A Llama ``config.json`` for ``c`` (both RoPE spellings, for transformers 4 and 5)."""
    rope = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        s = c.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": c.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings}
    out = {"model_type": "llama", "architectures": [ARCHITECTURE], "vocab_size": c.vocab_size,
           "hidden_size": c.embed_dim, "intermediate_size": c.mlp_dim,
           "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
           "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
           "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
           "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
           "tie_word_embeddings": c.tie_embeddings, "rope_theta": c.rope_theta,
           "rope_parameters": rope}
    if c.rope_scaling is not None:
        out["rope_scaling"] = dict(rope)
    return out


def pieces(c: LlamaConfig, names) -> tuple[dict[str, Piece], dict]:
    """Our leaves -> their pieces: top-level leaves, and per-layer ones."""
    d, h, g, k, f = c.embed_dim, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim
    v, vp = c.vocab_size, c.padded_vocab_size
    top = {"embed": Piece("model.embed_tokens.weight", (vp,), (d,), rows_stored=v),
           "norm.scale": Piece("model.norm.weight", (), (d,))}
    if not c.tie_embeddings:
        top["head"] = Piece("lm_head.weight", (d,), (vp,), transpose=True, cols_stored=v)

    def biases(b: str) -> dict[str, Piece]:  # Qwen2's q, k, v biases [H*K], [G*K]
        if not c.qkv_bias:
            return {}
        return {"blocks.attn.query.bias": Piece(f"{b}self_attn.q_proj.bias", (), (h, k)),
                "blocks.attn.key_value.bias": Stacked(tuple(
                    Piece(f"{b}self_attn.{n}_proj.bias", (), (g, k)) for n in "kv"), 0)}

    def layer(i: int) -> dict[str, Piece]:
        b = f"model.layers.{i}."
        return biases(b) | {
            "blocks.attn_norm.scale": Piece(f"{b}input_layernorm.weight", (), (d,)),
            "blocks.mlp_norm.scale": Piece(f"{b}post_attention_layernorm.weight", (), (d,)),
            "blocks.attn.query.kernel": Piece(f"{b}self_attn.q_proj.weight", (d,), (h, k), True),
            "blocks.attn.key_value.kernel": Stacked(tuple(
                Piece(f"{b}self_attn.{n}_proj.weight", (d,), (g, k), True) for n in "kv"), 1),
            "blocks.attn.out.kernel": Piece(f"{b}self_attn.o_proj.weight", (h, k), (d,), True),
            "blocks.mlp.gate_up.kernel": Stacked(tuple(
                Piece(f"{b}mlp.{n}_proj.weight", (d,), (f,), True) for n in ("gate", "up")), 1),
            "blocks.mlp.down.kernel": Piece(f"{b}mlp.down_proj.weight", (f,), (d,), True),
        }

    return top, {i: layer(i) for i in range(c.num_layers)}


def ignored(name: str) -> bool:
    """Rotary caches of old files; the head when tied."""
    return name.endswith("rotary_emb.inv_freq") or name == "lm_head.weight"


def export(c: LlamaConfig, leaves: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our leaves (dotted names, host arrays) -> Llama's tensors, as transformers saves them.

    The dense MLP's tensors are written when the model has one (an MoE Llama's experts are
    :mod:`parallax.models.pretrained.mixtral`'s to write).
    """
    d, v = c.embed_dim, c.vocab_size
    out = {"model.embed_tokens.weight": leaves["embed"][:v], "model.norm.weight": leaves["norm.scale"]}
    if not c.tie_embeddings:
        out["lm_head.weight"] = leaves["head"][:, :v].T
    for i in range(c.num_layers):
        at = {name: leaf[i] for name, leaf in leaves.items() if name.startswith("blocks.")}
        b = f"model.layers.{i}."
        out[f"{b}input_layernorm.weight"] = at["blocks.attn_norm.scale"]
        out[f"{b}post_attention_layernorm.weight"] = at["blocks.mlp_norm.scale"]
        key_value = at["blocks.attn.key_value.kernel"]
        attention = {"q_proj": at["blocks.attn.query.kernel"], "k_proj": key_value[:, 0],
                     "v_proj": key_value[:, 1]}
        for theirs, kernel in attention.items():
            out[f"{b}self_attn.{theirs}.weight"] = kernel.reshape(d, -1).T
        out[f"{b}self_attn.o_proj.weight"] = at["blocks.attn.out.kernel"].reshape(-1, d).T
        if c.qkv_bias:
            kv_bias = at["blocks.attn.key_value.bias"]
            for theirs, bias in (("q", at["blocks.attn.query.bias"]), ("k", kv_bias[0]),
                                 ("v", kv_bias[1])):
                out[f"{b}self_attn.{theirs}_proj.bias"] = bias.reshape(-1)
        if "blocks.mlp.gate_up.kernel" not in at:
            continue
        gate_up = at["blocks.mlp.gate_up.kernel"]
        mlp = {"gate": gate_up[:, 0], "up": gate_up[:, 1], "down": at["blocks.mlp.down.kernel"]}
        for name, kernel in mlp.items():
            out[f"{b}mlp.{name}_proj.weight"] = kernel.T
    return out
