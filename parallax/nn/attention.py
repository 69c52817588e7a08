"""Megatron's parallel self-attention: heads split over ranks, grouped-query attention included.

Each rank computes the attention of ``H / T`` query heads from the whole input: the query,
key and value projections are column parallel and share one ``f`` (or, under sequence
parallelism, one all-gather of the sequence), so their three input gradients are summed
before the single all-reduce; the output projection is row parallel and ends in ``g``. Per
call: one all-reduce forward, one backward.

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
from parallax.nn.linear import ColumnParallelLinear, RowParallelLinear
from parallax.activations import constrain

Initializer = nnx.initializers.Initializer
_HEADS = ("batch", None, "heads", "kv")  # GSPMD: the sequence stays whole for attention


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

    Parameter names and shapes follow ``px.models``' ``CausalSelfAttention`` (``query``,
    ``key``, ``value`` kernels ``[D, H, K]``, no key bias, ``out`` ``[H, K, D]``), so with
    ``num_kv_heads=None`` the state of one loads into the other. Key/value kernels of a
    grouped-query layer are ``[D, G, K]``, their head dimension named ``"kv_heads"``.

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
      >>> nnx.jit(attn)(jnp.ones((1, 5, 16))).shape
      (1, 5, 16)

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
        kv_name = "heads" if g == h else "kv_heads"
        kw = dict(rngs=rngs, axis=axis, sequence_parallel=sequence_parallel, dtype=dtype,
                  param_dtype=param_dtype)
        self.query = ColumnParallelLinear(d, (h, k), names=("embed", "heads", "kv"),
                                          kernel_init=kernel_init, **kw)
        # No key bias: softmax cancels it (see docs/models.md), so it would train on noise.
        self.key = ColumnParallelLinear(d, (g, k), names=("embed", kv_name, "kv"),
                                        kernel_init=kernel_init, use_bias=False, **kw)
        self.value = ColumnParallelLinear(d, (g, k), names=("embed", kv_name, "kv"),
                                          kernel_init=kernel_init, **kw)
        self.out = RowParallelLinear((h, k), d, names=("heads", "kv", "embed"),
                                     kernel_init=out_init, **kw)

    def _key_value(self, proj: ColumnParallelLinear, x: jax.Array) -> jax.Array:
        """k or v for this rank's query heads: ``[B, T, G_local, K]``."""
        n = regions.axis_size(self.axis)
        if n == 1 or self.num_kv_heads % n == 0:
            return proj.project(x)
        # Fewer key/value heads than ranks: all are replicated; use this rank's group.
        head = regions.axis_index(self.axis) * self.num_kv_heads // n
        kernel = lax.dynamic_slice_in_dim(proj.kernel[...], head, 1, axis=1)
        dtype = proj.dtype or x.dtype
        y = jnp.tensordot(jnp.asarray(x, dtype), jnp.asarray(kernel, dtype), axes=1)
        if proj.bias is not None:
            y = y + jnp.asarray(lax.dynamic_slice_in_dim(proj.bias[...], head, 1, axis=0), dtype)
        return y

    def __call__(self, x: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        manual = regions.is_manual(self.axis)
        if manual:
            check_heads("ParallelSelfAttention", self.num_heads, self.num_kv_heads, self.axis,
                        regions.axis_size(self.axis))
        x = self.query.enter(x)  # one f (or sequence all-gather) for q, k and v
        q = self.query.project(x)
        k, v = self._key_value(self.key, x), self._key_value(self.value, x)
        if not manual:
            q = constrain(q, _HEADS)
            kv_names = _HEADS if self.num_kv_heads == self.num_heads else None
            if kv_names:
                k, v = constrain(k, kv_names), constrain(v, kv_names)
        y = attend(q, k, v, causal=self.causal, dropout_rate=self.dropout_rate,
                   dropout_key=dropout_key, axis=self.axis)
        return self.out(y if manual else constrain(y, _HEADS))
