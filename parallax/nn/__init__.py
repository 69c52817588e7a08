"""parallax.nn: Megatron tensor and sequence parallelism as Flax NNX layers (explicit style).

Every layer keeps its parameters at their global shapes with logical names, so it is the
plain layer on one device, a GSPMD layer under ``px.TensorParallel``'s rules, and, inside a
``shard_map`` manual over the tensor axis (``tensor_parallel``), the Megatron layer on its
local shard, communicating through the named operators of :mod:`parallax.nn.regions`:

* operators: :func:`copy_to_tensor` (``f``), :func:`reduce_from_tensor` (``g``),
  :func:`scatter_to_tensor`, :func:`gather_from_tensor`, and for sequence parallelism
  :func:`scatter_to_sequence`, :func:`gather_from_sequence`,
  :func:`reduce_scatter_to_sequence`;
* layers: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`, :class:`ParallelMLP`,
  :class:`ParallelSelfAttention` (grouped-query too), :class:`VocabParallelEmbedding`;
* :func:`vocab_parallel_cross_entropy`: the loss from vocabulary slices;
* random streams: :func:`dropout` (the single-device mask on every layout), :func:`rank_key`;
* :class:`MoE`: the mixture-of-experts layer (defined in ``parallax.models.moe``, where the
  GPT can use it; ``px.ExpertParallel`` splits its experts, see ``docs/moe.md``);
* :class:`ParallelGPT`: ``px.models.GPT`` built from these layers;
* :func:`tensor_parallel`, :func:`param_specs`: running them in ``shard_map``, also inside
  ``px.train_step``.

See ``docs/tensor_parallel.md``.
"""

from parallax.nn.attention import ParallelSelfAttention as ParallelSelfAttention
from parallax.nn.embedding import VocabParallelEmbedding as VocabParallelEmbedding
from parallax.nn.embedding import vocab_parallel_embed as vocab_parallel_embed
from parallax.nn.embedding import vocab_parallel_logits as vocab_parallel_logits
from parallax.nn.gpt import ParallelBlock as ParallelBlock
from parallax.nn.gpt import ParallelGPT as ParallelGPT
from parallax.nn.gpt import parallel_next_token_loss as parallel_next_token_loss
from parallax.nn.linear import ColumnParallelLinear as ColumnParallelLinear
from parallax.nn.linear import ParallelMLP as ParallelMLP
from parallax.nn.linear import RowParallelLinear as RowParallelLinear
from parallax.models.moe import MoE as MoE
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
    "ParallelBlock",
    "ParallelGPT",
    "ParallelMLP",
    "ParallelSelfAttention",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tensor",
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
