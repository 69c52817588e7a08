"""A key/value cache for decoding: the keys and values of the tokens seen so far.

Autoregressive decoding feeds one new token at a time; without a cache every step would
recompute the keys and values of the whole prefix. The attention layers
(``CausalSelfAttention``, ``GroupedQueryAttention``) take ``cache=`` as a keyword: given a
:class:`KVCache`, they write the new tokens' keys and values at ``cache.length``, attend over
everything written so far, and return ``(y, updated cache)``. Without it (training) their
program is what it always was.

The cache is preallocated at its final length ``S`` (prompt plus new tokens) so each step has
static shapes (one compiled program for the whole loop); positions past ``length`` are masked.

References:
  Pope et al., "Efficiently Scaling Transformer Inference", 2022 (the KV cache and its
  layout); Hugging Face transformers ``StaticCache`` (a preallocated cache).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from parallax.activations import constrain


class KVCache(NamedTuple):
    """Keys and values written so far.

    Fields (one layer; the stacked models keep a leading ``[L]`` axis on each):
      key: ``[B, S, G, K]`` the keys of positions ``0 .. S - 1`` (G key/value heads).
      value: ``[B, S, G, K]`` their values.
      length: int32 scalar, how many positions hold real keys (the next one to write).
    """

    key: jax.Array
    value: jax.Array
    length: jax.Array


def empty_cache(batch: int, max_length: int, kv_heads: int, head_dim: int, dtype,
                layers: int | None = None) -> KVCache:
    """A zeroed cache of ``max_length`` positions (``layers``: stacked, a leading ``[L]``).

    Example:
      >>> empty_cache(2, 16, 4, 8, jnp.float32, layers=3).key.shape
      (3, 2, 16, 4, 8)
    """
    lead = () if layers is None else (layers,)
    zeros = jnp.zeros(lead + (batch, max_length, kv_heads, head_dim), dtype)
    return KVCache(zeros, zeros, jnp.zeros(lead, jnp.int32))


def cached_attention(query: jax.Array, key: jax.Array, value: jax.Array, cache: KVCache,
                     names: tuple) -> tuple[jax.Array, KVCache]:
    """Causal attention of new tokens over a cache, which they are first written into.

    Args:
      query: ``[B, T, H, K]`` of the T new tokens (at positions ``length .. length + T - 1``).
      key, value: ``[B, T, G, K]`` of the same tokens, H a multiple of G.
      cache: the :class:`KVCache` of one layer, ``S >= length + T`` positions.
      names: the logical names of the keys ``(batch, length, heads, kv)``; the cache keeps
        their heads' split (its own length stays whole).

    Returns:
      ``(y [B, T, H, K], cache with the new keys and values, length + T)``.

    Example:
      >>> q = k = v = jnp.ones((1, 2, 2, 4))
      >>> y, cache = cached_attention(q, k, v, empty_cache(1, 5, 2, 4, jnp.float32),
      ...                             ("batch", "length", "heads", "kv"))
      >>> y.shape, int(cache.length)
      ((1, 2, 2, 4), 2)
    """
    start, steps = cache.length, query.shape[1]
    kept = (names[0], None) + tuple(names[2:])
    keys = constrain(jax.lax.dynamic_update_slice_in_dim(
        cache.key, key.astype(cache.key.dtype), start, axis=1), kept)
    values = constrain(jax.lax.dynamic_update_slice_in_dim(
        cache.value, value.astype(cache.value.dtype), start, axis=1), kept)
    # Query i (position start + i) sees keys 0 .. start + i; unwritten positions stay hidden.
    visible = (jnp.arange(keys.shape[1])[None, :]
               <= (start + jnp.arange(steps))[:, None])  # [T, S]
    y = jax.nn.dot_product_attention(query, keys.astype(query.dtype),
                                     values.astype(query.dtype), mask=visible[None, None],
                                     implementation="xla")
    return y, KVCache(keys, values, start + steps)
