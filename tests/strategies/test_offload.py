"""ZeRO-Offload (``px.ZeRO(..., offload=...)``): the same training as without offload, the
offloaded state in pinned host memory between steps, the transfers in the program."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import fixtures as fx
import parallax as px
from parallax import layout
from parallax.testing import relative_difference

from byom.stock import key_data

STEPS = 3
HOST = "pinned_host"


class StockNet(nnx.Module):
    """Stock Flax layers only: Linear, BatchNorm (statistics) and Dropout (an RNG counter)."""

    def __init__(self, *, rngs):
        self.lin = nnx.Linear(16, 32, rngs=rngs)
        self.bn = nnx.BatchNorm(32, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(self.bn(self.lin(x))))


def stock_state():
    return px.TrainState.create(StockNet(rngs=nnx.Rngs(0)), optax.adam(1e-2))


def stock_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def step_for(mesh, strategy, loss_fn):
    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(loss_fn)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}
    return step


def functional_step(mesh, strategy):
    @px.train_step(mesh, strategy)
    def step(state, batch):
        params, opt_state = state
        loss, grads = px.value_and_grad(fx.functional_mlp_loss)(params, batch)
        updates, opt_state = fx.FUNCTIONAL_TX.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), {"loss": loss}
    return step


CASES = {  # name -> (mesh axes, strategy without offload, make_state, step maker)
    "zero1-optimizer": ({"fsdp": 8}, lambda o: px.ZeRO(1, "fsdp", offload=o), "optimizer",
                        fx.mlp_state, lambda m, s: step_for(m, s, px.models.mse_loss)),
    "zero3-params": ({"fsdp": 8}, lambda o: px.ZeRO(3, "fsdp", offload=o), "params",
                     fx.mlp_state, lambda m, s: step_for(m, s, px.models.mse_loss)),
    "hsdp-params-stock": ({"data": 2, "fsdp": 4}, lambda o: px.HSDP(offload=o), "params",
                          stock_state, lambda m, s: step_for(m, s, stock_loss)),
    "zero2-optimizer-functional": ({"fsdp": 8}, lambda o: px.ZeRO(2, "fsdp", offload=o),
                                   "optimizer", fx.functional_mlp_state, functional_step),
}


def memory_kinds(state):
    return [x.sharding.memory_kind for x in jax.tree.leaves(state)]


def expected_kinds(state, strategy, mesh):
    return layout.state_layout(state, strategy, mesh, "test").memory_kinds


def both_runs(name):
    """Both runs of one case, the whole state after each step, and the offloaded program."""
    axes, strategy_of, offload, make_state, make_step = CASES[name]
    mesh = px.make_mesh(**axes)
    plain, offloaded = strategy_of(None), strategy_of(offload)
    out = {}
    for key, strategy in (("plain", plain), ("offloaded", offloaded)):
        state, step = px.init(make_state, mesh, strategy), make_step(mesh, strategy)
        states, kinds = [], [memory_kinds(state)]
        for batch in fx.mlp_batches(steps=STEPS, batch=16):
            state, _ = step(state, batch)
            states.append(key_data(jax.device_get(state)))
            kinds.append(memory_kinds(state))
        out[key] = (state, states, kinds, step)
    return offload, mesh, offloaded, out


@pytest.mark.parametrize("name", [
    "zero1-optimizer",
    pytest.param("zero3-params", marks=pytest.mark.slow),
    pytest.param("hsdp-params-stock", marks=pytest.mark.slow),
    pytest.param("zero2-optimizer-functional", marks=pytest.mark.slow),
])
def test_offload_trains_alike_keeps_state_on_the_host_and_moves_it_in_the_program(name):
    """One pair of runs per case (compiling dominates) checks the three promises."""
    offload, mesh, strategy, out = both_runs(name)
    every_step_equals_the_same_strategy_without_offload(out)
    offloaded_leaves_live_in_pinned_host_memory_between_steps(offload, mesh, strategy, out)
    the_compiled_program_moves_offloaded_leaves_in_and_out(out)


def every_step_equals_the_same_strategy_without_offload(out):
    for step, (got, want) in enumerate(zip(out["offloaded"][1], out["plain"][1]), 1):
        worst = relative_difference(got, want)
        assert worst <= 1e-6, f"step {step}: whole state {worst:.2e} apart"


def offloaded_leaves_live_in_pinned_host_memory_between_steps(offload, mesh, strategy, out):
    state, _, kinds, _ = out["offloaded"]
    lays = layout.state_layout(state, strategy, mesh, "test")
    hosted = {"optimizer": {"opt"}, "params": {"opt", "param"}}[offload]
    want = [HOST if role in hosted else "device" for role in lays.roles]
    assert HOST in want and "device" in want  # counters and statistics stay on the device
    for when in kinds:  # after px.init and after every step
        assert when == want
    assert all(k == "device" for k in out["plain"][2][-1])


def the_compiled_program_moves_offloaded_leaves_in_and_out(out):
    """Host memory space ``S(5)`` on exactly the offloaded parameters and results of the CPU
    program, and in the GPU lowering one placement to the device and one to the host per
    offloaded leaf."""
    state, _, _, step = out["offloaded"]
    batch = fx.mlp_batches(steps=1, batch=16)[0]
    compiled = step.lower(state, batch).compile()
    hosted = sum(k == HOST for k in memory_kinds(state))
    kinds = [s.memory_kind for s in jax.tree.leaves(compiled.input_shardings[0][0])]
    assert kinds == memory_kinds(state)
    layout_line = next(line for line in compiled.as_text().splitlines()
                       if "entry_computation_layout" in line)
    params, results = layout_line.split("entry_computation_layout={(", 1)[1].split(")->", 1)
    assert params.count("S(5)") == hosted and results.count("S(5)") == hosted
    gpu = step.lower(state, batch, platforms=("cuda",)).as_text()
    placements = re.findall(r'_xla_buffer_placement = "(\w+)"', gpu)
    assert placements.count("device") == hosted and placements.count("pinned_host") == hosted


def test_a_user_step_reading_the_offloaded_optimizer_state_is_told_what_to_do():
    mesh = px.make_mesh(fsdp=8)
    strategy = px.ZeRO(1, "fsdp", offload="optimizer")

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)
        first_moment = jax.tree.leaves(state.opt_state)[1]  # mu of the first parameter
        return state.apply_gradients(grads), {"loss": loss,
                                              "next": first_moment + jax.tree.leaves(grads)[0]}

    state = px.init(fx.mlp_state, mesh, strategy)
    with pytest.raises(ValueError, match=r"px\.train_step: the step computed with a value held "
                       r"in host memory .*parallax\.host_memory\.to_device\(state\.opt_state\)"):
        step(state, fx.mlp_batches(steps=1)[0])


@pytest.mark.parametrize("offload, error, message", [
    ("gpu", ValueError, r"px\.ZeRO: offload='gpu' must be one of \('optimizer', 'params'\)"),
    (True, TypeError, r"px\.ZeRO: offload must be one of \('optimizer', 'params'\) or None, "
                      r"got bool True"),
])
def test_a_bad_offload_is_refused_by_name(offload, error, message):
    with pytest.raises(error, match=message):
        px.ZeRO(1, "fsdp", offload=offload)


def test_names_and_composition():
    assert px.ZeRO(1, "fsdp", offload="optimizer").name == "ZeRO(1, 'fsdp', offload='optimizer')"
    assert px.FSDP(offload="params").zero.memory_kind("param") == HOST
    assert px.ZeRO(2, "fsdp").zero.memory_kind("opt") is None
    assert px.ZeRO(1, "fsdp", offload="optimizer").zero.memory_kind("param") is None
    composed = px.compose(px.ZeRO(1, "fsdp", offload="optimizer"), px.TensorParallel("tensor"))
    assert composed.zero.memory_kind("opt") == HOST


@pytest.mark.slow
def test_checkpoint_restores_offloaded_state_into_host_memory(tmp_path):
    mesh = px.make_mesh(fsdp=8)
    strategy = px.ZeRO(3, "fsdp", offload="params")
    step = step_for(mesh, strategy, px.models.mse_loss)
    state, _ = step(px.init(fx.mlp_state, mesh, strategy), fx.mlp_batches(steps=1)[0])
    px.checkpoint.save(tmp_path, state, step=1)
    restored = px.checkpoint.restore(tmp_path, like=fx.mlp_state, mesh=mesh,
                                     strategy=strategy).state
    assert memory_kinds(restored) == memory_kinds(state)
    assert HOST in memory_kinds(restored)
    assert relative_difference(jax.device_get(restored), jax.device_get(state)) == 0.0
    plain = px.checkpoint.restore(tmp_path, like=fx.mlp_state, mesh=mesh,
                                  strategy=px.ZeRO(3, "fsdp")).state  # without offload
    assert set(memory_kinds(plain)) == {"device"}
    continued, _ = step(restored, fx.mlp_batches(steps=2)[1])
    assert np.all(np.isfinite(np.asarray(jax.tree.leaves(continued.params)[0])))


def test_px_shard_moves_a_state_into_host_memory():
    mesh = px.make_mesh(fsdp=8)
    strategy = px.ZeRO(1, "fsdp", offload="optimizer")
    state = px.shard(fx.mlp_state(), mesh, strategy)
    assert memory_kinds(state) == [HOST if k == HOST else "device"
                                   for k in expected_kinds(state, strategy, mesh)]


def test_a_backend_without_pinned_host_memory_is_named():
    class Memory:
        kind = "device"

    class Device:
        platform, process_index = "tpu", 0

        def addressable_memories(self):
            return [Memory()]

    class Mesh:
        devices = np.array([Device()])

    check = px.ZeRO(1, "fsdp", offload="optimizer").model_hooks.layout_checks[0]
    with pytest.raises(ValueError, match=r"px\.init: px\.ZeRO\(offload='optimizer'\) keeps state "
                       r"in 'pinned_host' memory, but the mesh's tpu devices have only "
                       r"\['device'\]; drop offload="):
        check([], Mesh(), api="px.init", prefix=(), model=None)
