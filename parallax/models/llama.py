"""A Llama-family decoder in Flax NNX, with stacked (scanned) blocks like ``px.models.GPT``.

Pre-norm blocks (RMSNorm -> grouped-query attention with rotary positions -> residual,
RMSNorm -> SwiGLU MLP -> residual), no position table, no biases, a final RMSNorm and an
untied output projection (tied optionally). Blocks are built with ``nnx.vmap`` (a leading
``"layers"`` axis) and run with ``nnx.scan``; parameters and activations name logical axes
only (``LlamaConfig(moe=...)``: MoE blocks, Mixtral, :mod:`parallax.models.mixtral`), so
every strategy that applies to the GPT (DP, ZeRO 1/2/3, HSDP, tensor and sequence
parallelism, pipelines via :data:`llama_stages`) applies here. ``px.models.next_token_loss``
is its loss.

Tensor-parallel plan (Megatron's layout, as data in :data:`TENSOR_PLAN`): q column
parallel by heads, the fused k/v by key/value heads (replicated when the tensor size does
not divide them), o row parallel; the fused gate/up column parallel, down row parallel;
embedding and head vocabulary parallel. The logical names the layers carry are that plan, so
``px.TensorParallel("tensor")`` needs no ``plan=``.

References:
  Touvron et al., "LLaMA", 2023 and "Llama 2", 2023; Dubey et al., "The Llama 3 Herd of
  Models", 2024; Hugging Face transformers ``LlamaForCausalLM`` (the layout of the weights).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from parallax.activations import constrain
from parallax.attention import (in_sequence_order, natural_order, sequence_positions,
                                token_embeddings)
from parallax.models.gpt_pipeline import head_loss
from parallax.nn.layers import RESIDUAL, WHOLE_SEQUENCE, annotated_param, gather_sequence
from parallax.models.llama_config import LlamaConfig
from parallax.models.mixtral import apply_mixtral_blocks
from parallax.models.packed_batch import refuse_packed
from parallax.models.remat import remat_layer
from parallax.models.token_checks import check_positions, check_sequence, check_token_ids
from parallax.models.loss_head import config_token_losses
from parallax.nn.llama_layers import GroupedQueryAttention, RMSNorm, SwiGLU
from parallax.nn.moe import MoE
from parallax.nn.padding import mask_padded_logits, padded_init
from parallax.nn.rope import rope_frequencies
from parallax.pipeline.stages import Stages
from parallax import finite_check

# Megatron's styles of the Llama's weights (torchtitan's plan for its Llama, by our paths).
TENSOR_PLAN = {
    "embed": "vocab",
    "blocks.attn.query": "colwise",
    "blocks.attn.key_value": "colwise",
    "blocks.attn.out": "rowwise",
    "blocks.mlp.gate_up": "colwise",
    "blocks.mlp.down": "rowwise",
    "blocks.*_norm": "sequence",
    "norm": "sequence",
    "head": "vocab",
}


def token_positions(seq_len: int) -> jax.Array:
    """Each token's global position in its sequence, in the order the model holds it: what
    RoPE rotates by. ``jnp.arange(seq_len)``, except under context parallelism, whose zigzag
    order :func:`parallax.attention.sequence_positions` gives.

    Example:
      >>> token_positions(4).tolist()
      [0, 1, 2, 3]
    """
    return sequence_positions(seq_len, "Llama")


class LlamaBlock(nnx.Module):
    """One pre-norm Llama block; ``Llama`` holds L of them stacked on a leading axis."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c, kw = config, dict(dtype=config.dtype, param_dtype=config.param_dtype)
        inv_freq = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
        self.attn_norm = RMSNorm(c.embed_dim, epsilon=c.norm_eps, **kw)
        self.attn = GroupedQueryAttention(c.embed_dim, c.num_heads, c.num_kv_heads, inv_freq,
                                          rngs=rngs, qkv_bias=c.qkv_bias, **kw)
        self.mlp_norm = RMSNorm(c.embed_dim, epsilon=c.norm_eps, **kw)
        if c.moe is None:
            self.mlp = SwiGLU(c.embed_dim, c.mlp_dim, rngs=rngs, **kw)
        else:  # Mixtral: routed SwiGLU experts (parallax.models.mixtral)
            self.mlp = MoE(c.embed_dim, c.moe, mlp_dim=c.mlp_dim, rngs=rngs, **kw)

    def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        return llama_block_forward(self, x, segment_ids=segment_ids, positions=positions)


