"""A pipelined loss: ``Stages(first, stage, last, layers)``.

A model is pipelined along a stack of identical layers (the GPT's blocks): ``first`` runs
before the stack (the embedding), ``stage`` applies one layer, ``last`` runs after it (head
and loss). Called as ``loss(model, batch)`` a :class:`Stages` runs the plain sequential
model, so without a pipeline it is an ordinary loss function; the pipeline runtime instead
reads its pieces and places them as the schedule needs (``first`` on virtual stage 0,
``last`` on the last one, the layers split into chunks over the stage axis), from the flat
program it becomes (:mod:`parallax.pipeline.runtime.program`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
from flax import nnx
from jax import lax

@dataclasses.dataclass(frozen=True)
class Stages:
    """A loss function split for a pipeline: ``first``, one ``stage`` per layer, ``last``.

    Args:
      first: ``first(model, microbatch) -> x``, what runs before the layers.
      stage: ``stage(layer, x) -> x``, one layer; ``x`` keeps its shape and dtype.
      last: ``last(model, x, microbatch) -> loss``, a scalar mean over the micro-batch.
      layers: ``layers(model) -> the stacked layers``: an ``nnx.Module`` whose parameters
        have a leading layer axis (built with ``nnx.vmap``), or a pytree of arrays
        ``[L, ...]`` that is part of the parameters.

    ``model`` is whatever the loss is differentiated with respect to: an ``nnx.Module`` or a
    pytree of parameters. ``first`` and ``last`` must not read the stacked layers (on a stage
    they are not there: they are ``None``).

    Returns:
      Called as ``stages(model, batch)``: the loss of the sequential model (``first``,
      every layer in order, ``last``).

    Example:
      >>> import jax.numpy as jnp
      >>> from parallax.pipeline import Stages
      >>> loss = Stages(first=lambda p, b: b["x"] @ p["w_in"],
      ...               stage=lambda w, x: jnp.tanh(x @ w) + x,
      ...               last=lambda p, x, b: jnp.mean((x - b["y"]) ** 2),
      ...               layers=lambda p: p["layers"])
      >>> params = {"w_in": jnp.ones((2, 4)), "layers": jnp.zeros((3, 4, 4))}
      >>> float(loss(params, {"x": jnp.ones((8, 2)), "y": jnp.ones((8, 4))}))
      1.0

    References:
      Huang et al. 2019, GPipe (a model as a sequence of layers cut into cells).
    """

    first: Callable
    stage: Callable
    last: Callable
    layers: Callable

    def __post_init__(self):
        for name in ("first", "stage", "last", "layers"):
            if not callable(getattr(self, name)):
                raise TypeError(
                    f"px.pipeline.Stages: {name} must be callable, got "
                    f"{type(getattr(self, name)).__name__}"
                )

    def __call__(self, model, batch):
        x = self.first(model, batch)
        layers = self.layers(model)
        if isinstance(layers, nnx.Module):
            stage = self.stage

            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry,
                      transform_metadata=scan_metadata(layers))
            def body(x, layer):
                return stage(layer, x)

            x = body(x, layers)
        else:
            x = lax.scan(lambda x, layer: (self.stage(layer, x), None), x, layers)[0]
        return self.last(model, x, batch)


def scan_metadata(layers: nnx.Module) -> dict:
    """nnx.scan's metadata: strip the leading ``"layers"`` name when the params carry it
    (the sequential loss here and the runtime's one-layer rebuild, :mod:`.runtime.program`)."""
    for v in jax.tree.leaves(nnx.state(layers, nnx.Param),
                             is_leaf=lambda x: isinstance(x, nnx.Variable)):
        names = v.get_metadata().get("out_sharding")
        if names:
            return {nnx.PARTITION_NAME: names[0]}
    return {}
