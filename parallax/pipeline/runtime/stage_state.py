"""A module's non-parameter state in the pipeline runtime: carried by the stages, written by F.

``nnx.BatchNorm``'s running statistics and ``nnx.Dropout``'s RNG streams change during a
forward pass. In the tick scan (:mod:`parallax.pipeline.runtime.ticks`) each stage carries
the state of what it runs: the stacked layers' state (``[L, ...]`` per leaf) is split into
chunks over the stage axis exactly like their parameters, the state of ``first`` and
``last`` is carried where they run. Only ``F`` (the forward action) writes it; the
rematerialised forward inside ``B`` recomputes from what ``F`` started from (kept in the
``snapshots`` ring from ``F`` to ``B``) and its state is dropped, so no forward is counted
twice. Per stage and chunk, ``F`` runs the micro-batches in increasing order in every
schedule (checked), so the state after the step is what a one-device loop over the
micro-batches in order leaves:

- ``threaded`` (``batch_stats="per_microbatch"``): each ``F`` starts from the state the
  previous micro-batch's ``F`` left (GPipe's per-micro-batch statistics; RNG counters
  advance once per micro-batch, each micro-batch draws as its own batch would), the same
  as ``px.GradientAccumulation`` with that option;
- otherwise (a model without BatchNorm in training mode, e.g. only Dropout): every ``F``
  starts from the incoming state and draws micro-batch ``m``'s rows of one device's draw over
  the whole batch (``Position(m, M)`` inside the batch shard's position); floating state is
  averaged over the micro-batches, integers and keys are the (equal) last ones, as
  :func:`parallax.grad.aux_outputs.over_microbatches` does without a pipeline.

Keys travel as their integer data (``jax.random.key_data``): rings, chunk moves and
collectives then carry plain arrays; a forward pass draws from a key but never moves it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallax.grad import sliced_rng
from parallax.pipeline.schedules.action import Action
from parallax.grad.sliced_rng import Position


@dataclasses.dataclass(frozen=True)
class StateRun:
    """How the state flows through a pipelined step (what ``px.value_and_grad`` asked).

    Attributes:
      threaded: ``batch_stats="per_microbatch"``: the state is threaded through the
        micro-batches in order; otherwise every micro-batch starts from the incoming state.
      rng: ``"global"`` or ``"per_shard"`` (:func:`parallax.grad.sliced_rng.slice_keys`).
      index: the batch shard's index (``lax.axis_index`` of the batch axes, or 0).
      shards: the number of batch shards.
    """

    threaded: bool
    rng: str
    index: Any
    shards: int


def _impl(x):
    return jax.random.key_impl(x) if sliced_rng.is_key(x) else None


def encode(leaves: list) -> list:
    """Key leaves as their integer data; other leaves as they are."""
    return [jax.random.key_data(x) if sliced_rng.is_key(x) else x for x in leaves]


class Carrier:
    """The state's codecs and per-micro-batch preparation, for one pipelined step.

    Args:
      run: the :class:`StateRun`.
      stacked, others: the decoded state leaves (their key implementations are read).
      microbatches: ``M``; ``rows``: examples per micro-batch.
      vary: casts a value to vary over the runtime's manual axes.
    """

    def __init__(self, run: StateRun, stacked: list, others: list, microbatches: int,
                 rows: int, vary):
        self.run, self.M, self.rows, self.vary = run, microbatches, rows, vary
        self.stacked_impls = [_impl(x) for x in stacked]
        self.others_impls = [_impl(x) for x in others]

    @property
    def threaded(self) -> bool:
        return self.run.threaded

    def _decode(self, raw: list, impls: list, m) -> list:
        leaves = [x if impl is None else jax.random.wrap_key_data(x, impl=impl)
                  for x, impl in zip(raw, impls)]
        if not any(impl is not None for impl in impls):
            return leaves
        index = jnp.asarray(self.run.index, jnp.uint32)
        where = Position(index, self.run.shards)
        if not self.threaded:  # micro-batch m: block m of this shard's rows
            where = where.refine(jnp.asarray(m, jnp.uint32), self.M)
        return sliced_rng.slice_keys(leaves, where, self.rows, self.run.rng)

    def _encode(self, new: list, raw_in: list, impls: list) -> list:
        # keys are restored (a forward draws from them, it does not move them)
        return [self.vary(jnp.asarray(x).astype(old.dtype) if impl is None else old)
                for x, old, impl in zip(new, raw_in, impls)]

    def layer_in(self, raw: list, m) -> list:
        """A chunk's state ``[L_c, ...]`` as its layers take it for micro-batch ``m``."""
        return self._decode(raw, self.stacked_impls, m)

    def layer_out(self, new: list, raw_in: list) -> list:
        return self._encode(new, raw_in, self.stacked_impls)

    def others_in(self, raw: list, m) -> list:
        """The state of ``first`` / ``last`` as they take it for micro-batch ``m``."""
        return self._decode(raw, self.others_impls, m)

    def others_out(self, new: list, raw_in: list) -> list:
        return self._encode(new, raw_in, self.others_impls)


class Carried(NamedTuple):
    """What one stage's tick loop carries the state with.

    Attributes:
      carrier: the :class:`Carrier`.
      stacked: the chunks' state ``[v, L_c, ...]`` per leaf (raw, varying).
      others: ``first`` / ``last``'s state (raw, varying).
      given: ``first`` / ``last``'s state as passed in (replicated over the stages).
      first_writes, last_writes: which of those leaves ``first`` / ``last`` write.
      owner: the stage whose copy of each of those leaves is the result (None: unwritten).
    """

    carrier: Carrier
    stacked: list
    others: list
    given: list
    first_writes: list
    last_writes: list
    owner: list


