"""Every strategy trains to the single-device numbers: losses, gradients, parameters (fp32, 1e-5)."""

import fixtures as fx
import jax
import pytest
from flax import nnx

import parallax as px

MLP_CASES = [(kind, name) for kind in ("mlp", "functional-mlp") for name in fx.STRATEGIES]
GPT_CASES = [("gpt", name) for name in fx.STRATEGIES if name not in ("dp-gspmd", "zero3-gspmd")] + [
    ("functional-gpt", "zero3"),
    ("functional-gpt", "dp-fsdp-tp"),
]


def check(kind, name, microbatches=None):
    make, loss, data, tx, ref = fx.reference(kind)
    mesh, strategy = fx.mesh_for(name)
    run = px.testing.train(make, loss, data, mesh=mesh, strategy=strategy, tx=tx,
                           microbatches=microbatches)
    assert len(run.losses) == fx.STEPS
    px.testing.assert_equivalent(run, ref, rtol=1e-5)


@pytest.mark.parametrize("kind,name", MLP_CASES, ids=[f"{k}-{n}" for k, n in MLP_CASES])
def test_mlp_matches_one_device(kind, name):
    check(kind, name)


@pytest.mark.slow
@pytest.mark.parametrize("kind,name", GPT_CASES, ids=[f"{k}-{n}" for k, n in GPT_CASES])
def test_gpt_matches_one_device(kind, name):
    check(kind, name)


@pytest.mark.parametrize("kind", ["mlp", "functional-mlp"])
def test_microbatched_value_and_grad_matches_full_batch(kind):
    check(kind, "dp", microbatches=4)


@pytest.mark.slow
def test_gpt_microbatches_with_zero3_match_full_batch():
    check("gpt", "zero3", microbatches=2)


def test_accumulation_without_a_mesh_equals_the_full_batch():
    make, loss, data, _, _ = fx.reference("mlp")
    state = make()
    full_loss, full = jax.value_and_grad(
        lambda p: loss(nnx.merge(state.graphdef, p, state.rest), data[0])
    )(state.params)
    split_loss, split = px.value_and_grad(loss, microbatches=8)(state.model, data[0])
    assert abs(float(split_loss) - float(full_loss)) <= 1e-6 * abs(float(full_loss))
    assert px.testing.relative_difference(split, full) <= 1e-5
