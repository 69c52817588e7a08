"""The runtime's buffers: rings of slots and accumulators, carried by the tick loop.

Every stage keeps rings of slots (``[rows, ...]``: the lowered table's ``capacity``, plus a
spare row that takes the executed writes that go nowhere, such as an arrival when nothing
was sent, in the rings that have them: :meth:`LoweredSchedule.rows`) and accumulators:

================  =============================================  ============================
``inbox``         ``[rows, *x]``                                 activations and gradients
                                                                 received (the loss's too)
``stash``         per leaf ``[rows, L_c, ...]``                  what F keeps for B and W
``inputs``        ``[rows, *x]``                                 inputs of rematerialised F
``uses``          per use ``[rows, L_c, ...]``                   gradients at uses, B -> W
``versions``      per layer param ``[rows, L_c, ...]``           the weights F used
                                                                 (``weights="stashed"``)
``snapshots``     per state leaf ``[rows, ...]``                 the state F started from,
                                                                 for B (threaded state only)
``payload``       ``*x``                                         what the stage sends (the
                                                                 last F's or B's)
``d_stacked``     per layer param ``[v, L_c, ...]``              weight gradients (float32)
``d_others``      per other param                                first/last gradients
``loss``          scalar                                         sum of micro-batch losses
================  =============================================  ============================

The actions (:mod:`parallax.pipeline.runtime.actions`) read and write them in place; the
per-layer rings (``stash``, ``uses``) one layer at a time, at ``[slot, layer]``, from inside
the chunk's layer loops (:func:`read_layer`, :func:`write_layer`).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from jax import lax

RINGS = ("inbox", "stash", "inputs", "uses", "versions", "snapshots")


def wide(dtype):
    """Accumulation dtype: float32 at least for floating values."""
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else dtype


def slot_shapes(x_like, tmpl, lc: int, stacked: list, versions: bool,
                stacked_state: list = (), others_state: list = (),
                snapshots: bool = False) -> dict:
    """The shape of one slot of each ring (``versions``: one chunk's weights), and of the
    state an ``F`` leaves (``stacked_state``: ``[v, L_c, ...]`` raw leaves)."""
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


def initial_state(rows: dict, slots: dict, stacked, others, vary, stage,
                  microbatches: int | None = None) -> dict:
    """Zero rings (``rows[name]`` rows each), payload and accumulators, varying over the
    manual axes; ``stage`` is this stage's index (``lax.axis_index``).

    With ``microbatches`` (``weights="stashed"``), the other parameters' gradients are
    kept per micro-batch (``[M, ...]``) and the stacked ones not at all (each ``W`` applies
    its own).
    """
    count = itertools.count(1)

    def zeros(shape, dtype):
        return vary(_own_zeros(shape, dtype, stage, next(count)))

    state = {name: jax.tree.map(lambda a, n=rows[name]: zeros((n, *a.shape), a.dtype),
                                slots[name]) for name in RINGS}
    state["payload"] = jax.tree.map(lambda a: zeros(a.shape, a.dtype), slots["inbox"])
    per = () if microbatches is None else (microbatches,)
    state["d_stacked"] = ([zeros(p.shape, wide(p.dtype)) for p in stacked]
                          if microbatches is None else [])
    state["d_others"] = [zeros(per + o.shape, wide(o.dtype)) for o in others]
    state["loss"] = vary(jnp.zeros((), jnp.float32))
    return state


def _own_zeros(shape, dtype, stage, k):
    """Zeros of their own, which XLA does not merge with another buffer's: identical
    ``jnp.zeros`` are one instruction after XLA's common-subexpression pass, and the loop
    then copies it into each buffer it carries (measured: every ring written twice when the
    step starts). The scalar ``(stage + k) * 0`` differs per buffer and is not folded for
    floating types (it would be NaN for an infinite operand)."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return jnp.zeros(shape, dtype)
    return jnp.broadcast_to(((stage + k).astype(dtype) * 0).astype(dtype), shape)


def read(buf, slot):
    """Slot ``slot`` of every leaf of a ring (clamped into range, so -1 reads slot 0)."""
    return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, slot, keepdims=False), buf)


def write(buf, slot, value):
    """A ring with ``value`` in slot ``slot``."""
    return jax.tree.map(
        lambda b, x: lax.dynamic_update_index_in_dim(b, x.astype(b.dtype), slot, 0), buf, value)


def read_layer(buf, slot, layer) -> list:
    """``[slot, layer]`` of every leaf of a per-layer ring (``[rows, L_c, ...]``):
    one dynamic slice of one layer's values each, not of the whole slot."""
    return [lax.dynamic_slice(b, (slot, layer) + (0,) * (b.ndim - 2),
                              (1, 1, *b.shape[2:])).reshape(b.shape[2:]) for b in buf]


def write_layer(buf, slot, layer, values) -> list:
    """A per-layer ring with ``values`` (one layer's, per leaf) at ``[slot, layer]``, written
    in place where the ring is a loop's carried buffer."""
    return [lax.dynamic_update_slice(b, v.astype(b.dtype).reshape(1, 1, *b.shape[2:]),
                                     (slot, layer) + (0,) * (b.ndim - 2))
            for b, v in zip(buf, values)]


def accumulate(acc, delta, chunk):
    """``acc[chunk] += delta``; a plain add with one chunk."""
    if acc.shape[0] == 1:
        return acc + delta[None].astype(acc.dtype)
    return lax.dynamic_update_index_in_dim(
        acc, lax.dynamic_index_in_dim(acc, chunk, keepdims=False) + delta.astype(acc.dtype),
        chunk, 0)
