"""Qwen2 in Hugging Face's layout (``Qwen2ForCausalLM``) and ours (a ``Llama`` with q/k/v
biases).

Qwen2's decoder is the Llama's (RMSNorm, grouped-query attention with RoPE, SwiGLU) with
biases on the q, k and v projections (not on the output projection):
``LlamaConfig(qkv_bias=True)``. Names and layouts are the Llama's (:mod:`.llama`), plus

| Hugging Face | ours | how |
|---|---|---|
| ``model.layers.i.self_attn.q_proj.bias [H*K]`` | ``blocks.attn.query.bias [L, H, K]`` | split into heads |
| ``... k_proj.bias, v_proj.bias [G*K]`` | ``blocks.attn.key_value.bias [L, 2, G, K]`` | stacked k, v; each device reads its heads |

Config semantics, from ``configuration_qwen2.py``: absent ``rms_norm_eps`` is 1e-6 and
``max_position_embeddings`` 32768; ``use_sliding_window`` (windowed attention in the
layers past ``max_window_layers``) is refused, since parallax's attention is full causal;
``attention_dropout`` loads with a warning that names it.

References:
  Yang et al. 2024, "Qwen2 Technical Report"; Hugging Face transformers,
  ``models/qwen2/configuration_qwen2.py`` and ``modeling_qwen2.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from parallax.models.llama import Llama
from parallax.models.llama_config import LlamaConfig
from parallax.models.pretrained import llama
from parallax.models.pretrained.pieces import Piece

API = llama.API
MODEL = Llama
ARCHITECTURE = "Qwen2ForCausalLM"
DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768}


def writes(c: LlamaConfig) -> bool:
    """Whether ``save_pretrained`` writes a Llama of config ``c`` as this family."""
    return c.qkv_bias and c.moe is None


def config_from_hf(hf: Mapping, **overrides: Any) -> LlamaConfig:
    """Our ``LlamaConfig(qkv_bias=True)`` from a Qwen2 ``config.json``."""
    if hf.get("use_sliding_window", False):
        raise ValueError(
            f"{API}: Qwen2 config use_sliding_window=true is not supported; parallax's Llama "
            "attends causally over the whole sequence in every layer (set it false only if "
            "your sequences are no longer than sliding_window).")
    if hf.get("attention_dropout"):
        warnings.warn(f"{API}: Qwen2 config attention_dropout={hf['attention_dropout']} asks "
                      "for training-time noise that parallax's Llama does not have; the model "
                      "loads without it.", stacklevel=3)
    filled = dict(hf) | {key: hf.get(key, value) for key, value in DEFAULTS.items()}
    return llama.config_from_hf(filled, **({"qkv_bias": True} | overrides))


def config_to_hf(c: LlamaConfig) -> dict:
    """A Qwen2 ``config.json`` for ``c``."""
    out = llama.config_to_hf(c)
    for key in ("attention_bias", "mlp_bias"):
        del out[key]
    return out | {"model_type": "qwen2", "architectures": [ARCHITECTURE],
                  "use_sliding_window": False, "attention_dropout": 0.0}


def pieces(c: LlamaConfig, names) -> tuple[dict[str, Piece], dict]:
    """Our leaves -> their pieces: the Llama's, with the q/k/v biases."""
    return llama.pieces(c, names)


def ignored(name: str) -> bool:
    """Rotary caches of old files; the head when tied."""
    return llama.ignored(name)


def export(c: LlamaConfig, leaves: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our leaves -> Qwen2's tensors, as transformers saves them."""
    return llama.export(c, leaves)
