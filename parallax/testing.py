"""Equivalence checking: train the same steps in parallel and on one device, and compare.

Every parallel path in parallax is tested against its plain single-device version, over
several optimizer steps, on values and gradients. These helpers are what the tests (and the
demo) use; they are public so that users can check their own models and strategies the same
way.

Example:
  >>> import jax, jax.numpy as jnp, optax, parallax as px
  >>> from flax import nnx
  >>> make = lambda: px.TrainState.create(px.models.MLP(4, [8], 4, rngs=nnx.Rngs(0)),
  ...                                     optax.adam(1e-2))
  >>> data = [{"x": jnp.ones((8, 4)), "y": jnp.zeros((8, 4))}] * 3
  >>> ref = px.testing.train(make, px.models.mse_loss, data)
  >>> par = px.testing.train(make, px.models.mse_loss, data,
  ...                        mesh=px.make_mesh(data=-1), strategy=px.DataParallel())
  >>> px.testing.assert_equivalent(par, ref, rtol=1e-5)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from parallax.grad.gradients import value_and_grad
from parallax.state import TrainState
from parallax.step.placement import init
from parallax.step.spmd_step import train_step


@dataclasses.dataclass
class Trajectory:
    """What a few training steps produced (all on the host, as numpy)."""

    losses: list[float]
    first_grads: Any
    final_params: Any
    final_state: Any


def _kind(state, tx):
    """(what px.value_and_grad differentiates, the parameters, how to apply gradients)."""
    if isinstance(state, TrainState):
        return (lambda s: s.model), (lambda s: s.params), (lambda s, g: s.apply_gradients(g))
    if tx is None:
        raise TypeError("px.testing.train: a functional (params, opt_state) state needs tx=.")

    def update(s, g):
        params, opt_state = s
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return (lambda s: s[0]), (lambda s: s[0]), update


def _with_params(state, params):
    """What ``loss_fn`` takes, rebuilt from ``params`` (for plain ``jax.value_and_grad``)."""
    if isinstance(state, TrainState):
        return nnx.merge(state.graphdef, params, state.rest)
    return params


def train(
    make_state: Callable[[], Any],
    loss_fn: Callable,
    batches: Sequence[Any],
    *,
    mesh=None,
    strategy=None,
    tx: optax.GradientTransformation | None = None,
    microbatches: int | None = None,
) -> Trajectory:
    """Runs ``len(batches)`` optimizer steps and records losses and the first gradients.

    With ``mesh=None`` this is the plain single-device program: ``jax.jit`` of
    ``jax.value_and_grad``, no parallax in the loop (``microbatches`` is ignored: the
    reference is the full batch). Otherwise the state is created with ``px.init`` and
    stepped with ``px.train_step`` and ``px.value_and_grad``.

    Args:
      make_state: builds the state (``px.TrainState`` or ``(params, opt_state)``).
      loss_fn: ``loss_fn(model_or_params, batch) -> scalar mean loss``.
      batches: one batch per step.
      mesh, strategy: where and how to run; None for the single-device reference.
      tx: the optimizer, for a functional state.
      microbatches: gradient accumulation inside ``px.value_and_grad``.

    Returns:
      A :class:`Trajectory`.
    """
    if mesh is None:
        device = jax.local_devices()[0]  # in a multi-process run, one of this process
        with jax.default_device(device):
            state = make_state()
        _, params_of, update = _kind(state, tx)

        @jax.jit
        def step(state, batch):
            loss, grads = jax.value_and_grad(
                lambda p: loss_fn(_with_params(state, p), batch)
            )(params_of(state))
            return update(state, grads), {"loss": loss, "grads": grads}

        batches = [jax.device_put(b, device) for b in batches]
    else:
        state = init(make_state, mesh, strategy)
        target, params_of, update = _kind(state, tx)

        @train_step(mesh, strategy)
        def step(state, batch):
            loss, grads = value_and_grad(loss_fn, microbatches=microbatches)(target(state), batch)
            return update(state, grads), {"loss": loss, "grads": grads}

    losses, first_grads = [], None
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if first_grads is None:
            first_grads = jax.device_get(metrics["grads"])
    return Trajectory(losses, first_grads, jax.device_get(params_of(state)), state)


def relative_difference(a, b, floor: float = 1e-4) -> float:
    """The largest, over leaves, of ``max|a - b| / scale``, ``scale`` being ``max|b|`` of the leaf.

    A floating leaf whose values are all tiny next to the tree's other floating leaves is
    measured against ``floor`` times their largest value instead: a gradient that is zero
    in exact arithmetic holds only rounding noise, which no reduction order reproduces.
    Integer and bool leaves (counters, step numbers, keys as ``jax.random.key_data``) have
    no rounding: each must be equal, and one that differs counts as 1. They never set the
    floor: a key's data (up to ``2**32``) would otherwise make every float leaf of a
    module's state (BatchNorm statistics next to RNG keys) pass whatever its value.

    Args:
      a, b: pytrees of the same structure; ``b`` is the reference.
      floor: the fraction of the largest floating value below which a leaf is measured
        against that value.

    Returns:
      The largest relative difference (0.0 for equal trees).

    Example:
      >>> relative_difference({"w": np.ones(3), "n": np.int32(2)},
      ...                     {"w": np.ones(3), "n": np.int32(3)})
      1.0
    """
    xs, ys = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(xs) != len(ys):
        raise ValueError(f"relative_difference: {len(xs)} leaves against {len(ys)}.")
    xs, ys = [np.asarray(x) for x in xs], [np.asarray(y) for y in ys]
    exact = [not np.issubdtype(y.dtype, np.inexact) for y in ys]
    largest = max((float(np.max(np.abs(y.astype(np.float64)))) for y, e in zip(ys, exact)
                   if y.size and not e), default=0.0)
    worst = 0.0
    for x, y, e in zip(xs, ys, exact):
        if not y.size:
            continue
        if e:
            worst = max(worst, 0.0 if np.array_equal(x, y) else 1.0)
            continue
        x, y = x.astype(np.float64), y.astype(np.float64)
        scale = max(float(np.max(np.abs(y))), floor * largest, 1e-30)
        worst = max(worst, float(np.max(np.abs(x - y))) / scale)
    return worst


def assert_equivalent(parallel: Trajectory, reference: Trajectory, rtol: float = 1e-5) -> None:
    """Asserts equal loss curves, first-step gradients and final parameters within ``rtol``."""
    losses = relative_difference(jnp.asarray(parallel.losses), jnp.asarray(reference.losses))
    grads = relative_difference(parallel.first_grads, reference.first_grads)
    params = relative_difference(parallel.final_params, reference.final_params)
    report = (f"losses {losses:.2e}, first gradients {grads:.2e}, final parameters "
              f"{params:.2e} (relative; tolerance {rtol:g})")
    assert max(losses, grads, params) <= rtol, report
