"""The named schedules: GPipe, 1F1B (PipeDream-flush) and Megatron's interleaved 1F1B.

Each is a per-stage order of actions; :meth:`Schedule.from_orders` places every action at its
earliest tick, which reproduces the published timelines under the tick model of
:mod:`parallax.pipeline.schedule`.
"""

from __future__ import annotations

import operator

from parallax.pipeline.schedule import Action, Schedule

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def schedule(
    name: str,
    stages: int,
    microbatches: int,
    virtual_stages: int = 1,
    split_backward: bool = False,
) -> Schedule:
    """Builds a named pipeline schedule as a validated table.

    * ``"gpipe"``: every forward, then every backward.
    * ``"1f1b"``: PipeDream-flush, Megatron's non-interleaved schedule: stage ``s`` runs
      ``min(stages - s - 1, microbatches)`` warm-up forwards, then one forward and one
      backward in turn, then the remaining backwards. Holds at most ``stages - s``
      micro-batches' residuals instead of GPipe's ``microbatches``.
    * ``"interleaved_1f1b"``: Megatron's interleaved schedule, ``virtual_stages`` model
      chunks per stage, micro-batches in groups of ``stages``; needs ``microbatches`` to be a
      multiple of ``stages``.

    A backward is a ``B`` then a ``W`` action (see :mod:`parallax.pipeline.schedule`); in
    these orders each ``W`` directly follows its ``B``.

    Args:
      name: one of ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"``.
      stages: pipeline stages, >= 1.
      microbatches: micro-batches per step, >= 1.
      virtual_stages: model chunks per stage; > 1 only for ``"interleaved_1f1b"``, which
        needs at least 2.
      split_backward: ``False`` keeps each backward one unit (the published schedules and
        their classic bubble); ``True`` lets the previous stage start after ``B``.

    Returns:
      A :class:`Schedule`.

    Raises:
      ValueError: for an unknown name or sizes the schedule cannot run.

    Example:
      >>> from parallax.pipeline import schedule
      >>> s = schedule("1f1b", stages=4, microbatches=8)
      >>> s.peak_in_flight(0), s.peak_in_flight(3)
      (4, 1)
      >>> round(s.bubble_fraction(), 4) == round(3 / 11, 4)
      True

    References:
      Huang et al. 2019, GPipe; Narayanan et al. 2021, Memory-Efficient Pipeline-Parallel
      DNN Training (PipeDream-flush / 2BW); Narayanan et al. 2021 (SC), Efficient
      Large-Scale Language Model Training on GPU Clusters Using Megatron-LM; Qi et al. 2023,
      Zero Bubble Pipeline Parallelism.
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule: unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    stages = _count("stages", stages)
    microbatches = _count("microbatches", microbatches)
    virtual_stages = _count("virtual_stages", virtual_stages)
    if name == "interleaved_1f1b":
        if virtual_stages < 2:
            raise ValueError(
                "schedule: 'interleaved_1f1b' needs virtual_stages >= 2 model chunks per stage, "
                f"got {virtual_stages}; with one chunk per stage use '1f1b'"
            )
        if microbatches < stages:
            raise ValueError(
                f"schedule: interleaved with too few micro-batches: {microbatches} for {stages} "
                "stages; Megatron's interleaved schedule needs microbatches to be a multiple of "
                "stages"
            )
        if microbatches % stages:
            lower = microbatches - microbatches % stages
            raise ValueError(
                "schedule: interleaved needs microbatches to be a multiple of stages, got "
                f"{microbatches} for {stages} stages (e.g. {lower} or {lower + stages})"
            )
        orders = interleaved_orders(stages, microbatches, virtual_stages)
    elif virtual_stages > 1:
        raise ValueError(
            f"schedule: virtual_stages={virtual_stages} needs 'interleaved_1f1b'; {name!r} runs "
            "one model chunk per stage"
        )
    elif name == "gpipe":
        orders = gpipe_orders(stages, microbatches)
    else:
        orders = one_f_one_b_orders(stages, microbatches)
    return Schedule.from_orders(
        orders,
        split_backward=bool(split_backward),
        microbatches=microbatches,
        virtual_stages=virtual_stages,
        name=name,
    )


def gpipe_orders(stages: int, microbatches: int) -> list[list[Action]]:
    """GPipe: all forwards, then all backwards, in micro-batch order."""
    return [
        [Action("F", m) for m in range(microbatches)]
        + [x for m in range(microbatches) for x in _backward(m)]
        for _ in range(stages)
    ]


def one_f_one_b_orders(stages: int, microbatches: int) -> list[list[Action]]:
    """1F1B: warm-up forwards, then one forward and one backward in turn, then the rest."""
    orders = []
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        order = [Action("F", m) for m in range(warmup)]
        for k in range(microbatches - warmup):
            order += [Action("F", warmup + k), *_backward(k)]
        for m in range(microbatches - warmup, microbatches):
            order += _backward(m)
        orders.append(order)
    return orders


def interleaved_orders(stages: int, microbatches: int, virtual_stages: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B with ``virtual_stages`` chunks per stage.

    The ``k``-th forward of a stage is micro-batch ``(k // (p v)) * p + k % p`` on chunk
    ``(k // p) % v``; backwards go through the chunks in reverse. Stage ``s`` warms up with
    ``2 (p - s - 1) + (v - 1) p`` forwards (at most all of them), then alternates.
    """
    p, v = stages, virtual_stages
    total = microbatches * v

    def nth(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (k // (p * v)) * p + k % p, chunk if forward else v - 1 - chunk

    orders = []
    for s in range(p):
        warmup = min(2 * (p - s - 1) + (v - 1) * p, total)
        order = [Action("F", *nth(k, True)) for k in range(warmup)]
        for k in range(total - warmup):
            order += [Action("F", *nth(warmup + k, True)), *_backward(*nth(k, False))]
        for k in range(total - warmup, total):
            order += _backward(*nth(k, False))
        orders.append(order)
    return orders


def _backward(m: int, chunk: int = 0) -> list[Action]:
    return [Action("B", m, chunk), Action("W", m, chunk)]


def _count(field: str, value) -> int:
    if isinstance(value, bool):
        raise TypeError(f"schedule: {field} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"schedule: {field} must be an int, got {value!r}") from None
    if value < 1:
        raise ValueError(f"schedule: {field} must be >= 1, got {value}")
    return value
