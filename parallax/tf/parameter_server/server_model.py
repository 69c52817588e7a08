"""``ServerModel``: an NNX model whose parameters and optimizer state live on the servers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from parallax.ps import UPDATE
from parallax.tf.parameter_server.key_layout import KeyLayout
from parallax.tf.parameter_server.sharded_variable import ShardedVariable


class ServerModel:
    """An NNX model split into ``ShardedVariable``s on the parameter servers.

    Workers :meth:`pull` the parameters (one request to each server), compute gradients
    with ``jax.jit`` on their own devices, and :meth:`push_gradients` (one request to each
    server); the servers' optimizer applies them. The model's structure (``graphdef``) and
    non-parameter state travel with the object; its parameters never do.

    Attributes:
      graphdef: the model's static structure (``nnx.split``).
      variables: ``{path: ShardedVariable}`` for every ``nnx.Param``.

    Example:
      >>> import numpy as np, optax, parallax as px
      >>> from flax import nnx
      >>> strategy = px.tf.ParameterServerStrategy(px.tf.RayClusterResolver(1, num_ps=1))
      >>> model = strategy.distribute_model(px.models.MLP(2, [4], 1, rngs=nnx.Rngs(0)),
      ...                                   optax.sgd(0.1))
      >>> sorted(model.variables)[:2]
      ["['layers'][0]['bias']", "['layers'][0]['kernel']"]
      >>> step = model.train_step(px.models.mse_loss)
      >>> loss = step({"x": np.ones((4, 2), np.float32), "y": np.zeros((4, 1), np.float32)})
      >>> strategy.shutdown()

    References:
      TensorFlow, ``ParameterServerStrategy`` (variables created under ``strategy.scope()``
      are placed on parameter servers); Dean et al., "Large Scale Distributed Deep
      Networks" (Downpour SGD), NeurIPS 2012.
    """

    def __init__(self, graphdef, rest, treedef, names: list[str],
                 variables: list[ShardedVariable], store):
        self.graphdef, self.rest, self.treedef = graphdef, rest, treedef
        self._names = list(names)
        self._variables = list(variables)
        self._layout = KeyLayout(self._variables)
        self._store = store
        self._client = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_client"] = None
        return state

    @property
    def variables(self) -> dict[str, ShardedVariable]:
        """Every parameter's ``ShardedVariable``, by pytree path."""
        return dict(zip(self._names, self._variables))

    def optimizer_variables(self, slot: int) -> dict[str, ShardedVariable]:
        """The optimizer's ``slot``-th per-element state of every parameter (e.g. Adam's mu)."""
        return {name: v.optimizer_slot(slot) for name, v in self.variables.items()}

    def pull_params(self) -> Any:
        """The current parameters (an ``nnx.State`` of numpy arrays), one pull per server."""
        client = self.client()
        arrays = self._layout.split(client.wait(client.pull(self._layout.keys)))
        return jax.tree.unflatten(self.treedef, arrays)

    def pull(self) -> nnx.Module:
        """A module with the current parameters."""
        return nnx.merge(self.graphdef, self.pull_params(), self.rest)

    def push_gradients(self, grads) -> None:
        """Sends gradients (the parameters' structure) to the servers and waits for them.

        Raises:
          ValueError: the gradients' structure is not the parameters'.
        """
        leaves, treedef = jax.tree.flatten(grads)
        if treedef != self.treedef:
            raise ValueError(f"ServerModel.push_gradients: the gradients' structure {treedef} "
                             f"is not the parameters' {self.treedef}; pass what "
                             f"jax.grad/nnx.grad returns for the pulled parameters.")
        client = self.client()
        flat = self._layout.join([np.asarray(leaf) for leaf in leaves])
        client.wait(client.push(self._layout.keys, flat, self._layout.lens, cmd=UPDATE))

    def train_step(self, loss_fn: Callable) -> ServerTrainStep:
        """A worker's step for ``loss_fn(model, batch)``: pull, jitted gradients, push."""
        return ServerTrainStep(self, loss_fn)

    def client(self):
        """This process's connection to the servers."""
        if self._client is None:
            self._client = self._store.client()
        return self._client


class ServerTrainStep:
    """``step(batch) -> loss``: pull the parameters, ``jax.jit`` gradients here, push them.

    The jitted function is built in the process that first calls the step (a worker), and
    kept for the next calls there.

    Example:
      >>> callable(ServerTrainStep)
      True
    """

    def __init__(self, model: ServerModel, loss_fn: Callable):
        self.model, self.loss_fn = model, loss_fn
        self._grad = None

    def __getstate__(self):
        return {"model": self.model, "loss_fn": self.loss_fn, "_grad": None}

    def __call__(self, batch) -> float:
        if self._grad is None:
            graphdef, rest, loss_fn = self.model.graphdef, self.model.rest, self.loss_fn
            self._grad = jax.jit(jax.value_and_grad(
                lambda params, batch: loss_fn(nnx.merge(graphdef, params, rest), batch)))
        loss, grads = self._grad(self.model.pull_params(), batch)
        self.model.push_gradients(grads)
        return float(loss)
