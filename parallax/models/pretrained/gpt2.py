"""GPT-2 in Hugging Face's layout (``GPT2LMHeadModel``) and ours (``px.models.GPT``).

Names and layouts, Hugging Face -> ours (``{p}`` is ``transformer.`` or nothing, as older
checkpoints have it; L layers stacked on our leading axis):

| Hugging Face | ours | how |
|---|---|---|
| ``{p}wte.weight [V, D]`` | ``wte [V', D]`` | rows V..V' (vocabulary padding) are zero |
| ``{p}wpe.weight [P, D]`` | ``wpe [S, D]`` | the first S <= P positions |
| ``{p}h.i.ln_1/ln_2.weight, bias`` | ``blocks.ln1/ln2.scale, bias`` | |
| ``{p}h.i.attn.c_attn.weight [D, 3D]`` | ``blocks.attn.qkv.kernel [D, 3, H, K]`` | ``Conv1D`` is ``[in, out]`` already: columns split q / k / v, then heads; each device reads its heads of the three column ranges |
| ``{p}h.i.attn.c_attn.bias [3D]`` | ``blocks.attn.query_bias / value_bias [H, K]`` | the key bias is dropped: it adds ``q . b`` to every score of a query's row, which softmax cancels (saved back as zeros) |
| ``{p}h.i.attn.c_proj.weight [D, D]`` | ``blocks.attn.out.kernel [H, K, D]`` | rows split into heads |
| ``{p}h.i.mlp.c_fc / c_proj`` | ``blocks.mlp.fc / proj`` | |
| ``{p}ln_f`` | ``ln_f`` | |
| ``lm_head.weight`` | ``wte`` (tied) | GPT-2 ties them; saved without ``lm_head`` |
| ``embd_pdrop``, ``attn_pdrop``, ``resid_pdrop`` (config) | ``GPTConfig.embed_dropout``, ``attention_dropout``, ``residual_dropout`` | turned on as the checkpoint asks (transformers' default 0.1), with a warning that says so |

References:
  Hugging Face transformers, ``models/gpt2/modeling_gpt2.py`` (``GPT2Attention``,
  ``Conv1D``) and ``configuration_gpt2.py`` (the config's names and defaults).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from parallax.models.gpt import GPT
from parallax.models.gpt_config import GPTConfig
from parallax.models.pretrained.config_warnings import say_dropout_on, warn_lacking
from parallax.models.pretrained.pieces import Piece, Stacked

API = "px.models.from_pretrained"
MODEL = GPT
ARCHITECTURE = "GPT2LMHeadModel"


def _require(config: Mapping, key: str, allowed: tuple, default: Any) -> None:
    value = config.get(key, default)
    if value not in allowed:
        raise ValueError(
            f"{API}: GPT-2 config {key}={value!r} is not supported; parallax's GPT computes "
            f"{key} in {allowed} only (convert the checkpoint or use a model that does).")


# GPT-2's dropout fields -> ours; absent from a config.json, transformers' default is 0.1.
DROPOUT = {"embed_dropout": "embd_pdrop", "attention_dropout": "attn_pdrop",
           "residual_dropout": "resid_pdrop"}
LACKING = {"reorder_and_upcast_attn": (
    False, "it computes the attention scores in the compute dtype (GPTConfig.dtype; in "
    "float32, the default, that is the upcast)")}


def config_from_hf(hf: Mapping, **overrides: Any) -> GPTConfig:
    """Our ``GPTConfig`` from a GPT-2 ``config.json`` (``overrides``: dtype, padding, ...).

    The checkpoint's dropout (``embd_pdrop``, ``attn_pdrop``, ``resid_pdrop``) is turned on
    and said so; a field our GPT does not compute is refused, or warned about where the
    weights still mean the same (:mod:`parallax.models.pretrained.config_warnings`).
    """
    _require(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
    _require(hf, "add_cross_attention", (False,), False)
    warn_lacking("GPT-2", hf, LACKING)
    rates = {ours: (theirs, float(hf.get(theirs, 0.1))) for ours, theirs in DROPOUT.items()
             if ours not in overrides}
    say_dropout_on("GPT-2", rates)
    _require(hf, "layer_norm_epsilon", (1e-5,), 1e-5)
    _require(hf, "scale_attn_weights", (True,), True)
    _require(hf, "scale_attn_by_inverse_layer_idx", (False,), False)
    d = hf["n_embd"]
    sizes = dict(vocab_size=hf["vocab_size"], max_seq_len=hf["n_positions"],
                 num_layers=hf["n_layer"], num_heads=hf["n_head"], embed_dim=d,
                 mlp_dim=hf.get("n_inner") or 4 * d,
                 tie_embeddings=hf.get("tie_word_embeddings", True),
                 **{ours: rate for ours, (_, rate) in rates.items()})
    if not sizes["tie_embeddings"]:
        raise ValueError(f"{API}: GPT-2 checkpoints with tie_word_embeddings=false are not "
                         "supported yet (every released GPT-2 ties them).")
    return GPTConfig(**(sizes | overrides))


def config_to_hf(c: GPTConfig) -> dict:
    """A GPT-2 ``config.json`` for ``c``, its dropout rates included."""
    return {"model_type": "gpt2", "architectures": [ARCHITECTURE], "vocab_size": c.vocab_size,
            "n_positions": c.max_seq_len, "n_ctx": c.max_seq_len, "n_embd": c.embed_dim,
            "n_layer": c.num_layers, "n_head": c.num_heads, "n_inner": c.mlp_dim,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "tie_word_embeddings": c.tie_embeddings, "scale_attn_weights": True,
            **{theirs: getattr(c, ours) for ours, theirs in DROPOUT.items()}}


def prefix_of(names) -> str:
    return "transformer." if any(n.startswith("transformer.") for n in names) else ""


def pieces(c: GPTConfig, names) -> tuple[dict[str, Piece], dict]:
    """Our leaves -> their pieces: top-level leaves, and per-layer ones (``layer -> Piece``)."""
    p, d, h, k, f = prefix_of(names), c.embed_dim, c.num_heads, c.head_dim, c.mlp_dim
    top = {
        "wte": Piece(f"{p}wte.weight", (c.padded_vocab_size,), (d,), rows_stored=c.vocab_size),
        "wpe": Piece(f"{p}wpe.weight", (c.max_seq_len,), (d,)),
        "ln_f.scale": Piece(f"{p}ln_f.weight", (), (d,)),
        "ln_f.bias": Piece(f"{p}ln_f.bias", (), (d,)),
    }

    def layer(i: int) -> dict[str, Piece]:
        b = f"{p}h.{i}."
        out = {}
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            out[f"blocks.{ours}.scale"] = Piece(f"{b}{theirs}.weight", (), (d,))
            out[f"blocks.{ours}.bias"] = Piece(f"{b}{theirs}.bias", (), (d,))
        out["blocks.attn.qkv.kernel"] = Stacked(tuple(
            Piece(f"{b}attn.c_attn.weight", (d,), (h, k), col_offset=j * d) for j in range(3)),
            axis=1)
        for j, name in ((0, "query"), (2, "value")):
            out[f"blocks.attn.{name}_bias"] = Piece(f"{b}attn.c_attn.bias", (), (h, k),
                                                    col_offset=j * d)
        out["blocks.attn.out.kernel"] = Piece(f"{b}attn.c_proj.weight", (h, k), (d,))
        out["blocks.attn.out.bias"] = Piece(f"{b}attn.c_proj.bias", (), (d,))
        out["blocks.mlp.fc.kernel"] = Piece(f"{b}mlp.c_fc.weight", (d,), (f,))
        out["blocks.mlp.fc.bias"] = Piece(f"{b}mlp.c_fc.bias", (), (f,))
        out["blocks.mlp.proj.kernel"] = Piece(f"{b}mlp.c_proj.weight", (f,), (d,))
        out["blocks.mlp.proj.bias"] = Piece(f"{b}mlp.c_proj.bias", (), (d,))
        return out

    return top, {i: layer(i) for i in range(c.num_layers)}


def ignored(name: str) -> bool:
    """Checkpoint tensors that are not parameters (causal-mask buffers of old files), the
    tied head, and nothing else."""
    return name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight"


def export(c: GPTConfig, leaves: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our leaves (dotted names, host arrays) -> GPT-2's tensors, as transformers saves them."""
    d, v = c.embed_dim, c.vocab_size
    out = {"transformer.wte.weight": leaves["wte"][:v], "transformer.wpe.weight": leaves["wpe"],
           "transformer.ln_f.weight": leaves["ln_f.scale"], "transformer.ln_f.bias": leaves["ln_f.bias"]}
    for i in range(c.num_layers):
        at = {name: leaf[i] for name, leaf in leaves.items() if name.startswith("blocks.")}
        b = f"transformer.h.{i}."
        out[f"{b}ln_1.weight"], out[f"{b}ln_1.bias"] = at["blocks.ln1.scale"], at["blocks.ln1.bias"]
        out[f"{b}ln_2.weight"], out[f"{b}ln_2.bias"] = at["blocks.ln2.scale"], at["blocks.ln2.bias"]
        out[f"{b}attn.c_attn.weight"] = at["blocks.attn.qkv.kernel"].reshape(d, 3 * d)
        q_bias = at["blocks.attn.query_bias"].reshape(d)
        out[f"{b}attn.c_attn.bias"] = np.concatenate(
            [q_bias, np.zeros_like(q_bias), at["blocks.attn.value_bias"].reshape(d)])
        out[f"{b}attn.c_proj.weight"] = at["blocks.attn.out.kernel"].reshape(d, d)
        out[f"{b}attn.c_proj.bias"] = at["blocks.attn.out.bias"]
        out[f"{b}mlp.c_fc.weight"], out[f"{b}mlp.c_fc.bias"] = (at["blocks.mlp.fc.kernel"],
                                                                at["blocks.mlp.fc.bias"])
        out[f"{b}mlp.c_proj.weight"], out[f"{b}mlp.c_proj.bias"] = (at["blocks.mlp.proj.kernel"],
                                                                    at["blocks.mlp.proj.bias"])
    return out
