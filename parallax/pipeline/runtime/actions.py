"""The runtime's actions, ``F``, ``B``, ``W`` and ``BW``, each run in place under a guard.

Each action is a plain function ``action(env, cell, state) -> state`` (:data:`ACTIONS`):
``env`` (:class:`Env`) is what a stage's actions share, ``cell`` the tick's flags and slots
for this stage, ``state`` the carried buffers (:mod:`parallax.pipeline.runtime.rings`).
Each tick, every stage runs one guarded loop per kind of action the table has, named
``pp_F``, ``pp_B``, ``pp_W`` and ``pp_BW`` (a backward the schedule does not split: ``B``
and its ``W`` in one layer loop, the stash read once): a ``lax.while_loop`` of 1 trip where
the cell is of that kind and 0 elsewhere (:mod:`parallax.pipeline.runtime.guarded`). Its
body writes what it makes straight into the carried buffers: its ring slots (the per-layer
rings, ``stash`` and ``uses``, at ``[slot, layer]`` from inside the chunk's layer loop,
:class:`parallax.pipeline.runtime.chunk.Chunk`), its gradients, the loss, the payload the
tick sends (an ``F``'s activation, or on the last virtual stage the loss's gradient; a
``B``'s input gradient), and for an ``F`` the module state after it
(:mod:`parallax.pipeline.runtime.stage_state`); with ``weights="stashed"`` a ``W`` applies
its update (:mod:`parallax.pipeline.runtime.stashed`). A tick that does not run an action
touches none of its buffers.

Whether a cell is on the first or last virtual stage is a ``lax.cond`` inside its body
(``pp_first``, ``pp_last``), which returns values only; a rematerialised ``B``'s
recomputation writes the stash ring, so it is a guard (``pp_remat``). Each is there only
where the table mixes both cases; :mod:`parallax.analysis.executed` finds them by
these names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from parallax import context
from parallax.pipeline.runtime import stage_state, stashed
from parallax.pipeline.runtime.chunk import Chunk
from parallax.pipeline.runtime.guarded import guard_when, when
from parallax.pipeline.runtime.lowering import LoweredSchedule
from parallax.pipeline.runtime.optimizer import PartOptimizer
from parallax.pipeline.runtime.rings import accumulate, read, wide, write
from parallax.pipeline.runtime.program import Program


class Env(NamedTuple):
    """What every action of one stage's tick loop shares, built once per trace.

    Attributes:
      lowered: the :class:`LoweredSchedule` (its static ``mixed`` flags are read).
      prog, chunk: the :class:`Program` and the :class:`Chunk` that runs its layers.
      stacked: the chunks' layer parameters, ``[v, L_c, ...]`` per leaf; ``others``: the
        parameters outside the stack; ``micro``: the micro-batches ``[M, rows, ...]``.
      slot_mask: ``[v, slots]``: which chunk slots hold a layer (None: all of them).
      vary: casts a value to vary over the runtime's manual axes.
      optimizer: ``weights="stashed"``: the stacked layers' optimizer, which each ``W``
        applies (None: gradients are accumulated).
      carried: the module state (:class:`stage_state.Carried`; None: no state).
    """

    lowered: LoweredSchedule
    prog: Program
    chunk: Chunk
    stacked: list
    others: list
    micro: Any
    slot_mask: Any
    vary: Callable
    optimizer: PartOptimizer | None = None
    carried: stage_state.Carried | None = None

    @property
    def versions(self) -> bool:
        """Weight versions (``weights="stashed"``): each ``W`` updates the latest weights."""
        return self.optimizer is not None

    @property
    def carrier(self) -> stage_state.Carrier | None:
        return self.carried.carrier if self.carried is not None else None

    @property
    def threaded(self) -> bool:
        return self.carrier is not None and self.carrier.threaded

    @property
    def scale(self) -> float:
        # a flushed step's gradient is the mean over micro-batches; a stashing step applies
        # each micro-batch's own
        return 1.0 if self.versions else 1.0 / jax.tree.leaves(self.micro)[0].shape[0]

    def mixed(self, kind: str, flag: str) -> tuple[bool, bool]:
        """Does the table have cells of ``kind`` with, and without, ``flag``?"""
        return self.lowered.mixed[kind, flag]

    def batch(self, m) -> Any:
        """Micro-batch ``m`` (``[rows, ...]`` per leaf), as ``first`` and ``last`` read it.

        Under context parallelism each leaf is pinned whole past its rows on the automatic
        axes: ``first`` and ``last`` read the token ids at two offsets (inputs, labels), and
        left to GSPMD the ids are split by sequence and the shift becomes a halo
        ``collective-permute`` whose pairs span every stage, on which a stage running its
        action alone waits forever. The ids are small; each device holds them anyway.
        """
        batch = read(self.micro, m)
        ctx = context.current()
        if ctx is None or ctx.strategy.sequence_split is None:
            return batch
        return jax.tree.map(lambda x: lax.with_sharding_constraint(
            x, P(P.UNCONSTRAINED, *[None] * (x.ndim - 1))) if x.ndim > 1 else x, batch)

    def mask(self, cell):
        return None if self.slot_mask is None else _at(self.slot_mask, cell["chunk"])

    def zero_others(self) -> list:
        """Zero gradients of the parameters outside the stack (accumulation dtype)."""
        return [self.vary(jnp.zeros(o.shape, wide(o.dtype))) for o in self.others]

    def layer_in(self, raw, m) -> list:
        return self.carrier.layer_in(raw, m) if self.carrier is not None else []

    def others_in(self, raw, m) -> list:
        return self.carrier.others_in(raw, m) if self.carrier is not None else []

    def others_out(self, new, raw) -> list:
        return self.carrier.others_out(new, raw) if self.carrier is not None else []


def forward(env: Env, cell, st: dict) -> dict:
    """``F``: the chunk's forward for the cell's micro-batch; on virtual stage 0 from
    ``first``, on the last one through ``last`` (whose loss gradient becomes the payload).

    Writes the stash (or, for a rematerialised micro-batch, the input), the payload, the
    loss and ``last``'s gradients, the weight version used and the module state after it.
    """
    st = dict(st)
    m, c = cell["microbatch"], cell["chunk"]
    params = [_at(p, c) for p in (st["live"] if env.versions else env.stacked)]
    batch = env.batch(m)
    s_raw = [_at(x, c) for x in st.get("s_live", [])]
    o_raw = st.get("o_live", [])
    received = read(st["inbox"], cell["read_inbox"])

    def run_first():
        x, o_new = env.prog.first(env.others, env.others_in(o_raw, m), batch)
        return jax.tree.map(env.vary, x), env.others_out(o_new, o_raw)

    x, o_mid = when("first", cell["first"], env.mixed("F", "first"), run_first,
                    lambda: (received, o_raw))
    s_in = env.layer_in(s_raw, m)
    remat = env.mixed("F", "remat")
    if remat[1]:  # some forwards keep what B and W need
        y, st["stash"], s_new = env.chunk.forward_stash(params, x, st["stash"],
                                                        cell["store_stash"], env.mask(cell), s_in)
    else:
        y, s_new = env.chunk.forward(params, x, env.mask(cell), s_in)
    if remat[0]:  # some forwards are recomputed by their B from the input
        st["inputs"] = write(st["inputs"], cell["store_inputs"], x)

    def skip():
        return env.vary(jnp.zeros((), jnp.float32)), env.zero_others(), y, o_mid

    loss, d_others, payload, o_end = when(
        "last", cell["last"], env.mixed("F", "last"),
        lambda: _loss_head(env, y, batch, env.others_in(o_mid, m), o_mid), skip)
    st["payload"] = payload
    if env.mixed("F", "last")[0]:
        st["loss"] = st["loss"] + loss
        st["d_others"] = _add_others(env, st, cell, d_others)
    if env.versions:
        st["versions"] = write(st["versions"], cell["store_versions"], params)
    if env.threaded:
        st["snapshots"] = write(st["snapshots"], cell["store_snapshots"],
                                {"stacked": s_raw, "others": o_raw})
    if env.carrier is not None:
        st = stage_state.update(st, env.carrier.layer_out(s_new, s_raw), o_end, cell,
                                env.carried)
    return st


def backward_input(env: Env, cell, st: dict) -> dict:
    """``B``: the input gradient the previous virtual stage waits for, and the gradients at
    the parameters' uses that its ``W`` turns into weight gradients."""
    return _backward(env, "B", cell, st)


