"""Distributed autograd against jax.grad of the same computation in one process (1e-6), and
DistributedOptimizer against optax in one process, step by step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rpc import rpc_testing as t

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_cluster")]
T = 120  # seconds: a worker's first jax call compiles, slow on a loaded 2-core machine
RTOL = 1e-6


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype(np.float32)
    target = rng.normal(size=(8, 2)).astype(np.float32)
    w1 = (rng.normal(size=(4, 3)) / 2).astype(np.float32)
    w2 = (rng.normal(size=(3, 2)) / 2).astype(np.float32)
    return x, target, w1, w2


def two_layer_loss(params, x, target):
    return t.squared_error(jnp.tanh(jnp.tanh(x @ params["w1"]) @ params["w2"]), target)


def test_a_pipeline_of_two_workers_matches_jax_grad(group):
    rpc, dist_autograd = group, group.dist_autograd
    x, target, w1, w2 = data()
    r1 = rpc.remote("w1", np.asarray, args=(w1,), timeout=T)
    r2 = rpc.remote("w2", np.asarray, args=(w2,), timeout=T)
    with dist_autograd.context() as ctx:
        h = rpc.rpc_sync("w1", t.layer, args=(r1, x), timeout=T)
        y = rpc.rpc_sync("w2", t.layer, args=(r2, h), timeout=T)
        loss = rpc.rpc_sync("driver", t.squared_error, args=(y, target), timeout=T)
        dist_autograd.backward(ctx, [loss])
        g1 = rpc.rpc_sync("w1", dist_autograd.get_gradients, args=(ctx,), timeout=T)
        g2 = rpc.rpc_sync("w2", dist_autograd.get_gradients, args=(ctx,), timeout=T)
    want_loss, want = jax.value_and_grad(two_layer_loss)({"w1": w1, "w2": w2}, x, target)
    np.testing.assert_allclose(loss, want_loss, rtol=RTOL)
    assert list(g1) == [r1] and list(g2) == [r2]
    np.testing.assert_allclose(g1[r1], want["w1"], rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(g2[r2], want["w2"], rtol=RTOL, atol=1e-7)


def test_a_parameter_used_on_two_workers_gets_the_sum(group):
    rpc, dist_autograd = group, group.dist_autograd
    x, target, w1, _ = data()
    square = np.linalg.qr(np.random.default_rng(1).normal(size=(4, 4)))[0].astype(np.float32)
    shared = rpc.remote("w1", np.asarray, args=(square,), timeout=T)  # owned by w1
    with dist_autograd.context() as ctx:
        a = rpc.rpc_sync("w1", t.layer, args=(shared, x), timeout=T)  # read where it lives
        b = rpc.rpc_sync("w3", t.layer_from, args=(shared, a), timeout=T)  # fetched by w3
        loss = rpc.rpc_sync("driver", t.squared_error, args=(b, np.float32(0.5)), timeout=T)
        dist_autograd.backward(ctx, [loss])
        got = rpc.rpc_sync("w1", dist_autograd.get_gradients, args=(ctx,), timeout=T)

    def one_process(w):
        b = jnp.tanh(jnp.tanh(x @ w) @ w)
        return t.squared_error(b, np.float32(0.5))

    np.testing.assert_allclose(got[shared], jax.grad(one_process)(square), rtol=RTOL,
                               atol=1e-7)


def test_an_rref_passed_along_a_chain_of_three_workers(group):
    rpc, dist_autograd = group, group.dist_autograd
    x, target, w1, _ = data()
    scale = rpc.remote("w1", np.asarray, args=(w1[0],), timeout=T)  # (3,), owned by w1
    with dist_autograd.context() as ctx:
        h = x[:, :3]  # an input, not an output of a call: no gradient wanted for it
        # driver -> w2 (sin) -> w3 (fetches w1's value and scales): three workers on the chain
        y = rpc.rpc_sync("w2", t.forward_along, args=("w3", scale, h), timeout=T)
        loss = rpc.rpc_sync("driver", t.squared_error, args=(y, target[:, :1]), timeout=T)
        dist_autograd.backward(ctx, [loss])
        got = rpc.rpc_sync("w1", dist_autograd.get_gradients, args=(ctx,), timeout=T)

    want = jax.grad(lambda s: t.squared_error(jnp.sin(x[:, :3]) * s, target[:, :1]))(w1[0])
    np.testing.assert_allclose(got[scale], want, rtol=RTOL, atol=1e-7)


def test_distributed_optimizer_matches_optax_in_one_process_step_by_step(group):
    rpc, dist_autograd = group, group.dist_autograd
    x, target, w1, w2 = data()
    tx = optax.adam(0.05)
    r1 = rpc.remote("w1", np.asarray, args=(w1,), timeout=T)
    r2 = rpc.remote("w2", np.asarray, args=(w2,), timeout=T)
    optimizer = rpc.DistributedOptimizer(tx, [r1, r2])
    params = {"w1": jnp.asarray(w1), "w2": jnp.asarray(w2)}
    state = tx.init(params)
    for _ in range(3):
        with dist_autograd.context() as ctx:
            h = rpc.rpc_sync("w1", t.layer, args=(r1, x), timeout=T)
            y = rpc.rpc_sync("w2", t.layer, args=(r2, h), timeout=T)
            loss = rpc.rpc_sync("driver", t.squared_error, args=(y, target), timeout=T)
            dist_autograd.backward(ctx, [loss])
            optimizer.step(ctx)
        want_loss, grads = jax.value_and_grad(two_layer_loss)(params, x, target)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        np.testing.assert_allclose(r1.to_here(T), params["w1"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(r2.to_here(T), params["w2"], rtol=1e-5, atol=1e-6)


def test_rrefs_to_attributes_the_forward_reads_are_refused_not_silently_untrained(group):
    """PyTorch's ``[RRef(p) for p in self.parameters()]`` ported literally trains nothing in
    JAX (the RRef holds a value of its own): the optimizer's first step says so."""
    rpc, dist_autograd = group, group.dist_autograd
    x, target, w1, _ = data()
    server = rpc.remote("w1", t.AttributeReadingServer, args=(w1,), timeout=T)
    params = server.rpc_sync(T).parameter_rrefs()
    optimizer = rpc.DistributedOptimizer(optax.sgd(0.1), params)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync("driver", t.server_forward, args=(server, x), timeout=T)
        loss = rpc.rpc_sync("driver", t.squared_error, args=(y, x[:, :3]), timeout=T)
        dist_autograd.backward(ctx, [loss])
        with pytest.raises(RuntimeError, match=(
                r"DistributedOptimizer.step: no gradient reached parameter params_rref\[0\] "
                r"RRef\(owner='w1', id=\w+\) \(owned by 'w1', \(4, 3\) float32\) in "
                r"dist_autograd context '\w+', nor 0 other\(s\) of the 1 on this worker: no "
                r"recorded call read it through its RRef.*self.w_rref.local_value\(\).*"
                r"allow_unused=True")):
            optimizer.step(ctx)
    np.testing.assert_array_equal(params[0].to_here(T), w1)  # nothing was updated
    skipping = rpc.DistributedOptimizer(optax.adam(0.1), params, allow_unused=True)
    with dist_autograd.context() as ctx:
        y = rpc.rpc_sync("driver", t.server_forward, args=(server, x), timeout=T)
        loss = rpc.rpc_sync("driver", t.squared_error, args=(y, x[:, :3]), timeout=T)
        dist_autograd.backward(ctx, [loss])
        skipping.step(ctx)  # PyTorch's rule: a parameter without a gradient is left alone
    np.testing.assert_array_equal(params[0].to_here(T), w1)


