"""The Llama's blocks: RMSNorm, grouped-query attention with RoPE, the SwiGLU MLP.

Built from :mod:`parallax.nn.layers` (``Dense``, ``annotated_param``), with the same
logical names as the GPT's layers: query heads ``"heads"`` (split under tensor
parallelism), key/value heads ``"kv_heads"`` (split when the tensor size divides them,
replicated otherwise, as ``px.TensorParallel`` treats grouped-query attention), the MLP's
hidden width ``"mlp"``. No biases, except Qwen2's on q, k and v (``qkv_bias=True``).

Projections that read the same input are fused: k and v are one kernel ``[D, 2, G, K]``,
SwiGLU's gate and up one kernel ``[D, 2, F]``, each one matmul. The stacked axis (2) is never
split, so tensor parallelism's split of ``"kv_heads"`` or ``"mlp"`` gives each rank the same
heads (or columns) of both halves. q stays a kernel of its own: its heads split over the
tensor axis whether or not the key/value heads do (when fewer key/value heads than ranks
are kept whole), which one kernel holding both could not.

References:
  Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019; Ainslie et al., "GQA",
  2023; Shazeer, "GLU Variants Improve Transformer", 2020 (SwiGLU); Touvron et al.,
  "LLaMA", 2023 (the block).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from parallax.activations import constrain
from parallax.attention import dot_product_attention
from parallax.nn.kv_cache import cached_attention
from parallax.nn.layers import (HEADS, WHOLE_SEQUENCE, Dense, Names, annotated_param,
                                gather_sequence)
from parallax.nn.rope import apply_rotary

Initializer = nnx.initializers.Initializer
KV_HEADS = ("batch", "length", "kv_heads", "kv")
KEY_VALUE = ("embed", None, "kv_heads", "kv")  # the fused k/v kernel [D, 2, G, K]
GATE_UP = ("embed", None, "mlp")  # the fused gate/up kernel [D, 2, F]


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x^2) + eps) * scale`` over the last dimension, statistics in float32.

    Args:
      features: size of the normalised (last) dimension.
      names: its logical name (``("embed",)``).
      epsilon: added to the mean square (1e-5 as Llama).
      dtype: output dtype; None keeps the input's.
      param_dtype: storage dtype of ``scale`` (ones).

    Example:
      >>> import jax.numpy as jnp
      >>> from parallax.nn.llama_layers import RMSNorm
      >>> y = RMSNorm(2)(jnp.array([[3.0, 4.0]]))   # rms = sqrt(12.5)
      >>> bool(jnp.allclose(y, jnp.array([[3.0, 4.0]]) / 12.5 ** 0.5, atol=1e-6))
      True
    """

    def __init__(self, features: int, names: Names = ("embed",), *, epsilon: float = 1e-5,
                 dtype: jnp.dtype | None = None, param_dtype: jnp.dtype = jnp.float32):
        self.scale = annotated_param(nnx.initializers.ones, None, (features,), names,
                                     param_dtype)
        self.epsilon = epsilon
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = jnp.asarray(x, jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.epsilon)
        return jnp.asarray(y * jnp.asarray(self.scale[...], jnp.float32), self.dtype or x.dtype)


