"""px.plan: enumeration, pruning by the cost model, compiled checks, and brute force.

What the brute-force test measures: every candidate of a small search space is compiled
(``exhaustive=True``) and its peak memory (``memory_analysis``) and step time estimate (the
roofline of the *compiled* program: its matmul flops, bytes accessed and collectives) are
read; both are deterministic. The planner, which compiles only its top candidates, must
choose a configuration that fits and whose estimate is within 10% of the best that fits.
Wall-clock times of 8 simulated devices on a shared 2-core machine are too noisy for a test;
``benchmarks/plan.py`` compares the planner with brute force by timed steps (alternating,
medians) and prints the ratios.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

import parallax as px
from parallax import cli
from parallax.planner.candidates import SearchSpace, enumerate_candidates, factorizations

SMALL = SearchSpace(zero_stages=(1, 3), sequence_parallel=(False,), schedules=("1f1b",),
                    microbatches_per_stage=(2,), max_tensor=2, max_stages=2)


def make_mlp(width=64):
    return lambda: px.TrainState.create(
        px.models.MLP(16, [width, width], 16, rngs=nnx.Rngs(0)), optax.adam(1e-3))


MLP_BATCH = {"x": jnp.ones((16, 16)), "y": jnp.zeros((16, 16))}


def test_candidates_cover_the_factorizations_and_say_why_some_cannot_run():
    assert {tuple(f.values()) for f in factorizations(4, SearchSpace())} >= {
        (1, 4, 1, 1), (1, 1, 4, 1), (1, 1, 1, 4), (2, 1, 1, 2), (4, 1, 1, 1)}
    found = enumerate_candidates(4, px.models.mse_loss, 16, tensor_names=False, space=SMALL)
    why = {c.label: c.invalid for c in found}
    assert why["data=4: dp"] == "" and why["fsdp=2 tensor=2: zero3+tp"] == (
        "the model names no tensor-parallel axes")
    assert why["stage=2 data=2: dp+pp:1f1b:m4"] == "pipelines need the loss as px.pipeline.Stages"
    odd = enumerate_candidates(4, px.models.mse_loss, 6, tensor_names=True, space=SMALL)
    assert {c.label: c.invalid for c in odd}["data=4: dp"] == (
        "the batch of 6 does not split over 4 data-parallel ways")


@pytest.mark.slow
def test_the_plan_is_ready_for_init_and_a_step():
    plan = px.plan(make_mlp(), px.models.mse_loss, MLP_BATCH, devices=4, space=SMALL, top_k=2)
    mesh, strategy = plan
    assert mesh.size == 4 and plan.best.fits and plan.best.compiled_peak is not None
    assert "chosen" in plan.table().splitlines()[3]
    state = px.init(make_mlp(), mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    _, metrics = step(state, MLP_BATCH)
    assert jnp.isfinite(metrics["loss"])


def test_more_devices_than_present_are_ranked_by_the_cost_model():
    plan = px.plan(make_mlp(), px.models.mse_loss, {"x": jnp.ones((64, 16)),
                                                    "y": jnp.ones((64, 16))},
                   devices=16, space=SMALL)
    assert isinstance(plan.mesh, AbstractMesh) and plan.mesh.size == 16
    assert plan.best.compiled_peak is None and "cost model only" in plan.best.note


def test_nothing_fits():
    with pytest.raises(ValueError, match=r"px.plan: no configuration of 2 devices fits in "
                                         r"memory_per_device=1,000 bytes; use more devices"):
        px.plan(make_mlp(), px.models.mse_loss, MLP_BATCH, devices=2, memory_per_device=1e3,
                space=SMALL, top_k=1)


def test_the_state_must_be_a_train_state():
    with pytest.raises(TypeError, match=r"px.plan: state_fn must return a px.TrainState"):
        px.plan(lambda: {"w": jnp.ones(3)}, px.models.mse_loss, MLP_BATCH, devices=2)


def best_fitting(evaluations, budget):
    fits = [e for e in evaluations if e.compiled_peak is not None
            and (budget is None or e.compiled_peak <= budget)]
    return min(fits, key=lambda e: e.compiled_time)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_the_planner_against_brute_force(model):
    if model == "mlp":
        state_fn, loss_fn, batch = make_mlp(256), px.models.mse_loss, MLP_BATCH
    else:
        config = px.models.GPTConfig.tiny()
        state_fn = lambda: px.TrainState.create(  # noqa: E731
            px.models.GPT(config, rngs=nnx.Rngs(0)), optax.adam(1e-3))
        loss_fn = px.models.next_token_stages
        batch = {"tokens": jax.ShapeDtypeStruct((8, config.max_seq_len + 1), jnp.int32)}
    # GPT: no pipelines here (tracing their runtime is most of the time; test_explain checks
    # their formulas, and px.plan ranks them the same way).
    space = SMALL if model == "mlp" else dataclasses.replace(SMALL, max_stages=1,
                                                             zero_stages=(3,))
    brute = px.plan(state_fn, loss_fn, batch, devices=4, space=space, exhaustive=True)
    compiled = [e for e in brute.evaluations if e.compiled_peak is not None]
    assert len(compiled) >= 5, brute.table(20)
    peaks = sorted(e.compiled_peak for e in compiled)
    for budget in (None, peaks[len(peaks) // 2]):  # everything fits; half of them do
        chosen = px.plan(state_fn, loss_fn, batch, devices=4, space=space, top_k=2,
                         memory_per_device=budget).best
        assert budget is None or chosen.compiled_peak <= budget  # never one that does not fit
        best = best_fitting(brute.evaluations, budget)
        assert chosen.compiled_time <= 1.10 * best.compiled_time, (
            f"chose {chosen.candidate.label} ({chosen.compiled_time:.3g} s), brute force "
            f"{best.candidate.label} ({best.compiled_time:.3g} s)\n" + brute.table(20))


@pytest.mark.slow
def test_parallax_plan_and_explain_print_their_tables(capsys):
    assert cli.main(["plan", "--model", "tiny", "--devices", "8", "--max-stages", "1",
                     "--max-tensor", "2", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "px.plan:" in out and "configuration" in out and "chosen:" in out
    assert cli.main(["explain", "--model", "tiny", "--strategy", "zero2+tp", "--plain"]) == 0
    out = capsys.readouterr().out
    assert "strategy: ZeRO(2, 'fsdp') + TensorParallel('tensor')" in out
    assert "reduce-scatter over fsdp" in out and "all-reduce over tensor" in out
