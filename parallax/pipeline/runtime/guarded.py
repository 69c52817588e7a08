"""Conditionals that update the runtime's buffers in place: guards.

The tick loop carries every ring and accumulator; a ``lax.switch`` or ``lax.cond`` that
returns them makes XLA copy a buffer it returned, or read and saw written in the same tick
(measured: every tick stored a whole stash slot). A ``lax.while_loop`` of 0 or 1 trips
updates its carried buffers in place and touches none when it does not run: that is a
guard (:func:`guard`). Where every cell of a kind has a flag, or none has it, no
conditional is needed at all (:func:`when`, :func:`guard_when`); each conditional is named
(``pp_<name>``) so a reader of the compiled program
(:mod:`parallax.analysis.executed`) finds it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


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


def when(name: str, flag, mixed: tuple[bool, bool], if_true, if_false):
    """``lax.cond(flag, ...)`` where the table mixes both cases; the one case where it does not.

    ``mixed`` is (some cell has the flag, some cell lacks it), among the cells of the kind.
    """
    has, lacks = mixed
    if has and lacks:
        with jax.named_scope(f"pp_{name}"):
            return lax.cond(flag, if_true, if_false)
    return (if_true if has else if_false)()


def guard_when(name: str, flag, mixed: tuple[bool, bool], body, state, vary, cell):
    """``body(cell, state)`` under a guard where the table mixes both cases; else always or
    never."""
    has, lacks = mixed
    if has and lacks:
        return guard(name, flag, body, state, vary, cell)[1]
    return body(cell, state) if has else state
