"""The raw program a :class:`~parallax.pipeline.stages.Stages` loss becomes, for the runtime.

The runtime places ``first``, each layer and ``last`` on the stages as the schedule says and
differentiates each piece on its own, so it reads the loss as functions of flat lists of
arrays: the stacked layers' parameters (split into chunks over the stage axis), every other
parameter, and the module's non-parameter state beside each. :func:`program` builds that
:class:`Program` once per step, checking the model against the pipeline's assumptions
(stacked layers with one leading layer axis, no new variables in a forward pass), and casts
to a mixed-precision policy's compute dtype inside the functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from parallax.pipeline.stages import Stages, scan_metadata


class Program(NamedTuple):
    """A :class:`Stages` loss as functions of flat lists of arrays, for the runtime.

    Every function takes and returns the non-parameter state it runs with (empty lists for
    a stateless model): the stacked layers' state travels with the layers, the rest with
    ``first`` and ``last``.

    Attributes:
      stacked: the stacked layer parameters ``[L, ...]``.
      others: every other parameter (used by ``first`` and ``last``).
      first: ``first(others, others_state, microbatch) -> (x, others_state)``.
      layer: ``layer(leaves, x, state) -> (x, state)``, one layer from its slices of
        ``stacked`` and ``stacked_state``.
      last: ``last(others, others_state, x, microbatch) -> (loss, others_state)``.
      grads: ``grads(d_stacked, d_others) -> a tree shaped like the parameters`` (either
        may be ``None`` leaves: a tree with only the stacked, or only the other, leaves).
      stacked_state: the stacked layers' non-parameter state ``[L, ...]`` (BatchNorm
        statistics, RNG streams of each layer).
      others_state: the rest of the module's non-parameter state.
      state: ``state(stacked_state, others_state) -> the module's state tree``.
      reduce: the dtype name the gradients of ``others`` are summed over the stage axis in
        (a mixed-precision policy's ``reduce``), or None: their accumulation dtype.
    """

    stacked: list
    others: list
    first: Callable
    layer: Callable
    last: Callable
    grads: Callable
    stacked_state: list = []
    others_state: list = []
    state: Callable = lambda stacked_state, others_state: None
    reduce: str | None = None


def _leaves_at(state, paths: list, api: str, where: str) -> list:
    """The values of ``state`` (an ``nnx.State``) at ``paths``, refusing new variables."""
    by_path = dict(nnx.to_flat_state(state))
    extra = [p for p in by_path if p not in set(paths)]
    if extra:
        raise ValueError(
            f"{api}: {where} created the module variable {'.'.join(map(str, extra[0]))} "
            "(sow or a new nnx.Variable); under a pipeline a forward pass may change "
            "variables' values, not create them")
    return [by_path[p].get_value() for p in paths]


def _stateful_layer(stages: Stages, layers: nnx.Module, api: str, stateful: bool):
    """``(params, rest, layer)`` of nnx stacked layers: ``layer(leaves, x, state)`` rebuilds
    one layer from its slices and returns its state after ``stage`` (for a model whose state
    is carried, ``stateful``; otherwise none, as before state was carried)."""
    graphdef, state, rest = nnx.split(layers, nnx.Param, ...)
    meta = scan_metadata(layers)

    def one_layer(tree):  # the structure of one layer
        one = jax.tree.map(lambda v: v[0], tree)
        return nnx.spmd.remove_axis(one, 0, meta) if meta else one  # as nnx.scan does

    one_def, one_rest = jax.tree.structure(one_layer(state)), one_layer(rest)
    rest_def = jax.tree.structure(one_rest)
    rest_paths = [p for p, _ in nnx.to_flat_state(one_rest)]

    def layer(leaves, x, state_leaves):
        model = nnx.merge(graphdef, jax.tree.unflatten(one_def, leaves),
                          jax.tree.unflatten(rest_def, state_leaves))
        y = stages.stage(model, x)
        if not stateful:
            return y, []
        return y, _leaves_at(nnx.state(model, nnx.Not(nnx.Param)), rest_paths, api,
                             "Stages.stage")

    return state, rest, layer


def program(stages: Stages, params, rebuild: Callable, api: str, state=None, *,
            precision=None, scale=None) -> Program:
    """Splits ``params`` into the stacked layers and the rest, and the loss into functions.

    Args:
      stages: the pipelined loss.
      params: what is differentiated (an ``nnx.State`` of params, or a pytree).
      rebuild: ``params -> what stages' functions take`` (the module, or the params); with
        ``state``, ``rebuild(params, state) -> the module``.
      api: the public name, for errors.
      state: the module's non-parameter state (an ``nnx.State``), or None.
      precision: a ``parallax.precision.Policy``: ``first``, every layer and ``last`` cast
        their parameters and the micro-batch's floating leaves to its ``compute`` dtype
        inside the function the runtime differentiates (so the gradients reach the stored
        parameters through the cast, in their dtype), ``last``'s loss comes back in float32;
        None: no casts.
      scale: the loss scale ``last``'s loss is multiplied by (None: not scaled).

    Returns:
      A :class:`Program`.
    """
    stateful = state is not None
    model = rebuild(params, state) if stateful else rebuild(params)
    layers = stages.layers(model)
    rest = None
    if isinstance(layers, nnx.Module):
        layer_state, rest, layer = _stateful_layer(stages, layers, api, stateful)
        if jax.tree.leaves(rest) and not stateful:
            raise ValueError(
                f"{api}: the stacked layers hold state other than nnx.Param "
                f"({jax.tree.structure(rest)}); the pipeline runtime carries parameters only. "
                "Keep non-trained variables out of the stacked layers."
            )
        layer_leaves = jax.tree.leaves(layer_state)
    else:
        layer_leaves, layer_def = jax.tree.flatten(layers)

        def layer(leaves, x, state_leaves):
            return stages.stage(jax.tree.unflatten(layer_def, leaves), x), list(state_leaves)

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

    s_leaves, s_def = jax.tree.flatten(state) if stateful else ([], None)
    s_paths = [p for p, _ in nnx.to_flat_state(state)] if stateful else []
    s_position = {id(x): i for i, x in enumerate(s_leaves)}
    rest_leaves = jax.tree.leaves(rest) if rest is not None else []
    if any(id(x) not in s_position for x in rest_leaves):
        raise ValueError(f"{api}: the stacked layers' non-parameter state was not found in "
                         "the module's state")
    state_stacked_at = [s_position[id(x)] for x in rest_leaves]
    state_other_at = [i for i in range(len(s_leaves)) if i not in set(state_stacked_at)]

    def fill(count, at, values):
        leaves: list = [None] * count
        for i, x in zip(at, values):
            leaves[i] = x
        return leaves

    def model_of(others: list, others_state: list) -> Any:
        p = jax.tree.unflatten(p_def, fill(len(p_leaves), other_at, others))
        if not stateful:
            return rebuild(p)
        return rebuild(p, jax.tree.unflatten(s_def, fill(len(s_leaves), state_other_at,
                                                         others_state)))

    def state_after(model, where: str) -> list:
        if not stateful:
            return []
        after = _leaves_at(nnx.state(model, nnx.Not(nnx.Param)), s_paths, api, where)
        return [after[i] for i in state_other_at]

    def first(others, others_state, mb):
        model = model_of(others, others_state)
        return stages.first(model, mb), state_after(model, "Stages.first")

    def last(others, others_state, x, mb):
        model = model_of(others, others_state)
        return stages.last(model, x, mb), state_after(model, "Stages.last")

    def state_tree(stacked_state, others_state):
        if not stateful:
            return None
        leaves = fill(len(s_leaves), state_stacked_at, stacked_state)
        for i, x in zip(state_other_at, others_state):
            leaves[i] = x
        return jax.tree.unflatten(s_def, leaves)

    def grads(d_stacked, d_others):
        leaves: list = [None] * len(p_leaves)
        for i, g in zip(stacked_at, d_stacked or [None] * len(stacked_at)):
            leaves[i] = g
        for i, g in zip(other_at, d_others or [None] * len(other_at)):
            leaves[i] = g
        return jax.tree.unflatten(p_def, leaves)

    if precision is not None:
        first, layer, last = _in_compute_dtype(first, layer, last, precision, scale)
    return Program(
        stacked=[p_leaves[i] for i in stacked_at],
        others=[p_leaves[i] for i in other_at],
        first=first,
        layer=layer,
        last=last,
        grads=grads,
        stacked_state=[s_leaves[i] for i in state_stacked_at],
        others_state=[s_leaves[i] for i in state_other_at],
        state=state_tree,
        reduce=precision.reduce if precision is not None else None,
    )


def _in_compute_dtype(first, layer, last, policy, scale):
    """``first``, ``layer`` and ``last`` computing in ``policy.compute`` (see :func:`program`).
    Activations then travel between stages in that dtype; the runtime's gradient
    accumulators keep float32 at least (``rings.wide``)."""

    def first_c(others, others_state, mb):
        return first(policy.to_compute(others), others_state, policy.to_compute(mb))

    def layer_c(leaves, x, state_leaves):
        return layer(policy.to_compute(leaves), x, state_leaves)

    def last_c(others, others_state, x, mb):
        loss, after = last(policy.to_compute(others), others_state, x, policy.to_compute(mb))
        loss = loss.astype(jnp.float32)
        return (loss if scale is None else loss * scale), after

    return first_c, layer_c, last_c
