"""``px.models.GPT`` rebuilt from ``parallax.nn`` layers: Megatron's GPT in the explicit style.

``ParallelGPT(config)`` has the reference GPT's parameters exactly (same tree, shapes,
logical names and, from the same ``nnx.Rngs``, the same values), so a state trained one way
loads the other way. On one device it computes what ``px.models.GPT`` computes. Inside
``px.nn.tensor_parallel`` each rank holds its shard and the layers communicate as Megatron
does: a vocabulary-parallel embedding (all-reduce), per block ``f`` and ``g`` around
attention and the MLP, tied vocabulary-parallel logits and the vocabulary-parallel loss.
With ``sequence_parallel=True`` the residual stream, LayerNorms and residual adds hold
``T / n`` positions per rank.

Example:
  >>> import jax, jax.numpy as jnp, parallax as px, parallax.nn
  >>> from flax import nnx
  >>> config = px.models.GPTConfig.tiny(num_layers=1)
  >>> model = px.models.ParallelGPT(config, rngs=nnx.Rngs(0))
  >>> batch = {"tokens": jnp.arange(2 * 17).reshape(2, 17) % 256}
  >>> mesh = px.make_mesh(tensor=4, devices=jax.devices()[:4])
  >>> loss = px.nn.tensor_parallel(px.models.parallel_next_token_loss, mesh=mesh)
  >>> bool(5.0 < jax.jit(loss)(model, batch) < 6.0)  # about log(256) at init, as the GPT
  True

References:
  Shoeybi et al., "Megatron-LM", 2019; Narayanan et al., 2021; Korthikanti et al., 2022.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from parallax.models.packed_batch import refuse_packed
from parallax.models.gpt import block_forward, create_gpt_params
from parallax.models.gpt_config import GPTConfig
from parallax.nn.layers import LayerNorm
from parallax.nn import regions
from parallax.nn.attention import ParallelSelfAttention
from parallax.nn.embedding import vocab_parallel_embed, vocab_parallel_logits
from parallax.nn.linear import ParallelMLP
from parallax.nn.chunked_loss import chunked_cross_entropy


class ParallelBlock(nnx.Module):
    """A pre-norm block of ``ParallelSelfAttention`` and ``ParallelMLP`` (GPT's ``Block``)."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs, axis: str = "tensor",
                 sequence_parallel: bool = False):
        d = config.embed_dim
        kw = dict(dtype=config.dtype, param_dtype=config.param_dtype)
        par = dict(axis=axis, sequence_parallel=sequence_parallel, **kw)
        resid = nnx.initializers.normal(0.02 / math.sqrt(2 * config.num_layers))
        self.ln1 = LayerNorm(d, ("embed",), **kw)
        self.attn = ParallelSelfAttention(d, config.num_heads, rngs=rngs, out_init=resid, **par)
        self.ln2 = LayerNorm(d, ("embed",), **kw)
        self.mlp = ParallelMLP(d, config.mlp_dim, rngs=rngs, out_init=resid, **par)

    def __call__(self, x: jax.Array) -> jax.Array:
        return block_forward(self, x)


