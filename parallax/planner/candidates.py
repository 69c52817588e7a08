"""The configurations ``px.plan`` considers: mesh factorizations times strategies.

Every way of writing the device count as ``stage x data x fsdp x tensor`` (in parallax's
axis order), and for each: ZeRO stages 1-3 on ``fsdp``, tensor parallelism with and without
sequence parallelism on ``tensor``, and on ``stage`` each pipeline schedule with a few
micro-batch counts. A candidate that cannot run is kept with the reason (a batch that does
not split, a head count that does not divide, a loss that is not a ``Stages``), so the
planner's table can say why it was left out.

:meth:`SearchSpace.for_cluster` is the space for many nodes: tensor parallelism up to a
node, pipelines up to 64 stages whose micro-batches are counted by their size (Megatron's
``--micro-batch-size``), each rematerialisation option, interleaved schedules with 2 to 4
chunks, and micro-batches with gradient accumulation on one stage; data and ZeRO's axis
are not mixed there (one or the other), which keeps a 3,072-device search to a few
thousand candidates.
"""

from __future__ import annotations

import dataclasses
import itertools

from parallax.pipeline import Stages
from parallax.pipeline.schedules.named import INTERLEAVED
from parallax.planner.schedule_facts import facts
from parallax.strategies import DataParallel, Pipeline, TensorParallel, ZeRO
from parallax.strategy import Strategy, compose

