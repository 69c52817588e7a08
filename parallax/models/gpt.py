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
  Chowdhery et al., "PaLM", 2022, appendix B (the flops accounting).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from parallax import context
from parallax.models.layers import (
    CausalSelfAttention,
    FeedForward,
    LayerNorm,
    annotated_param,
    gather_sequence,
    mask_padded_logits,
    padded_init,
    padded_size,
)
from parallax.mesh import axes_text, axis_size
from parallax.activations import constrain
from parallax.rules import as_tuple

RESIDUAL = ("batch", "sequence", "embed")
WHOLE_SEQUENCE = ("batch", None, "embed")  # before a column-parallel matmul
_SIZES = ("vocab_size", "max_seq_len", "num_layers", "num_heads", "embed_dim", "mlp_dim")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes and dtypes of a ``GPT``; validated on creation.

    Args:
      vocab_size: number of token ids (V).
      max_seq_len: longest sequence the position table covers.
      num_layers: transformer blocks (L).
      num_heads: attention heads (H); ``embed_dim`` must be a multiple of it.
      embed_dim: width of the residual stream (D); head_dim K = D / H.
      mlp_dim: width of the MLP hidden layer (F).
      tie_embeddings: logits use ``wte.T`` instead of a separate ``head``.
      dtype: compute dtype (logits and loss are always float32).
      param_dtype: storage dtype of the params.
      vocab_pad_multiple: pad the embedding (and logits) to a multiple of this many token
        ids, so that the vocabulary splits over tensor-parallel ranks (Megatron's
        ``make_vocab_size_divisible_by``). Padded rows start at zero, are never looked up,
        and their logits are masked to the lowest float: the loss is the unpadded one.

    Example:
      >>> from parallax.models import GPTConfig
      >>> GPTConfig.tiny().head_dim
      16
    """

    vocab_size: int = 256
    max_seq_len: int = 64
    num_layers: int = 2
    num_heads: int = 4
    embed_dim: int = 64
    mlp_dim: int = 256
    tie_embeddings: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    vocab_pad_multiple: int = 1

    def __post_init__(self):
        for field in _SIZES + ("vocab_pad_multiple",):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"GPTConfig: {field} must be a positive int, got {value!r}; "
                    f"set {field} to an integer >= 1."
                )
        if self.embed_dim % self.num_heads:
            lower = self.embed_dim - self.embed_dim % self.num_heads
            raise ValueError(
                f"GPTConfig: embed_dim={self.embed_dim} is not divisible by "
                f"num_heads={self.num_heads}; set embed_dim to a multiple of num_heads "
                f"(e.g. {lower or self.num_heads}) or pick num_heads dividing {self.embed_dim}."
            )

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def padded_vocab_size(self) -> int:
        """``vocab_size`` rounded up to a multiple of ``vocab_pad_multiple``."""
        return padded_size(self.vocab_size, self.vocab_pad_multiple)

    @classmethod
    def tiny(cls, **overrides: Any) -> GPTConfig:
        """0.12M params (tests): vocab 256, seq 64, 2 layers, 4 heads, embed 64, mlp 256."""
        return cls._preset((256, 64, 2, 4, 64, 256), overrides)

    @classmethod
    def small(cls, **overrides: Any) -> GPTConfig:
        """3.3M params: vocab 256, seq 256, 4 layers, 8 heads, embed 256, mlp 1024."""
        return cls._preset((256, 256, 4, 8, 256, 1024), overrides)

    @classmethod
    def gpt2_124m(cls, **overrides: Any) -> GPTConfig:
        """GPT-2 small (124M); vocab 50257 padded to 50304, a multiple of 64, for sharding."""
        return cls._preset((50304, 1024, 12, 12, 768, 3072), overrides)

    @classmethod
    def gpt2_350m(cls, **overrides: Any) -> GPTConfig:
        """GPT-2 medium (355M with the padded 50304 vocabulary)."""
        return cls._preset((50304, 1024, 24, 16, 1024, 4096), overrides)

    @classmethod
    def _preset(cls, sizes: tuple[int, ...], overrides: dict[str, Any]) -> GPTConfig:
        return cls(**(dict(zip(_SIZES, sizes)) | overrides))


def check_sequence(api: str, seq: int) -> None:
    """Raises when the active strategy splits the sequence into more parts than ``seq`` fills."""
    ctx = context.current()
    if ctx is None:
        return
    axes = [a for a in as_tuple(ctx.strategy.rule_table.get("sequence"))
            if a in ctx.mesh.shape and a not in ctx.manual_axes]
    ways = axis_size(ctx.mesh, axes)
    if seq % ways:
        raise ValueError(
            f"{api}: sequence length {seq} does not split into the {ways} parts of sequence "
            f"parallelism ({axes_text(ctx.mesh, axes)} in {ctx.strategy.name}); use a "
            f"multiple of {ways}, e.g. "
            f"{seq + ways - seq % ways} (next_token_loss takes tokens [batch, length + 1]), "
            "or turn sequence_parallel off."
        )


def create_gpt_params(module: nnx.Module, config: GPTConfig, rngs: nnx.Rngs, make_block) -> None:
    """Sets the GPT's parameters on ``module``: ``wte``, ``wpe``, ``blocks``, ``ln_f``, ``head``.

    Shared by :class:`GPT` and ``px.nn.ParallelGPT`` (``make_block(rngs)`` builds one block),
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
        self.mlp = FeedForward(d, config.mlp_dim, rngs=rngs, out_init=resid, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return block_forward(self, x)


def block_forward(block: Block, x: jax.Array) -> jax.Array:
    """Applies one transformer block (unstacked params) to the residual stream.

    ``GPT.apply_blocks`` scans this over the stacked blocks; a pipeline stage can scan it over
    its own chunk of layers.

    Args:
      block: a ``Block`` whose params have no ``"layers"`` axis (one slice of ``GPT.blocks``).
      x: the residual stream ``[B, T, D]``.

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
    x = constrain(x + block.attn(block.ln1(x)), RESIDUAL)
    return constrain(x + block.mlp(block.ln2(x)), RESIDUAL)


class GPT(nnx.Module):
    """GPT-2 style decoder-only language model with stacked, scanned blocks.

    Args:
      config: a ``GPTConfig``.
      rngs: the ``nnx.Rngs`` to initialise from (stream ``params``).

    Returns:
      Calling the module on int tokens ``[B, T]`` (T <= max_seq_len) gives float32 logits
      ``[B, T, padded_vocab_size]`` (``vocab_size`` unless ``vocab_pad_multiple`` pads it).

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

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token plus position embeddings: int ``[B, T]`` -> residual stream ``[B, T, D]``."""
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"GPT.embed: tokens must be integer ids, got dtype {tokens.dtype}.")
        if tokens.ndim != 2:
            raise ValueError(f"GPT.embed: tokens must be [batch, seq], got {list(tokens.shape)}.")
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"GPT.embed: sequence length {seq} exceeds max_seq_len="
                f"{self.config.max_seq_len}; shorten the input or raise GPTConfig.max_seq_len."
            )
        check_sequence("GPT.embed", seq)
        x = jnp.take(self.wte[...], tokens, axis=0) + self.wpe[...][:seq]
        # Under sequence parallelism: all-reduce the vocabulary-parallel lookup, then split
        # the sequence (Megatron's embedding), rather than gathering the table.
        x = gather_sequence(x.astype(self.config.dtype), WHOLE_SEQUENCE)
        return constrain(x, RESIDUAL)

    def apply_blocks(self, x: jax.Array) -> jax.Array:
        """Runs all L blocks as one ``nnx.scan``: ``[B, T, D]`` -> ``[B, T, D]``."""

        layers = {nnx.PARTITION_NAME: "layers"}  # strip the axis inside, put it back after

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=layers)
        def body(x: jax.Array, block: Block) -> jax.Array:
            return block_forward(block, x)

        return body(x, self.blocks)

    def unembed(self, x: jax.Array) -> jax.Array:
        """Final LayerNorm and output projection: ``[B, T, D]`` -> float32 logits ``[B, T, V]``.

        V is ``config.padded_vocab_size``; the logits of padded ids are the lowest float.
        The logits are split by vocabulary (never by sequence: the vocabulary-parallel
        loss needs whole rows of positions), so no device holds all of them.
        """
        x = gather_sequence(self.ln_f(x), WHOLE_SEQUENCE)
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

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.unembed(self.apply_blocks(self.embed(tokens)))


def next_token_loss(model: GPT, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy over all B * T positions, in float32.

    Args:
      model: a ``GPT`` (any callable from tokens ``[B, T]`` to logits ``[B, T, V]``).
      batch: ``{"tokens": int [B, T + 1]}``; inputs are ``tokens[:, :-1]``, targets
        ``tokens[:, 1:]``.

    Returns:
      A float32 scalar: a plain mean, so every position weighs the same and the mean of
      equal-sized shards' losses is the full batch's (what data parallelism relies on).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.models import GPT, GPTConfig, next_token_loss
      >>> model = GPT(GPTConfig.tiny(), rngs=nnx.Rngs(0))
      >>> tokens = jnp.arange(34, dtype=jnp.int32).reshape(2, 17)
      >>> loss = next_token_loss(model, {"tokens": tokens})
      >>> bool(5.0 < loss < 6.0)  # about log(256) = 5.55 at init
      True
    """
    tokens = batch["tokens"]
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(
            f"next_token_loss: batch['tokens'] must have shape [batch, seq + 1] with "
            f"seq >= 1, got {list(tokens.shape)}."
        )
    logits = jnp.asarray(model(tokens[:, :-1]), jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.mean(losses)


def _block_params(c: GPTConfig) -> int:
    d, f = c.embed_dim, c.mlp_dim
    # q, v: [D, H, K] + [H, K]; k: [D, H, K] (no bias); out: [H, K, D] + [D]; H*K = D
    attention = 4 * d * d + 3 * d
    mlp = (d * f + f) + (f * d + d)
    return attention + mlp + 2 * (2 * d)  # two LayerNorms


def param_count(config: GPTConfig) -> int:
    """The exact number of parameters of ``GPT(config)``, computed from the sizes alone.

    Args:
      config: a ``GPTConfig``.

    Returns:
      Embeddings ``(V + max_seq_len) D``, ``L`` blocks of ``4 D^2 + 2 D F + 8 D + F``, the
      final LayerNorm ``2 D``, and ``D V`` more when the head is not tied.

    Example:
      >>> from parallax.models import GPTConfig, param_count
      >>> param_count(GPTConfig.gpt2_124m())
      124466688
    """
    c = config
    embeddings = (c.padded_vocab_size + c.max_seq_len) * c.embed_dim
    head = 0 if c.tie_embeddings else c.embed_dim * c.padded_vocab_size
    return embeddings + c.num_layers * _block_params(c) + 2 * c.embed_dim + head


def flops_per_token(config: GPTConfig, seq_len: int | None = None) -> int:
    """Training flops (forward + backward) per token: ``6 N + 12 L T D``.

    ``N`` is the parameters that take part in a matmul for every token: all of them except
    the token and position lookup tables, plus the ``D x V`` output projection, counted
    whether it is tied to ``wte`` or not (the logits are a matmul either way). ``6 N`` is
    2 flops per multiply-add, times 3 for forward and backward; ``12 L T D`` is the attention
    scores and weighted sum (``4 T D`` forward per layer, times 3), counted over the full
    ``T x T`` matrix as PaLM does (causal masking saves nothing in a dense kernel).

    Args:
      config: a ``GPTConfig``.
      seq_len: the sequence length T; ``config.max_seq_len`` when None.

    Returns:
      The flops per token as an int.

    Example:
      >>> from parallax.models import GPTConfig, flops_per_token
      >>> flops_per_token(GPTConfig.gpt2_124m(), 1024)  # 0.86 GFLOP per token
      855327744

    References:
      PaLM (Chowdhery et al., 2022), appendix B; Chinchilla (Hoffmann et al., 2022), app. F.
    """
    c = config
    t = c.max_seq_len if seq_len is None else seq_len
    if t <= 0:
        raise ValueError(f"flops_per_token: seq_len must be positive, got {t}.")
    n = c.num_layers * _block_params(c) + 2 * c.embed_dim + c.embed_dim * c.padded_vocab_size
    return 6 * n + 12 * c.num_layers * t * c.embed_dim
