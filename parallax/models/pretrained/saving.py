"""``px.models.save_pretrained``: our model (or a training state's) in Hugging Face's format."""

from __future__ import annotations

import pathlib

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from parallax import layout
from parallax.models.pretrained import families
from parallax.models.pretrained.checkpoint_files import write_checkpoint

API = "px.models.save_pretrained"


def save_pretrained(path: str | pathlib.Path, model, *,
                    max_shard_bytes: int | None = 5 << 30) -> None:
    """Writes ``config.json`` and safetensors that ``transformers`` loads as its own model.

    Args:
      path: the directory to write (created).
      model: a ``px.models.GPT`` (written as ``gpt2``, its dropout rates in the config) or
        a ``px.models.Llama`` (as ``llama``; ``qwen2`` with q/k/v biases; ``mixtral`` with
        MoE blocks), sharded or not, or a ``px.TrainState`` holding one.
      max_shard_bytes: files larger than this are split, with
        ``model.safetensors.index.json`` (transformers' default is 5 GB).

    Each leaf is gathered to the host one at a time (across processes with
    ``process_allgather``) and only process 0 writes.

    Example:
      >>> import tempfile, os
      >>> from flax import nnx
      >>> import parallax as px
      >>> d = tempfile.mkdtemp()
      >>> px.models.save_pretrained(d, px.models.GPT(px.models.GPTConfig.tiny(), rngs=nnx.Rngs(0)))
      >>> sorted(os.listdir(d))
      ['config.json', 'model.safetensors']

    References:
      Hugging Face ``PreTrainedModel.save_pretrained``; safetensors.
    """
    model = getattr(model, "model", model)  # a TrainState holds its model
    family = families.for_model(model, API)
    # the weights only: not the dropout streams, nor an MoE's sown router statistics
    _, state, _ = nnx.split(model, nnx.Param, ...)
    leaves = {}
    for key, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if jax.process_count() > 1 and not leaf.is_fully_addressable:
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        leaves[layout.dotted_key(key)] = np.asarray(leaf, dtype=np.float32)
    if jax.process_index() == 0:
        write_checkpoint(path, family.config_to_hf(model.config), family.export(model.config, leaves),
                         max_shard_bytes)
