"""``@px.eval_step``: a forward-only step (held-out loss, metrics) under the training layout.

The state stays where the train step keeps it (its own shardings, not donated: training
goes on with it), the batch gets the strategy's batch sharding, and the strategy's context
is active while the function is traced, so the model's activation names and attention
resolve as in training. In a multi-process run each process passes its own rows, as to a
train step, and the global batch is assembled from them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
from jax.sharding import Mesh

from parallax import context
from parallax.mesh import describe
from parallax.step import batch as batch_lib
from parallax.step import boundary_checks
from parallax.step.placement import checked_strategy
from parallax.strategy import Strategy

API = "px.eval_step"


class EvalStep:
    """A user's ``fn(state, batch, *args) -> metrics``, jitted for a mesh, nothing donated.

    ``lower(...)`` returns ``jax.jit``'s ``Lowered`` (to read the compiled program).
    """

    def __init__(self, fn: Callable, mesh: Mesh, strategy: Strategy):
        if not callable(fn):
            raise TypeError(f"{API}: decorate a function fn(state, batch, *args) -> metrics; "
                            f"got {type(fn).__name__}: {fn!r}. Use it as "
                            "@px.eval_step(mesh, strategy) above a def.")
        self.fn, self.mesh, self.strategy = fn, mesh, strategy
        self._context = context.StepContext(mesh, strategy)
        self._multiprocess = jax.process_count() > 1
        self._local_signature = None
        self._jitted = jax.jit(self._traced, in_shardings=(
            None, batch_lib.batch_sharding(strategy, mesh)))
        functools.update_wrapper(self, fn)

    def _traced(self, state, batch, *args):
        batch_lib.check_batch(batch, self.strategy, self.mesh, API)
        with context.activate(self._context):
            return self.fn(state, batch, *args)

    def _assemble(self, batch):
        signature = batch_lib.local_signature(batch)
        batch = batch_lib.assemble(batch, self.strategy, self.mesh, api=API,
                                   check=signature != self._local_signature)
        self._local_signature = signature
        return batch

    def __call__(self, state, batch, *args):
        if self._multiprocess:
            batch = self._assemble(batch)
        try:
            with jax.set_mesh(self.mesh):
                return self._jitted(state, batch, *args)
        except (TypeError, ValueError):
            batch_lib.check_batch(batch, self.strategy, self.mesh, API)
            boundary_checks.check_state_mesh(state, self.mesh, API)
            raise

    def lower(self, state, batch, *args):
        """``jax.jit(...).lower`` of this step (the state's own shardings)."""
        if self._multiprocess:
            batch = batch_lib.assemble(batch, self.strategy, self.mesh, api=API)
        with jax.set_mesh(self.mesh):
            return self._jitted.lower(state, batch, *args)

    def __repr__(self) -> str:
        return (f"px.eval_step({getattr(self.fn, '__name__', 'step')}, "
                f"mesh={describe(self.mesh)}, strategy={self.strategy.name})")


def eval_step(mesh: Mesh, strategy: Strategy | None = None):
    """Decorates ``fn(state, batch, *args) -> metrics`` as a jitted forward-only step.

    The training state is read in place (never donated) in the layout ``px.init`` and
    ``px.train_step`` keep it; the batch is split over the strategy's batch axes, as in the
    train step; the model runs under the strategy's rules. ``px.metrics.Evaluation`` builds
    one around a loss to report held-out loss and perplexity during training.

    Args:
      mesh: the training mesh.
      strategy: the training strategy (replicated when None).

    Returns:
      A decorator producing an :class:`EvalStep`.

    Example:
      >>> import jax.numpy as jnp, optax, parallax as px
      >>> from flax import nnx
      >>> mesh, strategy = px.make_mesh(data=-1), px.DataParallel("data")
      >>> state = px.init(lambda: px.TrainState.create(
      ...     px.models.MLP(4, [8], 2, rngs=nnx.Rngs(0)), optax.sgd(0.1)), mesh, strategy)
      >>> @px.eval_step(mesh, strategy)
      ... def evaluate(state, batch):
      ...     return {"loss": px.models.mse_loss(state.model, batch)}
      >>> float(evaluate(state, {"x": jnp.ones((16, 4)), "y": jnp.zeros((16, 2))})["loss"]) > 0
      True
    """
    strategy = checked_strategy(strategy, mesh, API)

    def decorator(fn: Callable) -> EvalStep:
        return EvalStep(fn, mesh, strategy)

    return decorator
