"""The runtime's buffers, and the branches of its switch (one per kind of action).

Every stage keeps six rings of slots (``[capacity + 1, ...]``: the last row is a spare that
takes the writes of ticks that have nothing to write) and three accumulators:

================  ==========================================  ===============================
``activations``   ``[capacity + 1, *x]``                      received from the previous stage
``gradients``     ``[capacity + 1, *x]``                      received from the next stage
``inputs``        ``[capacity + 1, *x]``                      inputs of rematerialised forwards
``residuals``     per closure leaf ``[capacity + 1, L_c, ...]`` per-layer vjp residuals
``cotangents``    ``[capacity + 1, L_c, *x]``                 each layer's output gradient
``seeds``         ``[capacity + 1, *x]``                      the loss's gradient, last stage
``d_stacked``     per layer param ``[v, L_c, ...]``            weight gradients (float32)
``d_others``      per other param                             first/last gradients (float32)
``loss``          scalar                                      sum of micro-batch losses
================  ==========================================  ===============================

The buffers never enter the switch: XLA copies a buffer that a ``lax.switch`` takes and
returns, on every tick (measured). The runtime reads the slots a tick needs before the
switch and writes what the branch returns after it; a branch is a function of one slot of
each ring, returning one slot of each (zeros where it has nothing) and its gradient deltas.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from parallax.pipeline.action import KIND_CODES

RINGS = ("activations", "gradients", "inputs", "residuals", "cotangents", "seeds")


class Out(NamedTuple):
    """What a branch returns: one slot per written ring, deltas, and what to send."""

    inputs: object
    residuals: list
    cotangents: object
    seeds: object
    d_chunk: list
    d_others: list
    loss: jax.Array
    send_x: object
    send_g: object
    code: jax.Array


def _wide(dtype):
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype


def slot_shapes(x_like, tmpl, lc: int) -> dict:
    """The shape of one slot of each ring."""
    x = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), x_like)
    stacked = lambda a: jax.ShapeDtypeStruct((lc, *a.shape), a.dtype)  # noqa: E731
    return {"activations": x, "gradients": x, "inputs": x, "seeds": x,
            "residuals": [stacked(a) for a in tmpl.stashed],
            "cotangents": jax.tree.map(stacked, x)}


def initial_state(capacity: dict, slots: dict, stacked, others, vary) -> dict:
    """Zero rings (with their spare row) and accumulators, varying over the manual axes."""
    state = {name: jax.tree.map(lambda a, n=capacity[name]: vary(
        jnp.zeros((n + 1, *a.shape), a.dtype)), slots[name]) for name in RINGS}
    state["d_stacked"] = [vary(jnp.zeros(p.shape, _wide(p.dtype))) for p in stacked]
    state["d_others"] = [vary(jnp.zeros(o.shape, _wide(o.dtype))) for o in others]
    state["loss"] = vary(jnp.zeros((), jnp.float32))
    return state


def read(buf, slot):
    """Slot ``slot`` of every leaf of a ring (clamped into range, so -1 reads slot 0)."""
    return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, slot, keepdims=False), buf)


def write(buf, slot, value):
    """A ring with ``value`` in slot ``slot``."""
    return jax.tree.map(
        lambda b, x: lax.dynamic_update_index_in_dim(b, x.astype(b.dtype), slot, 0), buf, value)


def _when(flag, mixed: tuple[bool, bool], if_true, if_false, *operands):
    """``lax.cond(flag, ...)`` where the table mixes both cases; the one case where it does not.

    ``mixed`` is (some cell has the flag, some cell lacks it), among the cells of the kind.
    """
    has, lacks = mixed
    if has and lacks:
        return lax.cond(flag, if_true, if_false, *operands)
    return (if_true if has else if_false)(*operands)


def branches(plan, prog, chunk, stacked, others, microbatches: int, slots: dict,
             vary) -> list:
    """The switch's branches (idle, F, B, W): ``fn(cell, inputs) -> Out``.

    ``cell`` holds the tick's flags for this stage; ``inputs`` the slots read for it
    (``params``, ``batch`` and one slot of each ring).
    """
    def zeros(like):
        return jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype)), like)

    scale = 1.0 / microbatches
    x_like = slots["activations"]
    others_like = [jax.ShapeDtypeStruct(o.shape, _wide(o.dtype)) for o in others]
    chunk_like = [jax.ShapeDtypeStruct(p.shape[1:], _wide(p.dtype)) for p in stacked]

    def mix(kind, name):  # does the table have cells of ``kind`` with and without ``name``?
        flags = getattr(plan, name)[plan.kind == KIND_CODES[kind]]
        return bool(flags.any()), bool((flags == 0).any())

    def out(kind, **given):
        fields = dict(inputs=x_like, residuals=slots["residuals"],
                      cotangents=slots["cotangents"], seeds=x_like, d_chunk=chunk_like,
                      d_others=others_like, loss=jax.ShapeDtypeStruct((), jnp.float32),
                      send_x=x_like, send_g=x_like)
        fields = {k: jax.tree.map(vary, given[k]) if k in given else zeros(v)
                  for k, v in fields.items()}
        return Out(**fields, code=vary(jnp.int32(KIND_CODES.get(kind, 0))))

    def forward(cell, got):
        x = _when(cell["first"], mix("F", "first"),
                  lambda: jax.tree.map(vary, prog.first(others, got["batch"])),
                  lambda: got["activations"])
        if mix("F", "remat")[1]:  # some forwards keep their residuals
            y, residuals = chunk.forward_vjp(got["params"], x)
        else:
            y, residuals = chunk.forward(got["params"], x), zeros(slots["residuals"])

        def head():
            # The loss and its gradient now: the backward starts from this seed, and the
            # head keeps no residuals.
            value, (d_last, dy) = jax.value_and_grad(prog.last, argnums=(0, 1))(
                others, y, got["batch"])
            return (vary(value.astype(jnp.float32)), [vary(g * scale) for g in d_last],
                    jax.tree.map(lambda g: vary(g * scale), dy))

        def skip():
            return vary(jnp.zeros((), jnp.float32)), zeros(others_like), zeros(x_like)

        loss, d_others, seeds = _when(cell["last"], mix("F", "last"), head, skip)
        return out("F", inputs=x, residuals=residuals, seeds=seeds, loss=loss,
                   d_others=d_others, send_x=y)

    def backward_input(cell, got):
        dy = _when(cell["last"], mix("B", "last"), lambda: got["seeds"],
                   lambda: got["gradients"])
        # A rematerialised micro-batch recomputes its forward, once: W reuses what B stashes.
        residuals = _when(cell["remat"], mix("B", "remat"),
                          lambda: chunk.forward_vjp(got["params"], got["inputs"])[1],
                          lambda: got["residuals"])
        dx, cotangents = chunk.backward_input(got["params"], residuals, dy)

        def first_backward():
            _, pullback = jax.vjp(lambda o: prog.first(o, got["batch"]), others)
            return [vary(g.astype(_wide(g.dtype))) for g in pullback(dx)[0]]

        d_others = _when(cell["first"], mix("B", "first"), first_backward,
                         lambda: zeros(others_like))
        return out("B", residuals=residuals, cotangents=cotangents, d_others=d_others,
                   send_g=dx)

    def backward_weights(cell, got):
        del cell
        grads = chunk.backward_weights(got["params"], got["residuals"], got["cotangents"])
        return out("W", d_chunk=[g.astype(_wide(g.dtype)) for g in grads])

    def idle(cell, got):
        del cell, got
        return out("idle")

    return [idle, forward, backward_input, backward_weights]