def llama_block_forward(block: LlamaBlock, x: jax.Array, *,
                        segment_ids: jax.Array | None = None,
                        positions: jax.Array | None = None) -> jax.Array:
    """Applies one Llama block (unstacked params) to the residual stream ``[B, T, D]``.

    Packed documents pass ``segment_ids`` and ``positions`` (int ``[B, T]``, in the model's
    order): attention stays inside each document and RoPE rotates by the position in it.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.models import LlamaConfig
      >>> block = LlamaBlock(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
      >>> llama_block_forward(block, jnp.ones((2, 8, 64))).shape
      (2, 8, 64)
    """
    if positions is None:
        positions = token_positions(x.shape[1])
    x = constrain(x + block.attn(block.attn_norm(x), positions, segment_ids=segment_ids),
                  RESIDUAL)
    return constrain(x + block.mlp(block.mlp_norm(x)), RESIDUAL)


class Llama(nnx.Module):
    """Llama-family decoder-only language model with stacked, scanned blocks.

    Args:
      config: a ``LlamaConfig``.
      rngs: the ``nnx.Rngs`` to initialise from (stream ``params``).

    Returns:
      Calling the module on int tokens ``[B, T]`` gives float32 logits
      ``[B, T, padded_vocab_size]``. Packed rows (``parallax.data``) also pass
      ``segment_ids=`` and ``positions=`` (int ``[B, T]``): attention stays inside each
      document and RoPE rotates by the position in it.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.models import Llama, LlamaConfig
      >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 16), jnp.int32)).shape
      (2, 16, 256)

    References:
      Touvron et al., 2023 (LLaMA); Dubey et al., 2024 (Llama 3).
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"Llama: config must be a LlamaConfig, got {type(config).__name__}; "
                            "e.g. Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0)).")
        self.config = c = config
        init, v, d, pd = nnx.initializers.normal(0.02), c.padded_vocab_size, c.embed_dim, \
            c.param_dtype
        rows = padded_init(init, c.vocab_size) if v > c.vocab_size else init
        self.embed = annotated_param(rows, rngs.params(), (v, d), ("vocab", "embed"), pd)

        @nnx.split_rngs(splits=c.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs):
            return LlamaBlock(c, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.norm = RMSNorm(d, epsilon=c.norm_eps, dtype=c.dtype, param_dtype=pd)
        if c.tie_embeddings:
            self.head = None  # the logits reuse embed
        else:
            cols = padded_init(init, c.vocab_size, axis=1) if v > c.vocab_size else init
            self.head = annotated_param(cols, rngs.params(), (d, v), ("embed", "vocab"), pd)

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """Token embeddings: int ``[B, T]`` -> residual stream ``[B, T, D]``."""
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"Llama.embed: tokens must be integer ids, got dtype {tokens.dtype}.")
        if tokens.ndim != 2:
            raise ValueError(f"Llama.embed: tokens must be [batch, seq], got "
                             f"{list(tokens.shape)}.")
        seq, vocab = tokens.shape[1], self.config.vocab_size
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"Llama.embed: sequence length {seq} exceeds max_seq_len="
                f"{self.config.max_seq_len}; shorten the input or raise LlamaConfig.max_seq_len.")
        check_sequence("Llama.embed", seq)
        check_token_ids("Llama.embed", tokens, vocab)
        finite_check.require(f"Llama.embed: token ids within [0, {vocab})",
                             lambda: ((tokens >= 0) & (tokens < vocab)).all())
        # Under context parallelism the model holds the sequence in the zigzag order.
        x = token_embeddings(self.embed[...], tokens, "Llama.embed").astype(self.config.dtype)
        # As the GPT: all-reduce the vocabulary-parallel lookup, then split the sequence.
        return constrain(gather_sequence(x, WHOLE_SEQUENCE), RESIDUAL)

    def apply_blocks(self, x: jax.Array, segment_ids: jax.Array | None = None,
                     positions: jax.Array | None = None) -> jax.Array:
        """Runs all L blocks as one ``nnx.scan``: ``[B, T, D]`` -> ``[B, T, D]``
        (packed documents: ``segment_ids``, ``positions`` ``[B, T]`` in the model's order)."""

        if self.config.moe is not None:  # and keeps the router statistics
            return apply_mixtral_blocks(self, x, segment_ids, positions)
        layers = {nnx.PARTITION_NAME: "layers"}
        forward = remat_layer(  # config.remat's checkpoint
            lambda block, x: llama_block_forward(block, x, segment_ids=segment_ids,
                                                 positions=positions), self.config.remat)

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=layers)
        def body(x: jax.Array, block: LlamaBlock) -> jax.Array:
            return forward(block, x)

        return body(x, self.blocks)

    def final_hidden(self, x: jax.Array) -> jax.Array:
        """The final RMSNorm, in natural order with the sequence whole (as ``GPT``'s)."""
        return gather_sequence(natural_order(self.norm(x), "Llama.unembed"), WHOLE_SEQUENCE)

    def output_matrix(self) -> tuple[jax.Array, bool]:
        """``(W, transposed)``: ``embed`` ``[V, D]`` (tied) or ``head`` ``[D, V]``, in the
        compute dtype."""
        if self.head is None:
            return self.embed[...].astype(self.config.dtype), False
        return self.head[...].astype(self.config.dtype), True

    def unembed(self, x: jax.Array) -> jax.Array:
        """Final RMSNorm and output projection: ``[B, T, D]`` -> float32 logits ``[B, T, V]``."""
        w, transposed = self.output_matrix()
        spec = "btd,dv->btv" if transposed else "btd,vd->btv"
        logits = jnp.einsum(spec, self.final_hidden(x), w, preferred_element_type=jnp.float32)
        if self.config.padded_vocab_size > self.config.vocab_size:
            logits = mask_padded_logits(logits, self.config.vocab_size)
        return constrain(logits, ("batch", None, "vocab"))

    def token_losses(self, x: jax.Array, labels: jax.Array) -> jax.Array:
        """float32 cross-entropy ``[B, T]`` of the residual stream ``x``, the logits a chunk of
        the sequence at a time (as ``GPT.token_losses``)."""
        return config_token_losses(self.final_hidden(x), self.output_matrix(), labels,
                                   self.config)

    def hidden_states(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                      positions: jax.Array | None = None) -> jax.Array:
        """The residual stream after the last block, ``[B, T, D]`` (packed documents:
        ``segment_ids`` and ``positions`` ``[B, T]``)."""
        check_positions("Llama", tokens, positions)
        if segment_ids is not None:
            segment_ids = in_sequence_order(segment_ids, "Llama")
        if positions is not None:
            positions = in_sequence_order(positions, "Llama")
        return self.apply_blocks(self.embed_tokens(tokens), segment_ids, positions)

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        return self.unembed(self.hidden_states(tokens, segment_ids=segment_ids,
                                               positions=positions))


def _first(model: Llama, batch: Mapping[str, jax.Array]) -> jax.Array:
    tokens = batch["tokens"]
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"llama_stages: batch['tokens'] must have shape [batch, seq + 1] with "
                         f"seq >= 1, got {list(tokens.shape)}.")
    refuse_packed("llama_stages", batch, "a pipeline's stages")
    if model.config.moe is not None:
        raise ValueError("llama_stages: a Llama with MoE blocks (LlamaConfig(moe=...)) has no "
                         "pipeline stages yet (its router statistics are not carried between "
                         "stages); train it without px.Pipeline, or use an MoE GPT, whose "
                         "stages carry them.")
    return model.embed_tokens(tokens[:, :-1])


# ``next_token_loss`` split for ``px.Pipeline``: embedding first, one block per stage step,
# final norm, head and the loss (``next_token_loss``'s own code) last.
llama_stages = Stages(first=_first, stage=llama_block_forward, last=head_loss,
                      layers=lambda model: model.blocks)
