"""The :class:`Schedule`: a validated table of ticks x stages, costed before anything runs.

The tick model it obeys is the package's (:mod:`parallax.pipeline.schedules`): stages
advance in lock-step, a tick costs its slowest action, a value sent at tick ``t`` is usable
from ``t + 1``, every backward is a ``B`` then a ``W``. (A little over 300 lines: one class,
whose construction, queries and costs are documented where they are defined.)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from parallax.pipeline.schedules import charts, dependencies, slots, timeline
from parallax.pipeline.schedules.action import Action
from parallax.pipeline.schedules.action import costs as _costs
from parallax.pipeline.schedules.action import parse_cell as _action
from parallax.pipeline.schedules.action import parse_order as _parse_order
from parallax.pipeline.schedules.action import sizes as _sizes
from parallax.pipeline.schedules.placement import Placement


@dataclasses.dataclass(frozen=True, repr=False)
class Schedule:
    """A validated pipeline schedule: ``table[tick][stage]`` is an :class:`Action` or ``None``.

    Stage ``s`` runs model chunks ``0 .. virtual_stages - 1``; ``placement`` says which
    virtual stage each chunk is (looped by default: chunk ``c`` of stage ``s`` is virtual
    stage ``c * stages + s``, as in Megatron's interleaved schedule; or V-shaped).

    Args:
      name: a label (``"1f1b"``, ``"custom"``).
      stages: number of pipeline stages (devices along the stage axis).
      microbatches: micro-batches per step.
      virtual_stages: model chunks per stage (> 1 for interleaved and V schedules).
      split_backward: whether ``B`` and ``W`` are scheduled independently; ``False`` pins
        each ``W`` right after its ``B`` and makes the previous stage wait for that ``W``.
      table: one row per tick, one cell per stage.
      placement: a :class:`Placement` (default: looped).

    Raises:
      ValueError: if the table breaks a rule (see :meth:`validate`).

    Example:
      >>> from parallax.pipeline import schedule
      >>> s = schedule("1f1b", stages=2, microbatches=2)
      >>> s.order(0)
      ['F0', 'F1', 'B0', 'W0', 'B1', 'W1']
      >>> round(s.bubble_fraction(), 4)   # the papers' (p - 1) / (m + p - 1)
      0.3333

    References:
      Huang et al. 2019, GPipe; Narayanan et al. 2021, Memory-Efficient Pipeline-Parallel
      DNN Training (PipeDream-flush); Narayanan et al. 2021 (SC), Efficient Large-Scale
      Language Model Training on GPU Clusters (interleaved 1F1B); Qi et al. 2024, Zero
      Bubble Pipeline Parallelism (B/W split, ZB-V).
    """

    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    split_backward: bool
    table: tuple[tuple[Action | None, ...], ...]
    placement: Placement | None = None

    def __post_init__(self):
        table = tuple(tuple(_action(cell) for cell in row) for row in self.table)
        object.__setattr__(self, "table", table)
        placement = self.placement
        if placement is None or isinstance(placement, str):
            placement = _placement(placement or "looped", self.stages, self.virtual_stages)
        if (placement.stages, placement.chunks) != (self.stages, self.virtual_stages):
            raise ValueError(
                f"schedule: the placement holds {placement.chunks} chunks on "
                f"{placement.stages} stages, the schedule {self.virtual_stages} on {self.stages}"
            )
        object.__setattr__(self, "placement", placement)
        self.validate()

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_orders(
        cls,
        orders: Sequence[str | Sequence[str | Action]],
        *,
        split_backward: bool = False,
        microbatches: int | None = None,
        virtual_stages: int | None = None,
        placement: Placement | str = "looped",
        name: str = "custom",
    ) -> Schedule:
        """Builds a schedule from each stage's order of actions, run as early as allowed.

        Each stage runs its actions in the given order; each action runs at the first tick
        at which its dependencies are met (one tick after the action that it needs). ``W``
        actions may be left out of an order: each ``W`` then runs right after its ``B``.

        Args:
          orders: one entry per stage, a string ``"F0 F1 B0 B1"`` or a list of actions.
          split_backward: see :class:`Schedule`.
          microbatches, virtual_stages: default to the largest ones named, plus one.
          placement: ``"looped"``, ``"v"`` or a :class:`Placement`.
          name: a label.

        Returns:
          The :class:`Schedule`.

        Raises:
          ValueError: if an order is incomplete, repeats an action, or deadlocks.

        Example:
          >>> s = Schedule.from_orders(["F0 F1 B0 B1", "F0 B0 F1 B1"])
          >>> s.ticks
          9
          >>> v = Schedule.from_orders(["F0.0 F0.1 B0.1 B0.0"] * 2, placement="v",
          ...                          split_backward=True)   # 0 -> 1 -> turn -> back to 0
          >>> v.order(1), v.ticks
          (['F0.0', 'F0.1', 'B0.1', 'W0.1', 'B0.0', 'W0.0'], 10)
        """
        parsed = [_parse_order(order, s) for s, order in enumerate(orders)]
        microbatches, virtual_stages = _sizes(parsed, microbatches, virtual_stages)
        placement = _placement(placement, len(parsed), virtual_stages)
        table = dependencies.place(parsed, microbatches, placement, split_backward)
        return cls(name, len(parsed), microbatches, virtual_stages, split_backward, table,
                   placement)

    @classmethod
    def from_table(
        cls,
        rows: Sequence[str | Sequence[str | Action | None]],
        *,
        split_backward: bool = False,
        microbatches: int | None = None,
        virtual_stages: int | None = None,
        placement: Placement | str = "looped",
        name: str = "custom",
    ) -> Schedule:
        """Builds a schedule from an explicit table, drawn as :meth:`text` draws it.

        Args:
          rows: one row per stage, one cell per tick: a string ``"F0 F1 .  B0 W0"`` (``.``
            is idle) or a list of cells. Short rows are padded with idle ticks.
          split_backward, microbatches, virtual_stages, placement, name: as for
            :meth:`from_orders`.

        Returns:
          The :class:`Schedule`.

        Raises:
          ValueError: naming the first action that breaks a rule (see :meth:`validate`).

        Example:
          >>> s = Schedule.from_table(["F0 .  .  .  B0 W0", ".  F0 B0 W0"])
          >>> s.order(1)
          ['F0', 'B0', 'W0']
        """
        cells = [row.split() if isinstance(row, str) else list(row) for row in rows]
        cells = [[_action(cell) for cell in row] for row in cells]
        ticks = max((len(row) for row in cells), default=0)
        table = [[row[t] if t < len(row) else None for row in cells] for t in range(ticks)]
        actions = [[a for a in row if a is not None] for row in cells]
        microbatches, virtual_stages = _sizes(actions, microbatches, virtual_stages)
        placement = _placement(placement, len(cells), virtual_stages)
        return cls(name, len(cells), microbatches, virtual_stages, split_backward, table,
                   placement)

    def validate(self) -> None:
        """Checks the table; raises ``ValueError`` naming the action and the rule it breaks.

        The rules: every (stage, micro-batch, chunk) has exactly one ``F``, one ``B`` and one
        ``W``; a forward runs after the previous virtual stage's forward of its micro-batch;
        a backward runs after its own forward and after the next virtual stage's backward
        (its ``W`` when the backward is not split); ``W`` runs after its ``B`` (right after,
        when not split); values sent at tick ``t`` arrive at ``t + 1``. A cell holds at most
        one action, so a stage runs at most one action per tick.
        """
        dependencies.check(self)

    # -- queries ------------------------------------------------------------------------

    @property
    def ticks(self) -> int:
        """Number of ticks (rows of the table)."""
        return len(self.table)

    @functools.cached_property
    def tick_of(self) -> dict[tuple[Action, int], int]:
        """``{(action, stage): tick}`` for every action of the table."""
        return {
            (a, s): t
            for t, row in enumerate(self.table)
            for s, a in enumerate(row)
            if a is not None
        }

    def label(self, action: Action) -> str:
        """An action's string form in this schedule (the chunk is shown when there are several)."""
        return action.label(self.virtual_stages > 1)

    def actions(self, stage: int) -> list[Action]:
        """The actions of ``stage`` in the order it runs them."""
        self._check_stage(stage)
        return [row[stage] for row in self.table if row[stage] is not None]

    def order(self, stage: int) -> list[str]:
        """The actions of ``stage`` in order, as strings: ``["F0", "F1", "B0", "W0", ...]``."""
        return [self.label(a) for a in self.actions(stage)]

    def time(self, f: float = 1, b: float = 1, w: float = 1) -> float:
        """Total time of the lock-step run: the sum over ticks of the tick's slowest action.

        This is what parallax's SPMD runtime pays (every stage waits for the slowest action
        of each tick); :meth:`makespan` is the papers' asynchronous replay.

        Args:
          f, b, w: the time of one ``F``, one ``B`` (input gradient) and one ``W`` (weight
            gradient), the zero-bubble paper's ``T_F``, ``T_B``, ``T_W``.

        Returns:
          ``sum_t max_s cost(table[t][s])``, idle cells costing 0.
        """
        return sum(self.tick_costs(f, b, w))

    def tick_costs(self, f: float = 1, b: float = 1, w: float = 1) -> list[float]:
        """Each tick's cost: its slowest action's (0 for a tick where every stage idles)."""
        cost = _costs(f, b, w)
        return [max((cost[a.kind] for a in row if a is not None), default=0)
                for row in self.table]

    def makespan(self, f: float = 1, b: float = 1, w: float = 1) -> float:
        """The papers' time of the step: each stage runs its order, each action as soon as it
        may (:func:`parallax.pipeline.schedules.timeline.replay`)."""
        return timeline.makespan(self, f, b, w)

    def bubble_fraction(self, f: float = 1, b: float = 1, w: float = 1, *,
                        overlap_steps: bool = False, lockstep: bool = False) -> float:
        """The bubble as the pipeline papers define it: idle time over every stage's makespan.

        Each stage runs its actions in order, each as soon as its stage is free and the
        action it needs has finished (sends take no time); ``F``, ``B``, ``W`` take ``f``,
        ``b``, ``w``. With ``T`` the end of the last action (:meth:`makespan`)::

            bubble = 1 - stages * virtual_stages * microbatches * (f + b + w) / (stages * T)

        ``W`` counts as work. At ``f = b = w = 1``, ``p`` stages, ``m`` micro-batches, ``v``
        chunks: GPipe and 1F1B give ``(p - 1) / (m + p - 1)`` (Narayanan et al.'s
        ``(p - 1) / m`` of the ideal time), interleaved 1F1B ``(p - 1) / (v m + p - 1)``,
        ZB-H1 ``(p - 1) / (3 m + p - 1)`` (Qi et al.'s ``(p - 1)(T_F + T_B - T_W)``), and no
        synchronous step does better than ``(p - 1) / (3 v m + p - 1)``: the last stage
        cannot start before ``p - 1`` forwards. Bubble over ideal time is
        ``bubble / (1 - bubble)``.

        Args:
          f, b, w: the time of one ``F``, one ``B`` (input gradient) and one ``W`` (weight
            gradient), the zero-bubble paper's ``T_F``, ``T_B``, ``T_W`` (per chunk for
            schedules with several chunks per stage).
          overlap_steps: count each stage only from its own first action to its last, as if
            the next step's work filled the rest: the zero-bubble paper's parallelogram,
            which its post-validated optimizer step makes real (parallax's steps are
            synchronous). ZB-H2 and ZB-V are at 0 by it at equal costs once ``m >= 2p``.
          lockstep: cost parallax's lock-step runtime instead (:meth:`time`: every tick lasts
            its slowest action on every stage). Equal to the default at equal costs for
            tables placed as early as allowed; larger when costs differ.

        Returns:
          A float in ``[0, 1)``.

        Example:
          >>> from parallax.pipeline import schedule
          >>> round(schedule("1f1b", 4, 8).bubble_fraction(f=1, b=1, w=1), 4)   # 3 / 11
          0.2727
          >>> round(schedule("zb_h1", 4, 8).bubble_fraction(f=1, b=1, w=1), 4)  # 3 / 27
          0.1111

        References:
          Narayanan et al. 2021; Qi et al. 2024 (Zero Bubble Pipeline Parallelism, table 2);
          :mod:`parallax.pipeline.schedules.timeline`.
        """
        if not lockstep:
            return timeline.bubble(self, f, b, w, overlap_steps=overlap_steps)
        useful = self.virtual_stages * self.microbatches * (f + b + w)
        tick_cost = self.tick_costs(f, b, w)
        if not overlap_steps:
            return 1 - useful / sum(tick_cost)
        spans = []
        for s in range(self.stages):
            busy = [t for t, row in enumerate(self.table) if row[s] is not None]
            spans.append(sum(tick_cost[busy[0]: busy[-1] + 1]) if busy else 0.0)
        return 1 - useful / max(spans)

    def peak_in_flight(self, stage: int, until: str = "W") -> int:
        """Most micro-batch chunks whose activations ``stage`` holds at once.

        Args:
          stage: the stage.
          until: ``"W"`` (default): a micro-batch is held from its ``F`` until its ``W``
            (what the runtime's residual stash holds); ``"B"``: until its ``B`` (the full
            activations, the zero-bubble paper's ``M_B``; after ``B`` only what ``W`` needs
            is left).

        1F1B holds ``min(stages - stage, microbatches)``; GPipe holds ``microbatches``.
        """
        if until not in ("B", "W"):
            raise ValueError(f"schedule: until must be 'B' or 'W', got {until!r}")
        held = peak = 0
        for action in self.actions(stage):
            if action.kind == "F":
                held += 1
                peak = max(peak, held)
            elif action.kind == until:
                held -= 1
        return peak

    def as_arrays(self) -> slots.ScheduleArrays:
        """The table and its buffer plan as int32 arrays ``[ticks, stages]``, for a runtime.

        Returns:
          A :class:`parallax.pipeline.schedules.slots.ScheduleArrays`.
        """
        return slots.schedule_arrays(self)

    def text(self, f: float = 1, b: float = 1, w: float = 1) -> str:
        """An ASCII Gantt chart: one row per stage, one column per tick (``.`` is idle)."""
        return charts.text(self, f=f, b=b, w=w)

    def plot(self, path=None, *, f: float = 1, b: float = 1, w: float = 1):
        """A Gantt chart in time units (needs matplotlib): :func:`charts.plot`."""
        return charts.plot(self, path, f=f, b=b, w=w)

    def _check_stage(self, stage: int) -> None:
        if not 0 <= stage < self.stages:
            raise ValueError(f"schedule: stage {stage} is out of range for {self.stages} stages")

    def __repr__(self) -> str:
        where = "" if self.placement.name == "looped" else f", placement={self.placement.name!r}"
        return (
            f"Schedule({self.name!r}, stages={self.stages}, microbatches={self.microbatches}, "
            f"virtual_stages={self.virtual_stages}, split_backward={self.split_backward}"
            f"{where}, ticks={self.ticks})"
        )


def _placement(placement, stages: int, chunks: int) -> Placement:
    if isinstance(placement, Placement):
        return placement
    if isinstance(placement, str):
        return Placement.named(placement, stages, chunks)
    raise TypeError(
        f"schedule: placement must be 'looped', 'v' or a Placement, got {placement!r}"
    )
