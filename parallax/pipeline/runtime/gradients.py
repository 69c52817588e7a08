"""``px.pipeline.value_and_grad``: a :class:`Stages` loss and its gradients, pipelined.

The entry point for any model given as ``(first, stage, last)`` functions over stacked
layers, and what the ``px.Pipeline`` strategy calls inside ``px.train_step``. The options
are checked once, into a :class:`parallax.pipeline.runtime.settings.PipelineSettings`, where the
function is built (or the strategy is); what depends on the call is checked where it is
known (:mod:`parallax.pipeline.runtime.checks`: the mesh axis, the schedule on it, the layer
count or balance, the batch's split into micro-batches), and the settings go on to the table
runtime of :mod:`parallax.pipeline.runtime.ticks`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from parallax import context
from parallax.grad.gradients import split_target
from parallax.grad.microbatches import check_microbatches
from parallax.grad.module_state import StateOptions, Target
from parallax.pipeline.runtime import module_state
from parallax.pipeline.runtime import ticks
from parallax.pipeline.runtime.optimizer import part_optimizer, replace_leaves
from parallax.pipeline.runtime.stage_state import StateRun
from parallax.pipeline.runtime.stashed import Versions
from parallax.pipeline.runtime.checks import POLICIES, REMAT
from parallax.pipeline.schedules.table import Schedule
from parallax.pipeline.runtime.settings import PipelineSettings
from parallax.pipeline.runtime.program import program
from parallax.pipeline.stages import Stages
from parallax.grad.sliced_rng import WHOLE

__all__ = ["POLICIES", "REMAT", "pipeline_grads", "pipeline_update", "value_and_grad"]
API = "px.pipeline.value_and_grad"


def pipeline_grads(stages: Stages, params, rebuild: Callable, batch,
                   settings: PipelineSettings, *, api: str = API, trace: bool = False,
                   state=None, run: StateRun | None = None, precision=None, scale=None):
    """``(loss, grads)`` of ``stages`` on ``batch``, pipelined as ``settings`` say.

    With ``state`` (the module's non-parameter state; ``rebuild(params, state)`` then
    builds the module) and ``run`` (how it flows, :mod:`parallax.pipeline.runtime.module_state`),
    ``(loss, grads, state_after)``. With ``trace``, also the action codes each stage
    ran at each tick, ``[ticks, stages]`` (0 idle, 1 F, 2 B, 3 W): a record of what
    executed, to compare with ``Schedule.as_arrays().kind``. ``api`` is named in errors.
    ``precision`` (a ``parallax.precision.Policy``) and ``scale`` (the loss scale): the
    stages compute in the policy's dtype (:func:`parallax.pipeline.runtime.program.program`).
    """
    prog, sched, layout = _prepare(stages, params, rebuild, batch, settings, api, state,
                                   precision=precision, scale=scale)
    _check_state_layers(prog, api)
    with context.manual((settings.axis,)):
        loss, d_stacked, d_others, *rest = ticks.execute(
            prog, sched, batch, settings, api=api, trace=trace, layout=layout,
            run=run if state is not None else None)
    if state is None:
        return (loss, prog.grads(d_stacked, d_others), *rest)
    if prog.stacked_state or prog.others_state:
        (s_new, o_new), *rest = rest
    else:
        s_new, o_new = [], []
    return (loss, prog.grads(d_stacked, d_others), prog.state(s_new, o_new), *rest)


def _prepare(stages, params, rebuild, batch, settings: PipelineSettings, api: str, state, *,
             precision=None, scale=None):
    """What depends on the call, checked: ``(program, schedule, layout)`` for the runtime
    (the mesh's stage count, the batch's micro-batches, the model's layers)."""
    size = ticks.stage_count(settings.axis, None, api)
    sched = settings.schedule_on(size, api)
    check_microbatches(batch, sched.microbatches, api)
    prog = program(stages, params, rebuild, api, state=state, precision=precision, scale=scale)
    return prog, sched, settings.layout(prog.stacked[0].shape[0], sched, api)


def _check_state_layers(prog, api: str) -> None:
    layers = prog.stacked[0].shape[0]
    bad = [x.shape for x in prog.stacked_state if not x.ndim or x.shape[0] != layers]
    if bad:
        raise ValueError(
            f"{api}: the stacked layers' non-parameter state must have the leading layer "
            f"axis of their parameters ({layers}); got shapes {bad[:3]}. Build the layers "
            "with nnx.vmap (and nnx.split_rngs for their RNG streams)")


def value_and_grad(stages: Stages, schedule: str | Schedule = "1f1b", *,
                   microbatches: int | None = None, virtual_stages: int | None = None,
                   split_backward: bool | None = None, axis: str = "stage",
                   remat="except_last", balance: Sequence[int] | None = None,
                   batch_stats: str = "global", rng: str = "global") -> Callable:
    """Pipelines a :class:`Stages` loss over mesh axis ``axis``: ``fn(model, batch)``.

    The batch is split into ``microbatches`` equal micro-batches (the batch is not split
    over ``axis``: every stage sees all of it, and only virtual stage 0 and the last read
    it); the stacked layers are split into ``stages x virtual_stages`` chunks (evenly, or as
    ``balance`` says); the schedule's table runs in one ``lax.scan`` inside ``shard_map``.
    The result equals ``jax.value_and_grad(stages)`` of the sequential model (the mean over
    micro-batches of their mean losses).

    Args:
      stages: the pipelined loss (:class:`Stages`).
      schedule: a name of ``px.pipeline.SCHEDULES`` (``"gpipe"``, ``"1f1b"``,
        ``"interleaved_1f1b"``, ``"zb_h1"``, ``"zb_h2"``, ``"interleaved_zb"``, ``"zbv"``,
        ``"dualpipev"``) or a :class:`Schedule` built for the mesh's stage count.
      microbatches: micro-batches per step (ignored for a :class:`Schedule`, which has its
        own).
      virtual_stages: model chunks per stage (default: the schedule's own, 2 for the V
        schedules, else 1; the interleaved ones need >= 2).
      split_backward: schedule ``W`` independently of ``B`` (default: the schedule's own).
      axis: the mesh axis of the pipeline; the mesh comes from ``jax.set_mesh``.
      remat: ``"always"``, ``"except_last"`` (default) or ``"never"``, torchgpipe's options
        (rematerialise every micro-batch's forward, all but the last one's, or none), or a
        ``jax.checkpoint_policies`` name applied to every layer.
      balance: layers per virtual stage (torchgpipe's ``balance``) or a
        ``px.pipeline.Partition`` from ``px.pipeline.partition``; default: an even split. Uneven
        stages run padded to the largest with masked, skipped slots.
      batch_stats, rng: as for ``px.value_and_grad``, for an NNX module with
        non-parameter state (BatchNorm statistics, RNG streams, in the stacked layers or in
        ``first`` / ``last``): a BatchNorm in training mode needs
        ``batch_stats="per_microbatch"`` (:mod:`parallax.pipeline.runtime.module_state`). The state
        after the step is written back into the module, as ``nnx.value_and_grad`` does
        (call ``fn`` eagerly or under ``nnx.jit``).

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
      Megatron-LM interleaved schedule; Qi et al. 2024, Zero Bubble Pipeline Parallelism.
    """
    if not isinstance(stages, Stages):
        raise TypeError(f"{API}: the loss must be a px.pipeline.Stages, got "
                        f"{type(stages).__name__}")
    settings = PipelineSettings.of(
        API, microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages,
        split_backward=split_backward, axis=axis, remat=remat, balance=balance)
    options = StateOptions(batch_stats, rng)

    def fn(target, batch):
        parts = Target.of(target)
        if module_state.carries_state(parts):
            module_state.check(parts, options, API)
            loss, grads, after = pipeline_grads(
                stages, parts.params, module_state.rebuild_for(parts, options), batch,
                settings, state=parts.state, run=module_state.run_for(options, WHOLE))
            parts.write_back(target, after, None)
            return loss, grads
        params, rebuild = split_target(target)
        return pipeline_grads(stages, params, rebuild, batch, settings)

    return fn


def pipeline_update(stages: Stages, params, rebuild: Callable, batch, tx, opt_state,
                    settings: PipelineSettings, *, api: str = "px.pipeline.update",
                    trace: bool = False):
    """PipeDream's weight stashing: ``(loss, new_params, new_opt_state)`` after one step.

    Every stage applies ``tx`` to its layers after each micro-batch's backward, each
    backward on the weights its forward used (:mod:`parallax.pipeline.runtime.stashed`);
    the parameters outside the stack take the micro-batches' updates at the end. The loss
    is the mean over micro-batches, each at the weights its forward saw.
    """
    prog, sched, layout = _prepare(stages, params, rebuild, batch, settings, api, None)
    stacked_opt, stacked_state = part_optimizer(tx, prog.grads, "stacked", prog.stacked,
                                                prog.others, opt_state, api)
    others_opt, others_state = (part_optimizer(tx, prog.grads, "others", prog.stacked,
                                               prog.others, opt_state, api)
                                if prog.others else (None, []))
    versions = Versions(stacked_opt, stacked_state, others_opt, others_state)
    with context.manual((settings.axis,)):
        loss, new_stacked, new_others, new_state, new_others_state, *codes = ticks.execute(
            prog, sched, batch, settings, api=api, trace=trace, layout=layout,
            versions=versions)
    leaves = dict(zip(stacked_opt.paths, new_state))
    if others_opt is not None:
        leaves |= dict(zip(others_opt.paths, new_others_state))
    new_params = prog.grads(new_stacked, new_others)
    return (loss, new_params, replace_leaves(opt_state, leaves), *codes)
