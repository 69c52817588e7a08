"""Bad input to the pipeline runtime fails at the boundary, with the message pinned."""

import re

import jax
import jax.numpy as jnp
import pytest

from parallax import pipeline as pp
from parallax.strategies.pipeline import Pipeline

from ..runtime_testing import TOY, stage_mesh, toy_batch, toy_params

API = "px.pipeline.value_and_grad"


def run(layers=4, stages=4, **kwargs):
    kwargs.setdefault("schedule", "1f1b")
    kwargs.setdefault("microbatches", 4)
    fn = pp.value_and_grad(kwargs.pop("loss", TOY), kwargs.pop("schedule"), **kwargs)
    with jax.set_mesh(stage_mesh(stages)):
        return jax.eval_shape(fn, toy_params(layers), toy_batch())


TRACED = [  # (kwargs of run, error, message)
    (dict(layers=6), ValueError,
     f"{API}: the model's 6 stacked layers do not split into stages=4 (mesh axis 'stage') x "
     "virtual_stages=1 = 4 equal chunks; use a multiple of 4 layers (e.g. 4 or 8), stages and "
     "virtual_stages whose product divides 6, or balance= to give each stage its own number of "
     "layers"),
    (dict(layers=8, schedule="interleaved_1f1b", virtual_stages=2, microbatches=4, stages=2,
          loss=pp.Stages(TOY.first, TOY.stage, TOY.last, TOY.layers)), None, None),
    (dict(layers=12, stages=2, schedule="interleaved_1f1b", virtual_stages=4), ValueError,
     "stages=2 (mesh axis 'stage') x virtual_stages=4 = 8 equal chunks"),
    (dict(microbatches=5), ValueError,
     f"{API}: microbatches=5 does not divide the batch: leaf ['x'] has 32 examples"),
    (dict(layers=8, schedule="interleaved_1f1b", virtual_stages=2, microbatches=2), ValueError,
     f"{API} on mesh axis 'stage' of size 4: schedule: interleaved with too few micro-batches: "
     "2 for 4 stages"),
    (dict(layers=8, schedule="interleaved_1f1b", virtual_stages=2, microbatches=6), ValueError,
     "interleaved needs microbatches to be a multiple of stages, got 6 for 4 stages (e.g. 4 or 8)"),
    (dict(schedule=pp.schedule("1f1b", 2, 4)), ValueError,
     "has 2 stages and 4 micro-batches, but mesh axis 'stage' has size 4"),
    (dict(axis="pipe"), ValueError,
     f"{API}: the pipeline runs over mesh axis 'pipe', but the mesh has axes {{'stage': 4}}"),
    (dict(loss=pp.Stages(TOY.first, lambda w, x: x[:, :2], TOY.last, TOY.layers)), ValueError,
     f"{API}: Stages.stage(layer, x) must return an x of the same structure, shape and dtype"),
    (dict(loss=pp.Stages(TOY.first, TOY.stage, TOY.last, lambda p: jnp.zeros((4, 8, 8)))),
     ValueError, f"{API}: Stages.layers(model) must return the stacked layers"),
]


@pytest.mark.parametrize("kwargs,error,message", TRACED)
def test_bad_input_when_traced(kwargs, error, message):
    if error is None:
        run(**kwargs)  # the valid neighbour of the bad cases
        return
    with pytest.raises(error, match=re.escape(message)):
        run(**kwargs)


def test_no_mesh():
    fn = pp.value_and_grad(TOY, "1f1b", microbatches=4)
    with pytest.raises(ValueError, match=re.escape(
            f"{API}: the pipeline runs over mesh axis 'stage', but no mesh is set; build the "
            "mesh with px.make_mesh(stage=N, ...) and run inside jax.set_mesh(mesh)")):
        jax.eval_shape(fn, toy_params(4), toy_batch())


EAGER = [  # (factory, error, message)
    (lambda: pp.value_and_grad(TOY, "zb", microbatches=4), ValueError,
     f"{API}: unknown schedule 'zb'; use one of 'gpipe', '1f1b', 'interleaved_1f1b'"),
    (lambda: pp.value_and_grad(TOY, "1f1b", microbatches=4, remat="sometimes"), ValueError,
     f"{API}: remat='sometimes' is not a rematerialisation option; use one of 'always', "
     "'except_last', 'never'"),
    (lambda: pp.value_and_grad(TOY, "1f1b", microbatches=4, virtual_stages=2), ValueError,
     f"{API}: virtual_stages=2 needs 'interleaved_1f1b', 'interleaved_zb', 'zbv' or "
     "'dualpipev'; '1f1b' runs one model chunk per stage"),
    (lambda: pp.value_and_grad(TOY, "interleaved_1f1b", microbatches=4), ValueError,
     f"{API}: 'interleaved_1f1b' needs virtual_stages >= 2 model chunks per stage, got 1; "
     "with one chunk per stage use '1f1b'"),
    (lambda: pp.value_and_grad(lambda p, b: 0.0, "1f1b", microbatches=4), TypeError,
     f"{API}: the loss must be a px.pipeline.Stages, got function"),
    (lambda: pp.value_and_grad(TOY, "1f1b"), TypeError, f"{API}: pass microbatches="),
    (lambda: pp.value_and_grad(TOY, "1f1b", microbatches=0), ValueError,
     f"{API}: microbatches must be >= 1, got 0"),
    (lambda: pp.gpipe_value_and_grad(TOY, microbatches=4, remat="except_last"), ValueError,
     "px.pipeline.gpipe_value_and_grad: remat='except_last' needs the table runtime"),
    (lambda: pp.Stages(1, 2, 3, 4), TypeError, "px.pipeline.Stages: first must be callable"),
    (lambda: Pipeline("stage", microbatches=True), TypeError,
     "px.Pipeline: microbatches must be an int, got True"),
    (lambda: Pipeline("stage", microbatches=4, schedule="nope"), ValueError,
     "px.Pipeline: unknown schedule 'nope'"),
    (lambda: Pipeline("stage", microbatches=4, remat="sometimes"), ValueError,
     "px.Pipeline: remat='sometimes' is not a rematerialisation option"),
    (lambda: Pipeline("stage", microbatches=2, schedule=pp.schedule("1f1b", 2, 4)), ValueError,
     "px.Pipeline: the schedule Schedule('1f1b', stages=2, microbatches=4, virtual_stages=1, "
     "split_backward=False, ticks=15) has 4 micro-batches but microbatches=2"),
]


@pytest.mark.parametrize("factory,error,message", EAGER)
def test_bad_input_when_built(factory, error, message):
    with pytest.raises(error, match=re.escape(message)):
        factory()
