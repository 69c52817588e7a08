"""Alpha-beta cost model of the collectives, hardware presets, and ``algorithm="auto"``.

A message of ``m`` bytes over one link costs ``a + m / B``: a latency ``a`` (alpha: start-up,
synchronisation, kernel launch) plus the bytes over the bandwidth ``B`` (one direction, per
device; beta = 1/B). With ``n`` devices and a message of ``S`` bytes (Thakur, Rabenseifner &
Gropp 2005; reductions assumed free next to the transfer):

=========================  ============================================
ring reduce-scatter        ``(n-1) a + (n-1)/n S/B``   (all-gather: same)
ring all-reduce            ``2(n-1) a + 2(n-1)/n S/B``
recursive doubling         ``R (a + S/B)``, ``R = log2 n`` (``floor(log2 n) + 2`` otherwise)
binomial-tree broadcast    ``ceil(log2 n) (a + S/B)``
hierarchical all-reduce    inner RS + outer all-reduce of ``S/n_inner`` + inner AG
=========================  ============================================

The ring's bandwidth term is optimal and does not grow with ``n``; its latency term does. The
tree has ``log2 n`` latencies but sends the whole message each round. :func:`choose_algorithm`
picks the cheaper; :func:`crossover_bytes` says where they meet.

The presets' bandwidths come from vendor spec pages (named in each ``source``); their
latencies are order-of-magnitude assumptions, labelled as such, since vendors do not publish
a per-step collective latency. ``"cpu-sim"`` was fitted on the development machine with
:func:`fit_link` from ``parallax bench comm``. Fit your own with the same function.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Link:
    """Alpha-beta parameters of one kind of link.

    Attributes:
      name: a short name.
      latency: alpha, seconds per message (per algorithm step).
      bandwidth: bytes per second one device can send on it, one direction.
      source: where the numbers come from.
    """

    name: str
    latency: float
    bandwidth: float
    source: str = ""

    def time(self, nbytes: float, messages: float = 1.0) -> float:
        """``messages`` latencies plus ``nbytes`` over the bandwidth, in seconds."""
        return messages * self.latency + nbytes / self.bandwidth


PRESETS: dict[str, Link] = {
    "nvlink-h100": Link(
        "nvlink-h100", 3e-6, 450e9,
        "bandwidth: NVIDIA H100 Tensor Core GPU datasheet, NVLink 900 GB/s per GPU "
        "(both directions) -> 450 GB/s each way; latency: assumed (a few us per NCCL step)."),
    "nvlink-a100": Link(
        "nvlink-a100", 3e-6, 300e9,
        "bandwidth: NVIDIA A100 Tensor Core GPU datasheet, NVLink 600 GB/s per GPU (both "
        "directions) -> 300 GB/s each way; latency: assumed (a few us per NCCL step)."),
    "tpu-v5e-ici": Link(
        "tpu-v5e-ici", 1e-6, 50e9,
        "bandwidth: Google Cloud TPU v5e system architecture page, ICI 400 GB/s per chip "
        "bidirectional over 4 ports -> 50 GB/s per link each way; latency: assumed (~1 us)."),
    "infiniband-ndr": Link(
        "infiniband-ndr", 2e-6, 50e9,
        "bandwidth: NVIDIA ConnectX-7 / Quantum-2 NDR InfiniBand, 400 Gb/s per port -> "
        "50 GB/s; latency: assumed (~1-2 us RDMA)."),
    "infiniband-hdr": Link("infiniband-hdr", 2e-6, 25e9, "bandwidth: NVIDIA ConnectX-6 HDR "
                           "InfiniBand, 200 Gb/s per port -> 25 GB/s; latency: assumed."),
    "ethernet-100g": Link(
        "ethernet-100g", 10e-6, 12.5e9,
        "bandwidth: IEEE 802.3 100GbE line rate, 100 Gb/s -> 12.5 GB/s; latency: assumed "
        "(~10 us through a host network stack)."),
    "cpu-sim": Link(
        "cpu-sim", 250e-6, 0.35e9,
        "fitted with fit_link() to ring all-reduce times (1 KiB..4 MiB) from "
        "benchmarks/comm_sweep.py on 8 simulated CPU devices sharing 2 cores (the "
        "development machine): 250 us per step, 0.35 GB/s; only meaningful there."),
    "cpu-sim-xla": Link(
        "cpu-sim-xla", 45e-6, 1.5e9,
        "fitted with fit_link() to XLA's own all-reduce (psum, 256 B .. 4 MiB) on 8 "
        "simulated CPU devices sharing 2 cores (the development machine): 45 us per step, "
        "1.5 GB/s; 'cpu-sim' fits parallax's ring of ppermutes instead."),
}


def preset(name: str | Link) -> Link:
    """A :class:`Link` by preset name (a ``Link`` is returned as is)."""
    if isinstance(name, Link):
        return name
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"cost.preset: unknown link {name!r}; the presets are {', '.join(PRESETS)} "
            "(or pass a cost.Link(name, latency, bandwidth))."
        ) from None


def default_link(backend: str | None = None, *, xla: bool = False) -> Link:
    """The preset assumed for a backend (the current one when None): gpu -> nvlink-h100,
    tpu -> tpu-v5e-ici, else cpu-sim.

    ``xla=True`` prices XLA's own collectives (``psum``, the all-gathers GSPMD inserts)
    rather than parallax's point-to-point algorithms. The two differ only on simulated CPU
    devices, where XLA's all-reduce is one in-process step ('cpu-sim-xla') and a ring of
    ``ppermute``s pays per step ('cpu-sim'); on a GPU or TPU both use the same link.

    Example:
      >>> default_link("cpu").name, default_link("cpu", xla=True).name, default_link("gpu").name
      ('cpu-sim', 'cpu-sim-xla', 'nvlink-h100')
    """
    if backend is None:
        import jax

        backend = jax.default_backend()
    cpu = "cpu-sim-xla" if xla else "cpu-sim"
    return PRESETS[{"gpu": "nvlink-h100", "cuda": "nvlink-h100", "rocm": "nvlink-h100",
                    "tpu": "tpu-v5e-ici"}.get(backend, cpu)]


def tree_rounds_count(n: int) -> int:
    """Rounds of recursive doubling on ``n`` devices (two more when not a power of two)."""
    if n <= 1:
        return 0
    p = 1 << (n.bit_length() - 1)
    return int(math.log2(p)) + (2 if p != n else 0)


def ring_reduce_scatter_time(nbytes: float, n: int, link: Link | str) -> float:
    """Ring reduce-scatter of an ``nbytes`` array: ``(n-1) a + (n-1)/n S/B``."""
    link = preset(link)
    return link.time((n - 1) / n * nbytes, n - 1) if n > 1 else 0.0


def ring_all_gather_time(nbytes: float, n: int, link: Link | str) -> float:
    """Ring all-gather producing ``nbytes``: ``(n-1) a + (n-1)/n S/B``."""
    return ring_reduce_scatter_time(nbytes, n, link)


def ring_all_reduce_time(nbytes: float, n: int, link: Link | str) -> float:
    """Ring all-reduce: ``2(n-1) a + 2(n-1)/n S/B``.

    Example:
      >>> round(ring_all_reduce_time(1e9, 8, "nvlink-h100") * 1e3, 2)   # ms for 1 GB
      3.93
    """
    return 2 * ring_reduce_scatter_time(nbytes, n, link)


def tree_all_reduce_time(nbytes: float, n: int, link: Link | str) -> float:
    """Recursive doubling: ``R (a + S/B)`` with ``R`` from :func:`tree_rounds_count`."""
    link = preset(link)
    rounds = tree_rounds_count(n)
    return link.time(rounds * nbytes, rounds)


def broadcast_time(nbytes: float, n: int, link: Link | str) -> float:
    """Binomial-tree broadcast: ``ceil(log2 n) (a + S/B)``."""
    link = preset(link)
    rounds = math.ceil(math.log2(n)) if n > 1 else 0
    return link.time(rounds * nbytes, rounds)


def hierarchical_all_reduce_time(
    nbytes: float, n_inner: int, n_outer: int, inner_link: Link | str, outer_link: Link | str,
    outer_algorithm: str = "ring",
) -> float:
    """Reduce-scatter inside (``n_inner``), all-reduce of ``S/n_inner`` across, gather inside.

    Example:
      >>> flat = ring_all_reduce_time(1e9, 16, "ethernet-100g")
      >>> two_d = hierarchical_all_reduce_time(1e9, 8, 2, "nvlink-h100", "ethernet-100g")
      >>> two_d < flat / 5
      True
    """
    inner = 2 * ring_reduce_scatter_time(nbytes, n_inner, inner_link)
    return inner + all_reduce_time(nbytes / n_inner, n_outer, outer_link, outer_algorithm)


def all_reduce_time(nbytes: float, n: int, link: Link | str, algorithm: str = "ring") -> float:
    """All-reduce time for ``algorithm`` ``"ring"``, ``"tree"`` or ``"xla"``.

    ``"xla"`` is modelled as the better of ring and tree, which is what NCCL's tuner aims at;
    the real library may do better (NVLink SHARP, multiple channels) or worse.
    """
    if algorithm == "ring":
        return ring_all_reduce_time(nbytes, n, link)
    if algorithm == "tree":
        return tree_all_reduce_time(nbytes, n, link)
    if algorithm in ("xla", "auto"):
        return min(ring_all_reduce_time(nbytes, n, link), tree_all_reduce_time(nbytes, n, link))
    raise ValueError(
        f"cost.all_reduce_time: algorithm={algorithm!r} is not one of 'ring', 'tree', 'xla'."
    )


def bucketed_all_reduce_time(
    leaf_bytes: Sequence[float], bucket_bytes: float, n: int, link: Link | str,
    algorithm: str = "ring",
) -> float:
    """All-reduce of several tensors fused into buckets of ``bucket_bytes`` (0: one per tensor).

    Fusion removes latencies: ``k`` small all-reduces pay ``k`` times the latency term.
    """
    total = float(sum(leaf_bytes))
    if bucket_bytes == 0:
        return sum(all_reduce_time(b, n, link, algorithm) for b in leaf_bytes)
    full, rest = divmod(total, bucket_bytes)
    t = full * all_reduce_time(bucket_bytes, n, link, algorithm)
    return t + (all_reduce_time(rest, n, link, algorithm) if rest else 0.0)


def choose_algorithm(nbytes: float, n: int, link: Link | str | None = None) -> str:
    """``"tree"`` or ``"ring"``: the cheaper all-reduce for ``nbytes`` on ``n`` devices.

    Example:
      >>> choose_algorithm(1e3, 8, "nvlink-h100"), choose_algorithm(1e8, 8, "nvlink-h100")
      ('tree', 'ring')
    """
    link = default_link() if link is None else preset(link)
    ring = ring_all_reduce_time(nbytes, n, link)
    return "tree" if tree_all_reduce_time(nbytes, n, link) < ring else "ring"


def crossover_bytes(n: int, link: Link | str) -> float:
    """The message size at which ring and tree all-reduce cost the same (``inf``: tree always).

    From ``R (a + S/B) = 2(n-1) a + 2(n-1)/n S/B``.
    """
    link = preset(link)
    rounds, steps = tree_rounds_count(n), 2 * (n - 1)
    denom = rounds - steps / n
    if n <= 1 or denom <= 0:
        return math.inf
    return (steps - rounds) * link.latency * link.bandwidth / denom


BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def bus_bandwidth_factor(collective: str, n: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth.

    ``busbw = algbw * factor``: ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for all-gather,
    reduce-scatter and all-to-all, ``1`` for broadcast and reduce. Bus bandwidth is comparable
    with the link's peak whatever ``n`` is.

    Example:
      >>> bus_bandwidth_factor("all_reduce", 8)
      1.75

    References:
      NVIDIA nccl-tests, ``doc/PERFORMANCE.md``.
    """
    try:
        return float(BUS_FACTORS[collective](n))
    except KeyError:
        raise ValueError(
            f"cost.bus_bandwidth_factor: unknown collective {collective!r}; use one of "
            f"{', '.join(BUS_FACTORS)}."
        ) from None


