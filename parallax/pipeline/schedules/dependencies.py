"""The dependency rules of a pipeline schedule, in one place.

:func:`requirements` says which actions must run before an action; :func:`check` validates
a table against the rules and :func:`place` builds a table from per-stage orders, running
every action at the first tick the rules allow. The schedule's
:class:`~parallax.pipeline.schedules.placement.Placement` says which virtual stage each
(stage, chunk) runs; activations flow up the virtual stages, gradients down.
"""

from __future__ import annotations

from parallax.pipeline.schedules.action import KINDS, Action
from parallax.pipeline.schedules.placement import Placement


_FORWARD = (
    "a forward needs the previous stage's activation, which arrives one tick after it is sent"
)
_BACKWARD = "a backward needs the gradient from the next stage first"
_FUSED = " (with split_backward=False, the next stage's backward ends with its W)"
_RESIDUALS = "a backward needs its own forward's residuals"
_WEIGHT = "a weight gradient needs the output gradient that its B received"


def requirements(action: Action, stage: int, placement: Placement, split_backward: bool):
    """The ``(action, stage, reason)`` triples that must run at earlier ticks than ``action``."""
    kind, m, c = action
    virtual = placement.virtual_stage(stage, c)
    if kind == "F":
        if virtual == 0:
            return []
        s, chunk = placement.location(virtual - 1)
        return [(Action("F", m, chunk), s, _FORWARD)]
    if kind == "B":
        needs = [(Action("F", m, c), stage, _RESIDUALS)]
        if virtual < placement.count - 1:
            s, chunk = placement.location(virtual + 1)
            if split_backward:
                needs.append((Action("B", m, chunk), s, _BACKWARD))
            else:
                needs.append((Action("W", m, chunk), s, _BACKWARD + _FUSED))
        return needs
    return [(Action("B", m, c), stage, _WEIGHT)]


def check(schedule) -> None:
    """Raises ``ValueError`` for the first broken rule (see ``Schedule.validate``)."""
    for field in ("stages", "microbatches", "virtual_stages"):
        value = getattr(schedule, field)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"schedule: {field} must be an int, got {value!r}")
        if value < 1:
            raise ValueError(f"schedule: {field} must be >= 1, got {value}")
    stages, label = schedule.stages, schedule.label
    seen: dict[tuple[Action, int], list[int]] = {}
    for t, row in enumerate(schedule.table):
        if len(row) != stages:
            raise ValueError(f"schedule: tick {t} has {len(row)} cells for {stages} stages")
        for s, a in enumerate(row):
            if a is None:
                continue
            if (
                a.kind not in KINDS
                or not 0 <= a.microbatch < schedule.microbatches
                or not 0 <= a.chunk < schedule.virtual_stages
            ):
                raise ValueError(
                    f"schedule: {a.label()} on stage {s} at tick {t} is out of range: kinds are "
                    f"F, B, W; micro-batches 0..{schedule.microbatches - 1}; "
                    f"chunks 0..{schedule.virtual_stages - 1}"
                )
            seen.setdefault((a, s), []).append(t)
    _check_complete(schedule, seen, "ticks")

    tick = schedule.tick_of
    for t, row in enumerate(schedule.table):
        for s, a in enumerate(row):
            if a is None:
                continue
            for need, ns, reason in requirements(
                a, s, schedule.placement, schedule.split_backward
            ):
                u = tick[(need, ns)]
                if u >= t:
                    when = "before" if u > t else "in the same tick as"
                    raise ValueError(
                        f"schedule: {label(a)} on stage {s} at tick {t} runs {when} "
                        f"{label(need)} on stage {ns} (tick {u}); {reason}"
                    )
            if a.kind == "W" and not schedule.split_backward:
                u = tick[(Action("B", a.microbatch, a.chunk), s)]
                if u != t - 1:
                    raise ValueError(
                        f"schedule: {label(a)} on stage {s} at tick {t} does not directly follow "
                        f"its B (tick {u}); with split_backward=False, W runs in the tick right "
                        "after its B (they are the two halves of one backward)"
                    )


def _check_complete(schedule, seen: dict, where: str) -> None:
    """Every (stage, micro-batch, chunk) has exactly one F, one B and one W."""
    for (a, s), places in seen.items():
        if len(places) > 1:
            raise ValueError(
                f"schedule: {schedule.label(a)} appears {len(places)} times on stage {s} ({where} "
                f"{', '.join(map(str, places))}); every action runs exactly once"
            )
    for s in range(schedule.stages):
        for c in range(schedule.virtual_stages):
            for m in range(schedule.microbatches):
                for kind in KINDS:
                    if (Action(kind, m, c), s) not in seen:
                        raise ValueError(
                            f"schedule: {schedule.label(Action(kind, m, c))} is missing on "
                            f"stage {s}; "
                            "every (stage, micro-batch, chunk) needs one F, one B and one W"
                        )


class _Sizes:
    """The fields of a schedule that the rules read, before the schedule exists."""

    def __init__(self, stages, microbatches, virtual_stages):
        self.stages, self.microbatches, self.virtual_stages = stages, microbatches, virtual_stages

    def label(self, action):
        return action.label(self.virtual_stages > 1)


def place(orders: list[list[Action]], microbatches: int, placement: Placement,
          split_backward: bool):
    """Runs each stage's order, every action at its earliest tick; returns the table.

    Raises:
      ValueError: if an order misses or repeats an action, or the orders deadlock.
    """
    stages, virtual_stages = len(orders), placement.chunks
    if stages < 1:
        raise ValueError("schedule: orders must list at least one stage")
    if stages != placement.stages:
        raise ValueError(
            f"schedule: {stages} orders for a placement of {placement.stages} stages"
        )
    sizes = _Sizes(stages, microbatches, virtual_stages)
    seen: dict = {}
    for s, order in enumerate(orders):
        for i, a in enumerate(order):
            seen.setdefault((a, s), []).append(i)
    _check_complete(sizes, seen, "positions")

    done: dict = {}
    position = [0] * stages
    table = []
    remaining = sum(len(order) for order in orders)
    while remaining:
        t = len(table)
        row, blocked = [None] * stages, []
        for s, order in enumerate(orders):
            if position[s] == len(order):
                continue
            a = order[position[s]]
            needs = requirements(a, s, placement, split_backward)
            missing = [(n, ns) for n, ns, _ in needs if done.get((n, ns), t) >= t]
            if missing:
                blocked.append(
                    f"stage {s}'s next action {sizes.label(a)} needs "
                    f"{sizes.label(missing[0][0])} on stage {missing[0][1]}"
                )
            else:
                row[s] = a
        if all(a is None for a in row):
            raise ValueError(f"schedule: the orders deadlock at tick {t}: {'; '.join(blocked)}")
        for s, a in enumerate(row):
            if a is not None:
                done[(a, s)] = t
                position[s] += 1
                remaining -= 1
        table.append(tuple(row))
    return tuple(table)
