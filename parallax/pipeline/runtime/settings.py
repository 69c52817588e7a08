"""The pipeline's settings, validated once into one frozen value.

``px.Pipeline`` and ``px.pipeline.value_and_grad`` take the same options (schedule,
micro-batches, virtual stages, rematerialisation, balance, weight versions, mesh axis);
:meth:`PipelineSettings.of` checks them at the API boundary, with the messages of
:mod:`parallax.pipeline.runtime.checks`, and the value then travels unchanged from the
strategy's gradient producer (:mod:`parallax.pipeline.producer`) through the gradients
(:mod:`parallax.pipeline.runtime.gradients`) into the tick loop
(:mod:`parallax.pipeline.runtime.ticks`), which read it and do not check it again. What
depends on the step's mesh, batch and model (the stage count, the :class:`Schedule` built for
it, the layer layout) is resolved where they are known, by :meth:`PipelineSettings.schedule_on`
and :meth:`PipelineSettings.layout`.

References:
  torchtitan's ``ParallelDims`` (``torchtitan/distributed/parallel_dims.py``): the parallel
  configuration as one validated dataclass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from parallax.pipeline.runtime.checks import (check_balance, check_positive_int, check_remat,
                                              check_schedule_name, chunks_for, layout_for,
                                              resolve_schedule)
from parallax.pipeline.runtime.layer_moves import Layout
from parallax.pipeline.schedules.table import Schedule

# PipeDream's weight-version modes (px.Pipeline(weights=...)).
WEIGHTS = ("flush", "stashed", "2bw")


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """A pipeline's options, checked (build it with :meth:`of`).

    Attributes:
      axis: the mesh axis of the stages.
      microbatches: micro-batches per step (a :class:`Schedule`'s own when one is given).
      schedule: a name of ``px.pipeline.SCHEDULES`` or a :class:`Schedule`.
      virtual_stages: model chunks per stage, resolved (the schedule's default if none).
      remat: the rematerialisation option as given (a torchgpipe option, a
        ``jax.checkpoint_policies`` name or a policy function).
      split_backward: ``W`` scheduled on its own (None: the schedule's default).
      balance: layers per virtual stage (None: an even split).
      weights: the weight-version mode (``"flush"``, ``"stashed"`` or ``"2bw"``).
      remat_mode: what the runtime lowers ``remat`` to: ``"always"``, ``"except_last"`` or
        ``"never"`` (a policy lowers like ``"never"``).
      policy: the checkpoint policy applied inside every layer (None: none).

    Example:
      >>> s = PipelineSettings.of("px.Pipeline", microbatches=4, remat="dots_saveable")
      >>> s.schedule, s.virtual_stages, s.remat_mode, s.policy is not None
      ('1f1b', 1, 'never', True)
    """

    axis: str
    microbatches: int
    schedule: Any
    virtual_stages: int
    remat: Any
    split_backward: bool | None
    balance: tuple[int, ...] | None
    weights: str
    remat_mode: str
    policy: Callable | None

    @classmethod
    def of(cls, api: str, *, microbatches: int | None, schedule: str | Schedule = "1f1b",
           virtual_stages: int | None = None, split_backward: bool | None = None,
           axis: str = "stage", remat="except_last", balance=None,
           weights: str = "flush") -> PipelineSettings:
        """The settings, every option checked; errors name ``api``.

        ``microbatches`` is ignored for a :class:`Schedule` (which has its own) and required
        with a named schedule. ``balance`` may be a ``px.pipeline.Partition``.
        """
        chunks = chunks_for(schedule, virtual_stages, api)
        check_schedule_name(schedule, chunks, api)
        mode, policy = check_remat(remat, api)
        balance = check_balance(balance, api)
        if weights not in WEIGHTS:
            raise ValueError(
                f"{api}: weights={weights!r} is not a weight-version mode; use 'flush' "
                "(PipeDream-flush: one version per step, synchronous), 'stashed' (PipeDream: "
                "an update after every micro-batch, each backward on the version its forward "
                "used) or '2bw' (PipeDream-2BW: two versions, the step's gradient at the "
                "previous one)"
            )
        if isinstance(schedule, Schedule):
            microbatches = schedule.microbatches
        elif microbatches is None:
            raise TypeError(f"{api}: pass microbatches= (micro-batches per step) with a named "
                            "schedule")
        microbatches = check_positive_int("microbatches", microbatches, api)
        split = None if split_backward is None else bool(split_backward)
        return cls(axis, microbatches, schedule, chunks, remat, split, balance, weights, mode,
                   policy)

    def schedule_on(self, stages: int, api: str) -> Schedule:
        """The :class:`Schedule` to run on ``stages`` stages (the mesh axis's size)."""
        return resolve_schedule(self.schedule, stages, self.microbatches, self.virtual_stages,
                                self.split_backward, self.axis, api)

    def layout(self, layers: int, sched: Schedule, api: str) -> Layout:
        """Which stored layers each chunk runs: ``balance``, or an even split (checked)."""
        return layout_for(layers, sched, self.balance, api, self.axis)
