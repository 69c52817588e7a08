"""PipelineSettings: the pipeline's options checked once, then read by the runtime as they are."""

import sys

import jax
import pytest

from parallax import pipeline as pp
from parallax.pipeline.runtime.gradients import pipeline_grads
from parallax.pipeline.runtime.settings import PipelineSettings
from parallax.strategies.pipeline import Pipeline
from parallax.testing import relative_difference

from ..runtime_testing import TOY, reference, stage_mesh, toy_batch, toy_params


def test_the_options_are_resolved_once():
    s = PipelineSettings.of("api", microbatches=8, schedule="zbv", remat="dots_saveable",
                            balance=pp.Partition.from_boundaries([1.0] * 4, (0, 1, 2, 3, 4)),
                            split_backward=1)
    assert s.virtual_stages == 2  # the V schedules' default
    assert s.remat_mode == "never"
    assert s.policy is jax.checkpoint_policies.dots_saveable
    assert s.balance == (1, 1, 1, 1) and s.split_backward is True
    sched = pp.schedule("1f1b", 2, 6)
    given = PipelineSettings.of("api", microbatches=None, schedule=sched)
    assert given.microbatches == 6 and given.virtual_stages == 1  # the Schedule's own


def test_the_strategy_holds_the_same_value():
    strategy = Pipeline("stage", microbatches=4, schedule="interleaved_1f1b",
                        virtual_stages=2, remat="always")
    assert strategy.grad_fn.settings == PipelineSettings.of(
        "px.Pipeline", microbatches=4, schedule="interleaved_1f1b", virtual_stages=2,
        remat="always")
    # equal options give equal producers, so equal strategies still compose
    assert strategy.grad_fn == Pipeline("stage", microbatches=4, schedule="interleaved_1f1b",
                                        virtual_stages=2, remat="always").grad_fn


def test_errors_name_the_api_that_checks_them():
    with pytest.raises(ValueError, match=r"^api: remat='sometimes' is not a rematerialisation"):
        PipelineSettings.of("api", microbatches=4, remat="sometimes")
    with pytest.raises(ValueError, match=r"^api: weights='async' is not a weight-version mode"):
        PipelineSettings.of("api", microbatches=4, weights="async")
    with pytest.raises(TypeError, match=r"^api: pass microbatches= \(micro-batches per step\)"):
        PipelineSettings.of("api", microbatches=None)


def test_the_runtime_does_not_check_the_options_again(monkeypatch):
    """Once checked, the settings go to the tick loop as they are: with every option check
    made to fail, wherever a pipeline module holds it, a step still runs and is right."""
    settings = PipelineSettings.of("test", microbatches=4, schedule="1f1b", remat="always")

    def refuse(*args, **kwargs):
        raise AssertionError("an option was checked again")

    for name, module in list(sys.modules.items()):
        if name.startswith("parallax.pipeline"):
            for check in ("check_remat", "chunks_for", "check_balance", "check_schedule_name"):
                if hasattr(module, check):
                    monkeypatch.setattr(module, check, refuse)
    with jax.set_mesh(stage_mesh(2)):
        loss, grads = jax.jit(lambda q, b: pipeline_grads(TOY, q, lambda p: p, b, settings))(
            toy_params(2), toy_batch())
    ref_loss, ref_grads = reference(2)
    assert relative_difference(loss, ref_loss) <= 1e-5
    assert relative_difference(grads, ref_grads) <= 1e-5