def test_the_same_server_reading_its_rrefs_trains_as_one_process(group):
    rpc, dist_autograd = group, group.dist_autograd
    x, target, w1, _ = data()
    server = rpc.remote("w1", t.RRefReadingServer, args=(w1,), timeout=T)
    params = server.rpc_sync(T).parameter_rrefs()
    optimizer = rpc.DistributedOptimizer(optax.sgd(0.1), params)
    w = jnp.asarray(w1)
    for _ in range(2):
        with dist_autograd.context() as ctx:
            y = rpc.rpc_sync("driver", t.server_forward, args=(server, x), timeout=T)
            loss = rpc.rpc_sync("driver", t.squared_error, args=(y, x[:, :3]), timeout=T)
            dist_autograd.backward(ctx, [loss])
            optimizer.step(ctx)
        grad = jax.grad(lambda w: t.squared_error(jnp.tanh(x @ w), x[:, :3]))(w)
        w = w - 0.1 * grad
        np.testing.assert_allclose(params[0].to_here(T), w, rtol=1e-5, atol=1e-6)


def test_get_gradients_on_the_caller_has_the_arrays_it_sent(group):
    """PyTorch's leaf tensors: an array the caller sent in a recorded call gets its gradient
    in the caller's ``get_gradients``, looked up by identity."""
    rpc, dist_autograd = group, group.dist_autograd
    x, _, w1, _ = data()
    target = np.ones((8, 3), np.float32)
    r1 = rpc.remote("w1", np.asarray, args=(w1,), timeout=T)
    with dist_autograd.context() as ctx:
        h = rpc.rpc_sync("w1", t.layer, args=(r1, x), timeout=T)
        loss = rpc.rpc_sync("w2", t.squared_error, args=(h, target), timeout=T)
        dist_autograd.backward(ctx, [loss])
        grads = dist_autograd.get_gradients(ctx)
    want_x, want_target = jax.grad(lambda x, target: t.squared_error(jnp.tanh(x @ w1), target),
                                   argnums=(0, 1))(x, target)
    assert x in grads and target in grads and len(grads) == 2  # every array it sent
    assert np.array(x) not in grads  # looked up by identity, not value
    np.testing.assert_allclose(grads[x], want_x, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(grads[target], want_target, rtol=RTOL, atol=1e-7)


def test_retain_graph_lets_a_second_backward_add_to_the_gradients(group):
    rpc, dist_autograd = group, group.dist_autograd
    x, target, w1, _ = data()
    r1 = rpc.remote("w1", np.asarray, args=(w1,), timeout=T)
    with dist_autograd.context() as ctx:
        h = rpc.rpc_sync("w1", t.layer, args=(r1, x), timeout=T)
        loss = rpc.rpc_sync("driver", t.squared_error, args=(h, x[:, :3]), timeout=T)
        dist_autograd.backward(ctx, [loss], retain_graph=True)
        dist_autograd.backward(ctx, [loss])  # the second one frees the records
        got = rpc.rpc_sync("w1", dist_autograd.get_gradients, args=(ctx,), timeout=T)[r1]
        with pytest.raises(RuntimeError, match=r"backward already ran through it \(pass "
                           r"retain_graph=True to the first backward to run it again\)"):
            dist_autograd.backward(ctx, [loss])
    want = jax.grad(lambda w: t.squared_error(jnp.tanh(x @ w), x[:, :3]))(w1)
    np.testing.assert_allclose(got, 2 * want, rtol=RTOL, atol=1e-7)


def test_rref_backward_starts_from_the_value_a_remote_call_made(group):
    rpc, dist_autograd = group, group.dist_autograd
    x, target, w1, _ = data()
    r1 = rpc.remote("w1", np.asarray, args=(w1,), timeout=T)
    with dist_autograd.context() as ctx:
        h = rpc.rpc_sync("w1", t.layer, args=(r1, x), timeout=T)
        loss_rref = rpc.remote("w2", t.squared_error, args=(h, x[:, :3]), timeout=T)
        assert loss_rref.confirmed_by_owner() in (True, False)
        loss_rref.backward(ctx)
        assert loss_rref.confirmed_by_owner() and r1.confirmed_by_owner()
        got = rpc.rpc_sync("w1", dist_autograd.get_gradients, args=(ctx,), timeout=T)[r1]
        with pytest.raises(NotImplementedError, match=r"RRef.backward: dist_autograd_ctx_id=-1 "
                           r"asks PyTorch for a local autograd pass on the owner"):
            loss_rref.backward()
        with pytest.raises(ValueError, match=r"was not made by a remote\(\) call of this worker "
                           r"in context"):
            r1.backward(ctx)
    want = jax.grad(lambda w: t.squared_error(jnp.tanh(x @ w), x[:, :3]))(w1)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-7)
