"""A pipelined loss: ``Stages(first, stage, last, layers)``, and the raw program it becomes.

A model is pipelined along a stack of identical layers (the GPT's blocks): ``first`` runs
before the stack (the embedding), ``stage`` applies one layer, ``last`` runs after it (head
and loss). Called as ``loss(model, batch)`` a :class:`Stages` runs the plain sequential
model, so without a pipeline it is an ordinary loss function; the pipeline runtime instead
reads its pieces and places them as the schedule needs (``first`` on virtual stage 0,
``last`` on the last one, the layers split into chunks over the stage axis).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

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
                      transform_metadata=_metadata(layers))
            def body(x, layer):
                return stage(layer, x)

            x = body(x, layers)
        else:
            x = lax.scan(lambda x, layer: (self.stage(layer, x), None), x, layers)[0]
        return self.last(model, x, batch)


def _metadata(layers: nnx.Module) -> dict:
    """nnx.scan's metadata: strip the leading ``"layers"`` name when the params carry it."""
    for v in jax.tree.leaves(nnx.state(layers, nnx.Param),
                             is_leaf=lambda x: isinstance(x, nnx.Variable)):
        names = v.get_metadata().get("out_sharding")
        if names:
            return {nnx.PARTITION_NAME: names[0]}
    return {}


class Program(NamedTuple):
    """A :class:`Stages` loss as functions of flat lists of arrays, for the runtime.

    Attributes:
      stacked: the stacked layer parameters ``[L, ...]``.
      others: every other parameter (used by ``first`` and ``last``).
      first: ``first(others, microbatch) -> x``.
      layer: ``layer(leaves, x) -> x``, one layer from its slices of ``stacked``.
      last: ``last(others, x, microbatch) -> loss``.
      grads: ``grads(d_stacked, d_others) -> a tree shaped like the parameters`` (either
        may be ``None`` leaves: a tree with only the stacked, or only the other, leaves).
    """

    stacked: list
    others: list
    first: Callable
    layer: Callable
    last: Callable
    grads: Callable


def program(stages: Stages, params, rebuild: Callable, api: str) -> Program:
    """Splits ``params`` into the stacked layers and the rest, and the loss into functions.

    Args:
      stages: the pipelined loss.
      params: what is differentiated (an ``nnx.State`` of params, or a pytree).
      rebuild: ``params -> what stages' functions take`` (the module, or the params).
      api: the public name, for errors.

    Returns:
      A :class:`Program`.
    """
    model = rebuild(params)
    layers = stages.layers(model)
    if isinstance(layers, nnx.Module):
        graphdef, state, rest = nnx.split(layers, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ValueError(
                f"{api}: the stacked layers hold state other than nnx.Param "
                f"({jax.tree.structure(rest)}); the pipeline runtime carries parameters only. "
                "Keep non-trained variables out of the stacked layers."
            )
        layer_leaves = jax.tree.leaves(state)
        meta = _metadata(layers)
        one = jax.tree.map(lambda v: v[0], state)  # the structure of one layer
        if meta:
            one = nnx.spmd.remove_axis(one, 0, meta)  # as nnx.scan does: drop "layers"
        one_def = jax.tree.structure(one)

        def layer(leaves, x):
            return stages.stage(nnx.merge(graphdef, jax.tree.unflatten(one_def, leaves)), x)
    else:
        layer_leaves, layer_def = jax.tree.flatten(layers)

        def layer(leaves, x):
            return stages.stage(jax.tree.unflatten(layer_def, leaves), x)

    p_leaves, p_def = jax.tree.flatten(params)
    position = {id(x): i for i, x in enumerate(p_leaves)}
    missing = [i for i, x in enumerate(layer_leaves) if id(x) not in position]
    if missing or not layer_leaves:
        raise ValueError(
            f"{api}: Stages.layers(model) must return the stacked layers, a part of the "
            "parameters being differentiated (e.g. lambda model: model.blocks); "
            f"{len(missing) if layer_leaves else 'none'} of its {len(layer_leaves)} arrays "
            "were not found among the parameters"
        )
    stacked_at = [position[id(x)] for x in layer_leaves]
    is_stacked = set(stacked_at)
    other_at = [i for i in range(len(p_leaves)) if i not in is_stacked]
    sizes = {x.shape[0] if x.ndim else None for x in layer_leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"{api}: every array of the stacked layers needs the same leading layer axis; "
            f"got leading sizes {sorted(map(str, sizes))}"
        )

    def model_of(others: list) -> Any:
        leaves: list = [None] * len(p_leaves)
        for i, x in zip(other_at, others):
            leaves[i] = x
        return rebuild(jax.tree.unflatten(p_def, leaves))

    def grads(d_stacked, d_others):
        leaves: list = [None] * len(p_leaves)
        for i, g in zip(stacked_at, d_stacked or [None] * len(stacked_at)):
            leaves[i] = g
        for i, g in zip(other_at, d_others or [None] * len(other_at)):
            leaves[i] = g
        return jax.tree.unflatten(p_def, leaves)

    return Program(
        stacked=[p_leaves[i] for i in stacked_at],
        others=[p_leaves[i] for i in other_at],
        first=lambda others, mb: stages.first(model_of(others), mb),
        layer=layer,
        last=lambda others, x, mb: stages.last(model_of(others), x, mb),
        grads=grads,
    )
