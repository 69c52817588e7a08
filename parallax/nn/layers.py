"""Building blocks of the reference models: annotated params, Dense, LayerNorm, attention, MLP.

Every parameter made here carries one logical name per dimension (``out_sharding`` metadata)
and ``eager_sharding=False``, so the models build on one device with no mesh: flax 0.12
would otherwise try to shard an annotated variable the moment it is created, and raise
outside a mesh. A strategy reads the names later and shards the state itself (``px.init``).
(A little over 300 lines: the GPT's building blocks, one family kept in one place.)

References:
  Shoeybi et al., "Megatron-LM", 2019 (the column/row naming of kernels).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from parallax import context
from parallax.activations import constrain
from parallax.nn.attention_dropout import attention_with_dropout
from parallax.nn.kv_cache import cached_attention
from parallax.rules import resolve_spec

Initializer = nnx.initializers.Initializer
Names = tuple[str | None, ...]
HEADS = ("batch", "length", "heads", "kv")  # "length": whole under Megatron, split under CP
RESIDUAL = ("batch", "sequence", "embed")  # the residual stream between blocks
WHOLE_SEQUENCE = ("batch", None, "embed")  # before a column-parallel matmul
QKV = ("embed", None, "heads", "kv")  # the fused q/k/v kernel [D, 3, H, K]


def annotated_param(
    init: Initializer,
    key: jax.Array | None,
    shape: Sequence[int],
    names: Names,
    dtype: jnp.dtype = jnp.float32,
) -> nnx.Param:
    """Creates an ``nnx.Param`` with one logical name per dimension.

    Args:
      init: a ``jax.nn.initializers`` style function ``(key, shape, dtype) -> array``.
      key: the PRNG key for ``init``; None for a deterministic one (ones, zeros).
      shape: the parameter's shape.
      names: one logical name (or None) per dimension, e.g. ``("embed", "mlp")``.
      dtype: the parameter's storage dtype.

    Returns:
      An ``nnx.Param`` whose metadata holds ``out_sharding=names`` and
      ``eager_sharding=False``.

    Raises:
      ValueError: ``names`` does not have one entry per dimension of ``shape``.

    Example:
      >>> import jax, parallax.nn.layers as L
      >>> from flax import nnx
      >>> p = L.annotated_param(nnx.initializers.zeros, jax.random.key(0), (4, 8), ("embed", "mlp"))
      >>> p.get_metadata()["out_sharding"]
      ('embed', 'mlp')
    """
    shape, names = tuple(shape), tuple(names)
    if len(names) != len(shape):
        raise ValueError(
            f"annotated_param: shape {shape} has {len(shape)} dimensions but names {names} "
            f"has {len(names)}; give one logical name (or None) per dimension."
        )
    return nnx.Param(init(key, shape, dtype), out_sharding=names, eager_sharding=False)


def gather_sequence(x: jax.Array, names: Names) -> jax.Array:
    """Constrains ``x`` to ``names`` (sequence whole) when the strategy splits the sequence.

    Under sequence parallelism Megatron all-gathers the sequence before each column-parallel
    matmul. ``px.constrain`` leaves replicated dimensions free, and on small shapes XLA then
    gathers the kernels (or the embedding table) instead; this pins Megatron's layout. With
    a strategy that does not map ``"sequence"`` (or none) it is the identity.

    Example:
      >>> import jax.numpy as jnp
      >>> from parallax.nn.layers import gather_sequence
      >>> gather_sequence(jnp.ones((2, 4, 8)), ("batch", None, "embed")).shape
      (2, 4, 8)
    """
    ctx = context.current()
    if ctx is None or "sequence" not in ctx.strategy.rule_table:
        return x
    split = ctx.strategy.sequence_split
    if split is not None and ctx.strategy.rule_table["sequence"] == split.axis:
        return x  # context parallelism keeps the sequence split through every matmul
    spec = resolve_spec(names, x.shape, ctx.strategy.activation_rules, ctx.mesh,
                        api="px.models", skip_axes=ctx.manual_axes, path=f"activation {names}")
    return jax.lax.with_sharding_constraint(x, spec)


class Dense(nnx.Module):
    """A linear layer ``y = x . kernel + bias`` over any number of input and output dims.

    The kernel has shape ``in_shape + out_shape`` and contracts the last ``len(in_shape)``
    dimensions of ``x``; e.g. a query projection is ``Dense((D,), (H, K))`` and an attention
    output projection ``Dense((H, K), (D,))``, so heads stay a named dimension of their own.

    Args:
      in_shape: the contracted trailing dimensions of the input.
      out_shape: the dimensions the output gains.
      names: logical names of the kernel, one per dimension of ``in_shape + out_shape``; the
        bias takes the output part.
      rngs: the ``nnx.Rngs`` to draw the kernel from (stream ``params``).
      kernel_init: the kernel initializer (bias is zeros).
      use_bias: add a bias (zeros at init).
      dtype: compute dtype (params are cast to it); None keeps the input's.
      param_dtype: storage dtype of the params.
      dot_general: the product (as ``nnx.Linear``'s; ``px.Float8`` swaps in float8's).

    Example:
      >>> import jax.numpy as jnp; from flax import nnx; from parallax.nn.layers import Dense
      >>> layer = Dense((8,), (2, 4), ("embed", "heads", "kv"), rngs=nnx.Rngs(0))
      >>> layer(jnp.ones((3, 8))).shape
      (3, 2, 4)
    """

    def __init__(
        self,
        in_shape: Sequence[int],
        out_shape: Sequence[int],
        names: Names,
        *,
        rngs: nnx.Rngs,
        kernel_init: Initializer = nnx.initializers.normal(0.02),
        use_bias: bool = True,
        dtype: jnp.dtype | None = None,
        param_dtype: jnp.dtype = jnp.float32,
        dot_general=jax.lax.dot_general,
    ):
        in_shape, out_shape = tuple(in_shape), tuple(out_shape)
        names = tuple(names)
        self.num_in, self.num_out, self.dot_general = len(in_shape), len(out_shape), dot_general
        self.dtype = dtype
        self.kernel = annotated_param(
            kernel_init, rngs.params(), in_shape + out_shape, names, param_dtype
        )
        self.bias = annotated_param(
            nnx.initializers.zeros, None, out_shape, names[self.num_in :], param_dtype
        ) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = self.dtype or x.dtype
        kernel = jnp.asarray(self.kernel[...], dtype)
        x, n = jnp.asarray(x, dtype), self.num_in
        y = self.dot_general(x, kernel, (((*range(x.ndim - n, x.ndim),), (*range(n),)), ((), ())))
        return y if self.bias is None else y + jnp.asarray(self.bias[...], dtype)


class LayerNorm(nnx.Module):
    """Layer normalisation over the last dimension, with statistics in float32.

    Args:
      features: size of the normalised (last) dimension.
      names: the logical name of that dimension (``("embed",)`` in the models).
      epsilon: added to the variance (1e-5, as GPT-2).
      dtype: output dtype; None keeps the input's.
      param_dtype: storage dtype of ``scale`` (ones) and ``bias`` (zeros).

    Example:
      >>> import jax.numpy as jnp
      >>> from parallax.nn.layers import LayerNorm
      >>> LayerNorm(8)(jnp.arange(16.0).reshape(2, 8)).shape
      (2, 8)
    """

    def __init__(
        self,
        features: int,
        names: Names = ("embed",),
        *,
        epsilon: float = 1e-5,
        dtype: jnp.dtype | None = None,
        param_dtype: jnp.dtype = jnp.float32,
    ):
        ones, zeros = nnx.initializers.ones, nnx.initializers.zeros
        self.scale = annotated_param(ones, None, (features,), names, param_dtype)
        self.bias = annotated_param(zeros, None, (features,), names, param_dtype)
        self.epsilon = epsilon
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        dtype = self.dtype or x.dtype
        # Mean and variance in fp32: in bf16 the variance of a wide residual stream is noisy.
        x32 = jnp.asarray(x, jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        y = y * jnp.asarray(self.scale[...], jnp.float32) + jnp.asarray(self.bias[...], jnp.float32)
        return jnp.asarray(y, dtype)


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention over ``[B, T, D]``, heads a dimension of their own.

    q, k and v are ``[B, T, H, K]`` (``jax.nn.dot_product_attention``'s layout), made by one
    matmul against one kernel ``qkv`` ``[D, 3, H, K]`` (Megatron's fused QKV). The stacked
    axis of 3 keeps q, k and v of a head together, so tensor parallelism, which splits
    ``"heads"``, gives each rank whole heads of all three (no slice crosses from q into k).
    The kernel is column parallel, the output kernel ``[H, K, D]`` row parallel. q and v
    have biases ``[H, K]``; k has none.

    Args:
      embed_dim: D, a multiple of ``num_heads``.
      num_heads: H; head_dim K = D / H.
      rngs: the ``nnx.Rngs`` for the kernels.
      kernel_init: init of the qkv kernel.
      out_init: init of the output kernel (GPT-2 scales it down with depth).
      dtype: compute dtype; None keeps the input's.
      param_dtype: storage dtype of the params.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.nn.layers import CausalSelfAttention
      >>> attn = CausalSelfAttention(8, 2, rngs=nnx.Rngs(0))
      >>> attn(jnp.ones((1, 5, 8))).shape, attn.qkv.kernel.shape
      ((1, 5, 8), (8, 3, 2, 4))

    References:
      Shoeybi et al., "Megatron-LM", 2019 (the fused QKV GEMM).
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        rngs: nnx.Rngs,
        kernel_init: Initializer = nnx.initializers.normal(0.02),
        out_init: Initializer = nnx.initializers.normal(0.02),
        dtype: jnp.dtype | None = None,
        param_dtype: jnp.dtype = jnp.float32,
    ):
        d, h, k = embed_dim, num_heads, embed_dim // num_heads
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.qkv = Dense((d,), (3, h, k), QKV, kernel_init=kernel_init, use_bias=False, **kw)
        # No key bias: it adds q . b to every score of a query's row, which softmax cancels.
        # Its gradient is zero in exact arithmetic, so it would train only on rounding noise
        # (amplified by Adam), and parallel runs could not reproduce one device's values.
        zeros = nnx.initializers.zeros
        self.query_bias = annotated_param(zeros, None, (h, k), ("heads", "kv"), param_dtype)
        self.value_bias = annotated_param(zeros, None, (h, k), ("heads", "kv"), param_dtype)
        self.out = Dense((h, k), (d,), ("heads", "kv", "embed"), kernel_init=out_init, **kw)

    def __call__(self, x: jax.Array, *, segment_ids: jax.Array | None = None,
                 probs_dropout: nnx.Dropout | None = None, cache=None):
        """``segment_ids`` ``[B, T]``: packed documents, attended to separately;
        ``probs_dropout``: dropout on the probabilities (:mod:`parallax.nn.attention_dropout`);
        ``cache``: a :class:`parallax.nn.kv_cache.KVCache` (decoding), then ``(y, cache)``."""
        dtype = self.qkv.dtype or x.dtype
        qkv = self.qkv(gather_sequence(x, WHOLE_SEQUENCE))  # [B, T, 3, H, K]: one matmul
        q = constrain(qkv[..., 0, :, :] + jnp.asarray(self.query_bias[...], dtype), HEADS)
        k = constrain(qkv[..., 1, :, :], HEADS)
        v = constrain(qkv[..., 2, :, :] + jnp.asarray(self.value_bias[...], dtype), HEADS)
        if cache is not None:
            y, cache = cached_attention(q, k, v, cache, HEADS)
            return self.out(constrain(y, HEADS)), cache
        y = attention_with_dropout(q, k, v, probs_dropout, segment_ids=segment_ids)  # [B,T,H,K]
        return self.out(constrain(y, HEADS))


class FeedForward(nnx.Module):
    """A transformer block's MLP: fc (column parallel) -> GELU -> proj (row parallel).

    Args:
      embed_dim: D, the input and output width.
      mlp_dim: F, the hidden width (named ``"mlp"``).
      rngs: the ``nnx.Rngs`` for the kernels.
      kernel_init: init of the fc kernel.
      out_init: init of the proj kernel.
      dtype: compute dtype; None keeps the input's.
      param_dtype: storage dtype of the params.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.nn.layers import FeedForward
      >>> FeedForward(8, 32, rngs=nnx.Rngs(0))(jnp.ones((1, 5, 8))).shape
      (1, 5, 8)
    """

    def __init__(
        self,
        embed_dim: int,
        mlp_dim: int,
        *,
        rngs: nnx.Rngs,
        kernel_init: Initializer = nnx.initializers.normal(0.02),
        out_init: Initializer = nnx.initializers.normal(0.02),
        dtype: jnp.dtype | None = None,
        param_dtype: jnp.dtype = jnp.float32,
    ):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.fc = Dense((embed_dim,), (mlp_dim,), ("embed", "mlp"), kernel_init=kernel_init, **kw)
        self.proj = Dense((mlp_dim,), (embed_dim,), ("mlp", "embed"), kernel_init=out_init, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = gather_sequence(x, WHOLE_SEQUENCE)
        return self.proj(constrain(jax.nn.gelu(self.fc(x)), ("batch", "length", "mlp")))
