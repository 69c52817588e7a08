"""When hvd.DistributedOptimizer steps with backward_passes_per_step=k: after k passes by
default (Horovod's TensorFlow optimizer: ``apply_gradients`` is a no-op until its counter
reaches k), or when ``update(..., step=True)`` says so (Horovod's torch optimizer: ``step()``
all-reduces and applies the passes so far, however many; more than k passes before a step
are refused). Checked on 8 ranks inside @hvd.jit and eagerly against one device computing
Horovod's numbers: parameters, the wrapped optimizer's state and the accumulated sum after
every pass."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import parallax.horovod as hvd
from tests.horovod.test_optimizer import data, init_params, loss_fn

TX = optax.sgd(0.1, momentum=0.9)
STEPS = [True, False, True, False, False, True]  # after 1 pass, after 2, after 3 (k = 3)
K = 3


def horovods_numbers(batches):
    """Horovod's torch optimizer on one device: each step applies the (rank-averaged) sum of
    the passes since the last step; params and momentum after every pass."""
    params, state, total, history = init_params(), TX.init(init_params()), None, []
    grad = jax.jit(jax.grad(loss_fn))
    for batch, step in zip(batches, STEPS):
        g = grad(params, batch)
        total = g if total is None else jax.tree.map(jnp.add, total, g)
        if step:
            updates, state = TX.update(total, state, params)
            params, total = optax.apply_updates(params, updates), None
        history.append((params, state))
    return history


def assert_same(history, got):
    for (want_params, want_state), (params, state) in zip(history, got, strict=True):
        for a, b in zip(jax.tree.leaves((want_params, want_state)),
                        jax.tree.leaves((params, state.inner))):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)


def test_step_true_applies_the_passes_so_far_inside_a_program():
    batches = data(steps=len(STEPS))
    tx = hvd.DistributedOptimizer(TX, backward_passes_per_step=K)

    @hvd.jit
    def step(params, state, stepping, batch):  # stepping: a Python bool, compiled per value
        grads = jax.grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params, step=stepping)
        return optax.apply_updates(params, updates), state

    params, state, got = init_params(), tx.init(init_params()), []
    for batch, stepping in zip(batches, STEPS):
        params, state = step(params, state, stepping, batch)
        got.append((params, state))
        assert int(state.count) == (0 if stepping else got[-2][1].count + 1)
    assert_same(horovods_numbers(batches), got)


def test_step_true_applies_the_passes_so_far_eagerly():
    batches = data(steps=len(STEPS))
    tx = hvd.DistributedOptimizer(TX, backward_passes_per_step=K)
    grad = jax.jit(jax.grad(loss_fn))
    params, state, got = init_params(), tx.init(init_params()), []
    for batch, stepping in zip(batches, STEPS):
        updates, state = tx.update(grad(params, batch), state, params, step=stepping)
        params = optax.apply_updates(params, updates)
        got.append((params, state))
    assert_same(horovods_numbers(batches), got)


def test_by_default_the_kth_pass_steps_as_horovods_tensorflow_optimizer():
    tx = hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=2)
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    first, state = tx.update({"w": jnp.ones(2)}, state, params)  # apply_gradients: a no-op
    second, state = tx.update({"w": jnp.ones(2)}, state, params)
    assert first["w"].tolist() == [0.0, 0.0]
    np.testing.assert_allclose(second["w"], [-0.2, -0.2], rtol=1e-6)


def test_more_passes_than_k_before_a_step_are_refused():
    tx = hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=2)
    params = {"w": jnp.ones(2)}
    message = ("hvd.DistributedOptimizer: more than backward_passes_per_step=2 backward passes "
               "(update calls with step=False) before a step, which Horovod's torch optimizer "
               "refuses too. Pass step=True on the pass that ends the step")
    state = tx.init(params)
    for _ in range(2):
        _, state = tx.update({"w": jnp.ones(2)}, state, params, step=False)
    with pytest.raises(ValueError, match=re.escape(message)):
        tx.update({"w": jnp.ones(2)}, state, params, step=True)

    @hvd.jit
    def three_passes(params, batch):
        state = tx.init(params)
        for _ in range(3):
            _, state = tx.update({"w": batch[0]}, state, params, step=False)
        return state.count

    with pytest.raises(Exception, match=re.escape(message)):  # raised by the host callback
        jax.block_until_ready(three_passes(params, np.ones((8, 2), np.float32)))
    _forget_the_failed_callback()


def _forget_the_failed_callback():
    """JAX keeps a failed host callback's error in its per-device runtime tokens and raises it
    again at every later ``jax.effects_barrier()`` (the profiler's, a checkpoint's, exit's)
    until another program with a host callback runs on those devices; run one, so that the
    tests after this one in the same process start clean."""
    mesh = jax.make_mesh((jax.device_count(),), ("all",))
    ones = jax.device_put(np.ones(jax.device_count(), np.float32),
                          jax.NamedSharding(mesh, jax.P("all")))
    unchanged = jax.jit(lambda x: jax.pure_callback(
        np.asarray, jax.ShapeDtypeStruct(x.shape, x.dtype), x))
    jax.block_until_ready(unchanged(ones))  # a program on every device, with a host callback
    jax.effects_barrier()


def test_step_errors_are_named():
    params = {"w": jnp.ones(2)}
    tx = hvd.DistributedOptimizer(optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"step=False with backward_passes_per_step=1: each "
                                         r"update call is one backward pass"):
        tx.update({"w": jnp.ones(2)}, tx.init(params), params, step=False)
    updates, _ = tx.update({"w": jnp.ones(2)}, tx.init(params), params, step=True)
    np.testing.assert_allclose(updates["w"], [-0.1, -0.1], rtol=1e-6)
    with pytest.raises(TypeError, match=r"step must be None \(step every "
                                        r"backward_passes_per_step passes\), True or False, "
                                        r"got str: 'yes'"):
        tx.update({"w": jnp.ones(2)}, tx.init(params), params, step="yes")
