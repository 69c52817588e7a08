"""A device's peak FLOP/s: the vendor's dense peak for GPU and TPU generations, stated for CPU.

MFU divides the FLOPs a step does by what the devices could do at peak in the same time
(Chowdhery et al. 2022, PaLM, appendix B). The peaks are :mod:`parallax.planner.roofline`'s
chip presets (each with its datasheet named in ``Chip.source``); a device whose kind is not
in the table is matched by platform, and ``peak_flops=`` overrides either.
"""

from __future__ import annotations

import jax

from parallax.planner import roofline


def peak_flops_per_device(device: jax.Device | None = None, dtype: str = "float32",
                          peak_flops: float | None = None) -> tuple[float, str]:
    """The peak matmul FLOP/s of one device, and where the figure comes from.

    Args:
      device: the device (the first of ``jax.devices()`` by default).
      dtype: the matmuls' dtype name (``"bfloat16"``, ``"float32"``).
      peak_flops: a figure to use instead of the table (FLOP/s per device).

    Returns:
      ``(flops_per_second, source)``: source is ``"given"`` or the chip preset's name.

    Example:
      >>> peak, source = peak_flops_per_device(dtype="float32")
      >>> source, peak   # 8 simulated CPU devices: the stated figure of the CPU preset
      ('cpu-sim', 10000000000.0)
    """
    if peak_flops is not None:
        if not peak_flops > 0:
            raise ValueError(f"px.metrics: peak_flops must be > 0 FLOP/s per device, got "
                             f"{peak_flops!r}.")
        return float(peak_flops), "given"
    chip = roofline.chip_for(device if device is not None else jax.devices()[0])
    precision = jax.config.jax_default_matmul_precision
    return chip.flops_per_second(dtype, precision), chip.name
