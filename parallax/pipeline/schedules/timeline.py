"""A schedule replayed in time, and its bubble as the pipeline papers define it.

The papers that introduced each named schedule cost it the same way: every device runs its
own actions in its own order, each action as soon as that device is free and the action it
needs has finished; ``F``, ``B`` and ``W`` take ``T_F``, ``T_B`` and ``T_W``; sending a
value takes no time. The bubble is the idle time of every device over the makespan
(the end of the last action), with ``W`` counted as work::

    bubble = sum over devices of idle / (devices * makespan)
           = 1 - devices * v * m * (T_F + T_B + T_W) / (devices * makespan)

This is what PyTorch's ``torch.distributed.pipelining`` runtime executes (each rank walks
its action list and blocks on receives), and it is *not* parallax's lock-step runtime
(:meth:`Schedule.time`), where a tick lasts its slowest action on every stage. With equal
costs the two agree for any table whose actions run at their earliest tick (every named
schedule); with unequal costs the lock-step runtime pays more, and
``bubble_fraction(..., lockstep=True)`` says how much.

References:
  Narayanan et al. 2021, Memory-Efficient Pipeline-Parallel DNN Training, section 3
  (1F1B's bubble ``(p - 1) / m`` of the ideal time); Narayanan et al. 2021 (SC),
  Efficient Large-Scale Language Model Training on GPU Clusters, section 2.2 (interleaved:
  ``(p - 1) / (v m)``); Qi et al. 2024, Zero Bubble Pipeline Parallelism, section 2 and
  table 2 (``T_F``, ``T_B``, ``T_W``; ZB-H1's ``(p - 1)(T_F + T_B - T_W)``); Qi et al. 2024,
  Pipeline Parallelism with Controllable Memory (V schedules); PyTorch
  ``torch/distributed/pipelining/schedules.py`` (the per-rank action lists).
"""

from __future__ import annotations

from typing import NamedTuple

from parallax.pipeline.schedules import dependencies
from parallax.pipeline.schedules.action import Action
from parallax.pipeline.schedules.action import costs as _costs


class Span(NamedTuple):
    """One action of a replayed schedule: it runs on its stage from ``start`` to ``end``."""

    action: Action
    start: float
    end: float


def replay(schedule, f: float = 1, b: float = 1, w: float = 1) -> tuple[tuple[Span, ...], ...]:
    """Each stage's actions with their start and end times, every action as early as it may.

    Args:
      schedule: a :class:`~parallax.pipeline.schedules.table.Schedule`; each stage runs its
        actions in the table's order.
      f, b, w: the time of one ``F``, one ``B`` (input gradient) and one ``W`` (weight
        gradient): the zero-bubble paper's ``T_F``, ``T_B``, ``T_W`` (per chunk, for
        schedules with several chunks per stage).

    Returns:
      One tuple of :class:`Span` per stage, in the stage's order.

    Example:
      >>> from parallax.pipeline import schedule
      >>> [tuple(x[1:]) for x in replay(schedule("1f1b", 2, 1), f=1, b=2, w=1)[0]]
      [(0, 1), (5, 7), (7, 8)]
    """
    cost = _costs(f, b, w)
    end: dict[tuple[Action, int], float] = {}
    free = [0] * schedule.stages
    spans: list[list[Span]] = [[] for _ in range(schedule.stages)]
    # A validated table runs every action after the actions it needs, so walking it tick by
    # tick meets each dependency's end time before it is needed.
    for row in schedule.table:
        for s, a in enumerate(row):
            if a is None:
                continue
            needs = dependencies.requirements(a, s, schedule.placement, schedule.split_backward)
            start = max([free[s], *(end[need, ns] for need, ns, _ in needs)])
            end[a, s] = free[s] = start + cost[a.kind]
            spans[s].append(Span(a, start, start + cost[a.kind]))
    return tuple(tuple(row) for row in spans)


def makespan(schedule, f: float = 1, b: float = 1, w: float = 1) -> float:
    """The end of the last action of the replayed schedule (:func:`replay`)."""
    return max((row[-1].end for row in replay(schedule, f, b, w) if row), default=0.0)


def bubble(schedule, f: float = 1, b: float = 1, w: float = 1, *,
           overlap_steps: bool = False) -> float:
    """The papers' bubble: idle time of every stage over the makespan, ``W`` counted as work.

    Args:
      schedule: the schedule.
      f, b, w: as for :func:`replay`.
      overlap_steps: count each stage only from its own first action to its last (the
        longest such span for all), as if the previous and the next step filled the rest:
        the zero-bubble paper's parallelogram, which its post-validated optimizer step makes
        real. ZB-H2 and ZB-V reach 0 by this measure at equal costs once ``m >= 2p``.

    Returns:
      A float in ``[0, 1)``.
    """
    rows = replay(schedule, f, b, w)
    work = schedule.virtual_stages * schedule.microbatches * (f + b + w)
    if overlap_steps:
        span = max(row[-1].end - row[0].start for row in rows if row)
    else:
        span = max(row[-1].end for row in rows if row)
    return 1 - work / span
