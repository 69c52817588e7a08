"""Rotary position embeddings (RoPE), with Llama 3's long-context frequency scaling.

Each pair of dimensions ``(i, i + K/2)`` of a query or key head is rotated by the angle
``position * inv_freq[i]``, so the score of a query and a key depends on their positions
only through their difference. The pairing is the "rotate half" layout of the Hugging Face
Llama (and of Meta's checkpoints as Hugging Face converts them), so weights load unchanged.

Llama 3.1 stretches the slow frequencies for longer context: wavelengths longer than
``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those
shorter than ``original_max_position_embeddings / high_freq_factor`` kept, and the band
between interpolated smoothly (Hugging Face's ``_compute_llama3_parameters``).

References:
  Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", 2021;
  Dubey et al., "The Llama 3 Herd of Models", 2024 (the frequency scaling); Hugging Face
  transformers, ``modeling_rope_utils._compute_llama3_parameters`` and
  ``models/llama/modeling_llama.apply_rotary_pos_emb``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3's RoPE frequency scaling (the ``rope_scaling`` of a Hugging Face config).

    Args:
      factor: how much the low frequencies are slowed (8 for Llama 3.1, 32 for Llama 3.2).
      low_freq_factor: wavelengths above ``original / low_freq_factor`` are scaled fully.
      high_freq_factor: wavelengths below ``original / high_freq_factor`` are kept.
      original_max_position_embeddings: the context length of pre-training (8192).

    Example:
      >>> RopeScaling(factor=8.0).original_max_position_embeddings
      8192
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if not (self.factor > 0 and 0 < self.low_freq_factor < self.high_freq_factor
                and self.original_max_position_embeddings > 0):
            raise ValueError(
                f"RopeScaling: need factor > 0, 0 < low_freq_factor < high_freq_factor and "
                f"original_max_position_embeddings > 0, got {self}; Llama 3.1 uses "
                "RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, "
                "original_max_position_embeddings=8192).")


def rope_frequencies(head_dim: int, theta: float = 10000.0,
                     scaling: RopeScaling | None = None) -> np.ndarray:
    """The inverse frequencies ``[K / 2]`` of RoPE, Llama 3 scaled when ``scaling`` is given.

    Computed on the host in float64 and returned as float32 (a constant of the program).

    Args:
      head_dim: K, even.
      theta: the base (10000 for Llama 2, 500000 for Llama 3).
      scaling: Llama 3's :class:`RopeScaling`, or None.

    Returns:
      ``theta ** (-2i / K)`` for ``i < K / 2``, scaled as the module docstring says.

    Example:
      >>> rope_frequencies(4, theta=100.0).tolist()
      [1.0, 0.10000000149011612]
    """
    if head_dim % 2:
        raise ValueError(f"rope_frequencies: head_dim={head_dim} must be even (RoPE rotates "
                         "pairs of dimensions); use an even head size.")
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is not None:
        s = scaling
        wavelen = 2 * math.pi / inv_freq
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                  / (s.high_freq_factor - s.low_freq_factor))
        medium = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
        inv_freq = np.where(wavelen > low_wavelen, inv_freq / s.factor,
                            np.where(wavelen < high_wavelen, inv_freq, medium))
    return inv_freq.astype(np.float32)


def apply_rotary(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates the heads of ``x`` ``[B, T, H, K]`` by their tokens' positions ``[T]`` (or
    ``[B, T]``: each row its own, as packed documents have).

    The angles are computed in float32 whatever ``x``'s dtype (bf16 positions past 256
    would lose whole units); the result has ``x``'s dtype.

    Args:
      x: queries or keys ``[B, T, H, K]``.
      positions: each token's position in its sequence, int ``[T]`` or ``[B, T]``.
      inv_freq: ``[K / 2]`` from :func:`rope_frequencies`.

    Returns:
      ``x * cos + rotate_half(x) * sin``, ``[B, T, H, K]``.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.ones((1, 3, 2, 4))
      >>> bool(jnp.allclose(apply_rotary(x, jnp.zeros(3, int), rope_frequencies(4)), x))
      True
    """
    angles = jnp.asarray(positions, jnp.float32)[..., None] * jnp.asarray(inv_freq)
    angles = jnp.concatenate([angles, angles], axis=-1)  # [T, K] or [B, T, K]
    angles = angles[None, :, None, :] if angles.ndim == 2 else angles[:, :, None, :]
    x32 = jnp.asarray(x, jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return jnp.asarray(x32 * jnp.cos(angles) + rotated * jnp.sin(angles), x.dtype)
