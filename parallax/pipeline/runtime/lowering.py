"""A schedule lowered to what the SPMD runtime executes: per-cell codes, flags and ring slots.

:meth:`Schedule.as_arrays` gives the actions and the inbox (what arrives from another
virtual stage, by the channel the placement says: from the previous stage, from the next,
or from this stage itself); the runtime asks it to route the loss's gradient through the
inbox too (the last virtual stage's ``F`` sends it to itself), so every ``B`` reads its
gradient from the inbox. The runtime keeps three more rings whose slots this module assigns
from the same table (lowest free slot first, as :mod:`parallax.pipeline.schedules.slots`
does), so the schedule stays the single source of truth. A ring that some executed write
must send nowhere has one spare row for it (the inbox: an arrival when nothing meant for the
stage was sent; the stash and inputs where only some forwards are rematerialised: the
stash of a forward its ``B`` recomputes, the input of one it does not); the other rings
have none, since every ring is zeroed when the step starts (JAX has no uninitialised
buffer) and a spare row would be zeroed for nothing:

* ``stash``: what ``F`` keeps for ``B`` and ``W`` (the closure's residuals and the uses'
  operands, :mod:`parallax.pipeline.runtime.chunk`); ``F`` writes it (``B`` when the forward
  is rematerialised), ``W`` frees it. Without rematerialisation these are exactly the slots
  of ``Schedule.as_arrays().stash``;
* ``inputs``: a stage's input ``x``, for a micro-batch whose forward is rematerialised;
  ``F`` writes it, ``B`` reads it to recompute the forward;
* ``uses``: the gradient at each use of a parameter, computed by ``B`` and read by ``W``;
* ``versions`` (``weights="stashed"`` only): the chunk's weights as its ``F`` used them, read
  by its ``B`` and ``W`` while later updates change the latest ones (PipeDream's weight
  stashing; the same spans as the stash without rematerialisation);
* ``snapshots`` (module state threaded through the micro-batches only): the state a
  micro-batch's ``F`` started from, read by its ``B`` (a rematerialised forward, and
  ``first``'s backward, recompute from it; :mod:`parallax.pipeline.runtime.stage_state`).

Each kind of action runs in its own guarded loop; three flags per cell say what else the
action does: whether it runs on virtual stage 0 (``first`` runs there), on the last
virtual stage (``last`` runs there) and whether its forward is rematerialised. Where the
schedule does not split the backward, each ``B`` runs its ``W`` (kind ``BW``: the table
puts that ``W`` in the next tick, which then idles), reading the stash once and keeping
no use gradients (no ``uses`` ring), and each stash slot is free after the ``B``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from parallax.pipeline.runtime.rings import RINGS
from parallax.pipeline.schedules.action import KIND_CODES, Action
from parallax.pipeline.schedules.slots import CHANNELS, _assign, schedule_arrays
from parallax.pipeline.schedules.table import Schedule

# The runtime's action codes: the schedule's (0 idle, F 1, B 2, W 3), and a backward that
# runs its W too (``split_backward=False``: the table's W follows its B in the next tick).
RUNTIME_CODES = {**KIND_CODES, "BW": 4}


class LoweredSchedule(NamedTuple):
    """Per-tick, per-stage indices the runtime reads (int32 ``[ticks, stages]``, -1 = none)."""

    kind: np.ndarray  # the guard that runs (RUNTIME_CODES): 0 idle, F 1, B 2, W 3, BW 4
    first: np.ndarray  # F, B on virtual stage 0
    last: np.ndarray  # F, B on the last virtual stage
    remat: np.ndarray  # F, B of a rematerialised micro-batch
    microbatch: np.ndarray  # clamped to 0 where idle
    chunk: np.ndarray  # clamped to 0 where idle
    slots: dict  # ring name -> [T, S] slot the cell's action reads or writes (-1: none)
    writes: dict  # ring name -> [T, S] slot written in the tick; ``capacity``: none (the
    #               spare row, in a ring that has one)
    arrive: dict  # channel ("up", "down", "local") -> [T, S] inbox slot, or the spare row
    capacity: dict  # ring name -> slots per stage (max over stages; SPMD shapes agree)
    mixed: dict  # (kind, flag) -> (some cell of the kind has it, some lacks it): static
    kinds: frozenset  # the action kinds any cell runs ("F", "B", "W", "BW"): static

    @property
    def spares(self) -> frozenset:
        """The rings with a spare row, which some executed write targets: every tick's
        arrivals (the inbox), and where ``mixed`` says only some forwards are
        rematerialised, every F's write to the stash and to the inputs (the runtime then
        writes both, one of them to the spare row: ``actions.forward``). Derived from
        ``mixed``, as the runtime's writes are, so a widened table has what it runs."""
        remat_mixed = all(self.mixed["F", "remat"])
        return frozenset({"inbox"} | ({"stash", "inputs"} if remat_mixed else set()))

    def rows(self, name: str) -> int:
        """The rows of ring ``name``: its slots, and its spare row if it has one."""
        return self.capacity.get(name, 0) + (name in self.spares)

    def table(self) -> dict:
        """The ``[T, S]`` arrays the tick loop scans over (reads clamped to slot 0).

        ``store_<ring>[t]`` is the slot the action of tick ``t`` writes, or the spare row
        (``capacity``) where it writes none there; ``arrive_<channel>[t]`` the inbox slot
        for what arrived from the last tick on that channel, or the spare row.
        """
        table = {name: getattr(self, name) for name in (
            "kind", "first", "last", "remat", "microbatch", "chunk")}
        table |= {f"read_{name}": np.maximum(slot, 0) for name, slot in self.slots.items()}
        table |= {f"store_{name}": slot for name, slot in self.writes.items()}
        return table | {f"arrive_{name}": slot for name, slot in self.arrive.items()}


