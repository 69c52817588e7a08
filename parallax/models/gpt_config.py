"""The GPT's configuration: its sizes, the presets, and its arithmetic (parameters, flops).

References:
  Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2), 2019;
  Chowdhery et al., "PaLM", 2022, appendix B (the flops accounting).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from parallax.nn.moe_config import MoEConfig
from parallax.nn.chunked_loss import check_loss_chunks
from parallax.nn.padding import padded_size
from parallax.models.remat import check_policy

_SIZES = ("vocab_size", "max_seq_len", "num_layers", "num_heads", "embed_dim", "mlp_dim")
_RATES = ("embed_dropout", "attention_dropout", "residual_dropout")


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
      moe: a ``MoEConfig`` to make every block's MLP a mixture of SwiGLU experts (the
        experts' width is ``moe.mlp_dim`` or ``mlp_dim``); None (the default) keeps the
        dense GELU MLP. Train it with ``moe_next_token_loss``, which adds the router's
        auxiliary losses.
      remat: what the backward recomputes of each scanned block (``jax.checkpoint``):
        ``"none"`` (the default: nothing), ``"full"``, ``"dots"`` (keep the matmul outputs)
        or ``"offload"`` (those, in host memory); see :mod:`parallax.models.remat` for the
        policies and their flops. Under ``px.Pipeline`` the pipeline's own ``remat=`` applies.
      loss_chunks: how many chunks of the sequence ``next_token_loss`` computes the logits
        in (:func:`parallax.nn.chunked_cross_entropy`; a divisor of the sequence length).
        None (the default) picks the smallest divisor with chunk logits no larger than the
        hidden states; 1 computes all ``[B, T, V]`` logits at once.
      embed_dropout: GPT-2's ``embd_pdrop``: dropout on the token plus position embeddings.
      attention_dropout: GPT-2's ``attn_pdrop``: dropout on the attention probabilities
        (computed by XLA's softmax attention in training, where the fused kernels cannot
        take the mask; see :mod:`parallax.nn.attention_dropout`).
      residual_dropout: GPT-2's ``resid_pdrop``: dropout on each block's attention and
        MLP outputs before they join the residual stream.
        All three are 0 by default (no dropout, no RNG streams in the model). A rate above
        0 gives the model ``nnx.Dropout`` layers with their own RNG streams (the
        ``"dropout"`` stream of the ``nnx.Rngs``, else its default), active until
        ``model.eval()``; under every strategy the masks are one device's
        (``docs/models.md``).

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
    moe: MoEConfig | None = None
    remat: str = "none"
    loss_chunks: int | None = None
    embed_dropout: float = 0.0
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0

    def __post_init__(self):
        check_policy(self.remat, "GPTConfig")
        for field in _RATES:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    0.0 <= value < 1.0):
                raise ValueError(f"GPTConfig: {field} must be a dropout rate in [0, 1), got "
                                 f"{value!r}; use 0.0 for no dropout (GPT-2 trains with 0.1).")
        check_loss_chunks("GPTConfig", self.loss_chunks)
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise TypeError(f"GPTConfig: moe must be a MoEConfig or None, got "
                            f"{type(self.moe).__name__}: {self.moe!r}.")
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
    def has_dropout(self) -> bool:
        """Whether any of the three dropout rates is above 0."""
        return any(getattr(self, field) > 0 for field in _RATES)

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


def _block_params(c: GPTConfig, active: bool = False) -> int:
    """One block's parameters; ``active``: only those one token's forward pass uses."""
    d, f = c.embed_dim, c.mlp_dim
    # q, v: [D, H, K] + [H, K]; k: [D, H, K] (no bias); out: [H, K, D] + [D]; H*K = D
    attention = 4 * d * d + 3 * d
    mlp = (d * f + f) + (f * d + d)
    if c.moe is not None:  # router [D, E]; per expert gate, up [D, F'], down [F', D]
        m = c.moe
        used = m.top_k if active else m.num_experts
        mlp = d * m.num_experts + used * 3 * d * (m.mlp_dim or f) + 3 * d * m.shared_mlp_dim
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
    ``T x T`` matrix as PaLM does (causal masking saves nothing in a dense kernel). With
    MoE blocks, ``N`` counts the ``top_k`` experts a token uses (and the router), not all.

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
    n = (c.num_layers * _block_params(c, active=True) + 2 * c.embed_dim
         + c.embed_dim * c.padded_vocab_size)
    return 6 * n + 12 * c.num_layers * t * c.embed_dim
