"""Splitting a sequence of layers into contiguous pipeline stages.

Four methods, all over per-layer costs (numbers, or the
:class:`~parallax.pipeline.planning.profile.LayerProfile` records of
:func:`~parallax.pipeline.planning.profile.profile_layers`):

* ``"uniform"``: the same number of layers per stage (the first ``L % S`` stages get one more).
* ``"balance_by_time"``: torchgpipe's ``balance_by_time``: minimise the slowest stage's time.
* ``"balance_by_size"``: torchgpipe's ``balance_by_size``: minimise the largest stage's memory,
  ``param_scale * param_bytes + activation_bytes`` per layer (``param_scale`` copies of each
  parameter live in training: itself, its gradient, optimizer state; about 2 for SGD, 4 for
  Adam).
* ``"pipedream"``: PipeDream's planner: minimise the slowest stage *including* the time to
  send its output activation to the next stage, ``activation_bytes / bandwidth``.

All optimising methods solve their min-max problem exactly (a dynamic program over prefix
sums; torchgpipe's block-partition algorithm finds the same optimum).

(A little over 300 lines: four methods that share one min-max search and its checks.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from parallax.pipeline.planning.profile import LayerProfile

METHODS = ("uniform", "balance_by_time", "balance_by_size", "pipedream")


@dataclasses.dataclass(frozen=True)
class Partition:
    """Contiguous stage boundaries and what each stage costs.

    Stage ``k`` holds layers ``boundaries[k]`` to ``boundaries[k + 1] - 1``.

    Attributes:
      method: the method that chose the boundaries (``"given"`` for :meth:`from_boundaries`).
      boundaries: ``stages + 1`` layer indices, ``0`` first, the number of layers last.
      compute: per stage, the sum of its layers' measure (time; bytes for ``balance_by_size``).
      comm: per stage, the time to send its output activation to the next stage (0 for the
        last stage, or without a bandwidth).
      costs: per stage, ``compute + comm`` (``max(compute, comm)`` with ``overlap=True``).

    Example:
      >>> split = partition([1.0, 1.0, 2.0, 4.0], stages=2)
      >>> split.boundaries, split.layers_per_stage, split.bottleneck, split.imbalance
      ((0, 3, 4), (3, 1), 4.0, 1.0)
      >>> print(split.text())
      balance_by_time: 2 stages, bottleneck 4 (stage 0), imbalance 1.000
      stage 0: layers 0-2 (3), compute 4, comm 0, cost 4
      stage 1: layers 3-3 (1), compute 4, comm 0, cost 4
    """

    method: str
    boundaries: tuple[int, ...]
    compute: tuple[float, ...]
    comm: tuple[float, ...]
    costs: tuple[float, ...]

    @property
    def stages(self) -> int:
        return len(self.costs)

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.boundaries, self.boundaries[1:]))

    def layers(self, stage: int) -> range:
        """The layer indices of ``stage``."""
        return range(self.boundaries[stage], self.boundaries[stage + 1])

    @property
    def slowest(self) -> int:
        """The index of the stage with the largest cost (the first, on ties)."""
        return max(range(self.stages), key=lambda k: (self.costs[k], -k))

    @property
    def bottleneck(self) -> float:
        """The largest stage cost: what bounds a pipeline's step time."""
        return max(self.costs)

    @property
    def imbalance(self) -> float:
        """``max(costs) / mean(costs)``: 1 is perfectly balanced."""
        return max(self.costs) * self.stages / sum(self.costs)

    def text(self) -> str:
        """A small table: one line per stage with its layers, compute, communication, cost."""
        lines = [
            f"{self.method}: {self.stages} stages, bottleneck {self.bottleneck:.4g} "
            f"(stage {self.slowest}), imbalance {self.imbalance:.3f}"
        ]
        for k in range(self.stages):
            first, last = self.boundaries[k], self.boundaries[k + 1] - 1
            lines.append(
                f"stage {k}: layers {first}-{last} ({last - first + 1}), compute "
                f"{self.compute[k]:.4g}, comm {self.comm[k]:.4g}, cost {self.costs[k]:.4g}"
            )
        return "\n".join(lines)

    @classmethod
    def from_boundaries(
        cls,
        costs,
        boundaries: Sequence[int],
        *,
        bandwidth=None,
        overlap=False,
        activation_bytes=None,
    ) -> Partition:
        """Evaluates given boundaries by time and communication, as ``"pipedream"`` does.

        Example:
          >>> Partition.from_boundaries([1.0, 2.0, 3.0], (0, 2, 3)).costs
          (3.0, 3.0)
        """
        layers = _layers(costs, activation_bytes)
        boundaries = tuple(int(b) for b in boundaries)
        n = len(layers["time"])
        if (
            len(boundaries) < 2
            or boundaries[0] != 0
            or boundaries[-1] != n
            or any(a >= b for a, b in zip(boundaries, boundaries[1:]))
        ):
            raise ValueError(
                f"partition: boundaries {boundaries} must rise strictly from 0 to the number "
                f"of layers ({n})"
            )
        stage_cost = _stage_cost(layers, "time", bandwidth, overlap)
        return _partition_of("given", boundaries, stage_cost)


