"""What ``px.Pipeline`` puts in a strategy: a gradient producer holding its settings.

``Strategy.grad_fn`` is called as ``grad_fn(request, params, batch)`` by
``px.value_and_grad``. :class:`PipelineProducer` is that callable, a frozen dataclass around
the pipeline's checked settings (:class:`parallax.pipeline.runtime.settings.PipelineSettings`),
which it passes on to the runtime and which ``px.pipeline.update`` reads back from the
strategy in context (equal settings compare equal, so equal strategies still compose).

An NNX module's non-parameter state (BatchNorm statistics, RNG streams) is read from the
request's slice loss (``GradRequest.value_and_grad``: the split module, its state, the
slice's position, the ``batch_stats`` / ``rng`` options), carried through the schedule by
the runtime, and returned in a :class:`parallax.grad.slice_loss.LocalResult`, which
``px.value_and_grad`` reduces over the batch shards and writes back as without a pipeline
(:mod:`parallax.pipeline.runtime.module_state` says what is supported).
"""

from __future__ import annotations

import dataclasses

from parallax import context
from parallax.grad.slice_loss import LocalResult
from parallax.pipeline.runtime import module_state
from parallax.pipeline.runtime.gradients import pipeline_grads
from parallax.pipeline.runtime.settings import PipelineSettings
from parallax.pipeline.stages import Stages

API = "px.Pipeline"
# What px.pipeline.update passes as the loss's extra argument: px.value_and_grad called by
# it, not by the user (who, with asynchronous weights, must call px.pipeline.update).
FROM_UPDATE = ("px.pipeline.update",)


@dataclasses.dataclass(frozen=True)
class PipelineProducer:
    """The pipeline's ``Strategy.grad_fn``.

    Attributes:
      settings: the options of :func:`parallax.strategies.pipeline.Pipeline`, checked there.
    """

    settings: PipelineSettings

    def __call__(self, request, params, batch):
        stages = request.loss_fn
        if not isinstance(stages, Stages):
            name = getattr(stages, "__name__", type(stages).__name__)
            raise TypeError(
                f"{API}: the loss given to px.value_and_grad must be a "
                f"px.pipeline.Stages(first, stage, last, layers), so the pipeline can place "
                f"its pieces on the stages; got {name}. For the GPT use "
                "parallax.models.gpt_pipeline.next_token_stages."
            )
        check_style()
        settings = self.settings
        if settings.weights != "flush" and request.args != FROM_UPDATE:
            raise ValueError(
                f"{API}(weights={settings.weights!r}): the weights are not one version per "
                "step, so px.value_and_grad + state.apply_gradients cannot express the step; "
                "write it as `state, loss = px.pipeline.update(loss_fn, state, batch)`"
            )
        if request.has_aux or (request.args and request.args != FROM_UPDATE):
            raise ValueError(
                f"{API}: a pipelined loss takes (model, batch) and returns the loss only; "
                f"got has_aux={request.has_aux} and {len(request.args)} extra arguments"
            )
        local = request.value_and_grad
        target = getattr(local, "target", None)
        policy = dict(precision=getattr(local, "precision", None),
                      scale=getattr(local, "scale", None))
        if module_state.carries_state(target):
            module_state.check(target, local.options, API, settings.weights)
            loss, grads, after = pipeline_grads(
                stages, params, module_state.rebuild_for(target, local.options), batch,
                settings, api=API, state=local.state,
                run=module_state.run_for(local.options, local.position), **policy)
            return (loss, LocalResult(None, module_state.shared_exact(after), None, {})), grads
        loss, grads = pipeline_grads(stages, params, request.rebuild, batch, settings, api=API,
                                     **policy)
        return (loss, None), grads


def check_style() -> None:
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
