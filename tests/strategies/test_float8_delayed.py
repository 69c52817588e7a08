"""px.Float8(delayed=True): the scale a step uses follows Transformer Engine's recipe from
the amaxes of the steps before it; the histories are model state that data parallel, FSDP
and tensor parallel carry exactly as one device does, and checkpoints keep; pinned errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from tests.fixtures import GPT_CONFIG, GPT_TX, gpt_batches
from tests.strategies.test_float8 import _delayed_reference
from tests.strategies.test_float8_step import _Net, _batches, _loss

DELAYED = px.Float8(delayed=True, amax_history_len=3)
E4M3, E5M2 = 448.0, 57344.0


def _linear_state():
    model = px.add_float8_histories(nnx.Linear(16, 8, rngs=nnx.Rngs(0)), DELAYED)
    return px.TrainState.create(model, optax.sgd(0.1))


def _linear_loss(model, batch):
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _step(mesh, strategy, loss=_linear_loss):
    @px.train_step(mesh, strategy, donate=False)
    def step(state, batch):
        value, grads = px.value_and_grad(loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": value}

    return step


def _cast(x, scale, top, dtype):
    return np.asarray(jnp.asarray(np.clip(x * scale, -top, top), jnp.float32).astype(dtype),
                      np.float32) / scale


def test_scale_used_at_each_step_follows_the_recipe_from_earlier_amaxes():
    mesh = px.make_mesh(devices=jax.devices()[:1], data=1)
    state = px.init(_linear_state, mesh, DELAYED)
    step = _step(mesh, DELAYED)
    rng = np.random.default_rng(1)
    history, scale = [[0.0] * 3 for _ in range(3)], [1.0, 1.0, 1.0]  # per column x, w, g
    for t in range(4):
        batch = {"x": rng.standard_normal((8, 16), np.float32) * (t + 1),
                 "y": rng.standard_normal((8, 8), np.float32)}
        w = np.asarray(state.model.kernel[...])
        b = np.asarray(state.model.bias[...])
        np.testing.assert_allclose(np.asarray(state.model.float8_scale[...]), scale, rtol=1e-6)
        # The step quantizes with the scale from the steps before it: its loss is the
        # written-out float8 forward's with those scales.
        y = _cast(batch["x"], scale[0], E4M3, jnp.float8_e4m3fn) @ \
            _cast(w, scale[1], E4M3, jnp.float8_e4m3fn) + b
        g = 2 * (y - batch["y"]) / y.size
        state, metrics = step(state, batch)
        assert float(metrics["loss"]) == pytest.approx(float(np.mean((y - batch["y"]) ** 2)),
                                                       rel=1e-5)
        # Then it records this step's amaxes and updates as TE's amax_and_scale_update.
        for col, (found, top) in enumerate([(np.abs(batch["x"]).max(), E4M3),
                                            (np.abs(w).max(), E4M3), (np.abs(g).max(), E5M2)]):
            history[col], scale[col] = _delayed_reference(
                [max(history[col][0], found)] + history[col][1:], scale[col], top, "max", 0.0)
        np.testing.assert_allclose(np.asarray(state.model.float8_history[...]),
                                   np.array(history).T, rtol=1e-5)
        assert float(state.model.float8_grad_amax[...]) == 0.0
    assert all(s != 1.0 for s in scale)  # every column's scale came from its history


def _net_state():
    model = px.add_float8_histories(_Net(nnx.Rngs(0)), DELAYED)
    return px.TrainState.create(model, optax.adam(1e-2))


def _states(mesh, strategy, batches):
    state = px.init(_net_state, mesh, strategy)
    step = _step(mesh, strategy, _loss)
    out = []
    for batch in batches:
        state, _ = step(state, batch)
        out.append(jax.device_get(nnx.state(state)))
    return out


@pytest.mark.parametrize("axes, parallel", [
    ({"data": 8}, px.DataParallel("data")),
    ({"fsdp": 8}, px.FSDP("fsdp")),
    ({"data": 4, "tensor": 2}, px.compose(  # explicit data axis, GSPMD tensor axis
        px.DataParallel("data"), px.TensorParallel("tensor", plan={"up": "colwise",
                                                                   "down": "rowwise"}))),
])
def test_delayed_under_data_parallel_fsdp_and_tp_equals_one_device_whole_state(axes, parallel):
    batches = _batches(steps=3)
    reference = _states(px.make_mesh(devices=jax.devices()[:1], data=1), DELAYED, batches)
    run = _states(px.make_mesh(**axes), px.compose(parallel, DELAYED), batches)
    for got, want in zip(run, reference):
        assert px.testing.relative_difference(got, want) <= 1e-5
        histories = [v for _, v in nnx.to_flat_state(want)
                     if isinstance(v, px.strategies.float8.Float8History)]
        assert len(histories) == 4  # two layers: history and scale each
    # The histories were written: both layers recorded three steps of x, w and g.
    flat = dict(nnx.to_flat_state(reference[-1]))
    recorded = np.asarray(flat[("rest", "up", "float8_history")][...])
    assert (recorded[1:] > 0).all()


def test_checkpoint_saves_and_restores_the_histories(tmp_path):
    """Saved on one device after 2 steps, restored into FSDP on 8: the histories come back,
    and the third step continues the uninterrupted run."""
    mesh = px.make_mesh(devices=jax.devices()[:1], data=1)
    batches = _batches(steps=3)
    uninterrupted = _states(mesh, DELAYED, batches)
    px.checkpoint.save(tmp_path, uninterrupted[1], step=2)
    fsdp, strategy = px.make_mesh(fsdp=8), px.compose(px.FSDP("fsdp"), DELAYED)
    restored = px.checkpoint.restore(tmp_path, like=_net_state, mesh=fsdp, strategy=strategy)
    assert restored.step == 2
    got = dict(nnx.to_flat_state(nnx.state(restored.state)))
    saved = dict(nnx.to_flat_state(uninterrupted[1]))
    for key in [("rest", "up", "float8_history"), ("rest", "down", "float8_scale")]:
        np.testing.assert_array_equal(np.asarray(got[key][...]), np.asarray(saved[key][...]))
    resumed, _ = _step(fsdp, strategy, _loss)(restored.state, batches[2])
    assert px.testing.relative_difference(jax.device_get(nnx.state(resumed)),
                                          uninterrupted[2]) <= 1e-5


def test_a_delayed_step_on_an_unprepared_model_names_the_call():
    mesh = px.make_mesh(devices=jax.devices()[:1], data=1)
    make = lambda: px.TrainState.create(_Net(nnx.Rngs(0)), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"px.Float8\(delayed=True\): layer 'down' \(Linear\) has "
                       r"no amax history.*call px.add_float8_histories\(model, strategy\) once "
                       r"after building the model, before px.TrainState.create"):
        _step(mesh, DELAYED, _loss)(px.init(make, mesh, DELAYED), _batches(steps=1)[0])


def test_bad_delayed_settings_are_refused():
    with pytest.raises(ValueError, match=r"px.Float8: fsdp_float8_gather=True needs current "
                       r"scaling.*Set fsdp_float8_gather=False, or delayed=False"):
        px.Float8(delayed=True, fsdp_float8_gather=True)
    with pytest.raises(ValueError, match=r"px.add_float8_histories: DataParallel\('data'\) "
                       r"holds no px.Float8"):
        px.add_float8_histories(_Net(nnx.Rngs(0)), px.DataParallel())


def test_delayed_with_micro_batches_is_refused():
    mesh = px.make_mesh(devices=jax.devices()[:1], data=1)
    strategy = px.compose(px.GradientAccumulation(2), DELAYED)
    with pytest.raises(ValueError, match=r"px.value_and_grad: the model holds state its "
                       r"backward pass writes \(down.float8_grad_amax.*2 micro-batches would "
                       r"split that step. Use microbatches=None"):
        _step(mesh, strategy, _loss)(px.init(_net_state, mesh, strategy), _batches(steps=1)[0])


def test_stacked_layers_get_one_history_per_layer():
    stacked = nnx.vmap(lambda r: nnx.Linear(4, 4, rngs=r))(nnx.Rngs(0).split(2))
    px.add_float8_histories(stacked, DELAYED)
    assert stacked.float8_history.shape == (2, 3, 3) and stacked.float8_scale.shape == (2, 3)
    assert stacked.float8_grad_amax.shape == (2,)


def _gpt_delayed_state():
    model = px.models.GPT(GPT_CONFIG, rngs=nnx.Rngs(0))
    return px.TrainState.create(px.add_float8_histories(model, DELAYED), GPT_TX)


@pytest.mark.slow
def test_gpt_tiny_scanned_blocks_keep_per_layer_histories_and_fsdp_equals_one_device():
    """px.models.GPT's blocks are nnx.vmap-stacked and run by nnx.scan:
    each layer's slice of the stacked history is its own, and FSDP's whole state is one
    device's."""
    batches = gpt_batches(2, batch=8)

    def states(mesh, strategy):
        state, step, out = px.init(_gpt_delayed_state, mesh, strategy), \
            _step(mesh, strategy, px.models.next_token_loss), []
        for batch in batches:
            state, _ = step(state, batch)
            out.append(jax.device_get(nnx.state(state)))
        return out

    reference = states(px.make_mesh(devices=jax.devices()[:1], data=1), DELAYED)
    run = states(px.make_mesh(fsdp=8), px.compose(px.FSDP("fsdp"), DELAYED))
    for got, want in zip(run, reference):
        assert px.testing.relative_difference(got, want) <= 1e-5
    flat = dict(nnx.to_flat_state(reference[-1]))
    history = np.asarray(flat[("rest", "blocks", "mlp", "fc", "float8_history")][...])
    assert history.shape == (GPT_CONFIG.num_layers, 3, 3)
    recorded = history[:, -2:]  # the two steps' amaxes of x, w, g, for each layer
    assert (recorded > 0).all() and not np.allclose(recorded[0], recorded[1])