def partition(
    costs: Sequence[float] | Sequence[LayerProfile],
    stages: int,
    method: str = "balance_by_time",
    *,
    bandwidth: float | None = None,
    overlap: bool = False,
    param_scale: float = 2.0,
    activation_bytes: Sequence[float] | None = None,
) -> Partition:
    """Splits layers into ``stages`` contiguous stages.

    Args:
      costs: per layer, a time (any unit) or a record with ``time``, ``param_bytes`` and
        ``activation_bytes`` (``LayerProfile`` from ``px.pipeline.profile_layers``). For
        ``"balance_by_size"`` plain numbers are the layers' memory sizes.
      stages: the number of stages, ``1 <= stages <= len(costs)``.
      method: ``"uniform"``, ``"balance_by_time"``, ``"balance_by_size"`` or ``"pipedream"``.
      bandwidth: bytes per unit of time between neighbouring stages; every method reports
        communication with it, ``"pipedream"`` also minimises it (without it, ``"pipedream"``
        is ``"balance_by_time"``). If costs are forward plus backward times, halve it: the
        gradient comes back over the same link.
      overlap: ``True`` when communication overlaps computation (PipeDream's asynchronous
        runtime): a stage costs ``max(compute, comm)``. ``False`` (parallax's lock-step
        runtime, where a tick computes and then sends): ``compute + comm``.
      param_scale: copies of each parameter held in training, for ``"balance_by_size"``.
      activation_bytes: per-layer output bytes, when ``costs`` are plain numbers.

    Returns:
      A :class:`Partition`.

    Raises:
      ValueError: for an unknown method, more stages than layers, or non-positive costs.

    Example:
      >>> from parallax.pipeline import partition
      >>> split = partition([1, 1, 2, 4], stages=2)
      >>> split.boundaries, split.costs, split.slowest
      ((0, 3, 4), (4.0, 4.0), 0)

    References:
      Kim et al. 2020, torchgpipe: On-the-fly Pipeline Parallelism for Training Giant Models;
      Narayanan et al. 2019, PipeDream: Generalized Pipeline Parallelism for DNN Training;
      Huang et al. 2019, GPipe.
    """
    if method not in METHODS:
        raise ValueError(f"partition: unknown method {method!r}; known: {', '.join(METHODS)}")
    if isinstance(stages, bool) or not isinstance(stages, int):
        raise TypeError(f"partition: stages must be an int, got {stages!r}")
    layers = _layers(costs, activation_bytes)
    n = len(layers["time"])
    if stages < 1:
        raise ValueError(f"partition: stages must be >= 1, got {stages}")
    if stages > n:
        raise ValueError(
            f"partition: {stages} stages for {n} layers; every stage needs at least one layer"
        )
    if bandwidth is not None and not bandwidth > 0:
        raise ValueError(f"partition: bandwidth must be positive, got {bandwidth!r}")

    measure = "size" if method == "balance_by_size" else "time"
    if measure == "size" and layers["records"]:
        layers["size"] = [
            param_scale * p + a for p, a in zip(layers["param_bytes"], layers["activation_bytes"])
        ]
    else:
        layers["size"] = layers["time"]
    _check_positive(layers[measure], measure)
    report = _stage_cost(layers, measure, bandwidth if measure == "time" else None, overlap)
    if method == "uniform":
        base, extra = divmod(n, stages)
        sizes = [base + (k < extra) for k in range(stages)]
        boundaries = tuple([0] + [sum(sizes[: k + 1]) for k in range(stages)])
    else:
        objective = _stage_cost(
            layers, measure, bandwidth if method == "pipedream" else None, overlap
        )
        boundaries = _min_max(n, stages, lambda i, j: objective(i, j)[2])
    return _partition_of(method, boundaries, report)


