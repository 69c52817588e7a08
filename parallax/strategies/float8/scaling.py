"""float8 scaling: amaxes, scales, saturated casts, and delayed scaling's amax history.

A tensor goes to float8 as ``q = saturate(x * scale).astype(fp8)`` and comes back as
``q / scale``; the scale maps the tensor's largest magnitude (its *amax*) onto the format's
largest finite value (448 for ``float8_e4m3fn``, 57344 for ``float8_e5m2``).

- **Current scaling** (torchao's ``Float8Linear`` default, TE's ``Float8CurrentScaling``):
  the amax is the tensor's own, taken right before the cast; ``scale = fp8_max /
  max(amax, 1e-12)`` in float32 (torchao ``float8_utils.amax_to_scale``: the same clamp, so
  an all-zero tensor gets a finite scale).
- **Tensorwise / rowwise**: one amax for the whole tensor, or one per slice along the
  matmul's contracted dimensions (torchao ``ScalingGranularity.AXISWISE``, its ``ROWWISE``
  recipe: each operand is scaled along the dimension its matmul reduces, so the scales
  factor out of the sum).
- **Delayed scaling** (Transformer Engine ``DelayedScaling``): each tensor keeps a history
  of its last ``amax_history_len`` amaxes, slot 0 the running step's; after a step the
  next scale comes from the history (``amax_compute_algo="max"``: its largest,
  ``"most_recent"``: slot 0), ``scale = fp8_max * 2**-margin / amax``, the old scale kept
  where that amax is zero or not finite; the history then rolls one slot toward 0 and
  slot 0 is zeroed (TE ``common/recipe/delayed_scaling.cu``, ``amax_and_scale_update``).
  So a step quantizes with a scale from the steps before it.

References:
  Micikevicius et al., "FP8 Formats for Deep Learning", 2022 (e4m3 forward, e5m2 gradients);
  NVIDIA Transformer Engine, ``transformer_engine/common/recipe/__init__.py``
  (``DelayedScaling``, ``Format.HYBRID``) and ``common/recipe/delayed_scaling.cu`` (the history's roll, the scale update);
  torchao ``torchao/float8/float8_utils.py`` (``amax_to_scale``, ``to_fp8_saturated``) and
  ``config.py`` (``Float8LinearRecipeName.TENSORWISE`` / ``ROWWISE``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

FORWARD = jnp.float8_e4m3fn  # activations and weights (TE Format.HYBRID's forward)
BACKWARD = jnp.float8_e5m2  # output gradients (its backward)
AMAX_FLOOR = 1e-12  # torchao's EPS in amax_to_scale


def fp8_max(dtype) -> float:
    """The largest finite value of a float8 format (448.0 for e4m3fn, 57344.0 for e5m2)."""
    return float(jnp.finfo(dtype).max)


def amax(x: jax.Array, dims: tuple[int, ...], axes: tuple[str, ...] = ()) -> jax.Array:
    """``max |x|`` over ``dims`` (kept, size 1), in float32, and over the mesh ``axes``
    that split those dimensions (manual batch axes: the amax of the whole batch, as one
    device would take it)."""
    found = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=dims, keepdims=True)
    return lax.pmax(found, axes) if axes else found


def scale_from_amax(found: jax.Array, dtype, power_of_2: bool = False) -> jax.Array:
    """Current scaling's scale: ``fp8_max / max(amax, 1e-12)`` in float32 (torchao), rounded
    down to a power of two with ``power_of_2`` (torchao's ``round_scales_to_power_of_2``:
    multiplying and dividing by it is then exact).

    Example:
      >>> float(scale_from_amax(jnp.float32(2.0), jnp.float8_e4m3fn))
      224.0
      >>> float(scale_from_amax(jnp.float32(2.0), jnp.float8_e4m3fn, power_of_2=True))
      128.0
    """
    scale = fp8_max(dtype) / jnp.maximum(found, AMAX_FLOOR)
    if not power_of_2:
        return scale
    # The exponent read exactly (frexp: scale = m * 2**e, 0.5 <= m < 1), not through a
    # rounded log2: a scale 8x another must round to exactly 8x its power of two.
    _, exponent = jnp.frexp(scale)
    return jnp.ldexp(jnp.ones_like(scale), exponent - 1)


def quantize(x: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """``x * scale`` clipped to the format's range and cast (saturated, as torchao's
    ``to_fp8_saturated``: an outlier becomes the largest value, never inf or NaN)."""
    top = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) * scale, -top, top).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """``q / scale`` in ``dtype``."""
    return (q.astype(jnp.float32) / scale).astype(dtype)


def record_amax(history: jax.Array, found: jax.Array) -> jax.Array:
    """The history with this step's amax in slot 0 (TE writes each step's amax there)."""
    return history.at[0].set(jnp.maximum(history[0], found))


def amax_and_scale_update(history: jax.Array, scale: jax.Array, dtype, *,
                          algo: str = "max", margin: float = 0.0):
    """Delayed scaling after a step: the next scale, and the history rolled for the next.

    As TE's ``amax_and_scale_update``: the amax is the history's largest (``"max"``) or
    slot 0 (``"most_recent"``, this step's); the scale is ``fp8_max * 2**-margin / amax``,
    or the old one where that amax is zero or not finite; the history rolls one slot toward
    0 (``roll(history, -1)``: this step's amax goes to the last slot) and slot 0 is zeroed
    for the next step's amax.

    Args:
      history: ``[amax_history_len, ...]`` float32 amaxes, slot 0 this step's.
      scale: the scale in use.
      dtype: the float8 format the scale is for.
      algo: ``"max"`` or ``"most_recent"``.
      margin: the scale is divided by ``2**margin`` (headroom for growth).

    Returns:
      ``(history, scale)`` for the next step.

    Example:
      >>> h, s = amax_and_scale_update(jnp.array([4.0, 2.0, 8.0]), jnp.float32(1.0),
      ...                              jnp.float8_e4m3fn)
      >>> h.tolist(), float(s)
      ([0.0, 8.0, 4.0], 56.0)
    """
    found = history[0] if algo == "most_recent" else jnp.max(history, axis=0)
    fresh = fp8_max(dtype) * 2.0 ** -margin / found
    usable = (found > 0.0) & jnp.isfinite(found)
    rolled = jnp.roll(history, -1, axis=0).at[0].set(0.0)
    return rolled, jnp.where(usable, fresh, scale).astype(jnp.float32)
