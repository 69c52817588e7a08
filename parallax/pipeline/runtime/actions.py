"""The runtime's actions, ``F``, ``B``, ``W`` and ``BW``, each run in place under a guard.

Each tick, every stage runs one guarded loop (:func:`guard`) per kind of action its plan
has, named (``jax.named_scope``) ``pp_F``, ``pp_B``, ``pp_W`` and ``pp_BW`` (a backward
the schedule does not split: ``B`` and its ``W`` in one layer loop, the stash read once):
a ``lax.while_loop`` whose trip count is 1 where the plan's cell is of that kind and 0
elsewhere. Its body reads the slots it needs from the rings
(:mod:`parallax.pipeline.runtime.rings`) and writes what it makes straight into the
carried buffers: its ring slots at the tick's ``store_*`` slots (the per-layer rings,
``stash`` and ``uses``, go to the chunk's layer loop
(:class:`parallax.pipeline.runtime.chunk.Chunk`), which reads and writes them at
``[slot, layer]``, one layer at a time), its gradients into the accumulators, the loss,
the payload the tick sends (an ``F``'s activation, or on the last virtual stage the loss's
gradient; a ``B``'s input gradient), and for an ``F`` the module state after it
(:mod:`parallax.pipeline.runtime.stage_state`); with ``weights="stashed"`` a ``W`` applies
its update to the latest weights (:mod:`parallax.pipeline.runtime.stashed`). XLA updates
a loop's carried buffers in place, so a tick that does not run an action touches none of
its buffers; a ``lax.switch`` over the actions instead copied a buffer it returned, or
read and saw written in the same tick (measured), which made every tick materialise zero
slots and store a whole stash slot.

Whether a cell is on the first or last virtual stage is a ``lax.cond`` inside its body
(``pp_first``, ``pp_last``), which returns values only (an activation, gradients of the
parameters outside the stack); a rematerialised ``B``'s recomputation writes the stash
ring, so it is a guard too (``pp_remat``). Each is there only where the table mixes both
cases; a reader of the compiled program (:mod:`parallax.analysis.executed`) finds
them by these names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from parallax.pipeline.runtime import stage_state, stashed
from parallax.pipeline.runtime.rings import accumulate, read, wide, write


def guard(name: str, flag, body, state, vary, cell):
    """``(trips, state)``: ``body(cell, state)`` where ``flag`` holds, else ``state`` untouched.

    A ``lax.while_loop`` of 0 or 1 trips named ``pp_<name>``: its carried buffers are
    updated in place, and not copied when it does not run. The body sees ``cell`` and the
    state through an optimisation barrier with the trip counter: XLA would otherwise hoist
    what the body computes from values the loop does not change (the rings it only reads,
    the parameters) out of the loop, to run on every tick (measured).
    """

    def run(carry):
        trips, seen, st = lax.optimization_barrier(carry)
        return trips + 1, seen, body(seen, st)

    with jax.named_scope(f"pp_{name}"):
        trips, _, state = lax.while_loop(lambda c: c[0] < flag.astype(jnp.int32), run,
                                         (vary(jnp.int32(0)), cell, state))
    return trips, state


def _when(name: str, flag, mixed: tuple[bool, bool], if_true, if_false):
    """``lax.cond(flag, ...)`` where the table mixes both cases; the one case where it does not.

    ``mixed`` is (some cell has the flag, some cell lacks it), among the cells of the kind.
    """
    has, lacks = mixed
    if has and lacks:
        with jax.named_scope(f"pp_{name}"):
            return lax.cond(flag, if_true, if_false)
    return (if_true if has else if_false)()


def _guard_when(name: str, flag, mixed: tuple[bool, bool], body, state, vary, cell):
    """``body(cell, state)`` under a guard where the table mixes both cases; else always or
    never."""
    has, lacks = mixed
    if has and lacks:
        return guard(name, flag, body, state, vary, cell)[1]
    return body(cell, state) if has else state


def actions(plan, prog, chunk, stacked, others, micro, slot_mask, vary, optimizer=None,
            carried=None) -> dict:
    """The guarded bodies ``{"F": fn, "B": fn, "W": fn, "BW": fn}``, each
    ``fn(cell, state) -> state``.

    ``cell`` holds the tick's flags and slots for this stage; ``state`` the carried buffers.
    ``optimizer`` (``weights="stashed"``): the stacked layers' optimizer; each ``W`` applies
    its micro-batch's update. ``carried``
    (:class:`parallax.pipeline.runtime.stage_state.Carried`): the module state (None: no
    state).
    """
    versions = optimizer is not None
    carrier = carried.carrier if carried is not None else None
    threaded = carrier is not None and carrier.threaded

    def zeros(like):
        return jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype)), like)

    # a flushed step's gradient is the mean over micro-batches; a stashing step applies
    # each micro-batch's own
    scale = 1.0 if versions else 1.0 / jax.tree.leaves(micro)[0].shape[0]
    others_like = [jax.ShapeDtypeStruct(o.shape, wide(o.dtype)) for o in others]

    def mix(kind, name):  # does the table have cells of ``kind`` with and without ``name``?
        return plan.mixed[kind, name]

    def at(x, i):
        return lax.dynamic_index_in_dim(x, i, keepdims=False)

    def mask_of(cell):
        return None if slot_mask is None else at(slot_mask, cell["chunk"])

    def weights(cell, st):  # B and W: the version their F used
        if versions:
            return read(st["versions"], cell["read_versions"])
        return [at(p, cell["chunk"]) for p in stacked]

    def add_others(st, cell, delta):
        if versions:
            return stashed.add_at(st["d_others"], cell["microbatch"], delta)
        return [acc + d.astype(acc.dtype) for acc, d in zip(st["d_others"], delta)]

    def layer_in(raw, m):
        return carrier.layer_in(raw, m) if carrier is not None else []

    def others_in(raw, m):
        return carrier.others_in(raw, m) if carrier is not None else []

    def others_out(new, raw):
        return carrier.others_out(new, raw) if carrier is not None else []

    def forward(cell, st):
        st = dict(st)
        m, c = cell["microbatch"], cell["chunk"]
        params = [at(p, c) for p in (st["live"] if versions else stacked)]
        batch = read(micro, m)
        s_raw = [at(x, c) for x in st.get("s_live", [])]
        o_raw = st.get("o_live", [])
        received = read(st["inbox"], cell["read_inbox"])

        def run_first():
            x, o_new = prog.first(others, others_in(o_raw, m), batch)
            return jax.tree.map(vary, x), others_out(o_new, o_raw)

        x, o_mid = _when("first", cell["first"], mix("F", "first"), run_first,
                         lambda: (received, o_raw))
        s_in = layer_in(s_raw, m)
        if mix("F", "remat")[1]:  # some forwards keep what B and W need
            y, st["stash"], s_new = chunk.forward_stash(params, x, st["stash"],
                                                        cell["store_stash"], mask_of(cell), s_in)
        else:
            y, s_new = chunk.forward(params, x, mask_of(cell), s_in)
        if mix("F", "remat")[0]:  # some forwards are recomputed by their B from the input
            st["inputs"] = write(st["inputs"], cell["store_inputs"], x)

        def head():
            # The loss and its gradient now: the backward starts from this seed, which the
            # payload sends to this stage's own inbox; the head keeps no residuals.
            (value, o_new), (d_last, dy) = jax.value_and_grad(
                lambda o, y: prog.last(o, others_in(o_mid, m), y, batch),
                argnums=(0, 1), has_aux=True)(others, y)
            return (vary(value.astype(jnp.float32)),
                    [vary(g.astype(wide(g.dtype)) * scale) for g in d_last],
                    jax.tree.map(lambda g: vary((g * scale).astype(g.dtype)), dy),
                    others_out(o_new, o_mid))

        def skip():
            return vary(jnp.zeros((), jnp.float32)), zeros(others_like), y, o_mid

        loss, d_others, payload, o_end = _when("last", cell["last"], mix("F", "last"), head,
                                               skip)
        st["payload"] = payload
        if mix("F", "last")[0]:
            st["loss"] = st["loss"] + loss
            st["d_others"] = add_others(st, cell, d_others)
        if versions:
            st["versions"] = write(st["versions"], cell["store_versions"], params)
        if threaded:
            st["snapshots"] = write(st["snapshots"], cell["store_snapshots"],
                                    {"stacked": s_raw, "others": o_raw})
        if carrier is not None:
            st = stage_state.update(st, carrier.layer_out(s_new, s_raw), o_end, cell, carried)
        return st

    def apply_weights(st, cell, grads):  # W's gradients: accumulated, or applied (PipeDream)
        grads = [g.astype(wide(g.dtype)) for g in grads]
        if versions:  # PipeDream: each W applies its micro-batch's update to the latest weights
            st["live"], st["opt"] = stashed.update_chunk(optimizer, st["live"], st["opt"], grads,
                                                         cell["chunk"])
        else:
            st["d_stacked"] = [accumulate(acc, d, cell["chunk"])
                               for acc, d in zip(st["d_stacked"], grads)]
        return st

    def backward(kind):
        """``B``, or with ``kind="BW"`` a backward that also runs its ``W`` in the same
        layer loop (schedules that do not split the backward): it reads each layer's stash
        once and keeps no use gradients."""

        def run(cell, st):
            st = dict(st)
            m, c, mask = cell["microbatch"], cell["chunk"], mask_of(cell)
            params = weights(cell, st)
            if threaded:  # the state this micro-batch's F started from
                start = read(st["snapshots"], cell["read_snapshots"])
            else:
                start = {"stacked": [at(x, c) for x in st.get("s_live", [])],
                         "others": st.get("o_live", [])}

            def recompute(cell, st):
                # A rematerialised micro-batch recomputes its forward, once, into the stash
                # slot that W reads too. It starts from the state its F started from; the
                # state it leaves is dropped.
                st = dict(st)
                st["stash"] = chunk.forward_stash(
                    params, read(st["inputs"], cell["read_inputs"]), st["stash"],
                    cell["store_stash"], mask, layer_in(start["stacked"], m))[1]
                return st

            st = _guard_when("remat", cell["remat"], mix(kind, "remat"), recompute, st, vary,
                             cell)
            dy = read(st["inbox"], cell["read_inbox"])
            if kind == "BW":
                dx, grads = chunk.backward_fused(params, st["stash"], cell["read_stash"], dy,
                                                 mask)
                st = apply_weights(st, cell, grads)
            else:
                dx, st["uses"] = chunk.backward_input(params, st["stash"], cell["read_stash"],
                                                      dy, st["uses"], cell["store_uses"], mask)
            st["payload"] = dx

            def first_backward():
                o_in = others_in(start["others"], m)
                _, pullback = jax.vjp(lambda o: prog.first(o, o_in, read(micro, m))[0], others)
                return [vary(g.astype(wide(g.dtype))) for g in pullback(dx)[0]]

            if mix(kind, "first")[0]:
                st["d_others"] = add_others(st, cell, _when(
                    "first", cell["first"], mix(kind, "first"), first_backward,
                    lambda: zeros(others_like)))
            return st

        return run

    def backward_weights(cell, st):
        grads = chunk.backward_weights(weights(cell, st), st["stash"], cell["read_stash"],
                                       st["uses"], cell["read_uses"], mask_of(cell))
        return apply_weights(dict(st), cell, grads)

    return {"F": forward, "B": backward("B"), "W": backward_weights, "BW": backward("BW")}
