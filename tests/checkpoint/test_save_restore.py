"""Save and restore round trips: NNX and functional states, extra, layouts, the Manager."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fixtures as fx
import parallax as px

from .ckpt_testing import assert_bitwise, host


def mlp_state():
    return px.TrainState.create(px.models.MLP(4, [8], 4, rngs=nnx.Rngs(0)), optax.adam(1e-2))


BATCH = {"x": np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4),
         "y": np.linspace(1, -1, 32, dtype=np.float32).reshape(8, 4)}


@pytest.fixture(scope="module")
def hsdp():
    mesh, strategy = px.make_mesh(data=2, fsdp=4), px.HSDP("data", "fsdp")
    state, _ = fx.mlp_step(mesh, strategy)(px.init(mlp_state, mesh, strategy), BATCH)
    return mesh, strategy, state


def test_nnx_state_round_trip_keeps_values_and_layout(hsdp, tmp_path):
    mesh, strategy, state = hsdp
    px.checkpoint.save(tmp_path, state, step=1)
    for like in (mlp_state, jax.eval_shape(mlp_state), state):  # function, abstract, concrete
        restored = px.checkpoint.restore(tmp_path, like=like, mesh=mesh, strategy=strategy)
        assert_bitwise(restored.state, state)
        for got, want in zip(jax.tree.leaves(restored.state), jax.tree.leaves(state)):
            assert got.sharding == want.sharding
        assert restored.state.graphdef == state.graphdef and restored.extra == {}
    single = px.checkpoint.restore(tmp_path, like=mlp_state).state  # one device, no mesh
    assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(single))
    assert_bitwise(single, state)


def test_functional_state_round_trip_under_another_strategy(tmp_path):
    mesh = px.make_mesh(fsdp=8)
    state = px.init(fx.functional_mlp_state, mesh, px.ZeRO(3, "fsdp"))
    px.checkpoint.save(tmp_path, state, step=0)
    mesh2 = px.make_mesh(data=4, devices=jax.devices()[:4])
    params, opt_state = px.checkpoint.restore(
        tmp_path, like=fx.functional_mlp_state, mesh=mesh2, strategy=px.ZeRO(1, "data")).state
    assert_bitwise((params, opt_state), state)
    assert params["w1"].sharding.spec == jax.P()                       # ZeRO 1: params whole,
    assert opt_state[0].mu["w1"].sharding.spec == jax.P(None, "data")  # moments sharded
    assert opt_state[0].mu["w1"].sharding.mesh == mesh2


def test_extra_round_trips_what_a_resume_needs(tmp_path):
    generator = np.random.default_rng(7)
    generator.standard_normal(5)
    extra = {"position": 12, "rng": generator.bit_generator.state, "key": jax.random.key(3),
             "keys": jax.random.split(jax.random.key(1), 2), "lr": 0.1 + 0.2,
             "counts": np.arange(6, dtype=np.int16).reshape(2, 3), "mean": np.float32(0.25),
             "device": jnp.ones(2, jnp.bfloat16), "tags": ["a", None, True], "nested": {"t": (1, 2)}}
    px.checkpoint.save(tmp_path, {"w": np.ones(3, np.float32)}, step=3, extra=extra)
    back = px.checkpoint.restore(tmp_path, like={"w": jax.ShapeDtypeStruct((3,), jnp.float32)}).extra
    resumed = np.random.default_rng()
    resumed.bit_generator.state = back["rng"]
    np.testing.assert_array_equal(resumed.standard_normal(4), generator.standard_normal(4))
    assert back["position"] == 12 and back["lr"] == 0.1 + 0.2 and back["tags"] == ["a", None, True]
    assert back["nested"] == {"t": [1, 2]}  # JSON: tuples come back as lists
    for name in ("key", "keys"):
        assert jax.random.key_impl(back[name]) == jax.random.key_impl(extra[name])
        np.testing.assert_array_equal(jax.random.key_data(back[name]),
                                      jax.random.key_data(extra[name]))
    for name in ("counts", "mean", "device"):
        got, want = back[name], np.asarray(extra[name])
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow
def test_manager_saves_every_few_steps_keeps_the_newest_and_restores(tmp_path):
    mesh, strategy = px.make_mesh(data=8), px.DataParallel("data")
    step = fx.mlp_step(mesh, strategy)
    state = px.init(mlp_state, mesh, strategy)
    saved = {}
    with px.checkpoint.Manager(tmp_path, max_to_keep=2, save_every=2) as manager:
        for i in range(1, 8):
            state, _ = step(state, BATCH)
            if manager.save(i, state, extra={"next_batch": i}):
                saved[i] = host(state)  # the state the asynchronous save was handed
        assert sorted(saved) == [2, 4, 6]
        assert not manager.save(6, state, force=False)  # not newer than the latest
        manager.wait()
        assert manager.all_steps() == [4, 6] and manager.latest_step() == 6
        latest = manager.restore(like=mlp_state, mesh=mesh, strategy=strategy)
        older = manager.restore(like=mlp_state, mesh=mesh, strategy=strategy, step=4)
        assert manager.save(7, state, force=True)  # off the schedule, on request
    assert latest.step == 6 and latest.extra == {"next_batch": 6} and older.step == 4
    # The donating steps that ran while a save was being written did not change what it wrote.
    assert_bitwise(latest.state, saved[6])
    assert_bitwise(older.state, saved[4])
    assert px.checkpoint.Manager(tmp_path).all_steps() == [6, 7]
    assert "save_every=2" in repr(manager)


def test_typed_prng_keys_in_the_state_round_trip(tmp_path):
    # NNX models that own an nnx.Rngs keep typed key arrays in their non-trained state.
    state = {"params": {"w": jnp.arange(4.0)}, "rngs": jax.random.split(jax.random.key(5), 8)}
    mesh = px.make_mesh(data=8)
    state = px.shard(state, mesh, px.DataParallel("data"))
    px.checkpoint.save(tmp_path, state, step=1)
    back = px.checkpoint.restore(tmp_path, like=state, mesh=mesh,
                                 strategy=px.DataParallel("data")).state
    assert jax.dtypes.issubdtype(back["rngs"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(back["rngs"]),
                                  jax.random.key_data(state["rngs"]))
    np.testing.assert_array_equal(back["params"]["w"], state["params"]["w"])
