"""One layer's backward split into an input-gradient part (``B``) and a weight part (``W``).

A backward through a layer computes, for every operation, the gradient of its inputs from
the gradient of its output. Its weight gradients (``W``) need the output gradient at each
*use* of a parameter (the output of a matmul against a weight, of a multiplication by a
LayerNorm scale), which only the chain of input gradients (``B``) computes. Split naively
(``B`` and ``W`` each call the layer's ``jax.vjp`` and keep half), ``W`` walks that chain
again: measured on the GPT, the step then ran 1.37x the sequential model's FLOPs. This
module splits the layer the way the zero-bubble paper's runtime does, at the level of its
operations:

1. The layer is traced to a jaxpr (``jit`` calls inlined). Values computed from parameters
   only are the *weight side*; an operation with an operand on each side (a "use" of the
   parameters: ``dot(x, w)``, ``x * scale``, ``x + bias``) gets a zero perturbation
   ``eps`` added to its output.
2. ``F`` runs the layer with the perturbations, keeps the residuals of its ``vjp`` with
   respect to ``(x, eps)`` and, for ``W``, the activation operands of every use.
3. ``B`` pulls the output gradient back: the input gradient, and the gradient of every
   ``eps``, which is the output gradient of that use. No weight gradient is computed.
4. ``W`` evaluates the weight side and each use from the stored activation operands and
   pulls the stored output gradients back to the parameters: each weight gradient once,
   and nothing of the chain.

Operations other than ``jit`` calls (custom derivatives, loops) are kept whole: they are
split at their boundary, which is correct but leaves any use inside them to ``W``'s
recomputation.

A layer with non-parameter state (``nnx.BatchNorm``'s running statistics, ``nnx.Dropout``'s
RNG stream) is traced as ``layer(params, x, state) -> (y, new_state)``: the state is on
the activation side (it is not differentiated; a value computed from it, e.g. a dropout
mask, that meets a weight is an operand ``W`` stores), and the new state is an output of
``F`` only, never of ``B`` or ``W``.

References:
  Qi et al. 2024, Zero Bubble Pipeline Parallelism (B stores the output gradient of each
  linear layer; W computes its weight gradient from it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

_INLINE = {"jit", "pjit", "closed_call", "core_call"}
# Uses whose weight gradient does not read the activation operand (x + b: db = sum(g)).
_ADDITIVE = {"add", "sub", "add_any"}


@dataclasses.dataclass(frozen=True)
class _Eqn:
    primitive: Any
    params: dict
    inputs: tuple  # ints (variable ids) or ("const", value)
    outputs: tuple  # ints
    side: str  # "weight" (parameters only), "use" (both sides), "activation", "const"
    avals: tuple  # the outputs' abstract values


@dataclasses.dataclass(frozen=True)
class Split:
    """A layer as three functions of flat lists (parameters, activations, eps).

    Attributes:
      eqns: the flattened equations; ``uses`` index the ``"use"`` ones.
      params: variable ids of the parameters; ``inputs``: of ``x``'s leaves; ``outputs``:
        the atoms of the layer's output leaves; ``state_inputs``, ``state_outputs``: of the
        non-parameter state's leaves, before and after the layer (empty without).
      use_inputs: the activation-side variable ids that ``W`` needs (each use's operands).
      eps_like: shape and dtype of each perturbation (each use's inexact outputs).
    """

    eqns: tuple
    params: tuple
    inputs: tuple
    outputs: tuple
    use_inputs: tuple
    eps_like: tuple
    x_def: Any
    avals: dict  # variable id -> ShapeDtypeStruct, for the operands W does not store
    perturbed: frozenset  # equation positions whose outputs get an eps
    gradient_of: tuple  # for each output of ``uses``, the eps whose gradient it receives
    state_inputs: tuple = ()
    state_outputs: tuple = ()

    def forward(self, params: list, x, eps: list, state: list | None = None):
        """The layer's output, perturbed at every use; aux: the operands ``W`` needs, and
        with ``state`` (the layer's non-parameter state leaves) ``(operands, new_state)``."""
        env = dict(zip(self.params, params))
        env.update(zip(self.inputs, jax.tree.leaves(x)))
        env.update(zip(self.state_inputs, state or ()))
        perturb = iter(eps)
        for i, eqn in enumerate(self.eqns):
            outs = _bind(eqn, [_read(env, a) for a in eqn.inputs])
            if i in self.perturbed:
                outs = [o + next(perturb) if _inexact(o) else o for o in outs]
            env.update(zip(eqn.outputs, outs))
        y = jax.tree.unflatten(self.x_def, [_read(env, a) for a in self.outputs])
        operands = [env[v] for v in self.use_inputs]
        if state is None:
            return y, operands
        return y, (operands, [_read(env, a) for a in self.state_outputs])

    def uses(self, params: list, operands: list, vary: Callable = lambda x: x) -> list:
        """Every use's (inexact) outputs from the parameters and the stored operands.

        ``vary`` casts the placeholders of unstored (additive) operands to the manual axes.
        """
        env = dict(zip(self.params, params))
        env.update(zip(self.use_inputs, operands))
        out = []
        for eqn in self.eqns:
            if eqn.side == "activation":
                continue
            # an additive use's activation operand is not stored: its gradient ignores it
            outs = _bind(eqn, [_read(env, a) if isinstance(a, tuple) or a in env
                               else vary(jnp.zeros(self.avals[a].shape, self.avals[a].dtype))
                               for a in eqn.inputs])
            if eqn.side == "use":  # its outputs stay the stored operands of later uses
                out += [o for o in outs if _inexact(o)]
            else:
                env.update(zip(eqn.outputs, outs))
        return out


def _read(env, atom):
    return atom[1] if isinstance(atom, tuple) else env[atom]


def _inexact(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.inexact)


def _bind(eqn: _Eqn, args: list) -> list:
    # get_bind_params turns a jaxpr-holding equation's params (custom_vjp_call, shard_map)
    # back into the functions its bind takes, as jax.core.eval_jaxpr does
    out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]


def split(layer: Callable, params_like: list, x_like, api: str,
          state_like: list | None = None) -> Split:
    """Traces ``layer(params, x)`` and classifies its operations (see the module docstring).

    Args:
      layer: ``layer(params, x) -> x``, ``params`` a flat list of arrays; with
        ``state_like``, ``layer(params, x, state) -> (x, new_state)``.
      params_like, x_like: values (or abstract values) of the right shapes and types.
      api: the public name, for errors.
      state_like: the layer's non-parameter state leaves (values of the right types).

    Returns:
      A :class:`Split`.

    Example:
      >>> import jax.numpy as jnp
      >>> s = split(lambda p, x: jnp.tanh(x @ p[0]) * p[1], [jnp.ones((3, 3)), jnp.ones(3)],
      ...           jnp.ones((2, 3)), "example")
      >>> [e.shape for e in s.eps_like]      # the outputs of x @ w and of * scale
      [(2, 3), (2, 3)]
    """
    stateful = state_like is not None
    if not stateful:
        plain = layer
        layer = lambda p, x, s: (plain(p, x), [])  # noqa: E731
    closed = jax.make_jaxpr(layer)(params_like, x_like, list(state_like or ()))
    counter = iter(range(1 << 62))
    env: dict = {}
    top = closed.jaxpr
    params = [next(counter) for _ in params_like]
    x_leaves, x_def = jax.tree.flatten(x_like)
    inputs = [next(counter) for _ in x_leaves]
    state_inputs = [next(counter) for _ in state_like or ()]
    env.update(zip(top.invars, params + inputs + state_inputs))
    eqns: list[_Eqn] = []
    # the state is not differentiated: what it computes is on the activation side
    side = ({v: "weight" for v in params} | {v: "activation" for v in inputs}
            | {v: "activation" for v in state_inputs})
    _flatten(top, closed.consts, env, eqns, side, counter)
    everything = tuple(_atom(env, v) for v in top.outvars)
    outputs, state_outputs = everything[:len(x_leaves)], everything[len(x_leaves):]
    weight_outputs = [a for a in outputs if isinstance(a, tuple) or side[a] != "activation"]
    if weight_outputs:
        raise ValueError(
            f"{api}: an output of Stages.stage(layer, x) depends on the layer's parameters "
            "only, not on x; a pipelined layer must transform its input"
        )
    consumers: dict = {}
    for eqn in eqns:
        for a in eqn.inputs:
            if not isinstance(a, tuple):
                consumers[a] = consumers.get(a, 0) + 1
    for a in everything:
        if not isinstance(a, tuple):
            consumers[a] = consumers.get(a, 0) + 1
    use_inputs, eps_like, perturbed, gradient_of = [], [], set(), []
    eps_of: dict = {}  # variable id -> the eps added to it
    for i, eqn in enumerate(eqns):
        if eqn.side != "use":
            continue
        acts = [a for a in eqn.inputs if not isinstance(a, tuple) and side[a] == "activation"]
        if eqn.primitive.name in _ADDITIVE and len(acts) == 1 and acts[0] in eps_of \
                and consumers[acts[0]] == 1 and len(eqn.outputs) == 1:
            # x' = use(...) + eps only feeds this "x' + b": the gradient at its output is
            # that eps's gradient; no eps of its own
            gradient_of.append(eps_of[acts[0]])
            continue
        if eqn.primitive.name not in _ADDITIVE:  # the weight gradient reads the operand
            use_inputs += [a for a in acts if a not in use_inputs]
        perturbed.add(i)
        for var, aval in zip(eqn.outputs, eqn.avals):
            if jnp.issubdtype(aval.dtype, jnp.inexact):
                eps_of[var] = len(eps_like)
                gradient_of.append(len(eps_like))
                eps_like.append(aval)
    shapes = {v: a for eqn in eqns for v, a in zip(eqn.outputs, eqn.avals)}
    shapes |= {v: jax.typeof(x) for v, x in zip(inputs, x_leaves)}
    shapes |= {v: jax.typeof(x) for v, x in zip(state_inputs, state_like or ())}
    return Split(tuple(eqns), tuple(params), tuple(inputs), outputs, tuple(use_inputs),
                 tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in eps_like), x_def,
                 {v: jax.ShapeDtypeStruct(a.shape, a.dtype) for v, a in shapes.items()},
                 frozenset(perturbed), tuple(gradient_of), tuple(state_inputs),
                 tuple(state_outputs))


def _atom(env, v):
    if isinstance(v, jcore.Literal):
        return ("const", v.val)
    return env[v]


def _flatten(jaxpr, consts, env, eqns, side, counter) -> None:
    """Appends ``jaxpr``'s equations to ``eqns`` (``jit`` calls inlined), with their side."""
    for var, value in zip(jaxpr.constvars, consts):
        env[var] = ("const", value)
    for eqn in jaxpr.eqns:
        args = [_atom(env, v) for v in eqn.invars]
        inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
        if eqn.primitive.name in _INLINE and inner is not None:
            inner_jaxpr = getattr(inner, "jaxpr", inner)
            inner_consts = getattr(inner, "consts", ())
            sub_env = {}
            for var, a in zip(inner_jaxpr.invars, args):
                sub_env[var] = a
            _flatten(inner_jaxpr, inner_consts, sub_env, eqns, side, counter)
            for var, inner_var in zip(eqn.outvars, inner_jaxpr.outvars):
                env[var] = _atom(sub_env, inner_var)
            continue
        sides = {side[a] for a in args if not isinstance(a, tuple)} - {"const"}
        kind = ("use" if sides == {"weight", "activation"} else
                sides.pop() if sides else "const")
        outs = []
        for var in eqn.outvars:
            ident = next(counter)
            env[var] = ident
            side[ident] = "activation" if kind == "use" else kind
            outs.append(ident)
        eqns.append(_Eqn(eqn.primitive, dict(eqn.params), tuple(args), tuple(outs), kind,
                         tuple(v.aval for v in eqn.outvars)))
