"""One model chunk (a stage's run of layers) split into the runtime's three actions.

``F`` scans the chunk's layers, each through ``jax.vjp``, and returns the residuals of every
layer (the leaves of the vjp closures, stacked over the layers); ``B`` walks the layers
backwards from the output gradient and returns the input gradient and each layer's output
gradient; ``W`` computes each layer's weight gradient from its residuals and output gradient,
independently of the others. ``B`` and ``W`` call the same closure and each keeps only its
half, so XLA drops the other half (``B`` computes no weight gradient, ``W`` no input gradient
and no chain through the layers).

The closure's structure comes from one template trace on *varying* dummy inputs (the JAX
notes: with invariant dummies the rebuilt closure's cotangent types differ between switch
branches). Residual leaves that are the layer's own parameters are not stashed: they are
taken from the parameters again when the closure is rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax


class Template(NamedTuple):
    """The structure of one layer's vjp closure."""

    treedef: object
    param_at: dict  # closure leaf position -> index of the layer parameter it is
    stashed: list  # ShapeDtypeStruct of every other closure leaf (what the stash holds)


def template(layer: Callable, param_like: list, x_like, vary: Callable, api: str) -> Template:
    """Traces ``jax.vjp(layer)`` once on varying dummies of the given shapes."""
    dummies = [vary(jnp.zeros(p.shape, p.dtype)) for p in param_like]
    x = jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype)), x_like)
    y, pullback = jax.vjp(layer, dummies, x)
    shapes = lambda t: jax.tree.map(lambda a: (a.shape, str(a.dtype)), t)  # noqa: E731
    if jax.tree.structure(y) != jax.tree.structure(x) or shapes(y) != shapes(x):
        raise ValueError(
            f"{api}: Stages.stage(layer, x) must return an x of the same structure, shape and "
            f"dtype as its input: got {shapes(y)} for an input {shapes(x)}"
        )
    leaves, treedef = jax.tree.flatten(pullback)
    param_at = _param_positions(leaves, dummies)
    stashed = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
               for i, leaf in enumerate(leaves) if i not in param_at]
    return Template(treedef, param_at, stashed)


def _param_positions(leaves: list, params: list) -> dict:
    ids = {id(p): k for k, p in enumerate(params)}
    return {i: ids[id(leaf)] for i, leaf in enumerate(leaves) if id(leaf) in ids}


class Chunk:
    """The actions of one chunk of ``layers`` stacked layers under a closure template.

    Args:
      layer: ``layer(leaves, x) -> x`` (one layer's parameter slices).
      tmpl: the :class:`Template` of ``jax.vjp(layer)``.
      vary: casts a value to vary over the runtime's manual axes.
    """

    def __init__(self, layer: Callable, tmpl: Template, vary: Callable):
        self.layer, self.tmpl, self.vary = layer, tmpl, vary

    def forward(self, params: list, x):
        """The chunk's output, keeping nothing (a rematerialised forward)."""
        return lax.scan(lambda x, p: (self.layer(p, x), None), x, params)[0]

    def forward_vjp(self, params: list, x):
        """The chunk's output and the stashed residuals of each layer, ``[layers, ...]``."""

        def body(x, p):
            y, pullback = jax.vjp(self.layer, p, x)
            leaves = jax.tree.leaves(pullback)
            if _param_positions(leaves, p) != self.tmpl.param_at or len(leaves) != len(
                self.tmpl.param_at) + len(self.tmpl.stashed):
                raise AssertionError("pipeline runtime: a layer's vjp closure changed structure")
            return y, [self.vary(leaf) for i, leaf in enumerate(leaves)
                       if i not in self.tmpl.param_at]

        return lax.scan(body, x, params)

    def _pullback(self, p: list, residuals: list):
        stashed = iter(residuals)
        count = len(self.tmpl.param_at) + len(self.tmpl.stashed)
        leaves = [p[self.tmpl.param_at[i]] if i in self.tmpl.param_at else next(stashed)
                  for i in range(count)]
        return jax.tree.unflatten(self.tmpl.treedef, leaves)

    def backward_input(self, params: list, residuals: list, dy):
        """``B``: the gradient of the chunk's input, and of each layer's output ``[layers]``."""

        def body(g, xs):
            p, res = xs
            _, dx = self._pullback(p, res)(g)
            return jax.tree.map(self.vary, dx), g

        return lax.scan(body, dy, (params, residuals), reverse=True)

    def backward_weights(self, params: list, residuals: list, cotangents):
        """``W``: each layer's weight gradient ``[layers, ...]`` from its output gradient."""

        def body(_, xs):
            p, res, g = xs
            dp, _ = self._pullback(p, res)(g)
            return None, [self.vary(d) for d in dp]

        return lax.scan(body, None, (params, residuals, cotangents))[1]
