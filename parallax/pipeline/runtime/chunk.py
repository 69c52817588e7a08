"""One model chunk (a stage's run of layers) as the runtime's three actions, ``F``, ``B``, ``W``.

Each layer is split by :mod:`parallax.pipeline.runtime.split`: ``F`` runs it with a zero
perturbation at every use of a parameter and keeps, per layer, the residuals of its ``vjp``
with respect to the input and the perturbations, plus the activation operands of the uses;
``B`` pulls the output gradient back through the layers (last to first) and keeps, per layer,
the gradient at every use; ``W`` turns those into each layer's weight gradient, layer by layer
and independently. ``F + B + W`` computes what one ``jax.vjp`` does, once.

What a layer keeps goes straight into the runtime's rings
(:mod:`parallax.pipeline.runtime.rings`, ``[rows, L_c, ...]`` per leaf): each
action's layer loop carries the ring it writes and updates ``[slot, layer]`` as it reaches
the layer, and reads ``[slot, layer]`` of the rings it reads with one dynamic slice per
layer. No ``[L_c, ...]`` buffer of the chunk's own is built and then stored into a slot,
or read out of one (measured: 1F1B's bytes accessed 1.97x -> 1.21x the sequential
program's, ``docs/pipeline.md``).

The closure's structure comes from one template trace on *varying* dummy inputs (with
invariant dummies the rebuilt closure's cotangent types differ between the actions).
Residual leaves that are the layer's own parameters are not stashed: they are taken from the
parameters again when the closure is rebuilt; nor are leaves made from no input at all (a
causal mask: :mod:`parallax.pipeline.runtime.constants`), which the template's trace
holds once for every layer and micro-batch.

Every layer also takes and returns its non-parameter state (``[layers, ...]`` per leaf for a
chunk; none for a stateless model): ``F`` (and a rematerialised forward) returns the state
after each layer; ``B`` and ``W`` read only what ``F`` stashed, so they never move it.

(A little over 300 lines: the template and the four layer loops, ``F``, ``F`` into the
stash, ``B`` and ``W`` apart or fused, read one layout of the stash and must change
together.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from parallax.pipeline.runtime.constants import constant_outputs
from parallax.pipeline.runtime.rings import read_layer, write_layer
from parallax.pipeline.runtime.split import Split, split


class Template(NamedTuple):
    """The structure of one layer's ``F``: its closure and what it stashes."""

    split: Split
    treedef: object  # of the vjp closure
    param_at: dict  # closure leaf position -> index of the layer parameter it is
    zero_at: dict  # closure leaf position -> index of the (zero) perturbation it is
    residuals: list  # ShapeDtypeStruct of every other closure leaf
    operands: list  # ShapeDtypeStruct of the uses' activation operands (for W)
    uses: list  # ShapeDtypeStruct of the gradient at each use (B -> W)
    same_as: dict  # position in residuals + operands -> earlier position holding that value
    constants: dict  # position in residuals + operands -> its value, made from no input

    def kept(self, i: int) -> bool:
        """Whether ``F`` stashes position ``i`` of the residuals + operands."""
        return i not in self.same_as and i not in self.constants

    @property
    def stashed(self) -> list:
        """What ``F`` keeps per layer: the closure's residuals, then the uses' operands, each
        value once (an operand that is also a residual, e.g. the input under a checkpoint
        policy, is kept once), constants not at all."""
        return [a for i, a in enumerate(self.residuals + self.operands) if self.kept(i)]

    def unstash(self, kept: list, vary: Callable) -> list:
        """The residuals and operands from what ``F`` kept (duplicates and constants
        restored; ``vary`` casts a constant like the stashed values)."""
        kept, out = iter(kept), []
        for i in range(len(self.residuals) + len(self.operands)):
            out.append(out[self.same_as[i]] if i in self.same_as else
                       vary(self.constants[i]) if i in self.constants else next(kept))
        return out


def _duplicates(values: list) -> dict:
    first: dict = {}
    return {i: first.setdefault(id(v), i) for i, v in enumerate(values)
            if first.setdefault(id(v), i) != i}


