"""Memory of one device during training: the allocator's figures where it has them, else ours.

GPU and TPU runtimes report ``bytes_in_use`` and ``peak_bytes_in_use`` through
``jax.Device.memory_stats()``. The CPU runtime reports nothing, so parallax counts what it can
see: the bytes of live arrays on the device (in use between steps) and, for the peak, the
compiled step's own figure (arguments + outputs - aliased + temporaries, from
``memory_analysis``), which is what the step needs at most while it runs.
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """Bytes on one device.

    Attributes:
      in_use: bytes allocated now (between steps: the state, the batch, outputs kept).
      peak: the most allocated at once so far (allocator), or the compiled step's need.
      source: ``"allocator"`` (``memory_stats()``) or ``"live arrays + compiled"``.
    """

    in_use: int
    peak: int | None
    source: str


def live_bytes(device: jax.Device) -> int:
    """Bytes of the live arrays' shards that sit on ``device``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.ones((1024,), jnp.float32)
      >>> live_bytes(jax.devices()[0]) >= 4096
      True
    """
    total = 0
    for array in jax.live_arrays():
        for shard in array.addressable_shards:
            if shard.device == device:
                total += shard.data.nbytes
    return total


def device_memory(device: jax.Device | None = None,
                  compiled_peak: int | None = None) -> DeviceMemory:
    """What ``device`` holds now and at most.

    Args:
      device: the device (the first addressable one by default).
      compiled_peak: the compiled step's bytes per device, used as the peak where the
        runtime reports none.

    Example:
      >>> device_memory(compiled_peak=1 << 20).source   # CPU: no allocator statistics
      'live arrays + compiled'
    """
    device = device if device is not None else jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_in_use" in stats:
        return DeviceMemory(int(stats["bytes_in_use"]), int(stats.get("peak_bytes_in_use", 0))
                            or None, "allocator")
    in_use = live_bytes(device)
    peak = None if compiled_peak is None else max(int(compiled_peak), in_use)
    return DeviceMemory(in_use, peak, "live arrays + compiled")
