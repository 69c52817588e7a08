"""``TrainState``: an NNX model and its optax optimizer as one immutable pytree."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from parallax import host_memory


@struct.dataclass
class TrainState:
    """An NNX model split into parameters and other state, plus an optax optimizer state.

    The model's structure (``graphdef``) and the optimizer (``tx``) are static; everything
    else is arrays, so the state can be jitted, sharded and donated as one pytree, and
    ``state.model`` rebuilds the module inside a step. This is flax's
    ``training.train_state.TrainState`` for NNX modules.

    State that a forward pass writes (BatchNorm statistics, RNG counters, variables) is
    kept in ``rest`` and flows as with ``nnx.Optimizer``: ``state.model`` is one module per
    state value, ``px.value_and_grad(loss)(state.model, batch)`` writes the forward pass's
    state into it, and ``state.apply_gradients(grads)`` stores that state with the new
    parameters. Sown intermediates (``nnx.Intermediate``) are outputs, not training state:
    they are not kept.

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
        graphdef, params, rest = split_without_intermediates(model, wrt)
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
        """The module of this state: built on first use, the same object afterwards.

        A forward pass may write its non-parameter state into it (``px.value_and_grad``
        does), and :meth:`apply_gradients` keeps what it wrote.
        """
        built = self.__dict__.get("_model")
        if built is None:
            built = nnx.merge(self.graphdef, self.params, self.rest)
            object.__setattr__(self, "_model", built)  # a cache, not a field: not traced
        return built

    def apply_gradients(self, grads, *, model: nnx.Module | None = None) -> TrainState:
        """One optimizer update; ``model`` (optional) supplies updated non-trained state.

        Args:
          grads: gradients with the structure of ``params`` (what ``px.value_and_grad``
            returns for ``state.model``).
          model: a module whose non-parameter state (e.g. batch statistics written by the
            forward pass) replaces ``rest``; by default :attr:`model`, when it was built.

        Returns:
          A new ``TrainState`` with ``step + 1``.
        """
        # ZeRO-Offload: an optimizer state in host memory comes to the device only now,
        # after the gradients exist (parallax.host_memory).
        opt_state = host_memory.to_device(self.opt_state, after=grads)
        updates, opt_state = self.tx.update(grads, opt_state, self.params)
        params = optax.apply_updates(self.params, updates)
        model = self.__dict__.get("_model") if model is None else model
        rest = self.rest if model is None else self._rest_of(model)
        return self.replace(step=self.step + 1, params=params, rest=rest, opt_state=opt_state)

    def _rest_of(self, model: nnx.Module):
        """``model``'s non-trained state, in the structure of ``rest``."""
        after = dict(nnx.to_flat_state(split_without_intermediates(model, self.wrt)[2]))
        before = nnx.to_flat_state(self.rest)
        missing = [path for path, _ in before if path not in after]
        if missing:
            raise ValueError(
                f"TrainState.apply_gradients: the model no longer has the variable "
                f"{'/'.join(map(str, missing[0]))}; pass a module of this state's structure.")
        return nnx.from_flat_state([(path, after[path]) for path, _ in before])


def split_without_intermediates(model: nnx.Module, wrt):
    """``(graphdef, trained, rest)`` of ``model`` as if it held no sown values."""
    graphdef, params, sown, rest = nnx.split(model, wrt, nnx.Intermediate, ...)
    if not jax.tree.leaves(sown):
        return graphdef, params, rest
    clean = nnx.merge(graphdef, params, sown, rest)
    nnx.pop(clean, nnx.Intermediate)
    return nnx.split(clean, wrt, ...)