def backward_fused(env: Env, cell, st: dict) -> dict:
    """``BW``: a backward that also runs its ``W`` in the same layer loop (schedules that do
    not split the backward): it reads each layer's stash once and keeps no use gradients."""
    return _backward(env, "BW", cell, st)


def backward_weights(env: Env, cell, st: dict) -> dict:
    """``W``: the chunk's weight gradients from the stash and ``B``'s use gradients,
    accumulated (or, with weight versions, applied)."""
    grads = env.chunk.backward_weights(_weights(env, cell, st), st["stash"], cell["read_stash"],
                                       st["uses"], cell["read_uses"], env.mask(cell))
    return _apply_weights(env, dict(st), cell, grads)


# The guarded body of each kind of action, ``fn(env, cell, state) -> state``.
ACTIONS = {"F": forward, "B": backward_input, "W": backward_weights, "BW": backward_fused}


def _backward(env: Env, kind: str, cell, st: dict) -> dict:
    st = dict(st)
    m, c, mask = cell["microbatch"], cell["chunk"], env.mask(cell)
    params = _weights(env, cell, st)
    if env.threaded:  # the state this micro-batch's F started from
        start = read(st["snapshots"], cell["read_snapshots"])
    else:
        start = {"stacked": [_at(x, c) for x in st.get("s_live", [])],
                 "others": st.get("o_live", [])}

    def recompute(cell, st):
        # A rematerialised micro-batch recomputes its forward, once, into the stash slot
        # that W reads too. It starts from the state its F started from; the state it
        # leaves is dropped.
        st = dict(st)
        st["stash"] = env.chunk.forward_stash(
            params, read(st["inputs"], cell["read_inputs"]), st["stash"],
            cell["store_stash"], mask, env.layer_in(start["stacked"], m))[1]
        return st

    st = guard_when("remat", cell["remat"], env.mixed(kind, "remat"), recompute, st,
                    env.vary, cell)
    dy = read(st["inbox"], cell["read_inbox"])
    if kind == "BW":
        dx, grads = env.chunk.backward_fused(params, st["stash"], cell["read_stash"], dy, mask)
        st = _apply_weights(env, st, cell, grads)
    else:
        dx, st["uses"] = env.chunk.backward_input(params, st["stash"], cell["read_stash"], dy,
                                                  st["uses"], cell["store_uses"], mask)
    st["payload"] = dx

    def first_backward():
        o_in = env.others_in(start["others"], m)
        _, pullback = jax.vjp(lambda o: env.prog.first(o, o_in, env.batch(m))[0],
                              env.others)
        return [env.vary(g.astype(wide(g.dtype))) for g in pullback(dx)[0]]

    first = env.mixed(kind, "first")
    if first[0]:
        st["d_others"] = _add_others(env, st, cell, when(
            "first", cell["first"], first, first_backward, env.zero_others))
    return st


