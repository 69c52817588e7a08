"""PipeDream-2BW's second weight version, kept by the optimizer: ``double_buffered(tx)``.

PipeDream-2BW keeps two versions of each stage's weights: micro-batches in flight finish
on the version they started with while the next batch starts on the new one, so the
gradient applied at step ``t`` was computed with the weights of step ``t - 1``:

    W(t + 1) = W(t) - lr * grad f(W(t - 1))

parallax's pipeline flushes at every step, so it realises this update rule directly: the
previous version lives in the optimizer state (``double_buffered(tx)``), the step computes
its gradient at that version (``px.pipeline.update``) and applies it to the current one.
The state then holds the parameters twice (the memory 2BW pays, read from the compiled
program's arguments by the tests).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optax


class DoubleBufferedState(NamedTuple):
    """The previous parameters (``W(t - 1)``) and the wrapped optimizer's state."""

    previous: Any  # the parameters one update ago, structured like them
    inner: Any  # the wrapped transformation's state


def double_buffered(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` with PipeDream-2BW's second weight version kept in its state.

    ``update(grads, state, params)`` is ``tx``'s update and records ``params`` as the
    previous version; ``init`` starts with the previous version equal to the parameters.
    ``px.pipeline.update`` with ``px.Pipeline(weights="2bw")`` evaluates the gradient at
    ``state.previous``.

    Args:
      tx: the optimizer.

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`DoubleBufferedState`.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = double_buffered(optax.sgd(0.5))
      >>> w = jnp.array([1.0]); state = tx.init(w)
      >>> updates, state = tx.update(jnp.array([2.0]), state, w)
      >>> float(optax.apply_updates(w, updates)[0]), float(state.previous[0])
      (0.0, 1.0)

    References:
      Narayanan et al. 2021, Memory-Efficient Pipeline-Parallel DNN Training (PipeDream-2BW,
      double-buffered weight updates).
    """

    def init_fn(params):
        return DoubleBufferedState(previous=params, inner=tx.init(params))

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError(
                "px.pipeline.double_buffered: update needs params (the current weights, "
                "kept as the next step's previous version)"
            )
        updates, inner = tx.update(updates, state.inner, params)
        return updates, DoubleBufferedState(previous=params, inner=inner)

    return optax.GradientTransformation(init_fn, update_fn)
