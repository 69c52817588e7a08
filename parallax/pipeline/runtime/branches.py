"""The runtime's buffers, and the branches of its switch (one per kind of action).

Every stage keeps four rings of slots (``[capacity + 1, ...]``: the last row is a spare that
takes the writes of ticks that have nothing to write) and three accumulators:

================  =============================================  ============================
``inbox``         ``[capacity + 1, *x]``                         activations and gradients
                                                                 received (the loss's too)
``stash``         per leaf ``[capacity + 1, L_c, ...]``          what F keeps for B and W
``inputs``        ``[capacity + 1, *x]``                         inputs of rematerialised F
``uses``          per use ``[capacity + 1, L_c, ...]``           gradients at uses, B -> W
``snapshots``     per state leaf ``[capacity + 1, ...]``         the state F started from,
                                                                 for B (threaded state only)
``d_stacked``     per layer param ``[v, L_c, ...]``              weight gradients (float32)
``d_others``      per other param                                first/last gradients
``loss``          scalar                                         sum of micro-batch losses
================  =============================================  ============================

The rings enter the switch read-only: XLA copies a buffer that a ``lax.switch`` returns,
or that is written after a switch reads it, on every tick (measured). A branch reads the
slots it needs in place and returns one slot of each ring it may write (zeros where it has
nothing), which the runtime stores at the start of the next tick, its gradient deltas and
its *payload*: what the tick sends (an ``F``'s activation, or on the last virtual stage the
loss's gradient; a ``B``'s input gradient). An ``F`` also returns the module state after it
(:mod:`parallax.pipeline.runtime.stage_state`); ``B`` recomputes from the state its ``F``
started from and returns none.

Whether a cell is on the first or last virtual stage, or rematerialised, is a ``lax.cond``
inside its branch, named (``jax.named_scope``) ``pp_first``, ``pp_last`` and ``pp_remat``,
and the switch ``pp_switch``, so a reader of the compiled program
(:mod:`parallax.pipeline.runtime.executed`) can tell them apart.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from parallax.pipeline.schedules.action import KIND_CODES

RINGS = ("inbox", "stash", "inputs", "uses", "snapshots")


class Out(NamedTuple):
    """What a branch returns: one slot per written ring, deltas, and what to send."""

    stash: list
    inputs: object
    uses: list
    versions: list  # weights="stashed": the version F used (empty otherwise)
    snapshots: dict  # F: the state it started from (threaded state only)
    d_chunk: list
    d_others: list
    loss: jax.Array
    payload: object
    code: jax.Array
    state: list  # F: the chunk's state after it, [L_c, ...] per leaf (raw: keys as data)
    others_state: list  # F: first / last's state after it


def wide(dtype):
    """Accumulation dtype: float32 at least for floating values."""
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype


def slot_shapes(x_like, tmpl, lc: int, stacked: list, versions: bool,
                stacked_state: list = (), others_state: list = (),
                snapshots: bool = False) -> dict:
    """The shape of one slot of each ring (``versions``: one chunk's weights), and of the
    state an ``F`` returns (``stacked_state``: ``[v, L_c, ...]`` raw leaves)."""
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x_like)
    layers = lambda a: jax.ShapeDtypeStruct((lc, *a.shape), a.dtype)  # noqa: E731
    like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    state = [jax.ShapeDtypeStruct(p.shape[1:], p.dtype) for p in stacked_state]
    others = [like(o) for o in others_state]
    return {"inbox": x, "inputs": x, "stash": [layers(a) for a in tmpl.stashed],
            "uses": [layers(a) for a in tmpl.uses],
            "versions": [jax.ShapeDtypeStruct(p.shape[1:], p.dtype) for p in stacked]
            if versions else [],
            "snapshots": ({"stacked": state, "others": others} if snapshots
                          else {"stacked": [], "others": []}),
            "state": state, "others_state": others}


def initial_state(capacity: dict, slots: dict, stacked, others, vary,
                  microbatches: int | None = None) -> dict:
    """Zero rings (with their spare row) and accumulators, varying over the manual axes.

    With ``microbatches`` (``weights="stashed"``), the other parameters' gradients are
    kept per micro-batch (``[M, ...]``) and the stacked ones not at all (each ``W`` applies
    its own).
    """
    state = {name: jax.tree.map(lambda a, n=capacity.get(name, 0): vary(
        jnp.zeros((n + 1, *a.shape), a.dtype)), slots[name]) for name in RINGS + ("versions",)}
    per = () if microbatches is None else (microbatches,)
    state["d_stacked"] = ([vary(jnp.zeros(p.shape, wide(p.dtype))) for p in stacked]
                          if microbatches is None else [])
    state["d_others"] = [vary(jnp.zeros(per + o.shape, wide(o.dtype))) for o in others]
    state["loss"] = vary(jnp.zeros((), jnp.float32))
    return state


def read(buf, slot):
    """Slot ``slot`` of every leaf of a ring (clamped into range, so -1 reads slot 0)."""
    return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, slot, keepdims=False), buf)


def write(buf, slot, value):
    """A ring with ``value`` in slot ``slot``."""
    return jax.tree.map(
        lambda b, x: lax.dynamic_update_index_in_dim(b, x.astype(b.dtype), slot, 0), buf, value)


def _when(name: str, flag, mixed: tuple[bool, bool], if_true, if_false):
    """``lax.cond(flag, ...)`` where the table mixes both cases; the one case where it does not.

    ``mixed`` is (some cell has the flag, some cell lacks it), among the cells of the kind.
    """
    has, lacks = mixed
    if has and lacks:
        with jax.named_scope(f"pp_{name}"):
            return lax.cond(flag, if_true, if_false)
    return (if_true if has else if_false)()


def branches(plan, prog, chunk, stacked, others, microbatches: int, slots: dict,
             vary, versions: bool = False, carrier=None) -> list:
    """The switch's branches (idle, F, B, W): ``fn(cell, got, rings) -> Out``.

    ``cell`` holds the tick's flags and slots for this stage; ``got`` what every action
    reads (``params``, ``batch``, ``mask``, the carried ``state`` of the chunk and
    ``others_state``, raw); ``rings`` the rings, read-only: a branch reads the slots it
    needs. ``carrier`` (:class:`parallax.pipeline.runtime.stage_state.Carrier`) prepares
    the state for a micro-batch (None: no state).
    """
    def zeros(like):
        return jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype)), like)

    # a flushed step's gradient is the mean over micro-batches; a stashing step applies
    # each micro-batch's own
    scale = 1.0 if versions else 1.0 / microbatches
    x_like = slots["inbox"]
    others_like = [jax.ShapeDtypeStruct(o.shape, wide(o.dtype)) for o in others]
    chunk_like = [jax.ShapeDtypeStruct(p.shape[1:], wide(p.dtype)) for p in stacked]

    def mix(kind, name):  # does the table have cells of ``kind`` with and without ``name``?
        return plan.mixed[kind, name]

    def out(kind, **given):
        fields = dict(stash=slots["stash"], inputs=x_like, uses=slots["uses"],
                      versions=slots["versions"], snapshots=slots["snapshots"],
                      d_chunk=chunk_like, d_others=others_like,
                      loss=jax.ShapeDtypeStruct((), jnp.float32), payload=x_like,
                      state=slots["state"], others_state=slots["others_state"])
        fields = {k: jax.tree.map(vary, given[k]) if k in given else zeros(v)
                  for k, v in fields.items()}
        return Out(**fields, code=vary(jnp.int32(KIND_CODES.get(kind, 0))))

    def slot(rings, cell, name):
        return read(rings[name], cell[f"read_{name}"])

    def weights(got, rings, cell):  # B and W: the version their F used
        return slot(rings, cell, "versions") if versions else got["params"]

    def layer_in(raw, m):
        return carrier.layer_in(raw, m) if carrier is not None else []

    def others_in(raw, m):
        return carrier.others_in(raw, m) if carrier is not None else []

    def others_out(new, raw):
        return carrier.others_out(new, raw) if carrier is not None else []

    def started(cell, got, rings):  # the state this micro-batch's F started from
        if carrier is not None and carrier.threaded:
            return slot(rings, cell, "snapshots")
        return {"stacked": got["state"], "others": got["others_state"]}

    def forward(cell, got, rings):
        m, o_raw = cell["microbatch"], got["others_state"]

        def run_first():
            x, o_new = prog.first(others, others_in(o_raw, m), got["batch"])
            return jax.tree.map(vary, x), others_out(o_new, o_raw)

        x, o_mid = _when("first", cell["first"], mix("F", "first"), run_first,
                         lambda: (slot(rings, cell, "inbox"), o_raw))
        s_in = layer_in(got["state"], m)
        if mix("F", "remat")[1]:  # some forwards keep what B and W need
            y, stash, s_new = chunk.forward_stash(got["params"], x, got["mask"], s_in)
        else:
            (y, s_new), stash = (chunk.forward(got["params"], x, got["mask"], s_in),
                                 zeros(slots["stash"]))

        def head():
            # The loss and its gradient now: the backward starts from this seed, which the
            # payload sends to this stage's own inbox; the head keeps no residuals.
            (value, o_new), (d_last, dy) = jax.value_and_grad(
                lambda o, y: prog.last(o, others_in(o_mid, m), y, got["batch"]),
                argnums=(0, 1), has_aux=True)(others, y)
            return (vary(value.astype(jnp.float32)), [vary(g * scale) for g in d_last],
                    jax.tree.map(lambda g: vary((g * scale).astype(g.dtype)), dy),
                    others_out(o_new, o_mid))

        def skip():
            return vary(jnp.zeros((), jnp.float32)), zeros(others_like), y, o_mid

        loss, d_others, payload, o_end = _when("last", cell["last"], mix("F", "last"), head,
                                               skip)
        kept = {"versions": got["params"]} if versions else {}
        if carrier is not None and carrier.threaded:
            kept["snapshots"] = {"stacked": got["state"], "others": o_raw}
        s_end = carrier.layer_out(s_new, got["state"]) if carrier is not None else []
        return out("F", inputs=x, stash=stash, loss=loss, d_others=d_others, payload=payload,
                   state=s_end, others_state=o_end, **kept)

    def backward_input(cell, got, rings):
        params = weights(got, rings, cell)
        m, start = cell["microbatch"], started(cell, got, rings)
        # A rematerialised micro-batch recomputes its forward, once: W reuses what B stashes.
        # It starts from the state its F started from; the state it leaves is dropped.
        stash = _when("remat", cell["remat"], mix("B", "remat"),
                      lambda: chunk.forward_stash(params, slot(rings, cell, "inputs"),
                                                  got["mask"],
                                                  layer_in(start["stacked"], m))[1],
                      lambda: slot(rings, cell, "stash"))
        dx, uses = chunk.backward_input(params, stash, slot(rings, cell, "inbox"),
                                        got["mask"])

        def first_backward():
            o_in = others_in(start["others"], m)
            _, pullback = jax.vjp(lambda o: prog.first(o, o_in, got["batch"])[0], others)
            return [vary(g.astype(wide(g.dtype))) for g in pullback(dx)[0]]

        d_others = _when("first", cell["first"], mix("B", "first"), first_backward,
                         lambda: zeros(others_like))
        return out("B", stash=stash, uses=uses, d_others=d_others, payload=dx)

    def backward_weights(cell, got, rings):
        grads = chunk.backward_weights(weights(got, rings, cell), slot(rings, cell, "stash"),
                                       slot(rings, cell, "uses"), got["mask"])
        return out("W", d_chunk=[g.astype(wide(g.dtype)) for g in grads])

    def idle(cell, got, rings):
        del cell, got, rings
        return out("idle")

    return [idle, forward, backward_input, backward_weights]