def widen(lowered) -> list[LoweredSchedule]:
    """Lowered schedules of one size (stages, chunks, micro-batches) padded to one shape: the
    most ticks (idle ticks at the end) and the largest capacity of every ring, with every
    flag mixed that any of them mixes. One compiled program then runs any of their tables,
    passed as arguments."""
    ticks = max(p.kind.shape[0] for p in lowered)
    capacity = {name: max(p.capacity[name] for p in lowered) for name in lowered[0].capacity}
    mixed = {key: tuple(any(p.mixed[key][i] for p in lowered) for i in (0, 1))
             for key in lowered[0].mixed}
    kinds = frozenset().union(*(p.kinds for p in lowered))

    def pad(a, fill):
        return np.concatenate([a, np.full((ticks - a.shape[0], a.shape[1]), fill, a.dtype)])

    def spare(a, old, new):  # the spare row moves to the new capacity
        return pad(np.where(a == old, new, a), new)

    out = []
    for p in lowered:
        inbox_old = p.capacity["inbox"]
        out.append(p._replace(
            **{name: pad(getattr(p, name), 0) for name in (
                "kind", "first", "last", "remat", "microbatch", "chunk")},
            slots={name: pad(slot, -1) for name, slot in p.slots.items()},
            writes={name: spare(w, p.capacity[name], capacity[name])
                    for name, w in p.writes.items()},
            arrive={name: spare(a, inbox_old, capacity["inbox"])
                    for name, a in p.arrive.items()},
            capacity=capacity, mixed=mixed, kinds=kinds))
    return out


def remat_flags(remat: str, microbatches: int) -> list[bool]:
    """Which micro-batches' forwards are rematerialised, for a torchgpipe option.

    A JAX checkpoint policy is applied inside every forward instead, so it marks none.
    """
    if remat == "always":
        return [True] * microbatches
    if remat == "except_last":
        return [m != microbatches - 1 for m in range(microbatches)]
    return [False] * microbatches


