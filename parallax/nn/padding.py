"""Vocabulary padding: a size rounded up so that it splits over tensor-parallel ranks, the
initialiser that leaves padded rows at zero, and logits of padded ids masked out.

Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by`` times the
tensor-parallel size; padded ids are never looked up, and masking their logits to the
lowest float keeps the loss the unpadded one.

References:
  Shoeybi et al., "Megatron-LM", 2019 (vocabulary padding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

Initializer = nnx.initializers.Initializer


def padded_init(init: Initializer, rows: int, axis: int = 0) -> Initializer:
    """``init`` for the first ``rows`` entries along ``axis`` (same key and shape as without
    padding), zeros after: a padded vocabulary starts from the unpadded values.

    Example:
      >>> import jax, parallax.nn.padding as L
      >>> from flax import nnx
      >>> L.padded_init(nnx.initializers.ones, 3)(jax.random.key(0), (4, 2))[:, 0].tolist()
      [1.0, 1.0, 1.0, 0.0]
    """

    def draw(key, shape, dtype=jnp.float32):
        real, pad = list(shape), [(0, 0)] * len(shape)
        real[axis], pad[axis] = rows, (0, shape[axis] - rows)
        return jnp.pad(init(key, tuple(real), dtype), pad)

    return draw


MASKED = float(jnp.finfo(jnp.float32).min)  # logits of padded ids: exp(MASKED - max) is 0


def padded_size(size: int, multiple: int) -> int:
    """``size`` rounded up to a multiple of ``multiple`` (a vocabulary padded for TP).

    Example:
      >>> from parallax.nn.padding import padded_size
      >>> padded_size(50257, 128)
      50304
    """
    if multiple < 1:
        raise ValueError(f"padded_size: multiple={multiple} must be >= 1 (1 = no padding).")
    return -(-size // multiple) * multiple


def mask_padded_logits(logits: jax.Array, vocab_size: int, first_id=0) -> jax.Array:
    """``logits`` over ids ``first_id ...`` with those of ids ``>= vocab_size`` (padding) set
    to the lowest float, so a softmax gives them exactly zero probability.

    Example:
      >>> import jax.numpy as jnp
      >>> from parallax.nn.padding import MASKED, mask_padded_logits
      >>> mask_padded_logits(jnp.zeros((1, 4)), 3)[0, 3] == MASKED
      Array(True, dtype=bool)
    """
    ids = first_id + jnp.arange(logits.shape[-1])
    return jnp.where(ids < vocab_size, logits, MASKED)
