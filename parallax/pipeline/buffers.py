"""What a lock-step runtime reads from a schedule: int arrays and a buffer plan.

Three kinds of buffers live on each stage, each a ring of slots whose indices the plan fixes:

* stash: an ``F`` writes its residuals to a slot; its ``B`` and ``W`` read them; ``W``
  frees it. Capacity = :meth:`Schedule.peak_in_flight`.
* activations: an activation sent by the previous virtual stage at tick ``t`` arrives at
  ``t + 1`` and is kept until the ``F`` that reads it.
* gradients: a gradient sent by the next virtual stage's ``B`` arrives one tick later and is
  kept until this stage's ``W`` (both ``B`` and ``W`` read it).

Slots are assigned first-come, lowest-free-first, which uses exactly as many slots as the
largest number of values held at once. A slot read in a tick is not written in that tick.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

from parallax.pipeline.action import KIND_CODES, Action



class ScheduleArrays(NamedTuple):
    """A schedule as arrays. All are int32; ``[T, S]`` is ``[ticks, stages]``; -1 means none.

    At tick ``t`` a stage ``s`` first stores what arrived (``arrive_activation[t, s]``,
    ``arrive_gradient[t, s]`` give the slots), then runs ``kind[t, s]`` on
    ``microbatch[t, s]``, ``chunk[t, s]``, then sends its output to its neighbours.
    """

    kind: np.ndarray  # [T, S]: 0 idle, 1 F, 2 B, 3 W (schedule.KIND_CODES)
    microbatch: np.ndarray  # [T, S]
    chunk: np.ndarray  # [T, S]
    stash: np.ndarray  # [T, S] stash slot written by F, read by B and W
    # [T, S] F: activation slot read (-1: the micro-batch itself); B, W: gradient slot (-1: loss)
    input: np.ndarray
    arrive_activation: np.ndarray  # [T, S] activation slot written at the start of the tick
    arrive_gradient: np.ndarray  # [T, S] gradient slot written at the start of the tick
    stash_capacity: np.ndarray  # [S]
    activation_capacity: np.ndarray  # [S]
    gradient_capacity: np.ndarray  # [S]


def schedule_arrays(schedule) -> ScheduleArrays:
    """Builds the arrays and buffer plan of ``schedule`` (``Schedule.as_arrays``)."""
    T, S, V = schedule.ticks, schedule.stages, schedule.virtual_stages
    last = S * V - 1
    tick = schedule.tick_of
    full = lambda: np.full((T, S), -1, np.int32)  # noqa: E731
    kind = np.zeros((T, S), np.int32)
    microbatch, chunk, stash, inputs, arrive_act, arrive_grad = (full() for _ in range(6))
    capacities = np.zeros((3, S), np.int32)

    for s in range(S):
        stash_spans, act_spans, grad_spans = [], [], []
        for c in range(V):
            virtual = c * S + s
            prev, nxt = virtual - 1, virtual + 1
            for m in range(schedule.microbatches):
                f, b, w = (tick[(Action(k, m, c), s)] for k in "FBW")
                stash_spans.append((f, w, (f, b, w)))
                if virtual > 0:
                    sent = tick[(Action("F", m, prev // S), prev % S)]
                    act_spans.append((sent + 1, f, (f,)))
                if virtual < last:
                    sent = tick[(Action("B", m, nxt // S), nxt % S)]
                    grad_spans.append((sent + 1, w, (b, w)))
        for i, (spans, arrive, readers) in enumerate(
            (
                (stash_spans, None, stash),
                (act_spans, arrive_act, inputs),
                (grad_spans, arrive_grad, inputs),
            )
        ):
            slots, capacities[i, s] = _assign(spans)
            for (start, _, uses), slot in zip(spans, slots):
                if arrive is not None:
                    arrive[start, s] = slot
                for t in uses:
                    readers[t, s] = slot

    for t, row in enumerate(schedule.table):
        for s, a in enumerate(row):
            if a is not None:
                kind[t, s], microbatch[t, s], chunk[t, s] = (
                    KIND_CODES[a.kind],
                    a.microbatch,
                    a.chunk,
                )
    return ScheduleArrays(
        kind, microbatch, chunk, stash, inputs, arrive_act, arrive_grad, *capacities
    )


def _assign(spans: list[tuple[int, int, tuple]]) -> tuple[list[int], int]:
    """Slots for inclusive tick intervals ``(start, end, _)``: lowest free slot, by start."""
    slots = [0] * len(spans)
    free: list[int] = []
    busy: list[tuple[int, int]] = []  # (end, slot)
    used = 0
    for i in sorted(range(len(spans)), key=lambda i: spans[i][:2]):
        start, end, _ = spans[i]
        while busy and busy[0][0] < start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            slots[i] = heapq.heappop(free)
        else:
            slots[i], used = used, used + 1
        heapq.heappush(busy, (end, slots[i]))
    return slots, used