def _loss_head(env: Env, y, batch, o_in, o_mid):
    """The loss and its gradient now: the backward starts from this seed, which the payload
    sends to this stage's own inbox; the head keeps no residuals. ``(loss, d_others, seed,
    state after last)``."""
    (value, o_new), (d_last, dy) = jax.value_and_grad(
        lambda o, y: env.prog.last(o, o_in, y, batch), argnums=(0, 1), has_aux=True)(
        env.others, y)
    scale = env.scale
    return (env.vary(value.astype(jnp.float32)),
            [env.vary(g.astype(wide(g.dtype)) * scale) for g in d_last],
            jax.tree.map(lambda g: env.vary((g * scale).astype(g.dtype)), dy),
            env.others_out(o_new, o_mid))


def _weights(env: Env, cell, st):
    """The chunk's weights for a ``B`` or ``W``: the version its ``F`` used."""
    if env.versions:
        return read(st["versions"], cell["read_versions"])
    return [_at(p, cell["chunk"]) for p in env.stacked]


def _add_others(env: Env, st, cell, delta) -> list:
    if env.versions:
        return stashed.add_at(st["d_others"], cell["microbatch"], delta)
    return [acc + d.astype(acc.dtype) for acc, d in zip(st["d_others"], delta)]


def _apply_weights(env: Env, st, cell, grads) -> dict:
    """A ``W``'s gradients: accumulated, or applied (PipeDream's weight stashing)."""
    grads = [g.astype(wide(g.dtype)) for g in grads]
    if env.versions:  # each W applies its micro-batch's update to the latest weights
        st["live"], st["opt"] = stashed.update_chunk(env.optimizer, st["live"], st["opt"],
                                                     grads, cell["chunk"])
    else:
        st["d_stacked"] = [accumulate(acc, d, cell["chunk"])
                           for acc, d in zip(st["d_stacked"], grads)]
    return st


def _at(x, i):
    return lax.dynamic_index_in_dim(x, i, keepdims=False)
