"""The Llama's configuration: its sizes, the presets, and its arithmetic (parameters, flops).

References:
  Touvron et al., "Llama 2", 2023; Dubey et al., "The Llama 3 Herd of Models", 2024 (the
  preset sizes, as their Hugging Face configs give them); Chowdhery et al., "PaLM", 2022,
  appendix B (the flops accounting).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from parallax.models.remat import check_policy
from parallax.nn.chunked_loss import check_loss_chunks
from parallax.nn.moe_config import MoEConfig
from parallax.nn.padding import padded_size
from parallax.nn.rope import RopeScaling

_SIZES = ("vocab_size", "max_seq_len", "num_layers", "num_heads", "num_kv_heads",
          "embed_dim", "mlp_dim")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes and dtypes of a ``Llama``; validated on creation.

    Args:
      vocab_size: number of token ids (V).
      max_seq_len: the longest sequence the model is called on (RoPE itself has no table).
      num_layers: transformer blocks (L).
      num_heads: query heads (H); ``embed_dim`` must be a multiple of it.
      num_kv_heads: key/value heads (G, grouped-query attention); H must be a multiple of it.
      embed_dim: width of the residual stream (D); head_dim K = D / H.
      mlp_dim: hidden width of the SwiGLU MLP (F).
      rope_theta: RoPE's base (10000 Llama 2, 500000 Llama 3).
      rope_scaling: Llama 3.1's frequency scaling (:class:`RopeScaling`), or None.
      norm_eps: RMSNorm's epsilon.
      tie_embeddings: logits use ``embed.T`` instead of a separate ``head`` (Llama 3.2 1B).
      dtype: compute dtype (logits and loss are always float32).
      param_dtype: storage dtype of the params.
      vocab_pad_multiple: pad the vocabulary to a multiple of this (as ``GPTConfig``).
      remat: what the backward recomputes of each scanned block: ``"none"`` (the default),
        ``"full"``, ``"dots"`` or ``"offload"`` (:mod:`parallax.models.remat`).
      loss_chunks: chunks of the sequence for the loss's logits (as ``GPTConfig``; None
        picks them, 1 computes all logits at once).
      moe: a ``MoEConfig`` to make every block's MLP a mixture of SwiGLU experts
        (Mixtral; each expert's width is ``moe.mlp_dim`` or ``mlp_dim``); None (the
        default) keeps the dense SwiGLU. Train it with ``moe_next_token_loss``.
      qkv_bias: biases on the q, k and v projections (Qwen2); False (Llama, Mixtral).

    Example:
      >>> from parallax.models import LlamaConfig
      >>> LlamaConfig.tiny().head_dim, LlamaConfig.tiny().num_kv_heads
      (16, 2)
    """

    vocab_size: int = 256
    max_seq_len: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    embed_dim: int = 64
    mlp_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    vocab_pad_multiple: int = 1
    remat: str = "none"
    loss_chunks: int | None = None
    moe: MoEConfig | None = None
    qkv_bias: bool = False

    def __post_init__(self):
        check_policy(self.remat, "LlamaConfig")
        check_loss_chunks("LlamaConfig", self.loss_chunks)
        for field in _SIZES + ("vocab_pad_multiple",):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig: {field} must be a positive int, got {value!r}; "
                                 f"set {field} to an integer >= 1.")
        if self.embed_dim % self.num_heads or (self.embed_dim // self.num_heads) % 2:
            raise ValueError(
                f"LlamaConfig: embed_dim={self.embed_dim} must be num_heads={self.num_heads} "
                "times an even head size (RoPE rotates pairs); e.g. embed_dim="
                f"{2 * self.num_heads * max(1, self.embed_dim // (2 * self.num_heads))}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig: num_heads={self.num_heads} is not a multiple of num_kv_heads="
                f"{self.num_kv_heads} (each key/value head serves a group of query heads); "
                "pick num_kv_heads dividing num_heads.")
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise TypeError(f"LlamaConfig: moe must be a MoEConfig or None, got "
                            f"{type(self.moe).__name__}: {self.moe!r}; e.g. "
                            "moe=MoEConfig(num_experts=8, top_k=2, capacity_factor=None).")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"LlamaConfig: rope_scaling must be a RopeScaling or None, got "
                            f"{type(self.rope_scaling).__name__}; e.g. RopeScaling(factor=8.0).")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def padded_vocab_size(self) -> int:
        """``vocab_size`` rounded up to a multiple of ``vocab_pad_multiple``."""
        return padded_size(self.vocab_size, self.vocab_pad_multiple)

    @classmethod
    def tiny(cls, **overrides: Any) -> LlamaConfig:
        """Tests: vocab 256, seq 64, 2 layers, 4 heads (2 kv), embed 64, mlp 128, scaled RoPE."""
        scaling = RopeScaling(factor=4.0, original_max_position_embeddings=16)
        return cls._preset((256, 64, 2, 4, 2, 64, 128), dict(rope_scaling=scaling) | overrides)

    @classmethod
    def small(cls, **overrides: Any) -> LlamaConfig:
        """vocab 256, seq 256, 4 layers, 8 heads (4 kv), embed 256, mlp 768."""
        return cls._preset((256, 256, 4, 8, 4, 256, 768), overrides)

    @classmethod
    def llama2_7b(cls, **overrides: Any) -> LlamaConfig:
        """Llama 2 7B (6.74B params): multi-head attention, 32k vocabulary."""
        return cls._preset((32000, 4096, 32, 32, 32, 4096, 11008), overrides)

    @classmethod
    def llama3_8b(cls, **overrides: Any) -> LlamaConfig:
        """Llama 3 8B (8.03B params): 8 kv heads, 128k vocabulary, theta 500000."""
        return cls._preset((128256, 8192, 32, 32, 8, 4096, 14336),
                           dict(rope_theta=500000.0) | overrides)

    @classmethod
    def llama3_70b(cls, **overrides: Any) -> LlamaConfig:
        """Llama 3 70B (70.6B params): 80 layers, 64 heads (8 kv), embed 8192, mlp 28672."""
        return cls._preset((128256, 8192, 80, 64, 8, 8192, 28672),
                           dict(rope_theta=500000.0) | overrides)

    @classmethod
    def llama3_1b(cls, **overrides: Any) -> LlamaConfig:
        """Llama 3.2 1B (1.24B params): tied embeddings, RoPE scaled by 32 to 128k context."""
        scaling = RopeScaling(factor=32.0)
        return cls._preset((128256, 131072, 16, 32, 8, 2048, 8192),
                           dict(rope_theta=500000.0, rope_scaling=scaling,
                                tie_embeddings=True) | overrides)

    @classmethod
    def mixtral_8x7b(cls, **overrides: Any) -> LlamaConfig:
        """Mixtral 8x7B (46.7B params, 12.9B active): 8 experts of width 14336, top-2,
        dropless, Mixtral's auxiliary loss (0.02 as its training used it; transformers'
        config default is 0.001, used only with ``output_router_logits``)."""
        moe = MoEConfig(num_experts=8, top_k=2, capacity_factor=None, aux_loss="mixtral",
                        balance_coef=0.02)
        return cls._preset((32000, 32768, 32, 32, 8, 4096, 14336),
                           dict(rope_theta=1e6, moe=moe) | overrides)

    @classmethod
    def _preset(cls, sizes: tuple[int, ...], overrides: dict[str, Any]) -> LlamaConfig:
        return cls(**(dict(zip(_SIZES, sizes)) | overrides))


