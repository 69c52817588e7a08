"""A GPT trained with DP x FSDP x TP on 8 devices, restored under other meshes and strategies.

Each restored state sits exactly in its strategy's layout (asserted leaf by leaf: Orbax
silently restoring the saved layout when the target sharding is lost is flax issue 5110)
and continues training to the losses of the uninterrupted run: bitwise on the same mesh and
strategy, within 1e-6 elsewhere.
"""

import jax
import numpy as np
import pytest

import fixtures as fx
import parallax as px

from .ckpt_testing import GPT_LOSS, STAGES_LOSS, assert_bitwise, assert_layout, run, stepper

SAVED_AT, MORE = 2, 2
DP_FSDP_TP = px.compose(px.DataParallel("data"), px.FSDP("fsdp"), px.TensorParallel("tensor"))
TARGETS = {
    "pp2-dp2-on-4": (dict(stage=2, data=2), 4,
                     px.compose(px.DataParallel("data"),
                                px.Pipeline("stage", microbatches=2, schedule="1f1b")),
                     STAGES_LOSS),
    "zero1-on-2": (dict(fsdp=2), 2, px.ZeRO(1, "fsdp"), GPT_LOSS),
    "one-device": (None, 1, None, GPT_LOSS),
}


def train_and_save(directory):
    """The uninterrupted run: 2 steps, save, 2 more; its losses after the save."""
    data = fx.gpt_batches(SAVED_AT + MORE, batch=8)
    mesh = px.make_mesh(data=2, fsdp=2, tensor=2)
    step = stepper(mesh, DP_FSDP_TP, GPT_LOSS)
    state, _ = run(step, px.init(fx.gpt_state, mesh, DP_FSDP_TP), data[:SAVED_AT])
    px.checkpoint.save(directory, state, step=SAVED_AT, extra={"next_batch": SAVED_AT})
    state, losses = run(step, state, data[SAVED_AT:])
    return data, mesh, step, losses, state


@pytest.mark.slow
def test_restore_matrix(tmp_path):
    """One test (one xdist worker): the uninterrupted run is trained once for every target."""
    data, mesh, step, losses, final = train_and_save(tmp_path)

    # The same mesh and strategy: bitwise.
    restored = px.checkpoint.restore(tmp_path, like=fx.gpt_state, mesh=mesh, strategy=DP_FSDP_TP)
    assert restored.step == SAVED_AT and restored.extra == {"next_batch": SAVED_AT}
    assert_layout(restored.state, mesh, DP_FSDP_TP)
    state, resumed = run(step, restored.state, data[restored.extra["next_batch"]:])
    np.testing.assert_array_equal(resumed, losses)
    assert_bitwise(state.params, final.params)

    # Other meshes and strategies: the target layout, leaf by leaf, and the same losses.
    for target, (axes, count, strategy, loss_fn) in TARGETS.items():
        mesh = px.make_mesh(**axes, devices=jax.devices()[:count]) if axes else None
        restored = px.checkpoint.restore(tmp_path, like=fx.gpt_state, mesh=mesh,
                                         strategy=strategy)
        assert_layout(restored.state, mesh, strategy)
        kernel = restored.state.params["blocks"]["mlp"]["fc"]["kernel"][...]
        assert len(kernel.sharding.device_set) == count, target
        _, resumed = run(stepper(mesh, strategy, loss_fn), restored.state, data[SAVED_AT:])
        np.testing.assert_allclose(resumed, losses, rtol=1e-6, atol=0, err_msg=target)
