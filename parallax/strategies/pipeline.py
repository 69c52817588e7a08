"""Pipeline parallelism as a strategy: stacked layers over a stage axis, any schedule,
PipeDream's weight versions."""

from __future__ import annotations

from parallax.pipeline.producer import PipelineProducer
from parallax.pipeline.runtime.checks import check_positive_int
from parallax.pipeline.schedules.table import Schedule
from parallax.pipeline.runtime.settings import PipelineSettings
from parallax.rules import LAYERS
from parallax.strategy import Strategy

API = "px.Pipeline"


def Pipeline(axis: str = "stage", *, microbatches: int, schedule: str | Schedule = "1f1b",
             virtual_stages: int | None = None, remat="except_last",
             split_backward: bool | None = None, balance=None,
             weights: str = "flush") -> Strategy:
    """Splits the stacked layers over mesh axis ``axis`` and runs a pipeline schedule.

    The rule ``("layers", axis)`` shards the stacked layer axis of the parameters (the GPT's
    blocks) over ``axis``; parameters outside the stack (embedding, head) are replicated over
    it. ``px.value_and_grad(loss)`` with this strategy splits each device's batch into
    ``microbatches`` micro-batches (the batch is not split over ``axis``) and runs the
    schedule's table in the SPMD runtime (:mod:`parallax.pipeline.runtime.ticks`). The loss
    must be a :class:`parallax.pipeline.Stages` (for the GPT:
    ``parallax.models.gpt_pipeline.next_token_stages``), so the runtime can place ``first``
    on the first virtual stage and ``last`` on the last. Compose it with ``DataParallel``,
    ``ZeRO`` and ``TensorParallel`` for 3D parallelism: the pipeline's ``shard_map`` is
    manual over ``axis`` only, inside the data-parallel one, with tensor axes left to GSPMD.

    An NNX model's non-parameter state (``nnx.BatchNorm`` statistics, ``nnx.Dropout`` RNG
    streams, in the stacked layers or in ``first`` / ``last``) is carried by the stages and
    written back as without a pipeline, with ``weights="flush"`` and every schedule: a
    BatchNorm in training mode needs ``px.value_and_grad(loss,
    batch_stats="per_microbatch")`` (the state after the step then equals a one-device loop
    over the micro-batches in order; the default ``"global"`` is refused with that fix); a
    Dropout-only model keeps the default options (one device's masks over the whole batch).
    ``weights="stashed"`` / ``"2bw"`` refuse a model with state
    (:mod:`parallax.pipeline.runtime.module_state`).

    Args:
      axis: the mesh axis of the pipeline stages.
      microbatches: micro-batches per device slice of the batch, per step.
      schedule: a name of ``px.pipeline.SCHEDULES`` (``"gpipe"``, ``"1f1b"``
        (PipeDream-flush), ``"interleaved_1f1b"``, ``"zb_h1"``, ``"zb_h2"``,
        ``"interleaved_zb"``, ``"zbv"``, ``"dualpipev"``) or a
        :class:`parallax.pipeline.Schedule` built for the mesh's stage count.
      virtual_stages: model chunks per stage (default: the schedule's own: 2 for the V
        schedules, else 1; the interleaved ones need >= 2).
      remat: ``"always"``, ``"except_last"`` or ``"never"`` (torchgpipe's options), or a
        ``jax.checkpoint_policies`` name.
      split_backward: schedule the weight-gradient half of each backward on its own
        (default: the schedule's own; the zero-bubble schedules need it).
      balance: layers per (virtual) stage, torchgpipe's ``balance``, or a
        ``px.pipeline.Partition`` from ``px.pipeline.partition``; default an even split.
      weights: PipeDream's weight versions: ``"flush"`` (one per step, synchronous),
        ``"stashed"`` (an update after every micro-batch, each backward on its forward's
        version) or ``"2bw"`` (the step's gradient at the previous version); the last two
        are written with ``px.pipeline.update`` (see ``docs/pipeline.md``).

    Returns:
      A :class:`parallax.Strategy`.

    Example:
      >>> from parallax.strategies.pipeline import Pipeline
      >>> s = Pipeline("stage", microbatches=4, schedule="1f1b")
      >>> s.rules, s.microbatches
      ((('layers', 'stage'),), 4)
      >>> Pipeline("stage", microbatches=8, schedule="zbv", weights="2bw").name
      "Pipeline('stage', microbatches=8, schedule='zbv', weights='2bw')"

    References:
      Huang et al. 2019, GPipe; Kim et al. 2020, torchgpipe; Narayanan et al. 2019,
      PipeDream; Narayanan et al. 2021, PipeDream-flush and 2BW; Narayanan et al. 2021 (SC),
      Megatron-LM (interleaved 1F1B, 3D parallelism); Qi et al. 2024, Zero Bubble Pipeline
      Parallelism; DeepSeek-AI 2024, DeepSeek-V3 (DualPipe).
    """
    microbatches = check_positive_int("microbatches", microbatches, API)
    if isinstance(schedule, Schedule):
        virtual_stages = schedule.virtual_stages
        if schedule.microbatches != microbatches:
            raise ValueError(
                f"{API}: the schedule {schedule!r} has {schedule.microbatches} micro-batches "
                f"but microbatches={microbatches}; pass the same number"
            )
    settings = PipelineSettings.of(
        API, microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages,
        split_backward=split_backward, axis=axis, remat=remat, balance=balance,
        weights=weights)
    balance = settings.balance
    label = schedule.name if isinstance(schedule, Schedule) else schedule
    extra = f", virtual_stages={virtual_stages}" if (virtual_stages or 1) > 1 else ""
    extra += f", balance={balance}" if balance else ""
    extra += f", weights={weights!r}" if weights != "flush" else ""
    return Strategy(
        name=f"Pipeline({axis!r}, microbatches={microbatches}, schedule={label!r}{extra})",
        rules=((LAYERS, axis),),
        grad_fn=PipelineProducer(settings),
        microbatches=microbatches,
    )
