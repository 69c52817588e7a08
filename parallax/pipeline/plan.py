"""What the SPMD runtime executes: a schedule's arrays, per-cell flags and its buffer slots.

:meth:`Schedule.as_arrays` gives the actions and the two communication rings (activations
received from the previous virtual stage, gradients from the next one). The runtime also
keeps, on each stage, the state of the backward between actions, in four more rings whose
slots this module assigns from the same table (lowest free slot first, as
:mod:`parallax.pipeline.buffers` does), so the schedule stays the single source of truth.
Every ring has one spare row that takes the writes of ticks that write nothing to it: the
runtime then writes each ring once per tick, outside its ``lax.switch`` (a buffer passed
through a switch is copied by XLA, measured):

* ``inputs``: a stage's input ``x``, for a micro-batch whose forward is rematerialised; ``F``
  writes it, ``B`` reads it to recompute the forward;
* ``residuals``: the per-layer residuals of ``jax.vjp``; ``F`` writes them (``B`` when the
  forward is rematerialised), ``W`` reads them. Without rematerialisation these are exactly
  the slots of ``Schedule.as_arrays().stash``;
* ``cotangents``: the gradient of each layer's output, computed by ``B`` (which walks the
  layers backwards) and read by ``W``, so ``W`` needs no chain through the layers;
* ``seeds``: on the last virtual stage, the loss's gradient with respect to the stage's
  output, computed with the loss at ``F`` and read by ``B``.

Each kind of action is one branch of a ``lax.switch``; three flags per cell say what else
the action does: whether it runs on virtual stage 0 (``first`` runs there), on the last
virtual stage (``last`` runs there) and whether its forward is rematerialised.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from parallax.pipeline.action import Action
from parallax.pipeline.buffers import _assign
from parallax.pipeline.schedule import Schedule

RINGS = ("inputs", "residuals", "cotangents", "seeds")  # and the two of Schedule.as_arrays:
COMMUNICATION = ("activations", "gradients")


class RuntimePlan(NamedTuple):
    """Per-tick, per-stage indices the runtime reads (int32 ``[ticks, stages]``, -1 = none)."""

    kind: np.ndarray  # 0 idle, 1 F, 2 B, 3 W (as Schedule.as_arrays): the switch's branch
    first: np.ndarray  # F, B on virtual stage 0
    last: np.ndarray  # F, B on the last virtual stage
    remat: np.ndarray  # F, B of a rematerialised micro-batch
    microbatch: np.ndarray  # clamped to 0 where idle
    chunk: np.ndarray  # clamped to 0 where idle
    slots: dict  # ring name -> [T, S] slot the cell's action reads or writes (-1: none)
    writes: dict  # ring name -> [T, S] slot written in the tick; ``capacity``: the spare row
    capacity: dict  # ring name -> slots per stage (max over stages; SPMD shapes agree)


def remat_flags(remat: str, microbatches: int) -> list[bool]:
    """Which micro-batches' forwards are rematerialised, for a torchgpipe option.

    A JAX checkpoint policy is applied inside every forward instead, so it marks none.
    """
    if remat == "always":
        return [True] * microbatches
    if remat == "except_last":
        return [m != microbatches - 1 for m in range(microbatches)]
    return [False] * microbatches


def runtime_plan(schedule: Schedule, remat: str = "never") -> RuntimePlan:
    """The runtime's plan for ``schedule`` with the torchgpipe option ``remat``.

    Args:
      schedule: a validated :class:`Schedule`.
      remat: ``"always"``, ``"except_last"``, ``"never"`` or a checkpoint policy name (the
        latter plans like ``"never"``).

    Returns:
      A :class:`RuntimePlan`.

    Example:
      >>> from parallax.pipeline import schedule
      >>> plan = runtime_plan(schedule("1f1b", 2, 4), remat="always")
      >>> plan.capacity["inputs"], plan.capacity["residuals"]
      (2, 1)
    """
    arrays = schedule.as_arrays()
    T, S, V, M = schedule.ticks, schedule.stages, schedule.virtual_stages, schedule.microbatches
    rematted = remat_flags(remat, M)
    last = S * V - 1
    tick = schedule.tick_of
    slots = {name: np.full((T, S), -1, np.int32) for name in RINGS}
    written = {name: np.zeros((T, S), bool) for name in RINGS}
    capacity = {}
    for name in RINGS:
        per_stage = []
        for s in range(S):
            spans = []
            for c in range(V):
                for m in range(M):
                    f, b, w = (tick[(Action(k, m, c), s)] for k in "FBW")
                    r = rematted[m]
                    uses = {  # the ticks whose action uses the slot; the first one writes it
                        "inputs": (f, b) if r else None,
                        "residuals": (b, w) if r else (f, b, w),
                        "cotangents": (b, w),
                        "seeds": (f, b) if c * S + s == last else None,
                    }[name]
                    if uses is not None:
                        spans.append((uses[0], uses[-1], uses))
            assigned, used = _assign(spans)
            for (_, _, uses), slot in zip(spans, assigned):
                for t in uses:
                    slots[name][t, s] = slot
                written[name][uses[0], s] = True
            per_stage.append(used)
        capacity[name] = max(per_stage, default=0)
    capacity["activations"] = int(arrays.activation_capacity.max(initial=0))
    capacity["gradients"] = int(arrays.gradient_capacity.max(initial=0))
    # Every ring has one spare row, ``capacity``: a tick that writes nothing to a ring writes
    # there, so the runtime writes every ring every tick, outside the switch.
    writes = {name: np.where(written[name], slots[name], capacity[name]).astype(np.int32)
              for name in RINGS}
    for name, arrive in (("activations", arrays.arrive_activation),
                         ("gradients", arrays.arrive_gradient)):
        writes[name] = np.where(arrive >= 0, arrive, capacity[name]).astype(np.int32)

    kind = arrays.kind
    chunk, microbatch = np.maximum(arrays.chunk, 0), np.maximum(arrays.microbatch, 0)
    active = (kind == 1) | (kind == 2)
    virtual = chunk * S + np.arange(S)[None, :]
    flags = {
        "first": active & (virtual == 0),
        "last": active & (virtual == last),
        "remat": active & np.asarray(rematted)[microbatch],
    }
    fwd, bwd = kind == 1, kind == 2
    # F reads the activation ring (-1: first(microbatch)); B the gradient ring (-1: the seed)
    slots["activations"] = np.where(fwd, arrays.input, -1).astype(np.int32)
    slots["gradients"] = np.where(bwd, arrays.input, -1).astype(np.int32)
    return RuntimePlan(
        kind=kind,
        **{name: flag.astype(np.int32) for name, flag in flags.items()},
        microbatch=microbatch,
        chunk=chunk,
        slots=slots,
        writes=writes,
        capacity=capacity,
    )
