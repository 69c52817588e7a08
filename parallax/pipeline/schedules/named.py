"""The named schedules: GPipe, 1F1B, interleaved 1F1B, and the zero-bubble and V schedules.

Each is a per-stage order of actions; :meth:`Schedule.from_orders` places every action at its
earliest tick, which reproduces the published timelines under the tick model of
:mod:`parallax.pipeline.schedules`. The classic orders are here; the zero-bubble ones in
:mod:`parallax.pipeline.schedules.zero_bubble`.
"""

from __future__ import annotations

import operator

from parallax.pipeline.schedules import zero_bubble
from parallax.pipeline.schedules.action import Action
from parallax.pipeline.schedules.table import Schedule

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_h2", "interleaved_zb", "zbv",
             "dualpipev")
INTERLEAVED = ("interleaved_1f1b", "interleaved_zb")  # >= 2 looped chunks per stage
V_SHAPED = ("zbv", "dualpipev")  # 2 chunks per stage, V placement
ZERO_BUBBLE = ("zb_h1", "zb_h2", "interleaved_zb", "zbv", "dualpipev")  # split backward


def default_virtual_stages(name) -> int:
    """The chunks per stage a named schedule runs when none are given (2 for V schedules)."""
    return 2 if name in V_SHAPED else 1


def check_chunks(name: str, virtual_stages: int) -> None:
    """Raises ``ValueError`` (prefixed ``schedule:``) if ``name`` cannot run that many chunks."""
    if name in INTERLEAVED and virtual_stages < 2:
        single = "1f1b" if name == "interleaved_1f1b" else "zb_h1"
        raise ValueError(
            f"schedule: {name!r} needs virtual_stages >= 2 model chunks per stage, got "
            f"{virtual_stages}; with one chunk per stage use {single!r}"
        )
    if name in V_SHAPED and virtual_stages != 2:
        raise ValueError(
            f"schedule: {name!r} runs 2 model chunks per stage in the V placement, got "
            f"virtual_stages={virtual_stages}"
        )
    if name not in INTERLEAVED + V_SHAPED and virtual_stages > 1:
        raise ValueError(
            f"schedule: virtual_stages={virtual_stages} needs 'interleaved_1f1b', "
            f"'interleaved_zb', 'zbv' or 'dualpipev'; {name!r} runs one model chunk per stage"
        )


def schedule(
    name: str,
    stages: int,
    microbatches: int,
    virtual_stages: int | None = None,
    split_backward: bool | None = None,
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
    * ``"zb_h1"``, ``"zb_h2"``, ``"interleaved_zb"``, ``"zbv"``, ``"dualpipev"``: the
      zero-bubble schedules (:mod:`parallax.pipeline.schedules.zero_bubble`); they split the
      backward, and ``"zbv"`` and ``"dualpipev"`` run two chunks per stage in the V
      placement.

    Args:
      name: one of :data:`SCHEDULES`.
      stages: pipeline stages, >= 1.
      microbatches: micro-batches per step, >= 1.
      virtual_stages: model chunks per stage: >= 2 for the interleaved schedules, 2 for the V
        ones (their default), 1 for the others (the default).
      split_backward: ``False`` keeps each backward one unit (the published classic
        schedules and their classic bubble); ``True`` lets the previous stage start after
        ``B``. Default: ``False``, and ``True`` for the zero-bubble schedules, which need it.

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
      >>> zb = schedule("zb_h1", stages=4, microbatches=8)
      >>> round(zb.bubble_fraction(f=1, b=1, w=1), 4) == round(3 / 27, 4)
      True
      >>> schedule("zbv", 4, 8).placement.virtual[0]
      (0, 7)

    References:
      Huang et al. 2019, GPipe; Narayanan et al. 2021, Memory-Efficient Pipeline-Parallel
      DNN Training (PipeDream-flush); Narayanan et al. 2021 (SC), Efficient Large-Scale
      Language Model Training on GPU Clusters Using Megatron-LM; Qi et al. 2024, Zero Bubble
      Pipeline Parallelism (ZB-H1, ZB-H2, ZB-V); DeepSeek-AI 2024, DeepSeek-V3 Technical
      Report (DualPipe); PyTorch ``torch.distributed.pipelining`` (interleaved zero bubble,
      ZBV, DualPipeV orders).
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule: unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    stages = check_positive_int("stages", stages)
    microbatches = check_positive_int("microbatches", microbatches)
    virtual_stages = check_positive_int("virtual_stages", default_virtual_stages(name)
                            if virtual_stages is None else virtual_stages)
    check_chunks(name, virtual_stages)
    zero = name in ZERO_BUBBLE
    if split_backward is None:
        split_backward = zero
    elif zero and not split_backward:
        raise ValueError(
            f"schedule: {name!r} moves weight gradients away from their input gradients, so "
            "it needs split_backward=True (its default)"
        )
    p, m, v = stages, microbatches, virtual_stages
    if name == "interleaved_1f1b":
        _check_multiple(p, m)
        orders = interleaved_orders(p, m, v)
    elif name == "interleaved_zb":
        rounds = max(1, m // p)
        if m % rounds:
            lower = (m // rounds) * rounds
            raise ValueError(
                f"schedule: 'interleaved_zb' runs micro-batches in {rounds} rounds of "
                f"max(1, microbatches // stages), so microbatches must be a multiple of "
                f"{rounds}, got {m} for {p} stages (e.g. {lower} or {lower + rounds})"
            )
        orders = zero_bubble.interleaved_zb_orders(p, m, v)
    elif name == "dualpipev":
        if m < 2 * p:
            raise ValueError(
                f"schedule: 'dualpipev' needs at least 2 * stages = {2 * p} micro-batches "
                f"(one per virtual stage), got {m}"
            )
        orders = zero_bubble.dualpipev_orders(p, m)
    else:
        orders = {
            "gpipe": gpipe_orders, "1f1b": one_f_one_b_orders,
            "zb_h1": zero_bubble.zb_h1_orders, "zb_h2": zero_bubble.zb_h2_orders,
            "zbv": zero_bubble.zbv_orders,
        }[name](p, m)
    return Schedule.from_orders(
        orders,
        split_backward=bool(split_backward),
        microbatches=m,
        virtual_stages=v,
        placement="v" if name in V_SHAPED else "looped",
        name=name,
    )


def _check_multiple(stages: int, microbatches: int) -> None:
    """Megatron's interleaved schedule runs micro-batches in groups of ``stages``."""
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


def check_positive_int(field: str, value, api: str = "schedule") -> int:
    """A positive int, or ``TypeError`` / ``ValueError`` naming the API and the field."""
    if isinstance(value, bool):
        raise TypeError(f"{api}: {field} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{api}: {field} must be an int, got {value!r}") from None
    if value < 1:
        raise ValueError(f"{api}: {field} must be >= 1, got {value}")
    return value
