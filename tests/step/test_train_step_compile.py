"""``TrainStep.compile``: the program compiled for inspection is the one the calls run."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import parallax as px


def _setup():
    mesh, strategy = px.make_mesh(data=-1), px.DataParallel("data")
    state = px.init(lambda: px.TrainState.create(
        nnx.Linear(4, 2, rngs=nnx.Rngs(0)), optax.adam(0.1)), mesh, strategy)
    traces = []

    @px.train_step(mesh, strategy)
    def step(state, batch):
        traces.append(jax.tree.map(jnp.shape, batch))
        loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    return mesh, strategy, state, step, traces


def _batch(rows, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(rows, 4)).astype(np.float32),
            "y": rng.normal(size=(rows, 2)).astype(np.float32)}


def test_compile_then_calls_trace_and_compile_once_and_match_plain_calls():
    *_, state, step, traces = _setup()
    compiled = step.compile(state, _batch(16))
    assert compiled.memory_analysis() is not None
    assert len(traces) == 1
    for i in range(3):
        state, metrics = step(state, _batch(16, i))
    assert len(traces) == 1  # the calls ran the compiled program: no second trace

    *_, plain_state, plain_step, _ = _setup()
    for i in range(3):
        plain_state, plain_metrics = plain_step(plain_state, _batch(16, i))
    assert float(metrics["loss"]) == float(plain_metrics["loss"])
    jax.tree.map(np.testing.assert_array_equal, nnx.state(state.model),
                 nnx.state(plain_state.model))


def test_a_call_that_does_not_fit_the_compiled_program_takes_jits_path():
    *_, state, step, traces = _setup()
    step.compile(state, _batch(16))
    state, _ = step(state, _batch(8))  # another batch size: traced and compiled by jit
    assert [t["x"] for t in traces] == [(16, 4), (8, 4)]
    state, _ = step(state, _batch(16))  # back to the compiled program's shapes
    assert len(traces) == 2