def fit_link(nbytes: Sequence[float], seconds: Sequence[float], n: int,
             algorithm: str = "ring", name: str = "fitted") -> Link:
    """Least-squares alpha and bandwidth from measured all-reduce times.

    Fits ``t = k_a * a + k_b * S / B`` with the ring's (``2(n-1)``, ``2(n-1)/n``) or the
    tree's (``R``, ``R``) coefficients.

    Example:
      >>> link = preset("ethernet-100g")
      >>> sizes = [1e3, 1e5, 1e7]
      >>> fit = fit_link(sizes, [ring_all_reduce_time(s, 8, link) for s in sizes], 8)
      >>> round(fit.latency * 1e6, 3), round(fit.bandwidth / 1e9, 3)
      (10.0, 12.5)
    """
    if algorithm == "ring":
        k_a, k_b = 2 * (n - 1), 2 * (n - 1) / n
    elif algorithm == "tree":
        k_a = k_b = tree_rounds_count(n)
    else:
        raise ValueError(f"cost.fit_link: algorithm={algorithm!r} is not 'ring' or 'tree'.")
    a = np.stack([np.full(len(nbytes), k_a), k_b * np.asarray(nbytes, float)], axis=1)
    (alpha, beta), *_ = np.linalg.lstsq(a, np.asarray(seconds, float), rcond=None)
    alpha, beta = max(float(alpha), 0.0), max(float(beta), 1e-30)
    return Link(name, alpha, 1.0 / beta, f"fitted to {len(nbytes)} {algorithm} timings, n={n}")