TP_NAMES = ("heads", "mlp", "vocab")
# How a label names a rematerialisation option (the default, "except_last", is not named).
_REMAT_LABELS = {"always": "remat", "never": "no-remat", "nothing_saveable": "remat-layers"}


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """What the planner may choose from.

    Attributes:
      zero_stages: ZeRO stages tried on the ``fsdp`` axis.
      sequence_parallel: tensor parallelism tried without / with sequence parallelism.
      schedules: pipeline schedules tried on the ``stage`` axis (any of
        ``px.pipeline.SCHEDULES``; the published three by default).
      microbatches_per_stage: micro-batch counts tried, as multiples of the stage count.
      max_tensor: the largest tensor-parallel size (tensor parallelism wants fast links).
      max_stages: the largest number of pipeline stages.
      microbatch_sizes: when given, the micro-batch counts are the rows each pipeline
        computes over these micro-batch sizes instead (``microbatches_per_stage`` unused).
      remat: the pipelines' rematerialisation options (``px.Pipeline(remat=...)``).
      virtual_stages: chunks per stage tried for the interleaved schedules.
      accumulate: also try one stage of micro-batches (gradient accumulation with the
        pipeline's rematerialisation) on meshes without a pipeline.
      mixed_data: try meshes with both a ``data`` and an ``fsdp`` axis (HSDP); when False,
        the batch axes are one or the other.
    """

    zero_stages: tuple[int, ...] = (1, 2, 3)
    sequence_parallel: tuple[bool, ...] = (False, True)
    schedules: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b")
    microbatches_per_stage: tuple[int, ...] = (1, 2, 4)
    max_tensor: int = 8
    max_stages: int = 8
    microbatch_sizes: tuple[int, ...] = ()
    remat: tuple[str, ...] = ("except_last",)
    virtual_stages: tuple[int, ...] = (2,)
    accumulate: bool = False
    mixed_data: bool = True

    @classmethod
    def for_cluster(cls, devices_per_node: int = 8, **overrides) -> SearchSpace:
        """The space for many nodes (module docstring); ``overrides`` replace fields.

        Example:
          >>> space = SearchSpace.for_cluster(8)
          >>> space.max_tensor, space.max_stages, space.remat, space.accumulate
          (8, 64, ('nothing_saveable', 'except_last'), True)
        """
        fields = dict(zero_stages=(1, 3), sequence_parallel=(True,),
                      schedules=("1f1b", "interleaved_1f1b"), max_tensor=devices_per_node,
                      max_stages=64, microbatch_sizes=(1, 2, 4),
                      remat=("nothing_saveable", "except_last"), virtual_stages=(2, 3, 4),
                      accumulate=True, mixed_data=False)
        return cls(**(fields | overrides))


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration: mesh axis sizes, the strategy, a short label, or why it cannot run."""

    axes: dict
    strategy: Strategy
    label: str
    invalid: str = ""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def factorizations(devices: int, space: SearchSpace) -> list[dict[str, int]]:
    """Every ``{stage, data, fsdp, tensor}`` whose product is ``devices``.

    Example:
      >>> len(factorizations(8, SearchSpace()))
      20
    """
    out = []
    for stage in _divisors(devices):
        for tensor in _divisors(devices // stage):
            for fsdp in _divisors(devices // stage // tensor):
                data = devices // stage // tensor // fsdp
                mixed = data > 1 and fsdp > 1
                if (stage <= space.max_stages and tensor <= space.max_tensor
                        and (space.mixed_data or not mixed)):
                    out.append({"stage": stage, "data": data, "fsdp": fsdp, "tensor": tensor})
    return out


def _counts(stage: int, rows: int, space: SearchSpace) -> list[int]:
    """Micro-batch counts: by micro-batch size over the pipeline's ``rows``, or as
    multiples of the stages."""
    if space.microbatch_sizes:
        return sorted({rows // size for size in space.microbatch_sizes
                       if size <= rows and rows % size == 0})
    return [stage * k for k in space.microbatches_per_stage]


def _pipelines(stage: int, rows: int, layers: int | None, space: SearchSpace):
    """``(label, strategy, micro-batches, chunks per stage)`` per schedule, count, chunk
    count and rematerialisation option. The label names the chunks when not 2 and the
    option when not the default (``"except_last"``); one stage is gradient accumulation."""
    names = space.schedules if stage > 1 else ("1f1b",)
    for name, micro, remat in itertools.product(names, _counts(stage, rows, space),
                                                space.remat):
        for virtual in (space.virtual_stages if name in INTERLEAVED else (None,)):
            if virtual and layers is not None and layers % (stage * virtual):
                continue
            try:
                chunks = facts(name, stage, micro, virtual).virtual_stages
            except ValueError:  # this schedule cannot run with these micro-batches
                continue
            label = (f"pp:{name}:m{micro}" if stage > 1 else f"accumulate:m{micro}") + (
                f":v{chunks}" if virtual and chunks != 2 else "") + (
                f":{_REMAT_LABELS.get(remat, remat)}" if remat != "except_last" else "")
            yield (label, Pipeline("stage", microbatches=micro, schedule=name,
                                   virtual_stages=virtual, remat=remat), micro, chunks)


def enumerate_candidates(devices: int, loss_fn, rows: int, *, tensor_names: bool,
                         layers: int | None = None, heads: int | None = None,
                         seq_len: int | None = None,
                         space: SearchSpace = SearchSpace()) -> list[Candidate]:
    """All candidates for ``devices`` devices, each valid or with the reason it is not.

    Args:
      devices: how many devices the mesh spans.
      loss_fn: the loss (a ``px.pipeline.Stages`` allows pipelines).
      rows: the global batch's examples.
      tensor_names: whether the model names tensor-parallel logical axes.
      layers, heads, seq_len: the GPT's sizes, when known (earlier, clearer refusals).
      space: the :class:`SearchSpace`.

    Returns:
      A list of :class:`Candidate`, ``invalid`` empty for those that can run.

    Example:
      >>> import parallax as px
      >>> found = enumerate_candidates(2, px.models.mse_loss, 8, tensor_names=True)
      >>> [c.label for c in found if not c.invalid]
      ['data=2: dp', 'fsdp=2: zero1', 'fsdp=2: zero2', 'fsdp=2: zero3',
       'tensor=2: tp', 'tensor=2: tp-sp']
      >>> next(c.invalid for c in found if c.label.startswith("stage"))
      'pipelines need the loss as px.pipeline.Stages'

    References:
      Narayanan et al., SC 2021 (the 3D design space); Zheng et al., "Alpa", OSDI 2022.
    """
    out = []
    for axes in factorizations(devices, space):
        stage, data, fsdp, tensor = (axes[a] for a in ("stage", "data", "fsdp", "tensor"))
        zeros = [(f"zero{k}", ZeRO(k, "fsdp")) for k in space.zero_stages] if fsdp > 1 else [
            (None, None)]
        tps = [("tp-sp" if sp else "tp", TensorParallel("tensor", sequence_parallel=sp))
               for sp in space.sequence_parallel] if tensor > 1 else [(None, None)]
        per_pipeline = rows // (data * fsdp) if rows % (data * fsdp) == 0 else 0
        pps = list(_pipelines(stage, per_pipeline, layers, space)) if stage > 1 else []
        if stage == 1 and space.accumulate and isinstance(loss_fn, Stages) and per_pipeline:
            pps = [(None, None, 1, 1)] + [p for p in _pipelines(1, per_pipeline, layers, space)
                                          if p[2] > 1]
        pps = pps if stage > 1 else pps or [(None, None, 1, 1)]
        for (zl, zs), (tl, ts), (pl, ps, micro, v) in itertools.product(zeros, tps, pps):
            parts = ([("dp", DataParallel("data"))] if data > 1 or devices == 1 else [])
            parts += [(zl, zs), (tl, ts), (pl, ps)]
            parts = [(label, s) for label, s in parts if s is not None]
            shown = {a: n for a, n in axes.items() if n > 1} or {"data": 1}
            label = " ".join(f"{a}={n}" for a, n in shown.items()) + ": " + "+".join(
                label for label, _ in parts)
            invalid = _invalid(rows, data * fsdp, micro, stage, v, tensor, loss_fn,
                               tensor_names, layers, heads, seq_len, tl)
            mesh_axes = shown | ({"stage": 1} if ps is not None and stage == 1 else {})
            out.append(Candidate(mesh_axes, compose(*(s for _, s in parts)), label, invalid))
    return out


def _invalid(rows, batch_ways, micro, stage, v, tensor, loss_fn, tensor_names, layers, heads,
             seq_len, tp_label) -> str:
    if rows % batch_ways:
        return f"the batch of {rows} does not split over {batch_ways} data-parallel ways"
    if stage > 1 and (rows // batch_ways) % micro:
        return f"{rows // batch_ways} rows per device do not split into {micro} micro-batches"
    if stage > 1 and not isinstance(loss_fn, Stages):
        return "pipelines need the loss as px.pipeline.Stages"
    if stage > 1 and layers is not None and layers % (stage * v):
        return f"{layers} layers do not split into {stage} x {v} chunks"
    if tensor > 1 and not tensor_names:
        return "the model names no tensor-parallel axes"
    if tensor > 1 and heads is not None and heads % tensor:
        return f"{heads} heads do not split over {tensor}"
    if tp_label == "tp-sp" and seq_len is not None and seq_len % tensor:
        return f"sequence {seq_len} does not split over {tensor}"
    return ""

