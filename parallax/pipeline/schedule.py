"""A pipeline schedule as data: a table of ticks x stages, each cell one action or idle.

(A little over 300 lines: the tick model below is the runtime's contract, kept beside the
table it governs.)

The tick model (an SPMD lock-step runtime, see ``docs/pipeline.md``):

* All stages advance through ticks together. In a tick every stage runs at most one action
  (or idles), then every stage exchanges activations and gradients with its neighbours
  (``ppermute``). A tick therefore lasts as long as its slowest action, on every stage.
* An action is ``F`` (forward), ``B`` (input-gradient backward: the gradient the previous
  stage waits for) or ``W`` (weight-gradient backward) of one micro-batch on one model chunk.
  Every backward is two actions, ``B`` then ``W``: an SPMD runtime can spend two ticks on a
  backward only by computing a different part of it in each, and these two parts are the
  ones that matter (``B`` is on the critical path, ``W`` is not).
* ``split_backward=False`` schedules the two halves as one unit, as the published schedules
  do: ``W`` runs in the tick right after its ``B``, and the previous stage starts its
  backward only after that ``W``. With costs ``f = 1`` and ``b = 2`` (so ``B`` and ``W``
  cost 1 each) every tick costs 1, and GPipe, 1F1B and interleaved 1F1B have exactly their
  classic bubble fractions. ``split_backward=True`` lets the previous stage start after
  ``B`` (zero-bubble style), which shortens the critical path.
* A value sent at the end of tick ``t`` is usable from tick ``t + 1``.

:func:`parallax.pipeline.schedule` builds the named schedules; :meth:`Schedule.from_orders`
and :meth:`Schedule.from_table` build custom ones. Every :class:`Schedule` is validated when
it is created.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from parallax.pipeline import buffers, dependencies
from parallax.pipeline import plot as _plot
from parallax.pipeline.action import KIND_CODES as KIND_CODES
from parallax.pipeline.action import KINDS as KINDS
from parallax.pipeline.action import Action as Action
from parallax.pipeline.action import costs as _costs
from parallax.pipeline.action import parse_cell as _action
from parallax.pipeline.action import parse_order as _parse_order
from parallax.pipeline.action import sizes as _sizes


@dataclasses.dataclass(frozen=True, repr=False)
class Schedule:
    """A validated pipeline schedule: ``table[tick][stage]`` is an :class:`Action` or ``None``.

    Stage ``s`` runs model chunks ``0 .. virtual_stages - 1``; chunk ``c`` on stage ``s`` is
    virtual stage ``c * stages + s`` (so the stage after chunk ``c`` of the last stage is
    chunk ``c + 1`` of stage 0, as in Megatron's interleaved schedule).

    Args:
      name: a label (``"1f1b"``, ``"custom"``).
      stages: number of pipeline stages (devices along the stage axis).
      microbatches: micro-batches per step.
      virtual_stages: model chunks per stage (> 1 for interleaved schedules).
      split_backward: whether ``B`` and ``W`` are scheduled independently (see the module
        docstring); ``False`` pins each ``W`` right after its ``B``.
      table: one row per tick, one cell per stage.

    Raises:
      ValueError: if the table breaks a rule (see :meth:`validate`).

    Example:
      >>> from parallax.pipeline import schedule
      >>> s = schedule("1f1b", stages=2, microbatches=2)
      >>> s.order(0)
      ['F0', 'F1', 'B0', 'W0', 'B1', 'W1']
      >>> round(s.bubble_fraction(), 4)   # the classic (p - 1) / (m + p - 1)
      0.3333

    References:
      Huang et al. 2019, GPipe; Narayanan et al. 2021, Memory-Efficient Pipeline-Parallel
      DNN Training (PipeDream-flush); Narayanan et al. 2021 (SC), Efficient Large-Scale
      Language Model Training on GPU Clusters (interleaved 1F1B); Qi et al. 2023, Zero
      Bubble Pipeline Parallelism (B/W split).
    """

    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    split_backward: bool
    table: tuple[tuple[Action | None, ...], ...]

    def __post_init__(self):
        table = tuple(tuple(_action(cell) for cell in row) for row in self.table)
        object.__setattr__(self, "table", table)
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
        name: str = "custom",
    ) -> Schedule:
        """Builds a schedule from each stage's order of actions, run as early as allowed.

        Each stage runs its actions in the given order; each action runs at the first tick
        at which its dependencies are met (one tick after the neighbour's action that it
        needs). ``W`` actions may be left out of an order: each ``W`` then runs right after
        its ``B``.

        Args:
          orders: one entry per stage, a string ``"F0 F1 B0 B1"`` or a list of actions.
          split_backward: see :class:`Schedule`.
          microbatches, virtual_stages: default to the largest ones named, plus one.
          name: a label.

        Returns:
          The :class:`Schedule`.

        Raises:
          ValueError: if an order is incomplete, repeats an action, or deadlocks.

        Example:
          >>> s = Schedule.from_orders(["F0 F1 B0 B1", "F0 B0 F1 B1"])
          >>> s.ticks
          9
        """
        parsed = [_parse_order(order, s) for s, order in enumerate(orders)]
        microbatches, virtual_stages = _sizes(parsed, microbatches, virtual_stages)
        table = dependencies.place(parsed, microbatches, virtual_stages, split_backward)
        return cls(name, len(parsed), microbatches, virtual_stages, split_backward, table)

    @classmethod
    def from_table(
        cls,
        rows: Sequence[str | Sequence[str | Action | None]],
        *,
        split_backward: bool = False,
        microbatches: int | None = None,
        virtual_stages: int | None = None,
        name: str = "custom",
    ) -> Schedule:
        """Builds a schedule from an explicit table, drawn as :meth:`text` draws it.

        Args:
          rows: one row per stage, one cell per tick: a string ``"F0 F1 .  B0 W0"`` (``.``
            is idle) or a list of cells. Short rows are padded with idle ticks.
          split_backward, microbatches, virtual_stages, name: as for :meth:`from_orders`.

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
        return cls(name, len(cells), microbatches, virtual_stages, split_backward, table)

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
        """An action's string form in this schedule (the chunk is shown when interleaved)."""
        return action.label(self.virtual_stages > 1)

    def actions(self, stage: int) -> list[Action]:
        """The actions of ``stage`` in the order it runs them."""
        self._check_stage(stage)
        return [row[stage] for row in self.table if row[stage] is not None]

    def order(self, stage: int) -> list[str]:
        """The actions of ``stage`` in order, as strings: ``["F0", "F1", "B0", "W0", ...]``."""
        return [self.label(a) for a in self.actions(stage)]

    def time(self, f: float = 1, b: float = 2, w: float | None = None) -> float:
        """Total time of the lock-step run: the sum over ticks of the tick's slowest action.

        Args:
          f: cost of a forward.
          b: cost of a whole backward; ``B`` costs ``b - w`` and ``W`` costs ``w``.
          w: the weight-gradient part of ``b``; default ``b / 2`` (about right for matmuls).

        Returns:
          ``sum_t max_s cost(table[t][s])``, idle cells costing 0.
        """
        cost = _costs(f, b, w)
        return sum(
            max((cost[a.kind] for a in row if a is not None), default=0) for row in self.table
        )

    def bubble_fraction(self, f: float = 1, b: float = 2, w: float | None = None) -> float:
        """The fraction of stage-time spent idle or waiting when the table runs in lock-step.

        With ``T = time(f, b, w)`` (the sum over ticks of each tick's slowest action) and
        ``U = virtual_stages * microbatches * (f + b)`` the useful work of each stage::

            bubble = 1 - (stages * U) / (stages * T) = 1 - U / T

        An action that is faster than the slowest one in its tick waits for it, so mixing
        cheap and expensive actions in one tick counts as bubble, as it costs in SPMD.

        With ``f = 1, b = 2`` (``B = W = 1``): GPipe and 1F1B give ``(p - 1) / (m + p - 1)``
        and interleaved 1F1B ``(p - 1) / (v m + p - 1)`` when the backward is not split,
        and ``2 (p - 1) / (3 m + 2 (p - 1))`` (``v m`` for ``m`` when interleaved) when it is.

        Args:
          f, b, w: costs per action (per chunk, for interleaved schedules), as for :meth:`time`.

        Returns:
          A float in ``[0, 1)``.
        """
        useful = self.virtual_stages * self.microbatches * (f + b)
        return 1 - useful / self.time(f, b, w)

    def peak_in_flight(self, stage: int) -> int:
        """Most micro-batch chunks whose residuals ``stage`` holds at once (``F`` run, ``W`` not).

        1F1B holds ``min(stages - stage, microbatches)``; GPipe holds ``microbatches``.
        """
        held = peak = 0
        for action in self.actions(stage):
            if action.kind == "F":
                held += 1
                peak = max(peak, held)
            elif action.kind == "W":
                held -= 1
        return peak

    def as_arrays(self) -> buffers.ScheduleArrays:
        """The table and its buffer plan as int32 arrays ``[ticks, stages]``, for a runtime.

        Returns:
          A :class:`parallax.pipeline.buffers.ScheduleArrays`.
        """
        return buffers.schedule_arrays(self)

    def text(self, f: float = 1, b: float = 2, w: float | None = None) -> str:
        """An ASCII Gantt chart: one row per stage, one column per tick (``.`` is idle)."""
        labels = [[self.label(a) if a is not None else "." for a in row] for row in self.table]
        width = max([len(x) for row in labels for x in row] + [len(str(max(self.ticks - 1, 0)))])
        chunks = f", {self.virtual_stages} chunks per stage" if self.virtual_stages > 1 else ""
        head = (
            f"{self.name}: {self.stages} stages, {self.microbatches} micro-batches{chunks}, "
            f"{'split' if self.split_backward else 'fused'} backward; {self.ticks} ticks, "
            f"bubble {100 * self.bubble_fraction(f, b, w):.1f}% "
            f"(f={f}, b={b}, w={b / 2 if w is None else w})"
        )
        name_width = len(f"stage {self.stages - 1}") + 1
        lines = [
            head,
            "tick".ljust(name_width) + " ".join(str(t).ljust(width) for t in range(self.ticks)),
        ]
        for s in range(self.stages):
            cells = " ".join(labels[t][s].ljust(width) for t in range(self.ticks))
            lines.append(f"stage {s}".ljust(name_width) + cells)
        lines.append("F forward, B input-gradient backward, W weight-gradient backward, . idle")
        return "\n".join(line.rstrip() for line in lines)

    def plot(self, path=None, *, f: float = 1, b: float = 2, w: float | None = None):
        """A Gantt chart in time units (needs matplotlib): :func:`parallax.pipeline.plot.plot`."""
        return _plot.plot(self, path, f=f, b=b, w=w)

    def _check_stage(self, stage: int) -> None:
        if not 0 <= stage < self.stages:
            raise ValueError(f"schedule: stage {stage} is out of range for {self.stages} stages")

    def __repr__(self) -> str:
        return (
            f"Schedule({self.name!r}, stages={self.stages}, microbatches={self.microbatches}, "
            f"virtual_stages={self.virtual_stages}, split_backward={self.split_backward}, "
            f"ticks={self.ticks})"
        )