def decode_like(raw: list, like: list) -> list:
    """The state after a step from its raw leaves: keys are the incoming ones (unmoved)."""
    return [old if sliced_rng.is_key(old) else x for x, old in zip(raw, like)]


def initial(stacked: list, others: list, threaded: bool, vary) -> dict:
    """The carried state: the live values, and without threading the accumulators."""
    state = {"s_live": list(stacked), "o_live": list(others)}
    if not threaded:
        state["s_acc"] = [vary(a) for a in accumulators(stacked)]
        state["o_acc"] = [vary(a) for a in accumulators(others)]
    return state


def first_last_writes(prog, micro) -> tuple[list, list]:
    """Which leaves of ``prog.others_state`` ``first`` and ``last`` write: traced once here
    (XLA drops the unused values), an output that is its input unchanged is not written."""
    state = list(prog.others_state)
    if not state:
        return [], []
    mb = jax.tree.map(lambda x: x[0], micro)
    x, after_first = prog.first(prog.others, state, mb)
    _, after_last = prog.last(prog.others, state, x, mb)
    return ([a is not b for a, b in zip(after_first, state)],
            [a is not b for a, b in zip(after_last, state)])


def owners(placement, first_writes: list, last_writes: list, api: str) -> list:
    """The stage whose copy of each ``first`` / ``last`` state leaf is the result (None: the
    leaf is not written). ``first`` and ``last`` run on different stages: a leaf both write
    (a shared RNG stream) would advance twice on one device, once on each stage here."""
    both = [i for i, (a, b) in enumerate(zip(first_writes, last_writes)) if a and b]
    if both:
        raise ValueError(
            f"{api}: Stages.first and Stages.last both write the same module variable (state "
            f"leaf {both[0]}; e.g. one nnx.Rngs stream drawn in both); they run on different "
            "pipeline stages, so give each its own stream (nnx.Dropout(..., rngs=rngs) forks "
            "one per layer)")
    virtual = np.asarray(placement.virtual)
    on = lambda k: int(np.argwhere(virtual == k)[0][0])  # noqa: E731
    head, tail = on(0), on(placement.count - 1)
    return [head if a else tail if b else None for a, b in zip(first_writes, last_writes)]


def check_order(sched, api: str) -> None:
    """Every stage's ``F`` of each chunk runs the micro-batches in increasing order."""
    for s in range(sched.stages):
        for c in range(sched.virtual_stages):
            ticks = [sched.tick_of[(Action("F", m, c), s)] for m in range(sched.microbatches)
                     if (Action("F", m, c), s) in sched.tick_of]
            if ticks != sorted(ticks):
                raise ValueError(
                    f"{api}: the schedule {sched.name!r} runs the forwards of stage {s} out "
                    "of micro-batch order; module state (BatchNorm statistics, RNG counters) "
                    "needs them in order: use a schedule that keeps it (1f1b, gpipe)")


def update(state: dict, new: list, others_new: list, cell, carried: Carried) -> dict:
    """The carried state after an ``F`` (inside its guard): ``new`` is the chunk's state
    after it (``[L_c, ...]`` per leaf, raw), ``others_new`` ``first`` / ``last``'s."""
    carrier = carried.carrier
    chunk = cell["chunk"]
    if carrier.threaded:
        state["s_live"] = [_put(live, x, chunk) for live, x in zip(state["s_live"], new)]
        state["o_live"] = list(others_new)
        return state
    state["s_acc"] = [_put(acc, _add(_at(acc, chunk), x, True), chunk)
                      for acc, x in zip(state["s_acc"], new)]
    took = [(cell["first"] > 0) & f | (cell["last"] > 0) & t
            for f, t in zip(carried.first_writes, carried.last_writes)]
    state["o_acc"] = [_add(acc, x, on) for acc, x, on in
                      zip(state["o_acc"], others_new, took)]
    return state


def finish(state: dict, carried: Carried, axis: str):
    """``(stacked, others)``: the state after the step on this stage (chunks ``[v, L_c,
    ...]``), and ``first`` / ``last``'s from the stage that wrote each leaf."""
    carrier = carried.carrier
    if carrier.threaded:
        stacked, others = state["s_live"], state["o_live"]
    else:
        stacked = [_mean(a, like, carrier.M) for a, like in zip(state["s_acc"], state["s_live"])]
        others = [_mean(a, like, carrier.M) for a, like in zip(state["o_acc"], state["o_live"])]
    s = lax.axis_index(axis)
    picked = []
    for x, o, g in zip(others, carried.owner, carried.given):
        if o is None:
            picked.append(g)  # not written: as it came
        else:
            picked.append(lax.psum(jnp.where(s == o, x, jnp.zeros_like(x)), axis))
    return stacked, picked


def accumulators(live: list) -> list:
    """Zero sums for floating state, the value itself for the rest."""
    return [jnp.zeros(x.shape, _wide(x.dtype)) if _floating(x) else x for x in live]


def _floating(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating)


def _wide(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _add(acc, new, on):
    if jnp.issubdtype(acc.dtype, jnp.floating):
        return acc + jnp.where(on, new.astype(acc.dtype), jnp.zeros_like(acc))
    return jnp.where(on, new.astype(acc.dtype), acc)


def _mean(acc, like, M: int):
    return (acc / M).astype(like.dtype) if _floating(like) else acc


def _at(x, chunk):
    return lax.dynamic_index_in_dim(x, chunk, keepdims=False)


def _put(x, value, chunk):
    return lax.dynamic_update_index_in_dim(x, value.astype(x.dtype), chunk, 0)
