"""Zero-bubble and V schedules as per-stage orders: ZB-H1, ZB-H2, interleaved ZB, ZB-V, DualPipeV.

Every one splits the backward into ``B`` (input gradient, on the critical path) and ``W``
(weight gradient, movable), so the schedules built from these orders have
``split_backward=True``; :meth:`Schedule.from_orders` places each action at its earliest
tick. With costs ``F = B = W = 1``:

* ``zb_h1`` (Qi et al. 2024, "ZB-H1"): 1F1B's warm-up and memory (``p`` micro-batches in
  flight on every stage), the ``W`` of stage ``s`` delayed by ``s`` steady iterations, so
  ``B`` reaches the first stage sooner and the ``W`` fill the tail. Bubble
  ``(p - 1) / (3 m + p - 1)``: the paper's ``(p - 1)(F + B - W)`` per stage, a third of
  1F1B's. It is the one-chunk case of ``interleaved_zb``.
* ``zb_h2`` ("ZB-H2"): ``2 (p - s) - 1`` warm-up forwards on stage ``s`` fill the bubble
  before the first ``B``; then ``B F W``; stage ``s`` defers its last ``2 s`` weight
  gradients to the tail, turning 1F1B's trapezoid into a parallelogram: every stage is busy
  for exactly ``3 m`` ticks once ``m >= 2p``, at up to ``2p - 1`` micro-batches of full
  activations (``2p`` counting those whose ``W`` is pending). Derived here from the
  paper's description; no reference implementation publishes its order.
* ``interleaved_zb``: PyTorch's ``ScheduleInterleavedZeroBubble`` (the paper's ZB-1p on
  looped chunks): Megatron's interleaved order with one fewer warm-up forward per hop, and
  each stage's ``W`` deferred by its rank.
* ``zbv`` (the paper's ZB-V, PyTorch's ``ScheduleZBVZeroBubble``): two chunks per stage in
  the V placement; 1F1B's memory, zero bubble at ``m >= 2p`` when steps overlap.
* ``dualpipev``: PyTorch's ``ScheduleDualPipeV``, the V form of DeepSeek-V3's DualPipe: the
  steady phase pairs the forward of one chunk with the full backward of the other (DualPipe
  overlaps them to hide MoE all-to-all time). In the lock-step tick model a pair is its
  actions in consecutive ticks, a full backward is ``B`` then ``W``: parallax has no
  communication of that kind to hide, so the pairing is kept as an order, not as one action.
"""

from __future__ import annotations

from collections import defaultdict, deque

from parallax.pipeline.schedules.action import Action


def zb_h1_orders(stages: int, microbatches: int) -> list[list[Action]]:
    """ZB-H1: 1F1B's warm-up, ``W`` of stage ``s`` deferred by ``s`` steady iterations."""
    return interleaved_zb_orders(stages, microbatches, 1)


def zb_h2_orders(stages: int, microbatches: int) -> list[list[Action]]:
    """ZB-H2: more warm-up forwards, ``B F W``, the last ``2s`` weight gradients at the tail."""
    orders = []
    for s in range(stages):
        warmup = min(2 * (stages - s) - 1, microbatches)
        order = [Action("F", j) for j in range(warmup)]
        forwards, weights = warmup, 0
        for k in range(microbatches):
            order.append(Action("B", k))
            if forwards < microbatches:
                order.append(Action("F", forwards))
                forwards += 1
            if weights < k + 1 - 2 * s:  # stage s keeps 2s weight gradients for the tail
                order.append(Action("W", weights))
                weights += 1
        order += [Action("W", j) for j in range(weights, microbatches)]
        orders.append(order)
    return orders


