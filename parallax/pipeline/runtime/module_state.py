"""Which module state a pipeline can carry, and with what semantics: the boundary checks.

``nnx.BatchNorm`` in training mode needs its statistics over the examples it normalises
before the next layer runs. A pipeline has micro-batches in flight on different stages, so
it can only compute them per micro-batch: under ``px.Pipeline`` and
``px.pipeline.value_and_grad`` a model whose forward pass computes batch statistics needs
``batch_stats="per_microbatch"`` (GPipe's statistics; the running averages then equal a
one-device loop over the micro-batches in order, as with ``px.GradientAccumulation`` and
the same option). ``"global"`` (the default) and ``"per_replica"`` would need the whole
batch or shard and are refused with that fix; for a model without batch statistics (only
``nnx.Dropout`` and other RNG streams, or BatchNorm with ``use_running_average=True``) they
mean what they mean without a pipeline: every micro-batch draws its rows of one device's
draw over the batch. The state is carried by the runtime
(:mod:`parallax.pipeline.runtime.stage_state`) with ``weights="flush"`` only: PipeDream's
weight versions (``"stashed"``, ``"2bw"``) are refused for a model with state.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from parallax.grad import module_state
from parallax.grad.module_state import StateOptions, Target
from parallax.pipeline.runtime.stage_state import StateRun
from parallax.grad.sliced_rng import Position, is_key
from parallax.comm.varying import varying_axes


def carries_state(target: Target | None) -> bool:
    """Whether ``target`` is a module with non-parameter state the pipeline must carry."""
    return target is not None and target.is_module and bool(jax.tree.leaves(target.state))


def stateless(target, api: str, why: str) -> Target:
    """``Target.of(target)``, refusing a module with non-parameter state for a producer that
    cannot carry it; ``why`` completes the message (why not, and what to use instead)."""
    parts = Target.of(target)
    if carries_state(parts):
        raise ValueError(f"{api}: the model holds non-parameter state ({held(parts)}), {why}")
    return parts


def held(target: Target) -> str:
    """The first few paths of the state a module holds, for messages."""
    paths = target.stateful_paths() or ["/".join(map(str, p)) for p, _ in
                                        nnx.to_flat_state(target.state)]
    return ", ".join(paths[:4])


def check(target: Target, options: StateOptions, api: str, weights: str = "flush") -> None:
    """Refuses, with the fix, what a pipeline cannot carry (see the module docstring)."""
    if weights != "flush":
        raise ValueError(
            f"{api}(weights={weights!r}): the model holds non-parameter state "
            f"({held(target)}), which the pipeline carries with weights='flush' only (one "
            "weight version per step); use px.Pipeline(..., weights='flush'), or a model "
            "without BatchNorm statistics or RNG streams")
    if target.trains_statistics and options.batch_stats != "per_microbatch":
        raise ValueError(
            f"{api}: batch_stats={options.batch_stats!r} asks for BatchNorm statistics over "
            f"the whole {'batch' if options.batch_stats == 'global' else 'batch shard'} "
            "before the next layer runs, which a pipeline cannot compute (its micro-batches "
            "are in flight on different stages); pass batch_stats='per_microbatch' to "
            "px.value_and_grad (GPipe's per-micro-batch statistics), or set the model's "
            "BatchNorm use_running_average=True")


def rebuild_for(target: Target, options: StateOptions) -> Callable:
    """``(params, state) -> module``, its BatchNorms prepared for per-micro-batch statistics
    (no ``axis_name``: a micro-batch on one stage is all they see)."""

    def rebuild(params, state):
        module = target.module(params, state)
        module_state.prepare(module, options, ())
        return module

    return rebuild


def run_for(options: StateOptions, position: Position) -> StateRun:
    """The runtime's settings for the batch slice at ``position``."""
    return StateRun(options.batch_stats == "per_microbatch", options.rng, position.index,
                    position.count)


def shared_exact(state):
    """Integer and bool leaves made the same value type on every batch shard.

    The runtime computes on values cast to vary over every manual axis; an RNG counter
    advanced by the micro-batches is the same on every shard (it depends on no data), and
    ``px.value_and_grad`` passes such leaves through only when they are invariant:
    ``pmax`` over the batch axes returns that common value as such.
    """

    def one(x):
        if x is None or is_key(x) or jnp.issubdtype(x.dtype, jnp.inexact):
            return x
        axes = tuple(sorted(varying_axes(x)))
        return lax.pmax(x, axes) if axes else x

    return jax.tree.map(one, state)