def _block_params(c: LlamaConfig, active: bool = False) -> int:
    """One block's parameters; ``active``: only those one token's forward pass uses."""
    d, f, k = c.embed_dim, c.mlp_dim, c.head_dim
    attention = 2 * d * c.num_heads * k + 2 * d * c.num_kv_heads * k  # q, o; k, v
    if c.qkv_bias:  # Qwen2: q [H, K], k and v [G, K]
        attention += (c.num_heads + 2 * c.num_kv_heads) * k
    mlp = 3 * d * f  # gate, up, down
    if c.moe is not None:  # router [D, E]; per expert gate, up [D, F'], down [F', D]
        m = c.moe
        used = m.top_k if active else m.num_experts
        mlp = d * m.num_experts + used * 3 * d * (m.mlp_dim or f) + 3 * d * m.shared_mlp_dim
    return attention + mlp + 2 * d  # two RMSNorms


def llama_param_count(config: LlamaConfig) -> int:
    """The exact number of parameters of ``Llama(config)``, from the sizes alone.

    Args:
      config: a ``LlamaConfig``.

    Returns:
      Embedding ``V D``, ``L`` blocks of ``2 D H K + 2 D G K + 3 D F + 2 D``, the final
      RMSNorm ``D``, and ``D V`` more when the head is not tied. With MoE blocks
      ``3 D F`` becomes the router's ``D E`` and ``E`` experts' ``3 D F'``.

    Example:
      >>> from parallax.models import LlamaConfig, llama_param_count
      >>> llama_param_count(LlamaConfig.llama3_8b())
      8030261248
      >>> llama_param_count(LlamaConfig.mixtral_8x7b())   # Mixtral 8x7B's 46.7B
      46702792704
    """
    c = config
    head = 0 if c.tie_embeddings else c.embed_dim * c.padded_vocab_size
    return c.padded_vocab_size * c.embed_dim + c.num_layers * _block_params(c) + c.embed_dim + head


def llama_flops_per_token(config: LlamaConfig, seq_len: int | None = None) -> int:
    """Training flops (forward + backward) per token: ``6 N + 12 L T H K``.

    As ``px.models.flops_per_token`` for the GPT: ``N`` counts every matmul parameter (not
    the embedding lookup; the ``D x V`` output projection, tied or not), and attention's
    scores and weighted sum add ``4 T H K`` forward per layer, over the full ``T x T``.
    With MoE blocks ``N`` counts the router and the ``top_k`` experts a token uses.

    Args:
      config: a ``LlamaConfig``.
      seq_len: the sequence length T; ``config.max_seq_len`` when None.

    Returns:
      The flops per token as an int.

    Example:
      >>> from parallax.models import LlamaConfig, llama_flops_per_token
      >>> llama_flops_per_token(LlamaConfig.llama3_8b(), 8192)  # 58 GFLOP per token
      57914449920

    References:
      PaLM (Chowdhery et al., 2022), appendix B.
    """
    c = config
    t = c.max_seq_len if seq_len is None else seq_len
    if t <= 0:
        raise ValueError(f"llama_flops_per_token: seq_len must be positive, got {t}.")
    n = c.num_layers * _block_params(c, active=True) + c.embed_dim + c.embed_dim * c.padded_vocab_size
    return 6 * n + 12 * c.num_layers * t * c.num_heads * c.head_dim
