"""parallax.nn: the layers the models are built from, below the models (Flax NNX).

Every layer keeps its parameters at their global shapes with logical names, so it is the
plain layer on one device and a GSPMD layer under a strategy's rules. Two kinds live here:

* annotated building blocks, the pieces of ``px.models``' networks:
  :mod:`~parallax.nn.layers` (``Dense``, ``LayerNorm``, causal attention, the feed-forward
  MLP, ``annotated_param``), :mod:`~parallax.nn.llama_layers` (``RMSNorm``, grouped-query
  attention, ``SwiGLU``), :mod:`~parallax.nn.rope`, :mod:`~parallax.nn.padding` (padded
  vocabularies), :class:`MoE` with its :class:`MoEConfig` (``px.ExpertParallel`` splits
  its experts, see ``docs/moe.md``), :func:`cross_entropy` (which GSPMD splits over a
  vocabulary-parallel axis as Megatron does) and :func:`chunked_cross_entropy` (the models'
  loss: the same from hidden states and the output matrix, the logits a chunk of the
  sequence at a time);
* Megatron's layers in the explicit style: inside a ``shard_map`` manual over the tensor
  axis (``tensor_parallel``) each is the Megatron layer on its local shard, communicating
  through the named operators of :mod:`parallax.nn.regions`:

  * operators: :func:`copy_to_tensor` (``f``), :func:`reduce_from_tensor` (``g``),
    :func:`scatter_to_tensor`, :func:`gather_from_tensor`, and for sequence parallelism
    :func:`scatter_to_sequence`, :func:`gather_from_sequence`,
    :func:`reduce_scatter_to_sequence`;
  * layers: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`, :class:`ParallelMLP`,
    :class:`ParallelSelfAttention` (grouped-query too), :class:`VocabParallelEmbedding`;
  * :func:`vocab_parallel_cross_entropy`: the loss from vocabulary slices;
  * random streams: :func:`dropout` (the single-device mask on every layout), :func:`rank_key`;
  * :func:`tensor_parallel`, :func:`param_specs`: running them in ``shard_map``, also inside
    ``px.train_step``.

A network built from these layers is a model and lives in ``parallax.models``; nothing here
imports it. ``ParallelGPT``, ``ParallelBlock`` and ``parallel_next_token_loss``
(``px.models.GPT`` built from Megatron's layers, ``parallax.models.parallel_gpt``) are still
answered here, as they always were (``px.nn.ParallelGPT``): their module is imported on
first use of one of those names, so this package's imports keep pointing down.

See ``docs/tensor_parallel.md``.
"""

import importlib

from parallax.nn.attention import ParallelSelfAttention as ParallelSelfAttention
from parallax.nn.embedding import VocabParallelEmbedding as VocabParallelEmbedding
from parallax.nn.embedding import vocab_parallel_embed as vocab_parallel_embed
from parallax.nn.embedding import vocab_parallel_logits as vocab_parallel_logits
from parallax.nn.linear import ColumnParallelLinear as ColumnParallelLinear
from parallax.nn.linear import ParallelMLP as ParallelMLP
from parallax.nn.linear import RowParallelLinear as RowParallelLinear
from parallax.nn.moe import MoE as MoE
from parallax.nn.moe_config import MoEConfig as MoEConfig
from parallax.nn.chunked_loss import chunked_cross_entropy as chunked_cross_entropy
from parallax.nn.loss import cross_entropy as cross_entropy
from parallax.nn.loss import vocab_parallel_cross_entropy as vocab_parallel_cross_entropy
from parallax.nn.regions import copy_to_tensor as copy_to_tensor
from parallax.nn.regions import gather_from_sequence as gather_from_sequence
from parallax.nn.regions import gather_from_tensor as gather_from_tensor
from parallax.nn.regions import is_manual as is_manual
from parallax.nn.regions import reduce_from_tensor as reduce_from_tensor
from parallax.nn.regions import reduce_scatter_to_sequence as reduce_scatter_to_sequence
from parallax.nn.regions import scatter_to_sequence as scatter_to_sequence
from parallax.nn.regions import scatter_to_tensor as scatter_to_tensor
from parallax.nn.rng import dropout as dropout
from parallax.nn.rng import rank_key as rank_key
from parallax.nn.shard import param_specs as param_specs
from parallax.nn.shard import tensor_parallel as tensor_parallel

__all__ = [
    "ColumnParallelLinear",
    "MoE",
    "MoEConfig",
    "ParallelBlock",
    "ParallelGPT",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "chunked_cross_entropy",
    "copy_to_tensor",
    "cross_entropy",
    "dropout",
    "gather_from_sequence",
    "gather_from_tensor",
    "is_manual",
    "param_specs",
    "parallel_next_token_loss",
    "rank_key",
    "reduce_from_tensor",
    "reduce_scatter_to_sequence",
    "scatter_to_sequence",
    "scatter_to_tensor",
    "tensor_parallel",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embed",
    "vocab_parallel_logits",
]

# Networks built from these layers, defined in parallax.models (above this package) and
# still answered here by name: imported on first use, so no module of parallax.nn imports
# parallax.models (tests/test_imports.py's LAYERS).
_NETWORKS = {
    "ParallelBlock": "parallax.models.parallel_gpt",
    "ParallelGPT": "parallax.models.parallel_gpt",
    "parallel_next_token_loss": "parallax.models.parallel_gpt",
}


def __getattr__(name: str):
    if name in _NETWORKS:
        return getattr(importlib.import_module(_NETWORKS[name]), name)
    raise AttributeError(f"module 'parallax.nn' has no attribute {name!r}")