def _layers(costs, activation_bytes) -> dict:
    """Per-layer lists: time, param_bytes, activation_bytes; ``records`` if costs were records."""
    if isinstance(costs, (str, bytes)) or not hasattr(costs, "__iter__"):
        raise TypeError(
            "partition: costs must be a sequence of numbers or profile records, got "
            f"{type(costs).__name__}"
        )
    costs = list(costs)
    if not costs:
        raise ValueError("partition: costs is empty; pass one cost per layer")
    records = all(hasattr(c, "time") for c in costs)
    if records:
        out = {
            "time": [float(c.time) for c in costs],
            "param_bytes": [float(getattr(c, "param_bytes", 0)) for c in costs],
            "activation_bytes": [float(getattr(c, "activation_bytes", 0)) for c in costs],
        }
    else:
        for i, c in enumerate(costs):
            if (
                isinstance(c, bool)
                or not isinstance(c, (int, float))
                and not hasattr(c, "__float__")
            ):
                raise TypeError(f"partition: costs[{i}] is {c!r}; pass numbers or profile records")
        out = {"time": [float(c) for c in costs], "param_bytes": None, "activation_bytes": None}
    if activation_bytes is not None:
        if len(activation_bytes) != len(costs):
            raise ValueError(
                f"partition: {len(activation_bytes)} activation sizes for {len(costs)} layers"
            )
        out["activation_bytes"] = [float(a) for a in activation_bytes]
    if out["activation_bytes"] is not None and any(
        not (a >= 0 and math.isfinite(a)) for a in out["activation_bytes"]
    ):
        raise ValueError("partition: activation bytes must be >= 0 and finite")
    out["records"] = records
    return out


def _check_positive(values, measure) -> None:
    for i, value in enumerate(values):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(
                f"partition: layer {i} has cost {value!r} ({measure}); costs must be positive "
                "and finite"
            )


def _stage_cost(layers, measure, bandwidth, overlap):
    """``cost(i, j) -> (compute, comm, total)`` of a stage holding layers ``i .. j - 1``."""
    values = layers[measure]
    prefix = [0.0]
    for value in values:
        prefix.append(prefix[-1] + value)
    sent = layers["activation_bytes"]
    if bandwidth is not None and sent is None:
        raise ValueError(
            "partition: communication needs per-layer activation bytes: pass profile records "
            "(px.pipeline.profile_layers) or activation_bytes=[...]"
        )
    n = len(values)

    def cost(i: int, j: int) -> tuple[float, float, float]:
        compute = prefix[j] - prefix[i]
        comm = sent[j - 1] / bandwidth if bandwidth is not None and j < n else 0.0
        return compute, comm, max(compute, comm) if overlap else compute + comm

    return cost


def _min_max(n: int, stages: int, cost) -> tuple[int, ...]:
    """Boundaries minimising the largest ``cost(i, j)`` over ``stages`` contiguous stages."""
    inf = math.inf
    # best[k][j]: the smallest bottleneck of layers 0..j-1 in k stages; cut[k][j]: its last cut.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for j in range(k, n - (stages - k) + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], cost(i, j))
                if value < best[k][j]:
                    best[k][j], cut[k][j] = value, i
    boundaries = [n]
    for k in range(stages, 0, -1):
        boundaries.append(cut[k][boundaries[-1]])
    return tuple(reversed(boundaries))


def _partition_of(method: str, boundaries: tuple[int, ...], cost) -> Partition:
    parts = [cost(i, j) for i, j in zip(boundaries, boundaries[1:])]
    return Partition(method, boundaries, *(tuple(p[k] for p in parts) for k in range(3)))
