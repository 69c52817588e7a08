"""Scaled dot-product attention as the models call it: one entry point a strategy may replace.

The reference models (and any user model that wants it) call :func:`dot_product_attention`
instead of ``jax.nn.dot_product_attention``. Outside a parallax step, and under strategies
that leave the sequence whole, it is exactly ``jax.nn.dot_product_attention``. A strategy
that splits the sequence's attention over devices (context parallelism) supplies its own
implementation through the step context, so the model's code never names a mesh axis.
"""

from __future__ import annotations

import jax


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> jax.Array:
    """Softmax attention over ``[batch, seq, heads, head_dim]`` arrays.

    Args:
      query: ``[B, T, H, K]``.
      key, value: ``[B, S, G, K]`` with ``H`` a multiple of ``G`` (grouped-query attention).
      causal: mask each query from the keys after it.
      scale: the logits' scale; None is ``1 / sqrt(K)``.

    Returns:
      ``[B, T, H, K]``, as ``jax.nn.dot_product_attention`` returns it.

    Example:
      >>> import jax.numpy as jnp
      >>> from parallax.attention import dot_product_attention
      >>> dot_product_attention(jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 1, 8)),
      ...                       jnp.ones((1, 4, 1, 8))).shape
      (1, 4, 2, 8)

    References:
      Vaswani et al. 2017, "Attention Is All You Need"; Ainslie et al. 2023 (GQA).
    """
    return jax.nn.dot_product_attention(query, key, value, scale=scale, is_causal=causal)
