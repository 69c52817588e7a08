"""PipeDream's weight stashing inside the tick loop (``px.Pipeline(weights="stashed")``).

Every stage updates its chunk of the stacked layers after each micro-batch's backward: the
``W`` that finishes micro-batch ``j``'s weight gradient on a stage applies it, with the
state's optimizer, to that stage's latest weights. A forward runs on the latest weights and
keeps them (the ``versions`` ring, one slot per micro-batch in flight, freed by its ``W``),
and that micro-batch's ``B`` and ``W`` use the kept version: the gradient is the one of the
weights the forward saw (weight stashing). So micro-batch ``j``'s forward on stage ``s``
sees the updates of the micro-batches whose ``W`` ran on ``s`` before it; with 1F1B,
``max(0, j - p + s + 1)`` of them: PipeDream's rule, the first stage the most stale, the
last one up to date. The step starts from one version (the pipeline flushes at every step).

The parameters outside the stack (embedding, head), which every stage holds, keep the
step's starting version for every forward and take the micro-batches' updates in order at
the end of the step (each micro-batch's gradient is summed over the stages first), so every
parameter takes one update per micro-batch and the optimizer's shared state (Adam's count)
stays one value.

References:
  Narayanan et al. 2019, PipeDream: Generalized Pipeline Parallelism for DNN Training
  (1F1B without flushes, weight stashing).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from parallax.pipeline.runtime.optimizer import PartOptimizer


class Versions(NamedTuple):
    """The optimizer, split the way the pipeline holds the parameters, and its state."""

    stacked: PartOptimizer
    stacked_state: list  # leaves: mirrors [L, ...] sharded like the layers, and scalars
    others: PartOptimizer | None
    others_state: list


def update_chunk(opt: PartOptimizer, live: list, state: list, grads: list, chunk):
    """A ``W``'s update: the chunk's latest weights and optimizer state take ``grads``.

    ``live`` leaves are ``[v, slots, ...]``; mirrored state leaves too; the others (scalars)
    are per stage. Runs inside the ``W`` action's guarded loop, in place.
    """
    take = lambda x: lax.dynamic_index_in_dim(x, chunk, keepdims=False)  # noqa: E731
    params = [take(p) for p in live]
    chunk_state = [take(x) if m else x for x, m in zip(state, opt.mirrors)]
    new_params, new_state = opt.update(params, [g.astype(p.dtype) for g, p in
                                                zip(grads, params)], chunk_state)
    live = [lax.dynamic_update_index_in_dim(p, n.astype(p.dtype), chunk, 0)
            for p, n in zip(live, new_params)]
    state = [lax.dynamic_update_index_in_dim(x, n.astype(x.dtype), chunk, 0) if m
             else n.astype(x.dtype) for x, n, m in zip(state, new_state, opt.mirrors)]
    return live, state


def update_others(opt: PartOptimizer | None, others: list, state: list, grads: list):
    """At the end of the step: the micro-batches' updates of the other parameters, in order.

    ``grads`` leaves are ``[M, ...]``, one gradient per micro-batch, summed over stages.
    """
    if opt is None or not others:
        return others, state

    def one(carry, g):
        params, st = carry
        return opt.update(params, [x.astype(p.dtype) for x, p in zip(g, params)], st), None

    (others, state), _ = lax.scan(one, (others, state), grads)
    return others, state


def first_stage_value(x, axis: str):
    """A per-stage value that every stage agrees on, as one (invariant) value: stage 0's."""
    return lax.psum(jnp.where(lax.axis_index(axis) == 0, x, jnp.zeros_like(x)), axis)


def add_at(buffer: list, index, delta: list) -> list:
    """``buffer[index] += delta`` for each leaf."""
    return [lax.dynamic_update_index_in_dim(
        b, lax.dynamic_index_in_dim(b, index, keepdims=False) + d.astype(b.dtype), index, 0)
        for b, d in zip(buffer, delta)]


def scalar_like(x) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
