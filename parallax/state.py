"""``TrainState``: an NNX model and its optax optimizer as one immutable pytree."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct


@struct.dataclass
class TrainState:
    """An NNX model split into parameters and other state, plus an optax optimizer state.

    The model's structure (``graphdef``) and the optimizer (``tx``) are static; everything
    else is arrays, so the state can be jitted, sharded and donated as one pytree, and
    ``state.model`` rebuilds the module inside a step. This is flax's
    ``training.train_state.TrainState`` for NNX modules.

    Attributes:
      step: the number of updates applied (int32 scalar).
      params: the ``nnx.Param`` state of the model (with its logical-axis metadata).
      rest: the model's other state (batch statistics, RNG counters), not differentiated.
      opt_state: the optax state for ``params``.
      graphdef: the model's static structure.
      tx: the optax optimizer.
      wrt: the NNX filter of the trained state (``nnx.Param``).

    Example:
      >>> import optax, parallax as px
      >>> from flax import nnx
      >>> model = px.models.MLP(4, [8], 2, rngs=nnx.Rngs(0))
      >>> state = px.TrainState.create(model, optax.sgd(0.1))
      >>> int(state.step)
      0
    """

    step: jax.Array
    params: Any
    rest: Any
    opt_state: Any
    graphdef: Any = struct.field(pytree_node=False)
    tx: optax.GradientTransformation = struct.field(pytree_node=False)
    wrt: Any = struct.field(pytree_node=False, default=nnx.Param)

    @classmethod
    def create(cls, model: nnx.Module, tx: optax.GradientTransformation, *, wrt=nnx.Param):
        """Splits ``model`` into ``wrt`` state (trained) and the rest, and initialises ``tx``."""
        graphdef, params, rest = nnx.split(model, wrt, ...)
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            rest=rest,
            opt_state=tx.init(params),
            graphdef=graphdef,
            tx=tx,
            wrt=wrt,
        )

    @property
    def model(self) -> nnx.Module:
        """A module built from the current parameters (a fresh object each time)."""
        return nnx.merge(self.graphdef, self.params, self.rest)

    def apply_gradients(self, grads, *, model: nnx.Module | None = None) -> TrainState:
        """One optimizer update; ``model`` (optional) supplies updated non-trained state.

        Args:
          grads: gradients with the structure of ``params`` (what ``px.value_and_grad``
            returns for ``state.model``).
          model: a module whose non-parameter state (e.g. batch statistics mutated in the
            forward pass) replaces ``rest``.

        Returns:
          A new ``TrainState`` with ``step + 1``.
        """
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        params = optax.apply_updates(self.params, updates)
        rest = self.rest if model is None else nnx.split(model, self.wrt, ...)[2]
        return self.replace(step=self.step + 1, params=params, rest=rest, opt_state=opt_state)
