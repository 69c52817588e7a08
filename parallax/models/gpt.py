"""A GPT-2 style decoder-only transformer in Flax NNX, with stacked (scanned) blocks.

Pre-norm blocks (LayerNorm -> causal self-attention -> residual, LayerNorm -> GELU MLP ->
residual), learned position embeddings, a final LayerNorm and tied or separate output
embeddings. The blocks are built with ``nnx.vmap`` (every block param has a leading
``"layers"`` axis) and run with ``nnx.scan``, so the compiled program holds one block body
however deep the model is. Parameters and activations name logical axes only; a strategy
maps them to mesh axes.

References:
  Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2), 2019;
  Karpathy, nanoGPT (the init and the padded 50304 vocabulary);
  Shoeybi et al., "Megatron-LM", 2019 (column/row naming of the kernels);
  Chowdhery et al., "PaLM", 2022, appendix B (the flops accounting, in ``gpt_config``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from parallax.attention import (in_sequence_order, natural_order, sequence_positions,
                                token_embeddings)
from parallax import finite_check
from parallax.models.gpt_config import GPTConfig
from parallax.models.token_checks import check_positions, check_sequence, check_token_ids
from parallax.models.gpt_moe import apply_moe_blocks
from parallax.models.remat import remat_layer
from parallax.nn.moe import MoE
from parallax.nn.layers import (
    CausalSelfAttention,
    FeedForward,
    RESIDUAL,
    WHOLE_SEQUENCE,
    LayerNorm,
    annotated_param,
    gather_sequence,
)
from parallax.models.loss_head import config_token_losses
from parallax.nn.attention_dropout import (apply_dropout, dropout_layer, is_active,
                                           refuse_reordered_sequence)
from parallax.nn.padding import mask_padded_logits, padded_init
from parallax.activations import constrain


def create_gpt_params(module: nnx.Module, config: GPTConfig, rngs: nnx.Rngs, make_block) -> None:
    """Sets the GPT's parameters on ``module``: ``wte``, ``wpe``, ``blocks``, ``ln_f``, ``head``.

    Shared by :class:`GPT` and ``px.models.ParallelGPT`` (``make_block(rngs)`` builds one block),
    whose parameter trees, names and values from one seed must be identical.
    """
    c, init = config, nnx.initializers.normal(0.02)
    v, s, d, pd = c.padded_vocab_size, c.max_seq_len, c.embed_dim, c.param_dtype
    rows = padded_init(init, c.vocab_size) if v > c.vocab_size else init
    module.wte = annotated_param(rows, rngs.params(), (v, d), ("vocab", "embed"), pd)
    module.wpe = annotated_param(init, rngs.params(), (s, d), ("position", "embed"), pd)

    @nnx.split_rngs(splits=c.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def make_blocks(rngs: nnx.Rngs):
        return make_block(rngs)

    module.blocks = make_blocks(rngs)
    module.ln_f = LayerNorm(d, ("embed",), dtype=c.dtype, param_dtype=pd)
    if c.tie_embeddings:
        module.head = None  # the logits reuse wte
    else:
        cols = padded_init(init, c.vocab_size, axis=1) if v > c.vocab_size else init
        module.head = annotated_param(cols, rngs.params(), (d, v), ("embed", "vocab"), pd)


class Block(nnx.Module):
    """One pre-norm transformer block; ``GPT`` holds L of them stacked on a leading axis."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        d, kw = config.embed_dim, dict(dtype=config.dtype, param_dtype=config.param_dtype)
        # GPT-2 scales the two residual projections of each block by 1/sqrt(2L), so the
        # residual stream's variance does not grow with depth.
        resid = nnx.initializers.normal(0.02 / math.sqrt(2 * config.num_layers))
        self.ln1 = LayerNorm(d, ("embed",), **kw)
        self.attn = CausalSelfAttention(d, config.num_heads, rngs=rngs, out_init=resid, **kw)
        self.ln2 = LayerNorm(d, ("embed",), **kw)
        if config.moe is None:
            self.mlp = FeedForward(d, config.mlp_dim, rngs=rngs, out_init=resid, **kw)
        else:
            self.mlp = MoE(d, config.moe, mlp_dim=config.mlp_dim, rngs=rngs, out_init=resid,
                           **kw)
        # Made after the parameters: forking the RNG streams then leaves their values alone.
        self.attn_dropout = dropout_layer(config.attention_dropout, rngs)
        self.resid_dropout = dropout_layer(config.residual_dropout, rngs)

    def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None) -> jax.Array:
        return block_forward(self, x, segment_ids=segment_ids)


