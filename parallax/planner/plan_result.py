"""What ``px.plan`` returns: each candidate's evaluation, and the winner as ``(mesh, strategy)``.

:class:`Plan` unpacks as ``mesh, strategy``; its :meth:`Plan.table` lists every candidate
with its memory and time, predicted (formulas), compiled (the program XLA built; the ratio
compiled / predicted peak for every row compiled) and measured (when the planner ran them),
and the verdict: ``"rejected: predicted only"`` where no compilation checked a prediction.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from parallax.planner.candidates import Candidate


@dataclasses.dataclass(eq=False)
class Evaluation:
    """What the planner knows about one candidate (times in seconds, memory in bytes)."""

    candidate: Candidate
    predicted_peak: float | None = None
    predicted_time: float | None = None
    compiled_peak: int | None = None
    compiled_time: float | None = None
    measured_time: float | None = None
    fits: bool | None = None
    note: str = ""
    predicted_args: float = 0.0
    predicted_temps: float = 0.0
    predicted_hbm: float = 0.0
    split: object = None  # the predicted StepSplit on a cluster (predicted/step_time.py)

    @property
    def time(self) -> float:
        """The best estimate of the step time: measured, else compiled roofline, else predicted."""
        for t in (self.measured_time, self.compiled_time, self.predicted_time):
            if t is not None:
                return t
        return math.inf


class Plan(tuple):
    """``(mesh, strategy)`` of the chosen configuration, with every evaluation behind it.

    Unpacks as ``mesh, strategy = px.plan(...)``; ``plan.best`` is the winner's
    :class:`Evaluation`, ``plan.evaluations`` all of them (best first), ``plan.table()`` the
    ranked table with the reasons.
    """

    def __new__(cls, mesh, strategy, evaluations: list[Evaluation], budget: float | None,
                priced: str = "", topology=None):
        self = super().__new__(cls, (mesh, strategy))
        self.evaluations, self.budget, self.priced = evaluations, budget, priced
        self.topology = topology
        return self

    def hybrid_axes(self) -> tuple[dict, dict]:
        """``(ici, dcn)`` of the chosen mesh on the plan's cluster, for
        ``px.make_hybrid_mesh(ici, dcn)`` on the real machines (needs ``cluster=``)."""
        if self.topology is None:
            raise ValueError("Plan.hybrid_axes: this plan has no cluster; call px.plan(..., "
                             "cluster='dgx-h100') (or another preset) to lay it out on nodes.")
        return self.topology.hybrid_axes(dict(self.mesh.shape))

    @property
    def mesh(self):
        return self[0]

    @property
    def strategy(self):
        return self[1]

    @property
    def best(self) -> Evaluation:
        return self.evaluations[0]

    def table(self, limit: int = 12) -> str:
        """The ranked candidates: memory and time predicted and compiled, and the verdict."""
        return table(self.evaluations, self.budget, limit, self.priced)

    def __repr__(self) -> str:
        return f"Plan({self.best.candidate.label})"


def table(evaluations: Sequence[Evaluation], budget: float | None, limit: int = 12,
          priced: str = "") -> str:
    """A text table of evaluations (see :meth:`Plan.table`); ``priced`` names the chip and
    link the times assume (the header's second line)."""
    mb = lambda v: "-" if v is None else f"{v / 1e6:.2f}"  # noqa: E731
    ms = lambda v: "-" if v is None else f"{v * 1e3:.2f}"  # noqa: E731
    ratio = lambda e: ("-" if not (e.compiled_peak and e.predicted_peak)  # noqa: E731
                       else f"{e.compiled_peak / e.predicted_peak:.2f}")
    head = ["#", "configuration", "peak MB pred", "compiled", "ratio", "time ms pred",
            "compiled", "measured", "verdict"]
    rows = [[str(i + 1), e.candidate.label, mb(e.predicted_peak), mb(e.compiled_peak),
             ratio(e), ms(e.predicted_time), ms(e.compiled_time), ms(e.measured_time), e.note]
            for i, e in enumerate(evaluations[:limit])]
    if any(e.split is not None for e in evaluations[:limit]):  # on a cluster: MFU, split
        head[-1:-1] = ["MFU", "comm intra/inter ms", "bubble ms"]
        for row, e in zip(rows, evaluations):
            sp = e.split
            row[-1:-1] = (["-", "-", "-"] if sp is None else [
                f"{100 * sp.mfu:.1f}%", f"{ms(sp.communication['intra-node'])}/"
                f"{ms(sp.communication['inter-node'])}", ms(sp.bubble)])
    width = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head) - 1)]
    shown = "none" if budget is None else f"{budget / 1e6:.2f} MB"
    lines = [f"px.plan: {len(evaluations)} candidates, memory per device {shown}"]
    lines += [f"  {priced}"] if priced else []
    for r in [head, *rows]:
        lines.append("  ".join(c.ljust(w) if i == 1 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, width))) + "  " + r[-1])
    return "\n".join(line.rstrip() for line in lines)
