"""``px.pipeline.value_and_grad``: a :class:`Stages` loss and its gradients, pipelined.

The entry point for any model given as ``(first, stage, last)`` functions over stacked
layers, and what the ``px.Pipeline`` strategy calls inside ``px.train_step``. It validates
everything at the boundary (the mesh axis, the schedule, the layer count, the micro-batch
count, the rematerialisation option) and runs the table runtime of
:mod:`parallax.pipeline.runtime`.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable

import jax

from parallax import context
from parallax.grad import split_target
from parallax.microbatch import check_microbatches
from parallax.pipeline import runtime
from parallax.pipeline.schedule import Schedule
from parallax.pipeline.schedules import SCHEDULES, schedule as build_schedule
from parallax.pipeline.stages import Stages, program

REMAT = ("always", "except_last", "never")
# jax.checkpoint_policies that are policies themselves (the others are factories).
POLICIES = ("dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable",
            "nothing_saveable", "checkpoint_dots", "checkpoint_dots_with_no_batch_dims")
API = "px.pipeline.value_and_grad"


def check_remat(remat, api: str) -> tuple[str, Callable | None]:
    """``(mode, policy)``: a torchgpipe option, or ``("never", policy)`` for a JAX policy."""
    if callable(remat):
        return "never", remat
    if remat in REMAT:
        return remat, None
    if remat in POLICIES:
        return "never", getattr(jax.checkpoint_policies, remat)
    raise ValueError(
        f"{api}: remat={remat!r} is not a rematerialisation option; use one of "
        f"{', '.join(map(repr, REMAT))} (torchgpipe's checkpoint options) or a "
        f"jax.checkpoint_policies name ({', '.join(POLICIES)}), or pass a policy function"
    )


def check_count(field: str, value, api: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{api}: {field} must be an int, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{api}: {field} must be an int, got {value!r}") from None
    if value < 1:
        raise ValueError(f"{api}: {field} must be >= 1, got {value}")
    return value


def check_schedule_name(name, virtual_stages: int, api: str) -> None:
    if isinstance(name, Schedule):
        return
    if name not in SCHEDULES:
        raise ValueError(
            f"{api}: unknown schedule {name!r}; use one of {', '.join(map(repr, SCHEDULES))} "
            "or pass a px.pipeline.Schedule"
        )
    if (name == "interleaved_1f1b") != (virtual_stages > 1):
        fix = ("virtual_stages >= 2 model chunks per stage" if name == "interleaved_1f1b"
               else "schedule='interleaved_1f1b'")
        raise ValueError(
            f"{api}: schedule={name!r} with virtual_stages={virtual_stages}; use {fix}"
        )


@functools.lru_cache(maxsize=64)
def _named(name, stages, microbatches, virtual_stages, split_backward):
    return build_schedule(name, stages, microbatches, virtual_stages, split_backward)


def resolve_schedule(sched, stages: int, microbatches: int, virtual_stages: int,
                     split_backward: bool, axis: str, api: str) -> Schedule:
    """The :class:`Schedule` to run on ``stages`` stages, with the mesh axis in errors."""
    if isinstance(sched, Schedule):
        if (sched.stages, sched.microbatches) != (stages, microbatches):
            raise ValueError(
                f"{api}: the schedule {sched!r} has {sched.stages} stages and "
                f"{sched.microbatches} micro-batches, but mesh axis {axis!r} has size {stages} "
                f"and microbatches={microbatches}; build it for this mesh"
            )
        return sched
    try:
        return _named(sched, stages, microbatches, virtual_stages, bool(split_backward))
    except ValueError as e:
        raise ValueError(f"{api} on mesh axis {axis!r} of size {stages}: {e}") from None


def pipeline_grads(stages: Stages, params, rebuild: Callable, batch, *, schedule="1f1b",
                   microbatches: int, virtual_stages: int = 1, split_backward: bool = False,
                   axis: str = "stage", remat="except_last", api: str = API,
                   trace: bool = False):
    """``(loss, grads)`` of ``stages`` on ``batch``, pipelined over mesh axis ``axis``.

    With ``trace``, also the action codes each stage's switch ran at each tick,
    ``[ticks, stages]`` (0 idle, 1 F, 2 B, 3 W): a record of what executed, to compare with
    ``Schedule.as_arrays().kind``.
    """
    mode, policy = check_remat(remat, api)
    if isinstance(schedule, Schedule):
        virtual_stages = schedule.virtual_stages
    size = runtime.stage_count(axis, None, api)
    sched = resolve_schedule(schedule, size, microbatches, virtual_stages, split_backward,
                             axis, api)
    check_microbatches(batch, sched.microbatches, api)
    prog = program(stages, params, rebuild, api)
    runtime.check_layers(prog.stacked[0].shape[0], sched.stages, sched.virtual_stages, api,
                         axis)
    with context.manual((axis,)):
        loss, d_stacked, d_others, *codes = runtime.execute(
            prog, sched, batch, axis=axis, remat=mode, policy=policy, api=api, trace=trace)
    return (loss, prog.grads(d_stacked, d_others), *codes)


def value_and_grad(stages: Stages, schedule: str | Schedule = "1f1b", *,
                   microbatches: int | None = None, virtual_stages: int = 1,
                   split_backward: bool = False, axis: str = "stage",
                   remat="except_last") -> Callable:
    """Pipelines a :class:`Stages` loss over mesh axis ``axis``: ``fn(model, batch)``.

    The batch is split into ``microbatches`` equal micro-batches (the batch is not split
    over ``axis``: every stage sees all of it, and only virtual stage 0 and the last read
    it); the stacked layers are split into ``stages x virtual_stages`` chunks; the schedule's
    table runs in one ``lax.scan`` inside ``shard_map``. The result equals
    ``jax.value_and_grad(stages)`` of the sequential model (the mean over micro-batches of
    their mean losses).

    Args:
      stages: the pipelined loss (:class:`Stages`).
      schedule: ``"gpipe"``, ``"1f1b"``, ``"interleaved_1f1b"`` or a :class:`Schedule`
        built for the mesh's stage count.
      microbatches: micro-batches per step (ignored for a :class:`Schedule`, which has its
        own).
      virtual_stages: model chunks per stage (interleaved only).
      split_backward: schedule ``W`` independently of ``B`` (zero-bubble style).
      axis: the mesh axis of the pipeline; the mesh comes from ``jax.set_mesh``.
      remat: ``"always"``, ``"except_last"`` (default) or ``"never"``, torchgpipe's options
        (rematerialise every micro-batch's forward, all but the last one's, or none), or a
        ``jax.checkpoint_policies`` name applied to every layer.

    Returns:
      ``fn(model_or_params, batch) -> (loss, grads)``, ``grads`` shaped like the parameters
      (an ``nnx.State`` for a module), the stacked layers' gradients sharded over ``axis``.

    Example:
      >>> import jax, jax.numpy as jnp, parallax as px
      >>> from parallax.pipeline import Stages, value_and_grad
      >>> loss = Stages(lambda p, b: b["x"], lambda w, x: jnp.tanh(x @ w) + x,
      ...               lambda p, x, b: jnp.mean(x ** 2), lambda p: p["layers"])
      >>> params, batch = {"layers": jnp.eye(4)[None].repeat(2, 0)}, {"x": jnp.ones((8, 4))}
      >>> mesh = px.make_mesh(stage=2, devices=jax.devices()[:2])
      >>> with jax.set_mesh(mesh):
      ...     value, grads = jax.jit(value_and_grad(loss, "1f1b", microbatches=4))(params, batch)
      >>> bool(jnp.allclose(value, loss(params, batch)))
      True

    References:
      Huang et al. 2019, GPipe; Kim et al. 2020, torchgpipe; Narayanan et al. 2019,
      PipeDream; Narayanan et al. 2021, PipeDream-flush; Narayanan et al. 2021 (SC),
      Megatron-LM interleaved schedule.
    """
    if not isinstance(stages, Stages):
        raise TypeError(f"{API}: the loss must be a px.pipeline.Stages, got "
                        f"{type(stages).__name__}")
    virtual_stages = check_count("virtual_stages", virtual_stages, API)
    check_schedule_name(schedule, virtual_stages, API)
    check_remat(remat, API)
    if isinstance(schedule, Schedule):
        microbatches = schedule.microbatches
    elif microbatches is None:
        raise TypeError(f"{API}: pass microbatches= (micro-batches per step) with a named "
                        "schedule")
    microbatches = check_count("microbatches", microbatches, API)

    def fn(target, batch):
        params, rebuild = split_target(target)
        return pipeline_grads(stages, params, rebuild, batch, schedule=schedule,
                              microbatches=microbatches, virtual_stages=virtual_stages,
                              split_backward=split_backward, axis=axis, remat=remat)

    return fn
