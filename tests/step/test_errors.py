"""Bad input is caught at the API boundary, with messages that say what and how to fix."""

import fixtures as fx
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px


def mse_step(mesh, strategy, microbatches=None):
    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.mse_loss, microbatches=microbatches)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    return step


def test_indivisible_parameter_dimension_names_the_path():
    mesh = px.make_mesh(data=2, tensor=4)
    make = lambda: px.TrainState.create(px.models.MLP(16, [30], 16, rngs=nnx.Rngs(0)), optax.sgd(0.1))
    with pytest.raises(
        ValueError,
        match=r"px.init: cannot shard \.params\['layers'\]\[0\]\['bias'\]\.value of shape \(30,\): "
        r"dimension 0 \('mlp', size 30\) maps to mesh axes tensor=4 \(4 shards\), and 30 is not "
        r"divisible by 4. Fix: make that dimension a multiple of 4 \(pad it\), or map 'mlp' to None",
    ):
        px.init(make, mesh, px.Strategy(name="rules only", rules=(("mlp", "tensor"),)))
    # px.TensorParallel adds Megatron's check, which answers first with its own fix.
    with pytest.raises(ValueError, match=r"px.init: \.params\['layers'\]\[0\]\['bias'\] has "
                       r"shape \(30,\): its 'mlp' dimension 0 has 30 entries, which do not split "
                       r"over the tensor axis tensor=4. Fix: use an MLP width"):
        px.init(make, mesh, px.TensorParallel("tensor"))


def test_batch_not_divisible_by_the_data_axes():
    mesh = px.make_mesh(data=2, fsdp=4)
    strategy = px.HSDP()
    state = px.init(fx.mlp_state, mesh, strategy)
    batch = {"x": np.ones((12, 16), np.float32), "y": np.ones((12, 16), np.float32)}
    with pytest.raises(
        ValueError,
        match=r"px.train_step: the batch leaf \['x'\] has shape \(12, 16\): its leading \(batch\) "
        r"dimension 12 is not divisible by the 8 batch shards \(data=2 x fsdp=4\) of "
        r"DataParallel\('data'\) \+ ZeRO\(3, 'fsdp'\) on the mesh data=2 x fsdp=4 \(8 cpu devices\); "
        r"use a batch size that is a multiple of 8",
    ):
        mse_step(mesh, strategy)(state, batch)
    # Nothing was donated: the state is still usable.
    assert np.isfinite(np.asarray(state.params["layers"][0]["kernel"][...])).all()


def test_microbatches_not_dividing_the_batch():
    mesh = px.make_mesh(data=8)
    strategy = px.DataParallel("data")
    state = px.init(fx.mlp_state, mesh, strategy)
    batch = fx.mlp_batches(steps=1, batch=16)[0]
    with pytest.raises(
        ValueError,
        match=r"px.value_and_grad: microbatches=3 does not divide the batch: leaf \['x'\] has 16 "
        r"examples \(2 per device over 8 batch shards\); use a batch size that is a multiple of 24, "
        r"or a number of micro-batches that divides 2",
    ):
        mse_step(mesh, strategy, microbatches=3)(state, batch)


def test_microbatches_without_a_mesh():
    with pytest.raises(ValueError, match=r"microbatches=3 does not divide the batch: leaf \['x'\] has 8 examples;"):
        px.value_and_grad(lambda w, b: jnp.mean(b["x"] @ w), microbatches=3)(jnp.ones(2), {"x": jnp.ones((8, 2))})


def test_scalar_batch_leaf():
    mesh = px.make_mesh(data=8)
    with pytest.raises(ValueError, match=r"the batch leaf \['lr'\] is a scalar; every batch leaf needs a leading batch dimension"):
        mse_step(mesh, px.DataParallel())({"w": jnp.ones(3)}, {"lr": jnp.float32(0.1)})


def test_step_must_return_state_and_metrics():
    mesh = px.make_mesh(data=8)

    @px.train_step(mesh, px.DataParallel(), donate=False)
    def bad(state, batch):
        return state

    with pytest.raises(TypeError, match=r"px.train_step: bad must return \(state, metrics\); it returned dict"):
        bad({"w": jnp.ones(3)}, {"x": jnp.ones((8, 3))})

    @px.train_step(mesh, px.DataParallel(), donate=False)
    def changes_structure(state, batch):
        return {"w": state["w"], "extra": state["w"]}, {}

    with pytest.raises(TypeError, match=r"the state returned by the step has a different structure"):
        changes_structure({"w": jnp.ones(3)}, {"x": jnp.ones((8, 3))})


def test_wrong_kinds_of_arguments():
    with pytest.raises(TypeError, match=r"px.train_step: mesh must be a jax.sharding.Mesh"):
        px.train_step({"data": 8}, px.DataParallel())
    with pytest.raises(TypeError, match=r"px.init: strategy must be a px.Strategy"):
        px.init(fx.mlp_state, px.make_mesh(data=8), "dp")


def test_microbatches_twice():
    mesh = px.make_mesh(data=8)
    strategy = px.compose(px.DataParallel(), px.GradientAccumulation(2))
    state = px.init(fx.mlp_state, mesh, strategy)
    with pytest.raises(ValueError, match=r"microbatches=2 was given, but the strategy .* already decides"):
        mse_step(mesh, strategy, microbatches=2)(state, fx.mlp_batches(1)[0])
