"""What a lock-step runtime reads from a schedule: int arrays and a buffer plan.

Two kinds of buffers live on each stage, each a ring of slots whose indices the plan fixes:

* the **stash**: an ``F`` writes its residuals to a slot; its ``B`` and ``W`` read them;
  ``W`` frees it. Capacity = :meth:`Schedule.peak_in_flight`.
* the **inbox**: what arrives from another virtual stage, an activation for an ``F`` or
  a gradient for a ``B``. A value sent at tick ``t`` arrives at ``t + 1`` by one of three
  channels, fixed by the placement: from the previous stage (``s - 1``, cyclically), from
  the next stage (``s + 1``), or from this stage itself (the V placement's turn, and
  stages holding consecutive virtual stages). It is kept until the action that reads it.

Slots are assigned first-come, lowest-free-first, which uses exactly as many slots as the
largest number of values held at once. A slot read in a tick is not written in that tick.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

import numpy as np

from parallax.pipeline.schedules.action import KIND_CODES, Action

CHANNELS = ("up", "down", "local")  # what arrived from s - 1, from s + 1, from s itself


class ScheduleArrays(NamedTuple):
    """A schedule as arrays. All are int32; ``[T, S]`` is ``[ticks, stages]``; -1 means none.

    At tick ``t`` a stage ``s`` first stores what arrived (``arrive_up``, ``arrive_down``,
    ``arrive_local`` give the inbox slots), then runs ``kind[t, s]`` on
    ``microbatch[t, s]``, ``chunk[t, s]``, then sends its output (an ``F``'s activation, a
    ``B``'s input gradient) to both neighbours and keeps it for itself.
    """

    kind: np.ndarray  # [T, S]: 0 idle, 1 F, 2 B, 3 W (action.KIND_CODES)
    microbatch: np.ndarray  # [T, S]
    chunk: np.ndarray  # [T, S]
    stash: np.ndarray  # [T, S] stash slot written by F, read by B and W
    # [T, S] inbox slot read: F its activation (-1: the micro-batch itself, virtual stage 0),
    # B its gradient (-1: the loss's, last virtual stage); W reads none
    input: np.ndarray
    arrive_up: np.ndarray  # [T, S] inbox slot for what stage s - 1 sent last tick
    arrive_down: np.ndarray  # [T, S] inbox slot for what stage s + 1 sent last tick
    arrive_local: np.ndarray  # [T, S] inbox slot for what this stage kept last tick
    stash_capacity: np.ndarray  # [S]
    inbox_capacity: np.ndarray  # [S]


def schedule_arrays(schedule, local_seeds: bool = False) -> ScheduleArrays:
    """Builds the arrays and buffer plan of ``schedule`` (``Schedule.as_arrays``).

    With ``local_seeds``, the last virtual stage's ``F`` also sends the loss's gradient to
    itself (the ``"local"`` channel) and its ``B`` reads it from the inbox like any other
    gradient: what parallax's runtime does, so that every ``B`` reads the inbox.
    """
    T, S, V = schedule.ticks, schedule.stages, schedule.virtual_stages
    place = schedule.placement
    last = place.count - 1
    tick = schedule.tick_of
    full = lambda: np.full((T, S), -1, np.int32)  # noqa: E731
    kind = np.zeros((T, S), np.int32)
    microbatch, chunk, stash, inputs = (full() for _ in range(4))
    arrive = {channel: full() for channel in CHANNELS}
    capacities = np.zeros((2, S), np.int32)

    for s in range(S):
        stash_spans, inbox_spans = [], []
        for c in range(V):
            virtual = place.virtual_stage(s, c)
            for m in range(schedule.microbatches):
                f, b, w = (tick[(Action(k, m, c), s)] for k in "FBW")
                stash_spans.append((f, w, (f, b, w), None))
                # what this action reads from another virtual stage, and how it comes
                for other, kind_sent, reader in ((virtual - 1, "F", f), (virtual + 1, "B", b)):
                    if local_seeds and other == last + 1:  # the seed: from its own F
                        inbox_spans.append((f + 1, b, (b,), "local"))
                    if 0 <= other <= last:
                        src, src_chunk = place.location(other)
                        sent = tick[(Action(kind_sent, m, src_chunk), src)]
                        # "up" arrives from s - 1, "down" from s + 1, "local" from s itself
                        channel = place.direction(other, virtual)
                        inbox_spans.append((sent + 1, reader, (reader,), channel))
        for i, (spans, readers) in enumerate(((stash_spans, stash), (inbox_spans, inputs))):
            assigned, capacities[i, s] = _assign(spans)
            for (start, _, uses, channel), slot in zip(spans, assigned):
                if channel is not None:
                    arrive[channel][start, s] = slot
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
    inputs[kind == KIND_CODES["W"]] = -1  # W reads the stash, not the inbox
    return ScheduleArrays(kind, microbatch, chunk, stash, inputs, arrive["up"],
                          arrive["down"], arrive["local"], *capacities)


def _assign(spans: list[tuple]) -> tuple[list[int], int]:
    """Slots for inclusive tick intervals ``(start, end, ...)``: lowest free slot, by start."""
    slots = [0] * len(spans)
    free: list[int] = []
    busy: list[tuple[int, int]] = []  # (end, slot)
    used = 0
    for i in sorted(range(len(spans)), key=lambda i: spans[i][:2]):
        start, end = spans[i][:2]
        while busy and busy[0][0] < start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            slots[i] = heapq.heappop(free)
        else:
            slots[i], used = used, used + 1
        heapq.heappush(busy, (end, slots[i]))
    return slots, used
