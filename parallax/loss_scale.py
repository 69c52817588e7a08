"""Dynamic loss scaling for float16: the scale lives in the optimizer state and checkpoints.

float16 has 5 exponent bits: small gradients underflow to zero. The loss is multiplied by
a scale ``S`` before the backward pass (every gradient grows by ``S``) and the gradients
divided by ``S`` after it, in float32. :func:`dynamic_loss_scale` wraps an optax optimizer:
its state holds ``S``, the count of finite steps since the last change and the count of
skipped steps. A step whose gradients are not all finite applies no update (parameters and
the inner optimizer state unchanged) and halves ``S``; ``period`` finite steps in a row
double it (JMP's and PyTorch's ``GradScaler`` rule).

``px.train_step`` makes the scale of the state it is given current while it traces
(:func:`scale_of`), ``px.value_and_grad`` scales the loss by it and unscales the gradients
(``parallax.grad``), and :func:`metrics` reads the scale and the skipped steps for the
step's metrics.

Example:
  >>> import jax.numpy as jnp, optax
  >>> tx = dynamic_loss_scale(optax.sgd(0.1), initial_scale=4.0)
  >>> state = tx.init({"w": jnp.ones(2)})
  >>> _, state = tx.update({"w": jnp.array([1.0, jnp.inf])}, state)   # overflow: skipped
  >>> {k: float(v) for k, v in metrics(state).items()}
  {'loss_scale': 2.0, 'skipped_steps': 1.0}

References:
  Micikevicius et al., "Mixed Precision Training", ICLR 2018; DeepMind JMP
  (``jmp.DynamicLossScale``); optax ``apply_if_finite`` (skipping non-finite updates).
"""

from __future__ import annotations

import contextvars
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from parallax.context import binding

API = "px.dynamic_loss_scale"


class LossScaleState(NamedTuple):
    """The optimizer state of :func:`dynamic_loss_scale`."""

    scale: jax.Array  # float32 scalar: S
    good_steps: jax.Array  # int32 scalar: finite steps since S last changed
    skipped_steps: jax.Array  # int32 scalar: steps skipped for non-finite gradients
    inner: Any  # the wrapped optimizer's state


def dynamic_loss_scale(tx: optax.GradientTransformation, *, initial_scale: float = 2.0 ** 15,
                       period: int = 2000, factor: float = 2.0,
                       min_scale: float = 1.0) -> optax.GradientTransformation:
    """``tx`` with a dynamic loss scale: skips (and halves ``S``) on non-finite gradients.

    The gradients it receives are the unscaled ones (``px.value_and_grad`` divides by
    ``S``).

    Args:
      tx: the optimizer to wrap.
      initial_scale: ``S`` at the start (2^15, as JMP and PyTorch).
      period: finite steps in a row after which ``S`` is multiplied by ``factor``.
      factor: the growth factor (and the divisor on overflow).
      min_scale: ``S`` never drops below this.

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`LossScaleState`.
    """
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"{API}: tx must be an optax.GradientTransformation, got "
                        f"{type(tx).__name__}; e.g. dynamic_loss_scale(optax.adam(1e-3)).")
    if not (initial_scale >= min_scale > 0 and factor > 1 and int(period) == period > 0):
        raise ValueError(f"{API}: need initial_scale >= min_scale > 0, factor > 1 and a "
                         f"positive integer period; got initial_scale={initial_scale}, "
                         f"min_scale={min_scale}, factor={factor}, period={period}.")

    def init_fn(params):
        return LossScaleState(jnp.asarray(initial_scale, jnp.float32), jnp.zeros((), jnp.int32),
                              jnp.zeros((), jnp.int32), tx.init(params))

    def update_fn(updates, state, params=None):
        finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g))
                                      for g in jax.tree.leaves(updates)]))
        safe = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), updates)
        new_updates, inner = tx.update(safe, state.inner, params)
        new_updates = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)),
                                   new_updates)
        inner = jax.tree.map(lambda new, old: jnp.where(finite, new, old), inner, state.inner)
        grow = finite & (state.good_steps + 1 >= period)
        scale = jnp.where(grow, state.scale * factor,
                          jnp.where(finite, state.scale,
                                    jnp.maximum(state.scale / factor, min_scale)))
        good = jnp.where(finite & ~grow, state.good_steps + 1, 0)
        skipped = state.skipped_steps + (~finite).astype(jnp.int32)
        return new_updates, LossScaleState(scale.astype(jnp.float32), good.astype(jnp.int32),
                                           skipped, inner)

    return optax.GradientTransformation(init_fn, update_fn)


def _is_state(x) -> bool:
    return isinstance(x, LossScaleState)


def find(tree) -> LossScaleState | None:
    """The first :class:`LossScaleState` in ``tree`` (a train state, an optimizer state)."""
    found = [x for x in jax.tree.leaves(tree, is_leaf=_is_state) if _is_state(x)]
    return found[0] if found else None


def metrics(tree) -> dict[str, jax.Array]:
    """``{"loss_scale", "skipped_steps"}`` of the loss-scale state in ``tree`` ({} if none)."""
    state = find(tree)
    if state is None:
        return {}
    return {"loss_scale": state.scale, "skipped_steps": state.skipped_steps}


_current: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "parallax_loss_scale", default=None)


def current() -> jax.Array | None:
    """The loss scale of the step being traced (None: no loss-scale state in it)."""
    return _current.get()


def scale_of(state):
    """A ``with`` block in which :func:`current` is the scale found in ``state``."""
    found = find(state)
    return binding(_current, None if found is None else found.scale)
