"""Choosing the next token from logits: greedy, or sampled after temperature, top-k, top-p.

The warpers follow Hugging Face transformers' (``transformers/generation/logits_process.py``,
applied in the order ``generation/utils.py``'s ``_get_logits_processor`` builds them):

- ``TemperatureLogitsWarper``: ``logits / temperature`` (skipped at 1.0).
- ``TopKLogitsWarper``: every logit strictly below the k-th largest becomes ``-inf`` (ties
  with the k-th are kept); k is clipped to the vocabulary. ``top_k`` 0 or None is off
  (``_get_logits_processor`` adds the warper only when ``top_k != 0``).
- ``TopPLogitsWarper``: sort ascending, take the softmax's cumulative sum, drop the tokens
  whose cumulative probability is ``<= 1 - top_p`` but always keep the most likely one
  (``min_tokens_to_keep=1``). ``top_p`` 1.0 or None is off.

``temperature == 0`` is greedy (transformers' ``do_sample=False``): the argmax, where the
warpers do not apply. Sampling draws from the warped softmax with ``jax.random.categorical``
(transformers draws with ``torch.multinomial``: the same distribution, other random numbers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def warp_logits(logits: jax.Array, temperature: float, top_k: int | None,
                top_p: float | None) -> jax.Array:
    """Temperature, then top-k, then top-p, on float logits ``[B, V]`` (transformers' order).

    Example:
      >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
      >>> jnp.isinf(warp_logits(logits, 1.0, None, 0.7)).tolist()    # 0.5 + 0.3 covers 0.7
      [[False, False, True, True]]
    """
    logits = jnp.asarray(logits, jnp.float32)
    if temperature != 1.0:
        logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None and top_p < 1.0:
        order = jnp.argsort(logits, axis=-1)  # ascending
        ascending = jnp.take_along_axis(logits, order, axis=-1)
        cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
        drop_sorted = (cumulative <= 1.0 - top_p).at[..., -1].set(False)
        rows = jnp.arange(logits.shape[0])[:, None]
        drop = jnp.zeros_like(drop_sorted).at[rows, order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return logits


def next_token(logits: jax.Array, key: jax.Array, temperature: float, top_k: int | None,
               top_p: float | None) -> jax.Array:
    """The next token of each row, int32 ``[B]``: the argmax at ``temperature == 0``, else a
    draw from the warped distribution.

    Example:
      >>> int(next_token(jnp.array([[0.1, 2.0, 0.3]]), jax.random.key(0), 0.0, None, None)[0])
      1
    """
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    warped = warp_logits(logits, temperature, top_k, top_p)
    return jax.random.categorical(key, warped, axis=-1).astype(jnp.int32)
