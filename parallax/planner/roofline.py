"""A roofline for one training step: compute over peak, memory over bandwidth, collectives
over the links of ``parallax.comm.cost``.

A device that must do ``F`` floating-point operations and move ``M`` bytes through its
memory needs at least ``max(F / peak, M / hbm_bandwidth)`` seconds (Williams et al.); a
collective of ``S`` bytes over ``n`` devices needs what the alpha-beta model of
:mod:`parallax.comm.cost` says (ring all-reduce ``2(n-1) a + 2(n-1)/n S/B``, ...). A
pipeline stretches the compute by ``1 / (1 - bubble)``. The step's estimate adds compute and
communication (no overlap: an upper bound of the roofline; ``overlapped`` is the lower one).

The chips' numbers are the vendors' dense peaks (named in each ``source``). A roofline is a
bound: real kernels reach a fraction of peak (the MFU), so a measured step is slower than
the estimate, typically 1.5-3x on GPUs; ``"cpu-sim"`` was measured on the development
machine and is only meaningful there.

References:
  Williams, Waterman & Patterson, "Roofline: An Insightful Visual Performance Model for
  Multicore Architectures", CACM 2009. Chowdhery et al., "PaLM", 2022, appendix B (MFU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from parallax.comm import cost

# float8: the datasheet's dense FP8 Tensor Core peak (1,979 TFLOP/s; 3,958 is with sparsity).
_H100 = {"float8": 1978.9e12, "bfloat16": 989.4e12, "float16": 989.4e12, "tf32": 494.7e12,
         "float32": 66.9e12}
# Maximum achievable matmul FLOPS (bf16, the best of a sweep of large shapes, torch + cuBLAS):
# S. Bekman, "Machine Learning Engineering", compute/accelerator, "Maximum Achievable Matmul
# FLOPS comparison table" (mamf-finder.py): A100 SXM 271.2 of 312 TFLOP/s, H100 SXM 794.5 of
# 989. Measured on single GPUs, independently of any training run parallax is compared with.
_MAMF = "S. Bekman, Machine Learning Engineering, 'Maximum Achievable Matmul FLOPS' table (bf16)"


@dataclasses.dataclass(frozen=True)
class Chip:
    """Peak compute and memory of one device.

    Attributes:
      name: a short name.
      peak_flops: dense matmul flop/s by dtype name (``"bfloat16"``, ``"float32"``, ...;
        ``"tf32"``: float32 matmuls at JAX's default precision on NVIDIA GPUs).
      hbm_bandwidth: bytes per second between the device and its memory.
      memory_bytes: the device's memory.
      source: where the numbers come from.
      link: the ``parallax.comm.cost`` link preset its devices talk over (a chip implies
        its interconnect: NVLink for the NVIDIA parts, ICI for the TPU); ``px.plan`` and
        ``px.explain`` use it unless given a ``link``.
      matmul_efficiency: the fraction of ``peak_flops`` a large bf16 matmul reaches on it,
        measured once outside parallax (its source in ``efficiency_source``); 1.0 where no
        measurement is known. Only a cluster's step-time estimate
        (:mod:`parallax.planner.predicted.step_time`) uses it; the roofline here is a bound
        and keeps the peak.
      efficiency_source: where ``matmul_efficiency`` comes from.
    """

    name: str
    peak_flops: dict
    hbm_bandwidth: float
    memory_bytes: float
    source: str = ""
    link: str = ""
    matmul_efficiency: float = 1.0
    efficiency_source: str = "none measured: the peak"

    def flops_per_second(self, dtype: str = "float32", precision: str | None = None) -> float:
        """The peak for matmuls in ``dtype`` (float32 at default precision uses ``tf32``;
        ``"float8"`` on a chip without float8 matmul units, A100 or TPU v5e, is bfloat16's)."""
        tf32 = precision not in ("highest", "float32") and "tf32" in self.peak_flops
        if dtype == "float32" and tf32:
            return self.peak_flops["tf32"]
        if dtype == "float8" and dtype not in self.peak_flops:
            dtype = "bfloat16"
        return self.peak_flops.get(dtype, self.peak_flops["float32"])


CHIPS: dict[str, Chip] = {
    "h100": Chip("h100", _H100, 3.35e12, 80e9,
                 "NVIDIA H100 SXM datasheet: dense FP8 1,979 TFLOP/s, BF16 989, TF32 495, "
                 "FP32 67; "
                 "HBM3 3.35 TB/s, 80 GB.", "nvlink-h100", 794.5 / 989.4,
                 f"{_MAMF}: H100 SXM 794.5 TFLOP/s"),
    "h200": Chip("h200", _H100, 4.8e12, 141e9,
                 "NVIDIA H200 datasheet: the H100 SXM's compute (dense FP8 1,979 TFLOP/s, "
                 "BF16 989); "
                 "HBM3e 4.8 TB/s, 141 GB.", "nvlink-h100", 794.5 / 989.4,
                 f"the H100's ({_MAMF}), same compute die; the H200 itself not measured"),
    "a100": Chip("a100", {"bfloat16": 312e12, "float16": 312e12, "tf32": 156e12,
                          "float32": 19.5e12}, 2.039e12, 80e9,
                 "NVIDIA A100 80GB SXM datasheet: dense BF16 312 TFLOP/s, TF32 156, FP32 "
                 "19.5; HBM2e 2.0 TB/s.", "nvlink-a100", 271.2 / 312,
                 f"{_MAMF}: A100 SXM 271.2 TFLOP/s"),
    "tpu-v5e": Chip("tpu-v5e", {"bfloat16": 197e12, "float32": 197e12 / 3}, 819e9, 16e9,
                    "Google Cloud TPU v5e page: 197 TFLOP/s BF16, HBM 819 GB/s, 16 GB; float32 "
                    "assumed at a third (multi-pass bf16).", "tpu-v5e-ici"),
    "cpu-sim": Chip("cpu-sim", {"float32": 10e9, "bfloat16": 5e9}, 3e9, 2e9,
                    "measured on the development machine: a float32 matmul on 8 simulated CPU "
                    "devices sharing 2 cores ran at ~10 GFLOP/s per device, an elementwise "
                    "op at ~3 GB/s; only meaningful there.", "cpu-sim-xla"),
}


def mfu(flops_per_step: float, seconds: float, device: Chip | str,
        dtype: str = "bfloat16") -> float:
    """Model flops utilisation: ``flops_per_step / seconds / peak``.

    Example:
      >>> round(mfu(989.4e12 * 0.5, 1.0, "h100"), 2)
      0.5
    """
    peak = chip(device).flops_per_second(dtype)
    return flops_per_step / seconds / peak if seconds > 0 else 0.0


def chip(name: str | Chip) -> Chip:
    """A :class:`Chip` by name (a ``Chip`` is returned as is).

    Example:
      >>> chip("h200").hbm_bandwidth
      4800000000000.0
    """
    if isinstance(name, Chip):
        return name
    try:
        return CHIPS[name]
    except KeyError:
        raise ValueError(
            f"roofline.chip: unknown chip {name!r}; the presets are {', '.join(CHIPS)} (or "
            "pass a roofline.Chip(name, peak_flops, hbm_bandwidth, memory_bytes))."
        ) from None


def chip_for(device) -> Chip:
    """The preset that matches a ``jax.Device`` (its ``device_kind``), else by platform.

    Example:
      >>> import jax
      >>> chip_for(jax.devices()[0]).name
      'cpu-sim'
    """
    kind = str(getattr(device, "device_kind", "")).lower()
    for key, name in (("h200", "h200"), ("h100", "h100"), ("a100", "a100"), ("v5", "tpu-v5e"),
                      ("v5e", "tpu-v5e")):
        if key in kind:
            return CHIPS[name]
    platform = getattr(device, "platform", "cpu")
    return CHIPS["h100" if platform == "gpu" else "tpu-v5e" if platform == "tpu" else "cpu-sim"]


def link_for(device: Chip | str, link: cost.Link | str | None = None,
             backend: str | None = None) -> cost.Link:
    """The link a step on ``device`` is priced with: ``link`` when given, else the chip's own
    (``Chip.link``: ``"h100"`` -> ``"nvlink-h100"``, ``"tpu-v5e"`` -> ``"tpu-v5e-ici"``),
    else (a ``Chip`` of your own that names none) the backend's
    (``cost.default_link(backend, xla=True)``).

    Args:
      device: a :class:`Chip` or preset name.
      link: an explicit ``parallax.comm.cost.Link`` or preset name, which wins.
      backend: the platform whose default link a chip without one falls back to.

    Returns:
      A ``parallax.comm.cost.Link``.

    Example:
      >>> link_for("h100").name, link_for("tpu-v5e").name, link_for("h100", "ethernet-100g").name
      ('nvlink-h100', 'tpu-v5e-ici', 'ethernet-100g')
    """
    if link is not None:
        return cost.preset(link)
    device = chip(device)
    return cost.preset(device.link) if device.link else cost.default_link(backend, xla=True)


def compute_seconds(flops: float, hbm_bytes: float, device: Chip, dtype: str = "float32",
                    precision: str | None = None) -> float:
    """``max(flops / peak, bytes / bandwidth)``: the compute roof of one device.

    Example:
      >>> compute_seconds(989.4e12, 0, chip("h100"), "bfloat16")
      1.0
    """
    return max(flops / device.flops_per_second(dtype, precision),
               hbm_bytes / device.hbm_bandwidth)


def collective_seconds(kind: str, message_bytes: float, ways: int, link: cost.Link | str,
                       count: int = 1) -> float:
    """Time of ``count`` collectives of ``kind`` moving ``message_bytes`` in all, over ``ways``.

    Ring all-reduce, all-gather and reduce-scatter from :mod:`parallax.comm.cost`; a
    collective-permute is one message each way; an all-to-all sends ``(n-1)/n`` of the
    message in ``n - 1`` steps.

    Example:
      >>> round(collective_seconds("all-reduce", 1e9, 8, "nvlink-h100") * 1e3, 2)
      3.93
    """
    link, count = cost.preset(link), max(int(count), 1)
    each = message_bytes / count
    if ways <= 1 or message_bytes <= 0:
        return 0.0
    if kind == "all-reduce":
        return count * cost.ring_all_reduce_time(each, ways, link)
    if kind in ("all-gather", "reduce-scatter"):
        return count * cost.ring_reduce_scatter_time(each, ways, link)
    if kind == "all-to-all":
        return count * link.time((ways - 1) / ways * each, ways - 1)
    if kind == "collective-permute":
        return count * link.time(each, 1)
    raise ValueError(f"roofline.collective_seconds: unknown collective kind {kind!r}.")


@dataclasses.dataclass(frozen=True)
class StepTime:
    """A roofline estimate of one step, in seconds.

    ``total`` = ``compute / (1 - bubble) + communication`` (nothing overlapped);
    ``overlapped`` = ``max(compute / (1 - bubble), communication)``.
    """

    compute: float
    communication: float
    bubble: float

    @property
    def total(self) -> float:
        return self.compute / (1 - self.bubble) + self.communication

    @property
    def overlapped(self) -> float:
        return max(self.compute / (1 - self.bubble), self.communication)


def step_time(flops: float, hbm_bytes: float, traffic: Iterable[tuple[str, int, float, int]],
              device: Chip | str, link: cost.Link | str, *, dtype: str = "float32",
              precision: str | None = None, bubble: float = 0.0) -> StepTime:
    """A step's roofline from its per-device flops, memory traffic and collectives.

    Args:
      flops: floating-point operations one device runs per step.
      hbm_bytes: bytes one device moves through its memory per step.
      traffic: ``(kind, ways, message_bytes, count)`` per group of collectives.
      device: a :class:`Chip` or preset name.
      link: a ``parallax.comm.cost.Link`` or preset name.
      dtype: the matmuls' dtype name.
      precision: ``jax_default_matmul_precision`` (``"highest"`` disables TF32).
      bubble: the pipeline's bubble fraction.

    Returns:
      A :class:`StepTime`.

    Example:
      >>> t = step_time(989.4e12, 0, [("all-reduce", 8, 1e9, 1)], "h100", "nvlink-h100",
      ...               dtype="bfloat16")
      >>> round(t.compute, 3), round(t.communication * 1e3, 2)
      (1.0, 3.93)
    """
    device = chip(device)
    comm = sum(collective_seconds(kind, size, ways, link, count)
               for kind, ways, size, count in traffic)
    return StepTime(compute_seconds(flops, hbm_bytes, device, dtype, precision), comm, bubble)