def block_forward(block: Block, x: jax.Array, *, segment_ids: jax.Array | None = None
                  ) -> jax.Array:
    """Applies one transformer block (unstacked params) to the residual stream.

    ``GPT.apply_blocks`` scans this over the stacked blocks; a pipeline stage can scan it over
    its own chunk of layers.

    Args:
      block: a ``Block`` whose params have no ``"layers"`` axis (one slice of ``GPT.blocks``).
      x: the residual stream ``[B, T, D]``.
      segment_ids: int ``[B, T]`` of packed documents (attention stays inside each), or None.

    Returns:
      The residual stream after attention and MLP, ``[B, T, D]``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.models import GPTConfig, block_forward
      >>> from parallax.models.gpt import Block
      >>> block = Block(GPTConfig.tiny(), rngs=nnx.Rngs(0))
      >>> block_forward(block, jnp.ones((2, 8, 64))).shape
      (2, 8, 64)
    """
    packed = {} if segment_ids is None else {"segment_ids": segment_ids}  # ParallelGPT's: none
    probs, resid = getattr(block, "attn_dropout", None), getattr(block, "resid_dropout", None)
    if probs is not None:
        packed["probs_dropout"] = probs
    x = constrain(x + apply_dropout(resid, block.attn(block.ln1(x), **packed)), RESIDUAL)
    return constrain(x + apply_dropout(resid, block.mlp(block.ln2(x))), RESIDUAL)