class GroupedQueryAttention(nnx.Module):
    """Causal self-attention with H query heads sharing G key/value heads, and RoPE.

    Called as ``attn(x, positions)`` with each token's position ``[T]``
    (``parallax.models.llama.token_positions``), or ``[B, T]`` with ``segment_ids`` ``[B, T]``
    for packed documents (positions restarting at each document, attention kept inside it).
    Kernels: ``query`` ``[D, H, K]``, ``key_value`` ``[D, 2, G, K]`` (k and v in one matmul),
    ``out`` ``[H, K, D]``.
    The attention core is ``parallax.attention.dot_product_attention``, which takes k/v with
    fewer heads, so a context-parallel strategy that replaces it applies here too.

    Args:
      embed_dim: D.
      num_heads: H; head_dim K = D / H.
      num_kv_heads: G, dividing H.
      inv_freq: RoPE's inverse frequencies ``[K / 2]`` (``rope_frequencies``).
      rngs: the ``nnx.Rngs`` for the kernels.
      kernel_init: init of the kernels.
      dtype: compute dtype; None keeps the input's.
      param_dtype: storage dtype of the params.
      qkv_bias: biases on the q, k and v projections (Qwen2), ``query.bias [H, K]`` and
        ``key_value.bias [2, G, K]``; the output projection has none.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.nn.llama_layers import GroupedQueryAttention
      >>> from parallax.nn.rope import rope_frequencies
      >>> attn = GroupedQueryAttention(8, 2, 1, rope_frequencies(4), rngs=nnx.Rngs(0))
      >>> attn(jnp.ones((1, 5, 8)), jnp.arange(5)).shape, attn.key_value.kernel.shape
      ((1, 5, 8), (8, 2, 1, 4))
    """

    def __init__(self, embed_dim: int, num_heads: int, num_kv_heads: int, inv_freq: np.ndarray,
                 *, rngs: nnx.Rngs,
                 kernel_init: Initializer = nnx.initializers.normal(0.02),
                 dtype: jnp.dtype | None = None, param_dtype: jnp.dtype = jnp.float32,
                 qkv_bias: bool = False):
        d, h, g, k = embed_dim, num_heads, num_kv_heads, embed_dim // num_heads
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init)
        self.query = Dense((d,), (h, k), ("embed", "heads", "kv"), use_bias=qkv_bias, **kw)
        self.key_value = Dense((d,), (2, g, k), KEY_VALUE, use_bias=qkv_bias,
                               **kw)  # k and v: one matmul
        self.out = Dense((h, k), (d,), ("heads", "kv", "embed"), use_bias=False, **kw)
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: a constant of the program

    def __call__(self, x: jax.Array, positions: jax.Array, *,
                 segment_ids: jax.Array | None = None, cache=None):
        """``cache``: a :class:`parallax.nn.kv_cache.KVCache` (decoding; ``positions`` those
        of the new tokens), then ``(y, updated cache)``."""
        x = gather_sequence(x, WHOLE_SEQUENCE)
        inv_freq = np.asarray(self.inv_freq, np.float32)
        q = constrain(apply_rotary(self.query(x), positions, inv_freq), HEADS)
        kv = self.key_value(x)  # [B, T, 2, G, K]
        k = constrain(apply_rotary(kv[..., 0, :, :], positions, inv_freq), KV_HEADS)
        v = constrain(kv[..., 1, :, :], KV_HEADS)
        if cache is not None:
            y, cache = cached_attention(q, k, v, cache, KV_HEADS)
            return self.out(constrain(y, HEADS)), cache
        y = dot_product_attention(q, k, v, causal=True, segment_ids=segment_ids)  # [B, T, H, K]
        return self.out(constrain(y, HEADS))


class SwiGLU(nnx.Module):
    """Llama's MLP: ``down(silu(gate(x)) * up(x))``; gate and up (one kernel ``gate_up``
    ``[D, 2, F]``, one matmul) column parallel, down row parallel.

    Args:
      embed_dim: D.
      mlp_dim: F, the hidden width (named ``"mlp"``).
      rngs: the ``nnx.Rngs`` for the kernels.
      kernel_init: init of the kernels.
      dtype: compute dtype; None keeps the input's.
      param_dtype: storage dtype of the params.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.nn.llama_layers import SwiGLU
      >>> SwiGLU(8, 16, rngs=nnx.Rngs(0))(jnp.ones((1, 5, 8))).shape
      (1, 5, 8)
    """

    def __init__(self, embed_dim: int, mlp_dim: int, *, rngs: nnx.Rngs,
                 kernel_init: Initializer = nnx.initializers.normal(0.02),
                 dtype: jnp.dtype | None = None, param_dtype: jnp.dtype = jnp.float32):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype, use_bias=False,
                  kernel_init=kernel_init)
        self.gate_up = Dense((embed_dim,), (2, mlp_dim), GATE_UP, **kw)  # one matmul
        self.down = Dense((mlp_dim,), (embed_dim,), ("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate_up = self.gate_up(gather_sequence(x, WHOLE_SEQUENCE))  # [B, T, 2, F]
        hidden = jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]
        return self.down(constrain(hidden, ("batch", "length", "mlp")))