def template(layer: Callable, param_like: list, x_like, vary: Callable, policy,
             api: str, state: list = ()) -> Template:
    """Splits ``layer`` and traces ``F`` once on varying dummies of the given shapes.

    ``layer(params, x, state) -> (x, new_state)``; ``state`` is one layer's non-parameter
    state (values: keys cannot be dummies), empty for a stateless model.
    """
    dummies = [vary(jnp.zeros(p.shape, p.dtype)) for p in param_like]
    x = jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype)), x_like)
    state = list(state)
    s = split(layer, dummies, x, api, state)
    (y, pullback, (operands, new_state)), eps = _vjp(s, policy, vary, dummies, x, state)
    shapes = lambda t: jax.tree.map(lambda a: (a.shape, str(a.dtype)), t)  # noqa: E731
    if jax.tree.structure(y) != jax.tree.structure(x) or shapes(y) != shapes(x):
        raise ValueError(
            f"{api}: Stages.stage(layer, x) must return an x of the same structure, shape and "
            f"dtype as its input: got {shapes(y)} for an input {shapes(x)}"
        )
    if shapes(new_state) != shapes(state):
        raise ValueError(
            f"{api}: Stages.stage(layer, x) changed the shapes or dtypes of the layer's "
            f"non-parameter state: {shapes(state)} became {shapes(new_state)}")
    leaves, treedef = jax.tree.flatten(pullback)
    param_at, zero_at = _param_positions(leaves, dummies), _param_positions(leaves, eps)
    like = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    kept = [leaf for i, leaf in enumerate(leaves) if i not in param_at and i not in zero_at]
    values = kept + list(operands)
    same_as = _duplicates(values)

    def stashable(params, x, state):  # what F would stash, traced again to follow its inputs
        (_, pullback, (operands, _)), eps = _vjp(s, policy, vary, params, x, state)
        leaves = jax.tree.leaves(pullback)
        skip = set(_param_positions(leaves, params)) | set(_param_positions(leaves, eps))
        return [leaf for i, leaf in enumerate(leaves) if i not in skip] + list(operands)

    constants = {i: values[i] for i in constant_outputs(stashable, dummies, x, state)
                 if i not in same_as}
    return Template(s, treedef, param_at, zero_at, [like(leaf) for leaf in kept],
                    [like(o) for o in operands], list(s.eps_like), same_as, constants)


def _vjp(s: Split, policy, vary, params, x, state):
    """``F`` of one layer: (output, closure over ``(x, eps)``, (the uses' operands, the new
    state)), and the zero perturbations (a checkpointed closure keeps them: they are not
    stashed)."""
    eps = [vary(jnp.zeros(e.shape, e.dtype)) for e in s.eps_like]

    def forward(x, eps):
        return s.forward(params, x, eps, state)

    if policy is not None:
        forward = jax.checkpoint(forward, policy=policy)
    return jax.vjp(forward, x, eps, has_aux=True), eps


def _param_positions(leaves: list, params: list) -> dict:
    ids = {id(p): k for k, p in enumerate(params)}
    return {i: ids[id(leaf)] for i, leaf in enumerate(leaves) if id(leaf) in ids}