def lower_schedule(schedule: Schedule, remat: str = "never",
                   versions: bool = False, snapshots: bool = False) -> LoweredSchedule:
    """``schedule`` lowered for the runtime, with the torchgpipe option ``remat``.

    Args:
      schedule: a validated :class:`Schedule`.
      remat: ``"always"``, ``"except_last"``, ``"never"`` or a checkpoint policy name (the
        latter lowers like ``"never"``).
      versions: assign the ``versions`` ring's slots too (``weights="stashed"``).
      snapshots: assign the ``snapshots`` ring's slots too (module state threaded through the
        micro-batches).

    Returns:
      A :class:`LoweredSchedule`.

    Example:
      >>> from parallax.pipeline import schedule
      >>> lowered = lower_schedule(schedule("1f1b", 2, 4), remat="always")
      >>> lowered.capacity["inputs"], lowered.capacity["stash"]
      (2, 1)
    """
    arrays = schedule_arrays(schedule, local_seeds=True)
    T, S, V, M = schedule.ticks, schedule.stages, schedule.virtual_stages, schedule.microbatches
    split = schedule.split_backward
    rematted = remat_flags(remat, M)
    tick = schedule.tick_of
    capacity = {}
    # the rings whose slots are assigned here (the inbox's come with the schedule's arrays)
    wanted = {"inbox": False, "versions": versions, "snapshots": snapshots}
    rings = [name for name in RINGS if wanted.get(name, True)]
    slots = {name: np.full((T, S), -1, np.int32) for name in rings}
    written = {name: np.zeros((T, S), bool) for name in rings}
    for name in rings:
        per_stage = []
        for s in range(S):
            spans = []
            for c in range(V):
                for m in range(M):
                    f, b, w = (tick[(Action(k, m, c), s)] for k in "FBW")
                    r = rematted[m]
                    # a fused backward (BW) runs W's work in B's tick: nothing waits for W
                    after = (b, w) if split else (b,)
                    uses = {  # the ticks whose action uses the slot; the first one writes it
                        "stash": after if r else (f, *after),
                        "inputs": (f, b) if r else None,
                        "uses": (b, w) if split else None,
                        "versions": (f, *after),
                        "snapshots": (f, b),
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
    capacity["inbox"] = int(arrays.inbox_capacity.max(initial=0))
    # ``capacity`` is the spare row: a write that goes nowhere goes there (an unexecuted
    # one, or in a ring with a spare row, ``LoweredSchedule.spares``, an executed one).
    writes = {name: np.where(written[name], slots[name], capacity[name]).astype(np.int32)
              for name in rings}
    arrive = {channel: np.where(a >= 0, a, capacity["inbox"]).astype(np.int32)
              for channel, a in zip(CHANNELS, (arrays.arrive_up, arrays.arrive_down,
                                               arrays.arrive_local))}
    slots["inbox"] = arrays.input  # F: its activation (-1: first(micro-batch)); B: gradient

    kind = arrays.kind
    if not split:  # each B runs its W (whose tick, right after it, then idles)
        kind = np.where(kind == KIND_CODES["B"], RUNTIME_CODES["BW"],
                        np.where(kind == KIND_CODES["W"], 0, kind)).astype(kind.dtype)
    chunk, microbatch = np.maximum(arrays.chunk, 0), np.maximum(arrays.microbatch, 0)
    active = np.isin(kind, [RUNTIME_CODES[k] for k in ("F", "B", "BW")])
    virtual = np.asarray(schedule.placement.virtual)[np.arange(S)[None, :], chunk]
    flags = {
        "first": active & (virtual == 0),
        "last": active & (virtual == schedule.placement.count - 1),
        "remat": active & np.asarray(rematted)[microbatch],
    }
    mixed = {}
    for kind_name in ("F", "B", "BW"):
        cells = kind == RUNTIME_CODES[kind_name]
        for name, flag in flags.items():
            mixed[kind_name, name] = (bool(flag[cells].any()), bool((~flag[cells]).any()))
    return LoweredSchedule(
        kind=kind,
        **{name: flag.astype(np.int32) for name, flag in flags.items()},
        microbatch=microbatch,
        chunk=chunk,
        slots=slots,
        writes=writes,
        arrive=arrive,
        capacity=capacity,
        mixed=mixed,
        kinds=frozenset(k for k, code in RUNTIME_CODES.items() if (kind == code).any()),
    )
