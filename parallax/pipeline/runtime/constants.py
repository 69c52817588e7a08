"""Which outputs of a function depend on none of its inputs: residuals ``F`` need not stash.

A layer's ``vjp`` closure can hold values made from no input at all: a causal mask built
from ``iota`` and broadcast to the attention's shape, a constant table. ``F`` would write
them into a stash slot for every micro-batch and layer, and ``B`` read them back, while the
sequential program's ``scan`` hoists such loop-invariant residuals out of its loop (JAX's
scan partial evaluation) and keeps one. The runtime takes them from its template trace
instead (:mod:`parallax.pipeline.runtime.chunk`): one value for every layer and
micro-batch.

Measured on the GPT of ``benchmarks/pipeline.py``: the boolean mask was ``pred[slots, L_c,
1, 4, 4, 64, 64]`` in the stash, zeroed when the step started, written by every ``F`` and
read by every ``B``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.extend import core as jcore


def constant_outputs(fn: Callable, *args) -> set[int]:
    """The positions of ``fn(*args)``'s flat outputs that no input flows into.

    Dataflow over the jaxpr: an equation's outputs depend on the inputs where any of its
    operands does. An equation with a nested jaxpr counts whole: that can only take a
    constant for dependent (and stash it), never the reverse.

    Example:
      >>> import jax.numpy as jnp
      >>> sorted(constant_outputs(lambda x: (x + 1, jnp.arange(3) < 2, x * 0), 1.0))
      [1]
    """
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    dependent = set(jaxpr.invars)

    def depends(v) -> bool:
        return isinstance(v, jcore.Var) and v in dependent

    for eqn in jaxpr.eqns:
        if any(depends(v) for v in eqn.invars):
            dependent.update(eqn.outvars)
    return {i for i, v in enumerate(jaxpr.outvars) if not depends(v)}
