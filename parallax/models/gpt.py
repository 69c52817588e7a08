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
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from parallax.attention import (in_sequence_order, natural_order, sequence_positions,
                                token_embeddings, whole_labels)
from parallax import finite_check
from parallax.models.gpt_config import GPTConfig
from parallax.models.token_checks import check_positions, check_sequence, check_token_ids
from parallax.models.gpt_moe import apply_moe_blocks, take_stats
from parallax.models.packed_batch import split_batch
from parallax.models.remat import remat_layer
from parallax.nn.moe import MoE, aux_loss
from parallax.nn.layers import (
    CausalSelfAttention,
    FeedForward,
    RESIDUAL,
    WHOLE_SEQUENCE,
    LayerNorm,
    annotated_param,
    gather_sequence,
)
from parallax.nn.loss import cross_entropy
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
    x = constrain(x + block.attn(block.ln1(x), **packed), RESIDUAL)
    return constrain(x + block.mlp(block.ln2(x)), RESIDUAL)


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
        return constrain(x, RESIDUAL)

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

    def unembed(self, x: jax.Array) -> jax.Array:
        """Final LayerNorm and output projection: ``[B, T, D]`` -> float32 logits ``[B, T, V]``.

        V is ``config.padded_vocab_size``; the logits of padded ids are the lowest float.
        The logits are split by vocabulary (never by sequence: the vocabulary-parallel
        loss needs whole rows of positions), so no device holds all of them.
        """
        x = gather_sequence(natural_order(self.ln_f(x), "GPT.unembed"), WHOLE_SEQUENCE)
        if self.head is None:
            w, spec = self.wte[...], "btd,vd->btv"
        else:
            w, spec = self.head[...], "btd,dv->btv"
        # Accumulate in fp32 whatever the compute dtype: the loss needs fp32 logits.
        w = w.astype(self.config.dtype)
        logits = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
        if self.config.padded_vocab_size > self.config.vocab_size:
            logits = mask_padded_logits(logits, self.config.vocab_size)
        return constrain(logits, ("batch", None, "vocab"))

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array:
        segment_ids = None if segment_ids is None else in_sequence_order(segment_ids, "GPT")
        return self.unembed(self.apply_blocks(self.embed(tokens, positions), segment_ids))


def next_token_loss(model: GPT, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy over all B * T positions, in float32.

    Args:
      model: a ``GPT`` (any callable from tokens ``[B, T]`` to logits ``[B, T, V]``, taking
        ``segment_ids=`` and ``positions=`` too for packed rows, as ``GPT`` and ``Llama`` do).
      batch: ``{"tokens": int [B, T + 1]}``; inputs ``tokens[:, :-1]``, targets
        ``tokens[:, 1:]``. Packed rows (``parallax.data``) add ``"segment_ids"`` and
        ``"positions"`` ``[B, T + 1]``: attention stays within documents; a target in another
        document (a document's last token) or padding counts zero (``models.packed_batch``).

    Returns:
      A float32 scalar: a plain mean over the B * T positions (those that do not count add
      zero), so every position weighs the same and the mean of equal-sized shards' losses
      is the full batch's (what data parallelism relies on).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.models import GPT, GPTConfig, next_token_loss
      >>> tokens = jnp.arange(34, dtype=jnp.int32).reshape(2, 17)
      >>> loss = next_token_loss(GPT(GPTConfig.tiny(), rngs=nnx.Rngs(0)), {"tokens": tokens})
      >>> bool(5.0 < loss < 6.0)  # about log(256) = 5.55 at init
      True
    """
    inputs, targets, packed, weights = split_batch("next_token_loss", batch)
    config = getattr(model, "config", None)
    if isinstance(config, GPTConfig):  # the targets too: the last column is never embedded
        check_token_ids("next_token_loss", batch["tokens"], config.vocab_size)
    logits = jnp.asarray(model(inputs, **packed), jnp.float32)
    losses = cross_entropy(logits, whole_labels(targets))
    return jnp.mean(losses if weights is None else losses * weights)


def moe_next_token_loss(model: GPT, batch: Mapping[str, jax.Array]):
    """``next_token_loss`` plus the MoE router's auxiliary losses, with the statistics.

    For ``loss_fn`` with ``has_aux=True``: the loss is the cross-entropy plus
    ``balance_coef * load_balance_loss + z_coef * router_z_loss`` (summed over layers).

    Args:
      model: a ``GPT`` whose config has ``moe=MoEConfig(...)``.
      batch: ``{"tokens": int [B, T + 1]}``.

    Returns:
      ``(loss, stats)``: ``stats`` holds ``cross_entropy``, ``load_balance_loss``,
      ``router_z_loss``, ``dropped_fraction`` (scalars) and ``expert_load`` ``[L, E]``.
      Note: under ``px.value_and_grad`` an aux array whose leading dimension equals a
      device's batch rows is read as per-example; keep ``L != rows`` (or drop it).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.models import GPT, GPTConfig, MoEConfig, moe_next_token_loss
      >>> model = GPT(GPTConfig.tiny(moe=MoEConfig(num_experts=4)), rngs=nnx.Rngs(0))
      >>> loss, stats = moe_next_token_loss(model, {"tokens": jnp.ones((2, 9), jnp.int32)})
      >>> stats["expert_load"].shape
      (2, 4)

    References:
      Fedus et al. 2021, "Switch Transformers"; Zoph et al. 2022, "ST-MoE".
    """
    if not isinstance(getattr(model, "config", None), GPTConfig) or model.config.moe is None:
        raise ValueError("moe_next_token_loss: the model must be a GPT built from "
                         "GPTConfig(moe=MoEConfig(...)); use next_token_loss for a dense GPT.")
    ce = next_token_loss(model, batch)
    stats = take_stats(model)
    loss = ce + aux_loss(stats, model.config.moe)
    return loss, {"cross_entropy": ce, **stats}
