"""px.plan prices with the chip's link, and checks a rejection for memory before it makes one.

A chip implies its interconnect (``--chip h100`` prices collectives over NVLink, not the
host's link); a candidate predicted not to fit is compiled before being rejected (the
``top_k`` best predicted of them) or says that its rejection rests on the prediction only;
``exhaustive=True`` compiles every candidate.
"""

import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import parallax as px
from parallax import cli
from parallax.planner import roofline
from parallax.planner.candidates import SearchSpace

SMALL = SearchSpace(zero_stages=(1, 3), sequence_parallel=(False,), schedules=("1f1b",),
                    microbatches_per_stage=(2,), max_tensor=2, max_stages=2)
BATCH = {"x": jnp.ones((16, 16)), "y": jnp.zeros((16, 16))}


def make_mlp():
    return px.TrainState.create(px.models.MLP(16, [64, 64], 16, rngs=nnx.Rngs(0)),
                                optax.adam(1e-3))


def test_a_chip_implies_its_link_and_link_overrides():
    assert roofline.link_for("h100").name == "nvlink-h100"
    assert roofline.link_for("tpu-v5e").name == "tpu-v5e-ici"
    assert roofline.link_for("h100", "ethernet-100g").name == "ethernet-100g"
    own = roofline.Chip("mine", {"float32": 1e12}, 1e12, 1e9)  # names no link: the backend's
    assert roofline.link_for(own, backend="gpu").name == "nvlink-h100"
    big = {"x": jnp.ones((64, 16)), "y": jnp.ones((64, 16))}  # 16 devices: cost model only
    plan = px.plan(make_mlp, px.models.mse_loss, big, devices=16, space=SMALL, chip="h100")
    assert plan.table().splitlines()[1] == "  times priced for chip h100, link nvlink-h100"
    slow = px.plan(make_mlp, px.models.mse_loss, big, devices=16, space=SMALL, chip="h100",
                   link="ethernet-100g")
    assert "link ethernet-100g" in slow.table().splitlines()[1]
    # the same candidate costs more over Ethernet than over NVLink
    by_label = {e.candidate.label: e.predicted_time for e in plan.evaluations}
    over_ethernet = {e.candidate.label: e.predicted_time for e in slow.evaluations}
    assert over_ethernet["data=16: dp"] > by_label["data=16: dp"]


def test_explain_names_the_chips_link():
    mesh = px.make_mesh(data=-1)

    @px.train_step(mesh, px.DataParallel("data"))
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    import jax
    report = px.explain(step, jax.eval_shape(make_mlp), BATCH, chip="tpu-v5e")
    assert report.facts["chip"] == "tpu-v5e" and report.facts["link"] == "tpu-v5e-ici"


@pytest.mark.slow
def test_rejections_are_compiled_or_marked_predicted_only():
    free = px.plan(make_mlp, px.models.mse_loss, BATCH, devices=4, space=SMALL, top_k=1)
    ranked = sorted((e for e in free.evaluations if e.predicted_peak),
                    key=lambda e: e.predicted_time)
    # the two best predicted are predicted not to fit
    budget = 0.99 * min(ranked[0].predicted_peak, ranked[1].predicted_peak)
    plan = px.plan(make_mlp, px.models.mse_loss, BATCH, devices=4, space=SMALL, top_k=1,
                   memory_per_device=budget)
    table = plan.table(40)
    predicted_only = [e for e in plan.evaluations if e.note.startswith("rejected: predicted")]
    checked = [e for e in plan.evaluations if e.note in (
        "fits (predicted not to)", "does not fit (compiled, as predicted)")]
    assert predicted_only and len(checked) == 1, table  # top_k=1 rejected one compiled
    assert all(e.compiled_peak is None for e in predicted_only)
    for e in plan.evaluations:  # every compiled row shows predicted and compiled, and ratio
        if e.compiled_peak is not None:
            row = next(line for line in table.splitlines() if f" {e.candidate.label} " in line)
            assert f"{e.compiled_peak / 1e6:.2f}" in row
            assert f"{e.compiled_peak / e.predicted_peak:.2f}" in row
    assert plan.best.compiled_peak <= budget
    brute = px.plan(make_mlp, px.models.mse_loss, BATCH, devices=4, space=SMALL,
                    memory_per_device=budget, exhaustive=True)
    valid = [e for e in brute.evaluations if e.predicted_peak is not None]
    assert all(e.compiled_peak is not None for e in valid), brute.table(40)
    assert not any("predicted only" in e.note for e in brute.evaluations)


@pytest.mark.slow
def test_parallax_plan_chip_and_exhaustive_flags(capsys):
    assert cli.main(["plan", "--model", "tiny", "--devices", "2", "--max-stages", "1",
                     "--max-tensor", "1", "--chip", "h100", "--exhaustive"]) == 0
    out = capsys.readouterr().out
    assert "times priced for chip h100, link nvlink-h100" in out
    assert "predicted only" not in out and "not compiled" not in out
