"""The models ``parallax explain`` and ``parallax plan`` name: a preset, or sizes.

``--model`` takes a reference GPT (``tiny``, ``small``, ``gpt2_124m``, ``gpt2_350m``) or
Llama (``llama2_7b``, ``llama3_8b``, ``llama3_70b``, ``llama3_1b``) preset, or ``gpt`` /
``llama`` for sizes given on their own; ``--layers``, ``--hidden``, ``--heads``,
``--kv-heads``, ``--ffn``, ``--vocab`` and ``--seq`` replace a preset's sizes. The state and
the batch are abstract (``jax.ShapeDtypeStruct``): nothing is allocated, so a 70B model is
planned on a laptop.
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from parallax.models import GPT, GPTConfig, Llama, LlamaConfig, llama_stages, next_token_stages
from parallax.state import TrainState

GPTS = {"tiny": GPTConfig.tiny, "small": GPTConfig.small, "gpt2_124m": GPTConfig.gpt2_124m,
        "gpt2_350m": GPTConfig.gpt2_350m, "gpt": GPTConfig}
LLAMAS = {"llama2_7b": LlamaConfig.llama2_7b, "llama3_8b": LlamaConfig.llama3_8b,
          "llama3_70b": LlamaConfig.llama3_70b, "llama3_1b": LlamaConfig.llama3_1b,
          "llama": LlamaConfig}
MODELS = {**GPTS, **LLAMAS}
# Command-line size -> config field (a GPT has no kv heads).
SIZES = {"layers": "num_layers", "hidden": "embed_dim", "heads": "num_heads",
         "kv_heads": "num_kv_heads", "ffn": "mlp_dim", "vocab": "vocab_size",
         "seq": "max_seq_len"}


def config(name: str, dtype: str = "float32", **sizes) -> GPTConfig | LlamaConfig:
    """A preset by name, computing in ``dtype``, with ``sizes`` (the command line's names,
    None: the preset's) replacing its own.

    Example:
      >>> config("llama3_70b", "bfloat16", seq=4096).max_seq_len
      4096
      >>> config("gpt", layers=4, hidden=128, heads=4, ffn=512, vocab=1000).num_layers
      4
    """
    if name not in MODELS:
        raise ValueError(f"parallax: unknown model {name!r}; choose one of {', '.join(MODELS)}.")
    kind = GPTConfig if name in GPTS else LlamaConfig
    fields = {f.name for f in dataclasses.fields(kind)}
    given = {SIZES[k]: v for k, v in sizes.items() if v is not None}
    wrong = [k for k, v in sizes.items() if v is not None and SIZES[k] not in fields]
    if wrong:
        raise ValueError(f"parallax: --{wrong[0].replace('_', '-')} does not apply to "
                         f"{kind.__name__} (model {name!r}).")
    return MODELS[name](dtype=getattr(jnp, dtype), **given)


def state_fn(cfg: GPTConfig | LlamaConfig, learning_rate: float = 3e-4):
    """``() -> px.TrainState`` of the config's model with AdamW."""
    model = Llama if isinstance(cfg, LlamaConfig) else GPT
    return lambda: TrainState.create(model(cfg, rngs=nnx.Rngs(0)), optax.adamw(learning_rate))


def stages(cfg: GPTConfig | LlamaConfig):
    """The model's pipelined next-token loss (``px.pipeline.Stages``)."""
    return llama_stages if isinstance(cfg, LlamaConfig) else next_token_stages


def abstract_batch(cfg: GPTConfig | LlamaConfig, batch: int):
    """``{"tokens": [batch, max_seq_len + 1]}`` int32, abstract."""
    return {"tokens": jax.ShapeDtypeStruct((batch, cfg.max_seq_len + 1), jnp.int32)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", choices=list(MODELS),
                        help="a reference GPT or Llama preset, or 'gpt' / 'llama' with the "
                             "sizes below (default tiny)")
    for name, help_ in (("layers", "transformer blocks"), ("hidden", "model width"),
                        ("heads", "attention heads"), ("kv-heads", "key/value heads (Llama)"),
                        ("ffn", "MLP width"), ("vocab", "vocabulary"),
                        ("seq", "sequence length (the batch's tokens)")):
        parser.add_argument(f"--{name}", type=int, default=None,
                            help=f"{help_} (default: the preset's)")


def from_args(args) -> GPTConfig | LlamaConfig:
    return config(args.model, args.dtype, **{k: getattr(args, k) for k in SIZES})