def interleaved_zb_orders(stages: int, microbatches: int,
                          virtual_stages: int) -> list[list[Action]]:
    """PyTorch's interleaved zero-bubble order (ZB-1p), looped chunks.

    Micro-batches go through the chunks in rounds of ``r = m / max(1, m // p)``; stage
    ``s`` warms up with ``(v - 1) r + p - 1 - s`` forwards, then runs one forward and one
    ``B`` per step, and a ``W`` (the oldest pending) once ``s`` steps have passed.
    """
    p, m, v = stages, microbatches, virtual_stages
    per_round = m // max(1, m // p)
    total = m * v
    orders = []
    for s in range(p):
        warmup = min((v - 1) * per_round + p - 1 - s, total)
        counters: dict[tuple[str, int], int] = defaultdict(int)
        pending: deque[Action] = deque()
        order: list[Action] = []

        def add(kind: str, chunk: int) -> None:
            action = Action(kind, counters[kind, chunk], chunk)
            counters[kind, chunk] += 1
            order.append(action)
            if kind == "B":
                pending.append(Action("W", action.microbatch, chunk))

        def backward(step: int) -> None:
            add("B", v - 1 - ((step - warmup) // per_round) % v)
            if step - warmup >= s:
                order.append(pending.popleft())

        for step in range(total + warmup):
            if step < total:
                add("F", (step // per_round) % v)
            if step >= warmup:
                backward(step)
        order += pending
        orders.append(order)
    return orders


def zbv_orders(stages: int, microbatches: int) -> list[list[Action]]:
    """ZB-V (PyTorch's order): two chunks per stage in the V placement.

    Built for ``max(m, 2p - 1)`` micro-batches (the count the steady phase needs), then the
    actions of micro-batches beyond ``m`` are dropped.
    """
    p, m = stages, microbatches
    n = max(m, 2 * p - 1)
    orders = []
    for s in range(p):
        count: dict[tuple[str, int], int] = defaultdict(int)
        order: list[Action] = []

        def add(kind: str, chunk: int) -> None:
            order.append(Action(kind, count[kind, chunk], chunk))
            count[kind, chunk] += 1

        def full_backward(chunk: int) -> None:  # W right after its B
            order.extend(Action(k, count["B", chunk], chunk) for k in "BW")
            count["B", chunk] += 1

        for _ in range(2 * (p - s) - 1):
            add("F", 0)
        for _ in range(s):
            add("F", 1)
            add("F", 0)
        for _ in range(p - s):
            add("F", 1)
            full_backward(1)
        while count["F", 1] < count["F", 0] or count["F", 0] < n:
            if count["F", 0] < n:
                add("F", 0)
            full_backward(0)
            add("F", 1)
            full_backward(1)
        for chunk in (0, 1):  # the weight gradients left for the tail start here
            count["W", chunk] = count["B", chunk]
        for _ in range(s):
            add("B", 0)
            add("B", 1)
        for _ in range(p - s):
            add("B", 0)
            add("W", 0)
        for chunk in (1, 0):
            while count["W", chunk] < count["B", chunk]:
                add("W", chunk)
        orders.append([a for a in order if a.microbatch < m])
    return orders


def dualpipev_orders(stages: int, microbatches: int) -> list[list[Action]]:
    """DualPipeV (PyTorch's order): forward of one chunk paired with the other's backward.

    Needs ``m >= 2p``. A full backward is ``B`` then ``W``; a zero-bubble backward is a
    ``B`` whose ``W`` waits in a queue and fills a later gap.
    """
    p, m = stages, microbatches
    orders = []
    for s in range(p):
        count: dict[tuple[str, int], int] = defaultdict(int)
        waiting: deque[Action] = deque()
        order: list[Action] = []

        def add(kind: str, chunk: int) -> None:
            order.append(Action(kind, count[kind, chunk], chunk))
            count[kind, chunk] += 1

        def backward(chunk: int, split: bool) -> None:
            b = Action("B", count["B", chunk], chunk)
            count["B", chunk] += 1
            order.append(b)
            if split:
                waiting.append(Action("W", b.microbatch, chunk))
            else:
                order.append(Action("W", b.microbatch, chunk))

        def weight() -> None:
            if waiting:
                order.append(waiting.popleft())

        for _ in range(2 * (p - s - 1)):
            add("F", 0)
        for _ in range(s + 1):
            add("F", 0)
            add("F", 1)
        for _ in range(p - s - 1):
            backward(1, split=True)
            weight()
            add("F", 1)
        for _ in range(m - 2 * p + s + 1):  # the main phase: F0 with B1, F1 with B0
            add("F", 0)
            backward(1, split=False)
            add("F", 1)
            backward(0, split=False)
        for _ in range(p - s - 1):
            backward(1, split=False)
            add("F", 1)
            backward(0, split=False)
        split = False
        for i in range(s + 1):  # the second half of these backwards leaves W for later
            if i == (s + 1) // 2 and s % 2 == 1:
                split = True
            backward(1, split)
            if i == (s + 1) // 2 and s % 2 == 0:
                split = True
            backward(0, split)
        for _ in range(p - s - 1):
            weight()
            backward(0, split)
        for _ in range(s + 1):
            weight()
        order += waiting
        orders.append(order)
    return orders
