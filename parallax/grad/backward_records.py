"""Module state written by the backward pass: a variable whose new value is its cotangent.

A forward pass may write a module's state (BatchNorm statistics); a backward pass cannot:
a ``jax.custom_vjp`` rule returns cotangents, nothing else. A :class:`BackwardRecord` is
how a layer gets a value out of its backward pass anyway: the layer passes the variable
into its ``custom_vjp`` function as an input, the rule returns the value to record as that
input's cotangent, and ``px.value_and_grad`` (which differentiates the loss with respect to
the parameters *and* the records) stores each record's cotangent as its value after the
step. A record no backward pass reaches becomes zero.

``px.Float8(delayed=True)`` records each converted layer's output-gradient amax this way
(Transformer Engine records it inside its backward GEMM).

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> state = nnx.State({"seen": BackwardRecord(jnp.zeros(())), "n": nnx.BatchStat(jnp.ones(()))})
  >>> records, rest = split_records(state)
  >>> sorted(records.keys()), sorted(rest.keys())
  (['seen'], ['n'])
"""

from __future__ import annotations

from flax import nnx


class BackwardRecord(nnx.Variable):
    """A module variable whose value after a step is the cotangent the backward pass
    gives it (see the module docstring)."""


def split_records(state):
    """``(records, rest)`` of a module's non-parameter ``nnx.State`` (records empty when it
    holds none)."""
    return nnx.split_state(state, BackwardRecord, ...)


def has_records(records) -> bool:
    """Whether ``records`` (from :func:`split_records`) holds any variable."""
    return bool(nnx.to_flat_state(records))


def with_records(state, cotangents):
    """``state`` with each record's value replaced by its cotangent (same structure)."""
    _, rest = split_records(state)
    return nnx.merge_state(rest, cotangents)