class Chunk:
    """The actions of one chunk of stacked layers under a :class:`Template`.

    Every action takes an optional ``mask`` (``[layers]`` bools, uneven layouts): a slot
    whose mask is off holds no layer; ``lax.cond`` skips it (named ``pp_pad``), passing the
    activation and the gradient through, computing nothing and giving zeros to store. The
    cond returns values only and the ring is written after it: a cond returning the ring
    would make XLA copy it.

    Args:
      layer: ``layer(leaves, x, state) -> (x, new_state)`` (one layer's parameter and
        state slices).
      tmpl: the :class:`Template`.
      vary: casts a value to vary over the runtime's manual axes.
      policy: a ``jax.checkpoint`` policy applied to every layer's ``F``, or ``None``.
    """

    def __init__(self, layer: Callable, tmpl: Template, vary: Callable, policy=None):
        self.layer, self.tmpl, self.vary, self.policy = layer, tmpl, vary, policy

    def _zeros(self, like: list, layers: int | None = None) -> list:
        shape = (lambda a: a.shape) if layers is None else (lambda a: (layers, *a.shape))
        return [self.vary(jnp.zeros(shape(a), a.dtype)) for a in like]

    def _vary_state(self, state) -> list:
        """State leaves cast to vary like the rest (keys, which are not cast, stay)."""
        return [v if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else self.vary(v)
                for v in state]

    def _slot(self, on, real, skip):
        if on is None:
            return real()
        with jax.named_scope("pp_pad"):
            return lax.cond(on, real, skip)

    def forward(self, params: list, x, mask=None, state: list = ()):
        """The chunk's output and its state after each layer, keeping nothing (a
        rematerialised forward)."""

        def body(x, xs):
            p, st, on = xs

            def real():
                y, new = self.layer(p, x, st)
                return y, self._vary_state(new)

            return self._slot(on, real, lambda: (x, st))

        return lax.scan(body, x, (params, list(state), mask))

    def forward_layer(self, p: list, x, st: list):
        """One layer's ``F``: ``(y, (what it stashes, its new state))``."""
        tmpl = self.tmpl
        (y, pullback, (operands, new)), eps = _vjp(tmpl.split, self.policy, self.vary, p, x, st)
        leaves = jax.tree.leaves(pullback)
        if (_param_positions(leaves, p), _param_positions(leaves, eps)) != (
                tmpl.param_at, tmpl.zero_at) or len(leaves) != len(tmpl.param_at) + len(
                tmpl.zero_at) + len(tmpl.residuals):
            raise AssertionError("pipeline runtime: a layer's vjp closure changed structure")
        kept = [leaf for i, leaf in enumerate(leaves)
                if i not in tmpl.param_at and i not in tmpl.zero_at]
        values = kept + list(operands)
        if _duplicates(values) != tmpl.same_as:
            raise AssertionError("pipeline runtime: a layer's stash changed structure")
        kept = [self.vary(v) for i, v in enumerate(values) if tmpl.kept(i)]
        return y, (kept, self._vary_state(new))

    def forward_stash(self, params: list, x, ring: list, slot, mask=None, state: list = ()):
        """``F``: the chunk's output, the stash ring (:mod:`~.rings`, ``[rows, L_c,
        ...]`` per leaf) with each layer's stash written at ``[slot, layer]`` as the layer
        loop reaches it, and the state after each layer. The ring is carried by the loop,
        so it is written in place: no ``[L_c, ...]`` stash of the chunk's own is built."""
        tmpl = self.tmpl

        def body(carry, xs):
            x, ring = carry
            p, st, on, i = xs
            # the cond returns values only: a cond returning the ring makes XLA copy it
            y, (kept, new) = self._slot(on, lambda: self.forward_layer(p, x, st),
                                        lambda: (x, (self._zeros(tmpl.stashed), st)))
            return (y, write_layer(ring, slot, i, kept)), new

        (y, ring), new = lax.scan(body, (x, list(ring)),
                                  (params, list(state), mask, _layers(params)))
        return y, ring, new

    def _pullback(self, p: list, stash: list):
        tmpl = self.tmpl
        residuals = iter(tmpl.unstash(stash, self.vary)[: len(tmpl.residuals)])
        zeros = self._zeros([tmpl.split.eps_like[k] for k in sorted(set(tmpl.zero_at.values()))])
        zero = dict(zip(sorted(set(tmpl.zero_at.values())), zeros))
        count = len(tmpl.param_at) + len(tmpl.zero_at) + len(tmpl.residuals)
        leaves = [p[tmpl.param_at[i]] if i in tmpl.param_at else
                  zero[tmpl.zero_at[i]] if i in tmpl.zero_at else next(residuals)
                  for i in range(count)]
        return jax.tree.unflatten(tmpl.treedef, leaves)

    def input_grads(self, p: list, kept: list, g):
        """One layer's ``B``: its input gradient and the gradient at each use."""
        dx, d_uses = self._pullback(p, kept)(g)
        return jax.tree.map(self.vary, dx), [self.vary(d) for d in d_uses]

    def weight_grads(self, p: list, kept: list, d_uses: list) -> list:
        """One layer's ``W``: its weight gradients from its uses' operands (in ``kept``) and
        the gradients at the uses."""
        split_ = self.tmpl.split
        operands = self.tmpl.unstash(kept, self.vary)[len(self.tmpl.residuals):]
        _, pullback = jax.vjp(lambda q: split_.uses(q, operands, self.vary), p)
        return [self.vary(d) for d in pullback([d_uses[k] for k in split_.gradient_of])[0]]

    def backward_input(self, params: list, stash: list, read_slot, dy, uses: list, store_slot,
                       mask=None):
        """``B``: the chunk's input gradient, and the ``uses`` ring with each layer's
        gradients at its uses written at ``[store_slot, layer]``; each layer's stash is
        read from the ``stash`` ring at ``[read_slot, layer]`` inside the layer loop."""

        def body(carry, xs):
            g, uses = carry
            p, on, i = xs
            kept = read_layer(stash, read_slot, i)
            dx, d = self._slot(on, lambda: self.input_grads(p, kept, g),
                               lambda: (g, self._zeros(self.tmpl.uses)))
            return (dx, write_layer(uses, store_slot, i, d)), None

        (dx, uses), _ = lax.scan(body, (dy, list(uses)), (params, mask, _layers(params)),
                                 reverse=True)
        return dx, uses

    def backward_fused(self, params: list, stash: list, read_slot, dy, mask=None):
        """``B`` and ``W`` in one layer loop (a backward the schedule does not split): the
        chunk's input gradient and each layer's weight gradient ``[layers, ...]``, each
        layer's stash read once from the ``stash`` ring at ``[read_slot, layer]`` and its use
        gradients consumed where they are made."""

        def real(p, kept, g):
            dx, d_uses = self.input_grads(p, kept, g)
            return dx, self.weight_grads(p, kept, d_uses)

        def body(g, xs):
            p, on, i = xs
            kept = read_layer(stash, read_slot, i)
            return self._slot(on, lambda: real(p, kept, g), lambda: (g, self._zeros(p)))

        return lax.scan(body, dy, (params, mask, _layers(params)), reverse=True)

    def backward_weights(self, params: list, stash: list, stash_slot, uses: list, uses_slot,
                         mask=None):
        """``W``: each layer's weight gradient ``[layers, ...]`` from its uses' gradients,
        each layer's stash and use gradients read from their rings at ``[slot, layer]``
        inside the layer loop."""

        def body(_, xs):
            p, on, i = xs
            kept, g = read_layer(stash, stash_slot, i), read_layer(uses, uses_slot, i)
            return None, self._slot(on, lambda: self.weight_grads(p, kept, g),
                                    lambda: self._zeros(p))

        return lax.scan(body, None, (params, mask, _layers(params)))[1]


def _layers(params: list):
    """The layer index of each step of a chunk's layer loop."""
    return jnp.arange(params[0].shape[0], dtype=jnp.int32)
