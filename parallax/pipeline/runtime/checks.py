"""The pipeline's checks at the API boundary: counts, remat, schedule, balance, layers.

Shared by :meth:`parallax.pipeline.runtime.settings.PipelineSettings.of` (which
``px.pipeline.value_and_grad`` and the ``px.Pipeline`` strategy call) and
``px.pipeline.gpipe_value_and_grad``, so every entry point raises the same messages (each
names the API, the values and the fix).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax

from parallax.pipeline.planning.partition import Partition
from parallax.pipeline.runtime.layer_moves import Layout, check_layers
from parallax.pipeline.schedules.named import (SCHEDULES, check_chunks, check_positive_int,
                                               default_virtual_stages)
from parallax.pipeline.schedules.named import schedule as build_schedule
from parallax.pipeline.schedules.table import Schedule

REMAT = ("always", "except_last", "never")
# jax.checkpoint_policies that are policies themselves (the others are factories).
POLICIES = ("dots_saveable", "dots_with_no_batch_dims_saveable", "everything_saveable",
            "nothing_saveable", "checkpoint_dots", "checkpoint_dots_with_no_batch_dims")


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


def chunks_for(schedule, virtual_stages, api: str) -> int:
    """The model chunks per stage: the schedule's, the given count, or the name's default."""
    if isinstance(schedule, Schedule):
        return schedule.virtual_stages
    if virtual_stages is None:
        return default_virtual_stages(schedule)
    return check_positive_int("virtual_stages", virtual_stages, api)


def check_schedule_name(name, virtual_stages: int, api: str) -> None:
    """A known name that runs ``virtual_stages`` chunks, or a :class:`Schedule`."""
    if isinstance(name, Schedule):
        return
    if name not in SCHEDULES:
        raise ValueError(
            f"{api}: unknown schedule {name!r}; use one of {', '.join(map(repr, SCHEDULES))} "
            "or pass a px.pipeline.Schedule"
        )
    try:
        check_chunks(name, virtual_stages)
    except ValueError as e:
        raise ValueError(f"{api}: {str(e).removeprefix('schedule: ')}") from None


def check_balance(balance, api: str) -> tuple[int, ...] | None:
    """Layer counts per virtual stage, from a sequence or a ``px.pipeline.Partition``."""
    if balance is None:
        return None
    counts = balance.layers_per_stage if isinstance(balance, Partition) else balance
    if isinstance(counts, (str, bytes)) or not isinstance(counts, Sequence) or not counts:
        raise TypeError(
            f"{api}: balance must be a sequence of layer counts per stage (torchgpipe's "
            f"balance) or a px.pipeline.Partition, got {balance!r}"
        )
    return tuple(check_positive_int(f"balance[{i}]", n, api) for i, n in enumerate(counts))


def layout_for(layers: int, sched: Schedule, balance, api: str, axis: str) -> Layout:
    """The :class:`Layout` to run: the balance given, or an even split (checked)."""
    if balance is None:
        check_layers(layers, sched.stages, sched.virtual_stages, api, axis)
        return Layout.even(layers, sched.placement)
    count = sched.stages * sched.virtual_stages
    if len(balance) != count or sum(balance) != layers:
        raise ValueError(
            f"{api}: balance={tuple(balance)} must give one layer count per virtual stage "
            f"({sched.stages} stages on mesh axis {axis!r} x {sched.virtual_stages} chunks = "
            f"{count}) summing to the model's {layers} stacked layers; got {len(balance)} "
            f"counts summing to {sum(balance)}"
        )
    if layers % sched.stages:
        raise ValueError(
            f"{api}: the model's {layers} stacked layers are stored split evenly over mesh "
            f"axis {axis!r} of size {sched.stages} (the rule ('layers', {axis!r})), which "
            f"needs a multiple of {sched.stages} layers; balance= then says how many each "
            "stage runs"
        )
    return Layout.balanced(balance, sched.placement)


@functools.lru_cache(maxsize=64)
def _named(name, stages, microbatches, virtual_stages, split_backward):
    return build_schedule(name, stages, microbatches, virtual_stages, split_backward)


def resolve_schedule(sched, stages: int, microbatches: int, virtual_stages: int | None,
                     split_backward, axis: str, api: str) -> Schedule:
    """The :class:`Schedule` to run on ``stages`` stages, with the mesh axis in errors."""
    if isinstance(sched, Schedule):
        if (sched.stages, sched.microbatches) != (stages, microbatches):
            raise ValueError(
                f"{api}: the schedule {sched!r} has {sched.stages} stages and "
                f"{sched.microbatches} micro-batches, but mesh axis {axis!r} has size {stages} "
                f"and microbatches={microbatches}; build it for this mesh"
            )
        return sched
    split = None if split_backward is None else bool(split_backward)
    try:
        return _named(sched, stages, microbatches, virtual_stages, split)
    except ValueError as e:
        raise ValueError(f"{api} on mesh axis {axis!r} of size {stages}: {e}") from None