class ParallelGPT(nnx.Module):
    """The reference GPT built from ``parallax.nn`` layers (explicit Megatron style).

    Args:
      config: a ``px.models.GPTConfig`` (``vocab_pad_multiple`` pads the vocabulary).
      rngs: the ``nnx.Rngs``; the same seed gives ``px.models.GPT``'s parameters.
      axis: the tensor-parallel mesh axis.
      sequence_parallel: split the residual stream along the sequence (Korthikanti et al.).

    Returns:
      Called on tokens ``[B, T]``: float32 logits of this rank's vocabulary slice
      ``[B, T, V / n]`` (``[B, T, V]`` on one device), padded ids masked.
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs, axis: str = "tensor",
                 sequence_parallel: bool = False):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"ParallelGPT: config must be a GPTConfig, got {type(config).__name__}.")
        if config.has_dropout:
            raise ValueError(
                "ParallelGPT: GPTConfig's dropout (embed_dropout="
                f"{config.embed_dropout}, attention_dropout={config.attention_dropout}, "
                f"residual_dropout={config.residual_dropout}) is not built into the explicit "
                "Megatron GPT; train px.models.GPT under px.TensorParallel (one device's "
                "masks), or set the three rates to 0.")
        self.config, self.axis, self.sequence_parallel = config, axis, sequence_parallel
        create_gpt_params(self, config, rngs, lambda rngs: ParallelBlock(
            config, rngs=rngs, axis=axis, sequence_parallel=sequence_parallel))

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Vocabulary-parallel lookup (all-reduce) plus positions; then, under sequence
        parallelism, this rank's part of the sequence (Megatron's embedding)."""
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"ParallelGPT.embed: sequence length {seq} exceeds max_seq_len="
                             f"{self.config.max_seq_len}; shorten the input.")
        x = vocab_parallel_embed(self.wte[...], tokens, axis=self.axis) + self.wpe[...][:seq]
        x = x.astype(self.config.dtype)
        if self.sequence_parallel:
            x = regions.scatter_to_sequence(x, self.axis)
        return x

    def apply_blocks(self, x: jax.Array) -> jax.Array:
        """All blocks as one ``nnx.scan``, like ``GPT.apply_blocks``."""
        layers = {nnx.PARTITION_NAME: "layers"}

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=layers)
        def body(x: jax.Array, block: ParallelBlock) -> jax.Array:
            return block(x)

        return body(x, self.blocks)

    def unembed(self, x: jax.Array) -> jax.Array:
        """Final LayerNorm and this rank's float32 logits (tied or separate head)."""
        x = self.ln_f(x)
        table, transposed = self.output_matrix()
        return vocab_parallel_logits(
            x, table, axis=self.axis,
            vocab_size=self.config.vocab_size, sequence_parallel=self.sequence_parallel,
            transposed=transposed)

    def output_matrix(self) -> tuple[jax.Array, bool]:
        """``(table, transposed)`` in the compute dtype: the tied embedding ``[V, D]`` or the
        separate head ``[D, V]`` (this rank's vocabulary slice inside ``shard_map``)."""
        table = self.wte[...] if self.head is None else self.head[...]
        return jnp.asarray(table, self.config.dtype), self.head is not None

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.unembed(self.apply_blocks(self.embed(tokens)))


def parallel_next_token_loss(model: ParallelGPT, batch: Mapping[str, jax.Array]) -> jax.Array:
    """``px.models.next_token_loss`` from vocabulary-parallel logits (no full logits anywhere).

    Each rank computes its vocabulary slice's logits ``config.loss_chunks`` chunks of the
    sequence at a time (:func:`parallax.nn.chunked_cross_entropy`, three all-reduces of
    ``[B, T / n]`` per chunk), so no rank holds its ``[B, T, V / T]`` float32 logits whole.

    Args:
      model: a ``ParallelGPT``.
      batch: ``{"tokens": int [B, T + 1]}``, the same on every tensor rank.

    Returns:
      The float32 mean cross-entropy over all ``B * T`` positions, the same on every rank.
    """
    tokens = batch["tokens"]
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError("parallel_next_token_loss: batch['tokens'] must have shape "
                         f"[batch, seq + 1] with seq >= 1, got {list(tokens.shape)}.")
    refuse_packed("parallel_next_token_loss", batch, "ParallelGPT")
    c = model.config
    x = model.ln_f(model.apply_blocks(model.embed(tokens[:, :-1])))
    # Megatron's f before the vocabulary-parallel head (or, sequence-parallel, the gather):
    # every rank needs every position; the backward sums the ranks' d x.
    if model.sequence_parallel:
        x = regions.gather_from_sequence(x, model.axis, 1)
    else:
        x = regions.copy_to_tensor(x, model.axis)
    table, transposed = model.output_matrix()
    losses = chunked_cross_entropy(x, table, tokens[:, 1:],
                                   transposed=transposed, vocab_size=c.vocab_size,
                                   chunks=c.loss_chunks, axis=model.axis)
    return jnp.mean(losses)
