"""Pipeline parallelism as a strategy: stacked layers over a stage axis, any schedule."""

from __future__ import annotations

from parallax import context
from parallax.pipeline.grad import (check_count, check_remat, check_schedule_name,
                                    pipeline_grads)
from parallax.pipeline.schedule import Schedule
from parallax.pipeline.stages import Stages
from parallax.rules import LAYERS
from parallax.strategy import Strategy

API = "px.Pipeline"


def Pipeline(axis: str = "stage", *, microbatches: int, schedule: str | Schedule = "1f1b",
             virtual_stages: int = 1, remat="except_last",
             split_backward: bool = False) -> Strategy:
    """Splits the stacked layers over mesh axis ``axis`` and runs a pipeline schedule.

    The rule ``("layers", axis)`` shards the stacked layer axis of the parameters (the GPT's
    blocks) over ``axis``; parameters outside the stack (embedding, head) are replicated over
    it. ``px.value_and_grad(loss)`` with this strategy splits each device's batch into
    ``microbatches`` micro-batches (the batch is not split over ``axis``) and runs the
    schedule's table in the SPMD runtime (:mod:`parallax.pipeline.runtime`). The loss must
    be a :class:`parallax.pipeline.Stages` (for the GPT:
    ``parallax.models.gpt_pipeline.next_token_stages``), so the runtime can place ``first``
    on the first stage and ``last`` on the last. Compose it with ``DataParallel``, ``ZeRO``
    and ``TensorParallel`` for 3D parallelism: the pipeline's ``shard_map`` is manual over
    ``axis`` only, inside the data-parallel one, with tensor axes left to GSPMD.

    Args:
      axis: the mesh axis of the pipeline stages.
      microbatches: micro-batches per device slice of the batch, per step.
      schedule: ``"gpipe"``, ``"1f1b"`` (PipeDream-flush) or ``"interleaved_1f1b"``, or a
        :class:`parallax.pipeline.Schedule` built for the mesh's stage count.
      virtual_stages: model chunks per stage (``"interleaved_1f1b"`` needs >= 2).
      remat: ``"always"``, ``"except_last"`` or ``"never"`` (torchgpipe's options), or a
        ``jax.checkpoint_policies`` name.
      split_backward: schedule the weight-gradient half of each backward on its own
        (zero-bubble style); the default keeps the published schedules.

    Returns:
      A :class:`parallax.Strategy`.

    Example:
      >>> from parallax.strategies.pipeline import Pipeline
      >>> s = Pipeline("stage", microbatches=4, schedule="1f1b")
      >>> s.rules, s.microbatches
      ((('layers', 'stage'),), 4)

    References:
      Huang et al. 2019, GPipe; Kim et al. 2020, torchgpipe; Narayanan et al. 2019,
      PipeDream; Narayanan et al. 2021, PipeDream-flush; Narayanan et al. 2021 (SC),
      Megatron-LM (interleaved 1F1B, 3D parallelism).
    """
    microbatches = check_count("microbatches", microbatches, API)
    if isinstance(schedule, Schedule):
        virtual_stages = schedule.virtual_stages
        if schedule.microbatches != microbatches:
            raise ValueError(
                f"{API}: the schedule {schedule!r} has {schedule.microbatches} micro-batches "
                f"but microbatches={microbatches}; pass the same number"
            )
    virtual_stages = check_count("virtual_stages", virtual_stages, API)
    check_schedule_name(schedule, virtual_stages, API)
    check_remat(remat, API)
    label = schedule.name if isinstance(schedule, Schedule) else schedule

    def grad_fn(request, params, batch):
        stages = request.loss_fn
        if not isinstance(stages, Stages):
            name = getattr(stages, "__name__", type(stages).__name__)
            raise TypeError(
                f"{API}: the loss given to px.value_and_grad must be a "
                f"px.pipeline.Stages(first, stage, last, layers), so the pipeline can place "
                f"its pieces on the stages; got {name}. For the GPT use "
                "parallax.models.gpt_pipeline.next_token_stages."
            )
        _check_style()
        if request.has_aux or request.args:
            raise ValueError(
                f"{API}: a pipelined loss takes (model, batch) and returns the loss only; "
                f"got has_aux={request.has_aux} and {len(request.args)} extra arguments"
            )
        loss, grads = pipeline_grads(
            stages, params, request.rebuild, batch, schedule=schedule,
            microbatches=microbatches, virtual_stages=virtual_stages,
            split_backward=split_backward, axis=axis, remat=remat, api=API)
        return (loss, None), grads

    extra = f", virtual_stages={virtual_stages}" if virtual_stages > 1 else ""
    return Strategy(
        name=f"Pipeline({axis!r}, microbatches={microbatches}, schedule={label!r}{extra})",
        rules=((LAYERS, axis),),
        grad_fn=grad_fn,
        microbatches=microbatches,
    )



def _check_style() -> None:
    """The batch axes must be manual here (explicit style), not left to GSPMD."""
    ctx = context.current()
    if ctx is None:
        return
    auto = [a for a in ctx.strategy.batch_axes if a in ctx.mesh.shape and a not in ctx.manual_axes]
    if auto:
        raise ValueError(
            f"{API}: the batch axes {tuple(auto)} of {ctx.strategy.name} are left to GSPMD "
            "(style='gspmd'), which then splits the batch inside the pipeline's per-stage "
            "branches and places collectives there (measured: they deadlock on CPU); compose "
            "the pipeline with data-parallel strategies in the default style='explicit'"
        )