class GPT(nnx.Module):
    """GPT-2 style decoder-only language model with stacked, scanned blocks.

    Args:
      config: a ``GPTConfig``.
      rngs: the ``nnx.Rngs`` to initialise from (stream ``params``).

    Returns:
      Calling the module on int tokens ``[B, T]`` (T <= max_seq_len) gives float32 logits
      ``[B, T, padded_vocab_size]`` (``vocab_size`` unless ``vocab_pad_multiple`` pads it).
      Packed rows (``parallax.data``) also pass ``segment_ids=`` and ``positions=`` (int
      ``[B, T]``): attention stays inside each document and positions restart with it.
      With ``GPTConfig``'s dropout rates above 0 the model drops as GPT-2 does (embeddings,
      attention probabilities, residual branches) until ``model.eval()``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.models import GPT, GPTConfig
      >>> model = GPT(GPTConfig.tiny(), rngs=nnx.Rngs(0))
      >>> model(jnp.zeros((2, 16), jnp.int32)).shape
      (2, 16, 256)

    References:
      GPT-2 (Radford et al., 2019) and nanoGPT for the architecture and init.
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT: config must be a GPTConfig, got {type(config).__name__}.")
        self.config = config
        create_gpt_params(self, config, rngs, lambda rngs: Block(config, rngs=rngs))
        self.embed_dropout = dropout_layer(config.embed_dropout, rngs)  # after the params

    def embed(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """Token plus position embeddings: int ``[B, T]`` -> residual stream ``[B, T, D]``
        (``positions`` ``[B, T]``: each token's in its packed document; None: ``0 .. T - 1``)."""
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"GPT.embed: tokens must be integer ids, got dtype {tokens.dtype}.")
        if tokens.ndim != 2:
            raise ValueError(f"GPT.embed: tokens must be [batch, seq], got {list(tokens.shape)}.")
        seq = tokens.shape[1]
        check_positions("GPT.embed", tokens, positions)
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"GPT.embed: sequence length {seq} exceeds max_seq_len="
                f"{self.config.max_seq_len}; shorten the input or raise GPTConfig.max_seq_len."
            )
        # Under context parallelism the sequence is held in the zigzag order: token ids and
        # positions are read in it (positions stay global), checked before the generic split.
        order = sequence_positions(seq, "GPT.embed")
        check_sequence("GPT.embed", seq)
        # An id outside the vocabulary reads a NaN row (jnp.take's fill). Concrete ids are
        # checked here; under jit, px.train_step(check_finite=True) names this check.
        vocab = self.config.vocab_size
        check_token_ids("GPT.embed", tokens, vocab)
        finite_check.require(f"GPT.embed: token ids within [0, {vocab})",
                       lambda: ((tokens >= 0) & (tokens < vocab)).all())
        # Packed documents: positions restart with each (read in the model's order).
        positions = order if positions is None else in_sequence_order(positions, "GPT.embed")
        x = token_embeddings(self.wte[...], tokens, "GPT.embed") + jnp.take(
            self.wpe[...], positions, axis=0)
        # Under sequence parallelism: all-reduce the vocabulary-parallel lookup, then split
        # the sequence (Megatron's embedding), rather than gathering the table.
        x = gather_sequence(x.astype(self.config.dtype), WHOLE_SEQUENCE)
        if self.dropout_active():
            refuse_reordered_sequence("px.models.GPT", "dropout")
        return constrain(apply_dropout(self.embed_dropout, constrain(x, RESIDUAL)), RESIDUAL)

    def dropout_active(self) -> bool:
        """Whether a dropout layer of the model would drop (a rate above 0, not after
        ``model.eval()``)."""
        layers = (self.embed_dropout, getattr(self.blocks, "attn_dropout", None),
                  getattr(self.blocks, "resid_dropout", None))
        return any(map(is_active, layers))

    def apply_blocks(self, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
        """Runs all L blocks as one ``nnx.scan``: ``[B, T, D]`` -> ``[B, T, D]``
        (``segment_ids`` ``[B, T]`` in the model's order, for packed documents)."""
        if self.config.moe is not None:
            return apply_moe_blocks(self, x, segment_ids)  # and keeps the router statistics
        layers = {nnx.PARTITION_NAME: "layers"}  # strip the axis inside, put it back after
        forward = remat_layer(lambda block, x: block_forward(block, x, segment_ids=segment_ids),
                              self.config.remat)  # config.remat's checkpoint

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=layers)
        def body(x: jax.Array, block: Block) -> jax.Array:
            return forward(block, x)

        return body(x, self.blocks)

    def final_hidden(self, x: jax.Array) -> jax.Array:
        """The final LayerNorm, in natural order with the sequence whole: what the output
        projection reads. Under context or sequence parallelism the positions come back
        from the devices that hold them; the vocabulary-parallel loss needs whole rows."""
        return gather_sequence(natural_order(self.ln_f(x), "GPT.unembed"), WHOLE_SEQUENCE)

    def output_matrix(self) -> tuple[jax.Array, bool]:
        """``(W, transposed)``: ``wte`` ``[V, D]`` (tied) or ``head`` ``[D, V]``, in the
        compute dtype (the logits accumulate in float32 whatever it is)."""
        if self.head is None:
            return self.wte[...].astype(self.config.dtype), False
        return self.head[...].astype(self.config.dtype), True

    def unembed(self, x: jax.Array) -> jax.Array:
        """Final LayerNorm and output projection: ``[B, T, D]`` -> float32 logits ``[B, T, V]``.

        V is ``config.padded_vocab_size``; the logits of padded ids are the lowest float.
        The logits are split by vocabulary (never by sequence: the vocabulary-parallel
        loss needs whole rows of positions), so no device holds all of them.
        """
        w, transposed = self.output_matrix()
        spec = "btd,dv->btv" if transposed else "btd,vd->btv"
        logits = jnp.einsum(spec, self.final_hidden(x), w, preferred_element_type=jnp.float32)
        if self.config.padded_vocab_size > self.config.vocab_size:
            logits = mask_padded_logits(logits, self.config.vocab_size)
        return constrain(logits, ("batch", None, "vocab"))

    def token_losses(self, x: jax.Array, labels: jax.Array) -> jax.Array:
        """The float32 cross-entropy ``[B, T]`` of the residual stream ``x`` against ``labels``,
        with the logits computed ``config.loss_chunks`` chunks of the sequence at a time
        (:func:`parallax.nn.chunked_cross_entropy`): equal to ``cross_entropy(unembed(x),
        labels)``, without ``[B, T, V]`` logits."""
        return config_token_losses(self.final_hidden(x), self.output_matrix(), labels,
                                   self.config)

    def hidden_states(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                      positions: jax.Array | None = None) -> jax.Array:
        """The residual stream after the last block, ``[B, T, D]``: ``embed`` then the blocks
        (packed documents: ``segment_ids`` and ``positions`` ``[B, T]``)."""
        segment_ids = None if segment_ids is None else in_sequence_order(segment_ids, "GPT")
        return self.apply_blocks(self.embed(tokens, positions), segment_ids)

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        return self.unembed(self.hidden_states(tokens, segment_ids=segment_ids,
                                               positions=positions))
