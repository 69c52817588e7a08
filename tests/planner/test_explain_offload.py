"""px.explain under ZeRO-Offload: the offloaded state leaves the device's arguments, in the
prediction and in the compiled program, and shows as host memory."""

import jax
import pytest

import fixtures as fx
import parallax as px
from parallax.planner.predicted import memory as pm
from parallax.planner.setting import read_setting


def report_for(strategy):
    mesh = px.make_mesh(fsdp=8)
    step = fx.mlp_step(mesh, strategy)
    return px.explain(step, jax.eval_shape(fx.mlp_state), fx.mlp_batches(steps=1)[0])


@pytest.mark.slow
@pytest.mark.parametrize("stage, offload", [(1, "optimizer"), (3, "params")])
def test_offloaded_bytes_leave_device_memory_in_the_prediction_and_the_program(stage, offload):
    plain, offloaded = report_for(px.ZeRO(stage, "fsdp")), report_for(
        px.ZeRO(stage, "fsdp", offload=offload))
    host = offloaded.row("host memory (offloaded)")
    assert host.ratio == pytest.approx(1, abs=0.05), offloaded.text()
    hosted = offloaded.row("optimizer state").predicted + (
        offloaded.row("parameters").predicted if offload == "params" else 0)
    assert hosted - 16 <= host.predicted < hosted  # the row adds Adam's two step counters
    args, plain_args = offloaded.row("arguments (state + batch)"), plain.row(
        "arguments (state + batch)")
    assert args.ratio == pytest.approx(1, abs=0.05), offloaded.text()
    assert args.predicted == pytest.approx(plain_args.predicted - host.predicted, rel=1e-6)
    assert args.measured == pytest.approx(plain_args.measured - host.measured, rel=1e-6)
    assert offloaded.row("update (offloaded state on the device)").predicted > host.predicted
    with pytest.raises(KeyError):
        plain.row("host memory (offloaded)")


def test_nothing_offloaded_predicts_no_host_bytes():
    mesh = px.make_mesh(fsdp=8)
    state, batch = jax.eval_shape(fx.mlp_state), fx.mlp_batches(steps=1)[0]
    plain = read_setting(mesh, px.ZeRO(1, "fsdp"), state, batch)
    assert pm.offloaded_bytes(plain).value == 0 and pm.update_bytes(plain).value == 0
    one_device = read_setting(px.make_mesh(fsdp=1, devices=jax.devices()[:1]),
                              px.ZeRO(1, "fsdp", offload="params"), state, batch)
    totals = pm.state_bytes(one_device)  # one GPU: offload still moves the whole state
    assert pm.offloaded_bytes(one_device).value == (totals["parameters"].value
                                                    + totals["optimizer state"].value)
