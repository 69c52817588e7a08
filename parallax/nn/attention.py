"""Megatron's parallel self-attention: heads split over ranks, grouped-query attention included.

Each rank computes the attention of ``H / T`` query heads from the whole input: the query,
key and value projections are column parallel (one fused kernel, one matmul) and share one
``f`` (or, under sequence parallelism, one all-gather of the sequence), so their input
gradients are summed before the single all-reduce; the output projection is row parallel
and ends in ``g``. Per call: one all-reduce forward, one backward.

Grouped-query attention (``num_kv_heads < num_heads``, Ainslie et al. 2023) shares each
key/value head among ``num_heads / num_kv_heads`` query heads. With at least as many
key/value heads as ranks they are split like the query heads (each rank's query heads use
exactly its key/value heads). With fewer, every rank keeps all of them (their kernels are
small) and uses the one its query heads read: rank ``r`` uses key/value head
``r * num_kv_heads // T``; the gradients of the ranks that share a head are summed.

References:
  Shoeybi et al., "Megatron-LM", 2019, figure 3b. Ainslie et al., "GQA: Training Generalized
  Multi-Query Transformer Models from Multi-Head Checkpoints", 2023. Korthikanti et al.,
  2022 (sequence parallelism).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from parallax.nn import regions, rng
from parallax.nn.layers import QKV, annotated_param
from parallax.nn.linear import ColumnParallelLinear, RowParallelLinear
from parallax.nn.llama_layers import KEY_VALUE
from parallax.activations import constrain

Initializer = nnx.initializers.Initializer
_HEADS = ("batch", None, "heads", "kv")  # GSPMD: the sequence stays whole for attention
_KV_HEADS = ("batch", None, "kv_heads", "kv")


def check_heads(api: str, num_heads: int, num_kv_heads: int, axis: str, size: int) -> None:
    """Raises unless ``num_heads`` and ``num_kv_heads`` can be laid out over ``size`` ranks."""
    if num_heads % size:
        raise ValueError(
            f"{api}: num_heads={num_heads} is not divisible by the tensor-parallel size "
            f"{axis}={size}; each rank needs a whole number of heads. Use a number of heads "
            f"that is a multiple of {size}, or a tensor axis dividing {num_heads}."
        )
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"{api}: num_kv_heads={num_kv_heads} and the tensor-parallel size {axis}={size} "
            "do not divide one another; key/value heads are split when there are at least as "
            "many as ranks and replicated when fewer, which needs one to divide the other."
        )


def attend(q, k, v, *, causal: bool = True, dropout_rate: float = 0.0, dropout_key=None,
           axis: str = "tensor"):
    """Softmax attention ``[B, T, H, K] x [B, S, G, K]`` (``H`` a multiple of ``G``).

    Without dropout this is ``jax.nn.dot_product_attention``. With it, the probabilities
    are dropped with :func:`parallax.nn.dropout`, keyed by the global head index (heads are
    the sharded dimension), so every tensor-parallel layout draws the single-device mask.
    """
    if dropout_key is None or dropout_rate == 0.0:
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    scores = jnp.einsum("bthk,bshk->bhts", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    if causal:
        t, s = scores.shape[-2:]
        scores = jnp.where(jnp.tril(jnp.ones((t, s), bool)), scores, -jnp.inf)
    probs = rng.dropout(jax.nn.softmax(scores, axis=-1), dropout_rate, dropout_key,
                        sharded_dim=1, axis=axis)
    return jnp.einsum("bhts,bshk->bthk", probs.astype(v.dtype), v)


class ParallelSelfAttention(nnx.Module):
    """Multi-head (or grouped-query) causal self-attention over ``[B, T, D]``, heads split.

    Parameter names and shapes follow ``px.models``' ``CausalSelfAttention`` (one fused
    ``qkv`` kernel ``[D, 3, H, K]``, biases ``query_bias`` and ``value_bias`` ``[H, K]``, no
    key bias, ``out`` ``[H, K, D]``), so with ``num_kv_heads=None`` the state of one loads into
    the other. A grouped-query layer has ``query`` ``[D, H, K]`` and a fused ``key_value``
    ``[D, 2, G, K]`` (its head dimension named ``"kv_heads"``; biases ``[H, K]`` and
    ``[G, K]``), as ``px.models.Llama``'s attention: its query heads split whether or not the
    key/value heads do. Each fused kernel is one matmul.

    Args:
      embed_dim: D, a multiple of ``num_heads``.
      num_heads: H query heads; must divide by the tensor-parallel size.
      rngs: the ``nnx.Rngs`` for the kernels.
      num_kv_heads: G key/value heads (None: H). H must be a multiple of G.
      axis: the tensor-parallel mesh axis.
      sequence_parallel: input and output are split along the sequence.
      causal: mask future positions.
      dropout_rate: dropout on the attention probabilities (needs ``dropout_key`` at call).
      kernel_init: init of q/k/v; out_init: init of the output projection.
      dtype: compute dtype; param_dtype: storage dtype.

    Example:
      >>> import jax.numpy as jnp, parallax.nn
      >>> from flax import nnx
      >>> attn = parallax.nn.ParallelSelfAttention(16, 4, num_kv_heads=2, rngs=nnx.Rngs(0))
      >>> nnx.jit(attn)(jnp.ones((1, 5, 16))).shape, attn.key_value.kernel.shape
      ((1, 5, 16), (16, 2, 2, 4))

    References:
      Shoeybi et al., "Megatron-LM", 2019, figure 3b; Ainslie et al., "GQA", 2023.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, rngs: nnx.Rngs,
                 num_kv_heads: int | None = None, axis: str = "tensor",
                 sequence_parallel: bool = False, causal: bool = True,
                 dropout_rate: float = 0.0,
                 kernel_init: Initializer = nnx.initializers.normal(0.02),
                 out_init: Initializer = nnx.initializers.normal(0.02),
                 dtype=None, param_dtype=jnp.float32):
        api = "ParallelSelfAttention"
        g = num_heads if num_kv_heads is None else num_kv_heads
        if embed_dim % num_heads:
            raise ValueError(f"{api}: embed_dim={embed_dim} is not divisible by "
                             f"num_heads={num_heads}; pick num_heads dividing {embed_dim}.")
        if num_heads % g:
            raise ValueError(f"{api}: num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={g}; each key/value head serves a whole group.")
        d, h, k = embed_dim, num_heads, embed_dim // num_heads
        self.num_heads, self.num_kv_heads, self.axis = h, g, axis
        self.causal, self.dropout_rate = causal, dropout_rate
        kw = dict(rngs=rngs, axis=axis, sequence_parallel=sequence_parallel, dtype=dtype,
                  param_dtype=param_dtype, kernel_init=kernel_init, use_bias=False)
        zeros = nnx.initializers.zeros
        if g == h:  # one kernel for q, k and v (Megatron's fused QKV)
            self.qkv = ColumnParallelLinear(d, (3, h, k), names=QKV, **kw)
            value_heads = "heads"
        else:  # q on its own; k and v one kernel, its heads split only when T divides G
            self.query = ColumnParallelLinear(d, (h, k), names=("embed", "heads", "kv"), **kw)
            self.key_value = ColumnParallelLinear(d, (2, g, k), names=KEY_VALUE, **kw)
            value_heads = "kv_heads"
        # No key bias: softmax cancels it (see docs/models.md), so it would train on noise.
        self.query_bias = annotated_param(zeros, None, (h, k), ("heads", "kv"), param_dtype)
        self.value_bias = annotated_param(zeros, None, (g, k), (value_heads, "kv"),
                                          param_dtype)
        self.out = RowParallelLinear((h, k), d, names=("heads", "kv", "embed"),
                                     **{**kw, "kernel_init": out_init, "use_bias": True})

    def _projections(self, x: jax.Array):
        """q ``[B, T, H_local, K]`` and k, v for this rank's query heads, after ``f``."""
        if self.num_kv_heads == self.num_heads:
            x = self.qkv.enter(x)  # one f (or sequence all-gather) for q, k and v
            qkv = self.qkv.project(x)
            return qkv[..., 0, :, :], qkv[..., 1, :, :], qkv[..., 2, :, :]
        x = self.query.enter(x)  # one f for q and the fused k/v
        q, proj = self.query.project(x), self.key_value
        n = regions.axis_size(self.axis)
        if n == 1 or self.num_kv_heads % n == 0:
            kv = proj.project(x)
        else:  # fewer key/value heads than ranks: all are kept; use this rank's group
            head = regions.axis_index(self.axis) * self.num_kv_heads // n
            kernel = lax.dynamic_slice_in_dim(proj.kernel[...], head, 1, axis=2)
            dtype = proj.dtype or x.dtype
            kv = jnp.tensordot(jnp.asarray(x, dtype), jnp.asarray(kernel, dtype), axes=1)
        return q, kv[..., 0, :, :], kv[..., 1, :, :]

    def _value_bias(self) -> jax.Array:
        """This rank's value bias (its group's row when the key/value heads are kept whole)."""
        bias = self.value_bias[...]
        n = regions.axis_size(self.axis)
        if self.num_kv_heads == self.num_heads or n == 1 or self.num_kv_heads % n == 0:
            return bias
        head = regions.axis_index(self.axis) * self.num_kv_heads // n
        return lax.dynamic_slice_in_dim(bias, head, 1, axis=0)

    def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        manual = regions.is_manual(self.axis)
        if manual:
            check_heads("ParallelSelfAttention", self.num_heads, self.num_kv_heads, self.axis,
                        regions.axis_size(self.axis))
        q, k, v = self._projections(x)
        q = q + jnp.asarray(self.query_bias[...], q.dtype)
        v = v + jnp.asarray(self._value_bias(), v.dtype)
        if not manual:
            q = constrain(q, _HEADS)
            # GSPMD: key/value heads split with the query heads when the tensor size divides
            # them, whole otherwise (px.TensorParallel's choice for "kv_heads")
            kv_names = _HEADS if self.num_kv_heads == self.num_heads else _KV_HEADS
            k, v = constrain(k, kv_names), constrain(v, kv_names)
        y = attend(q, k, v, causal=self.causal, dropout_rate=self.dropout_rate,
                   dropout_key=dropout_key, axis=self.axis)
        return self.out(y if manual else constrain(y, _HEADS))
