"""A pipeline schedule's sizes, without building its table when it is large.

The predictors need four facts of a schedule: its ticks (the runtime sends a payload each
tick), its bubble, the most micro-batches a stage holds, and the rows of the runtime's rings
(``parallax.pipeline.runtime.lowering.LoweredSchedule.rows``) for each rematerialisation
option. They are read from the schedule's own table (``parallax.pipeline.schedule`` and
``lower_schedule``) whenever it is small. A table of 64 stages and 512 micro-batches takes
seconds to build and lower, so for the three published schedules with an unsplit backward
the facts come from closed forms instead (GPipe and 1F1B from ``p >= 2`` stages and
``m >= 2`` micro-batches; interleaved 1F1B with ``v`` chunks from ``p >= 3`` and ``m`` a
multiple of ``p``, at least ``2 p``, or ``m = p`` from 8 stages):

==================  ============  ==================  =====================================
                    GPipe         1F1B                interleaved 1F1B
==================  ============  ==================  =====================================
ticks               ``3 (m + p - 1)``                 ``3 (v m + p - 1)``
bubble              ``1 - 3 v m / ticks``: ``(p - 1) / (v m + p - 1)``
peak in flight      ``m``         ``min(p, m)``       ``(v + 1) p - 1``; ``v p`` at ``m = p``
inbox rows          ``m + 1``     3                   5 up to ``p = 10``, one more every 3
                                                      stages after
never (inputs,      0, ``peak``   0, ``peak``         0, ``peak``
stash)
always              ``peak``, 1   ``peak``, 1         ``peak``, 1
except_last         ``m``, 3      ``p + 1`` (``m``    ``peak + 1`` (``peak - v + 1`` at
                                  if ``m <= p``), 3   ``m = p``), ``v + 2``
==================  ============  ==================  =====================================

(no ring of ``uses``: the backward is not split). They were read off the tables, and
``tests/planner/test_schedule_facts.py`` checks them equal to the tables over a grid
(``p`` up to 20, ``v`` up to 4, ``m`` below, at and above ``p``); the inbox rows were also
read for ``p = 24, 32, 64`` (10, 13, 23). Other schedules and sizes use their tables.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from parallax.pipeline.runtime.lowering import lower_schedule
from parallax.pipeline.schedules.named import check_chunks, default_virtual_stages, schedule
from parallax.pipeline.schedules.table import Schedule

REMATS = ("never", "always", "except_last")
RINGS = ("inbox", "inputs", "stash", "uses")
CLOSED = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclasses.dataclass(frozen=True)
class ScheduleFacts:
    """What the predictors read of a schedule (see the module docstring).

    ``rows[remat][ring]`` is the ring's rows per stage for that rematerialisation option;
    ``from_table`` says whether the facts were read from a built table (else the closed
    forms).
    """

    name: str
    stages: int
    microbatches: int
    virtual_stages: int
    split_backward: bool
    ticks: int
    bubble: float
    peak: int
    rows: dict
    from_table: bool

    def bubble_fraction(self) -> float:
        """Idle over makespan at ``F = B = W`` (``Schedule.bubble_fraction``'s default)."""
        return self.bubble


def _closed_form(name: str, p: int, m: int, v: int) -> bool:
    if name in ("gpipe", "1f1b"):
        return p >= 2 and m >= 2
    return (name == "interleaved_1f1b" and p >= 3 and m % p == 0
            and (m >= 2 * p or (m == p and p >= 8)))


def of_table(table: Schedule) -> ScheduleFacts:
    """The facts of a built schedule (every ring's rows lowered for each option)."""
    rows = {remat: {ring: lower_schedule(table, remat).rows(ring) for ring in RINGS}
            for remat in REMATS}
    peak = max(table.peak_in_flight(stage) for stage in range(table.stages))
    return ScheduleFacts(table.name, table.stages, table.microbatches, table.virtual_stages,
                         table.split_backward, table.ticks, table.bubble_fraction(), peak,
                         rows, True)


@functools.lru_cache(maxsize=256)
def facts(name: str, stages: int, microbatches: int, virtual_stages: int | None = None,
          split_backward: bool | None = None) -> ScheduleFacts:
    """The facts of ``schedule(name, stages, microbatches, virtual_stages, split_backward)``.

    Raises the ``ValueError`` that ``parallax.pipeline.schedule`` raises for sizes the
    schedule cannot run.

    Example:
      >>> f = facts("interleaved_1f1b", 64, 512, 2)     # closed forms: no table built
      >>> f.ticks, f.peak, f.rows["never"]["inbox"], f.from_table
      (3261, 191, 23, False)
      >>> round(f.bubble, 4)
      0.058
    """
    v = default_virtual_stages(name) if virtual_stages is None else virtual_stages
    if split_backward or not _closed_form(name, stages, microbatches, v):
        return of_table(schedule(name, stages, microbatches, virtual_stages, split_backward))
    check_chunks(name, v)
    p, m = stages, microbatches
    ticks = 3 * (v * m + p - 1)
    if name == "gpipe":
        peak, inbox, kept, inputs_last = m, m + 1, 3, m
    elif name == "1f1b":
        peak, inbox, kept = min(p, m), 3, 3
        inputs_last = p + 1 if m > p else m
    else:
        peak = (v + 1) * p - 1 if m >= 2 * p else v * p
        inbox, kept = 5 + max(0, math.ceil((p - 10) / 3)), v + 2
        inputs_last = peak + 1 if m >= 2 * p else peak - v + 1
    rows = {"never": {"inbox": inbox, "inputs": 0, "stash": peak, "uses": 0},
            "always": {"inbox": inbox, "inputs": peak, "stash": 1, "uses": 0},
            "except_last": {"inbox": inbox, "inputs": inputs_last, "stash": kept, "uses": 0}}
    return ScheduleFacts(name, p, m, v, False, ticks, 1 - 3 * v * m / ticks, peak, rows, False)
