"""The GPT's and the Llama's loss head: chunked cross-entropy as their config asks.

Both models end the same way: final norm, output matrix (tied embedding or separate head),
cross-entropy per position with the logits ``config.loss_chunks`` chunks of the sequence at a
time, and padded vocabulary ids masked (:func:`parallax.nn.chunked_cross_entropy`).
"""

from __future__ import annotations

import jax

from parallax.nn.chunked_loss import chunked_cross_entropy


def config_token_losses(hidden: jax.Array, output_matrix: tuple[jax.Array, bool],
                        labels: jax.Array, config) -> jax.Array:
    """float32 cross-entropy ``[B, T]`` of final hidden states ``[B, T, D]`` against
    ``labels``, for a model whose ``output_matrix()`` is ``(matrix, transposed)`` and whose
    config has ``loss_chunks``, ``vocab_size`` and ``padded_vocab_size``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from parallax.models import GPTConfig
      >>> config = GPTConfig.tiny(vocab_size=250, vocab_pad_multiple=128)  # padded to 256
      >>> x, w = jnp.ones((1, 4, 64)), jnp.zeros((256, 64))
      >>> losses = config_token_losses(x, (w, False), jnp.zeros((1, 4), jnp.int32), config)
      >>> bool(jnp.allclose(losses, jnp.log(250.0)))   # the 6 padded ids take no share
      True
    """
    matrix, transposed = output_matrix
    padded = config.padded_vocab_size > config.vocab_size
    return chunked_cross_entropy(hidden, matrix, labels, transposed=transposed,
                                 chunks=config.loss_chunks,
                                 vocab_size=config.vocab_size if padded else None)
