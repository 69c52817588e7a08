"""KVStore and KVWorker on real server processes (Ray actors on 127.0.0.1)."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from ps import ps_testing

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_cluster"),
              pytest.mark.slow]


def test_pslite_push_50_times_then_pull_keys_on_every_server(store):
    store.reset(handle=None, consistency="eventual", num_workers=2)
    errors = px.ps.run_workers(store, ps_testing.pslite_worker)
    assert errors == [0.0, 0.0]  # PS-Lite's check: sum |pulled - 50 x values| / 50
    stats = store.stats()
    assert all(s["keys"] > 0 for s in stats)  # every server holds part of the keys
    assert sum(s["keys"] for s in stats) == 2 * 1000


def test_requests_are_sliced_by_range_and_reassembled_in_key_order(store):
    store.reset(handle=None, consistency="eventual", num_workers=1)
    ranges = store.server_key_ranges()
    assert [r.begin for r in ranges] == [r.begin for r in px.ps.server_key_ranges(3)]
    keys = np.array([5, ranges[1].begin, ranges[2].begin + 3, ranges[2].begin + 9], np.uint64)
    lens = np.array([1, 3, 2, 1])
    values = np.arange(7, dtype=np.float32)
    worker = store.client()
    worker.wait(worker.push(keys, values, lens))
    pulled, pulled_lens = worker.wait(worker.pull(keys), with_lens=True)
    assert pulled.tolist() == values.tolist() and pulled_lens.tolist() == lens.tolist()
    assert [s["keys"] for s in store.stats()] == [1, 1, 2]
    assert worker.wait(0) is None  # waiting again for a finished request returns at once


def test_one_worker_sequential_equals_one_device_training(store):
    tx = optax.adam(1e-2)
    model = px.models.MLP(4, [16], 2, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((8, 4)).astype(np.float32),
                rng.standard_normal((8, 2)).astype(np.float32)) for _ in range(5)]

    @jax.jit
    def loss_and_grad(params, x, y):
        return jax.value_and_grad(
            lambda p: px.models.mse_loss(nnx.merge(graphdef, p), {"x": x, "y": y}))(params)

    @jax.jit
    def reference_step(params, opt_state, x, y):
        loss, grads = loss_and_grad(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    reference, opt_state, reference_losses = params, tx.init(params), []
    for x, y in batches:
        reference, opt_state, loss = reference_step(reference, opt_state, x, y)
        reference_losses.append(float(loss))

    store.reset(handle=tx, consistency="sequential", num_workers=1)
    flat = ps_testing.FlatParams(params, store.server_key_ranges())
    worker = store.worker(0)
    client = store.client()
    client.wait(client.push(flat.keys, flat.flatten(params), flat.lens, cmd=px.ps.ASSIGN))
    losses = []
    for x, y in batches:
        pulled = flat.unflatten(worker.wait(worker.pull(flat.keys)))
        loss, grads = loss_and_grad(pulled, x, y)
        worker.push(flat.keys, flat.flatten(grads), flat.lens)  # not waited: the clock orders it
        losses.append(float(loss))
    final = flat.unflatten(worker.wait(worker.pull(flat.keys)))
    assert worker.staleness == [0] * 6
    assert px.testing.relative_difference(np.array(losses), np.array(reference_losses)) <= 1e-6
    assert px.testing.relative_difference(final, reference) <= 1e-6


def test_errors_from_servers_reach_the_worker_with_their_message(store):
    store.reset(handle=None, consistency="eventual", num_workers=1)
    worker = store.client()
    with pytest.raises(ValueError,
                       match=r"KVWorker.pull \(server 0\): 1 of 1 keys were never pushed"):
        worker.wait(worker.pull(np.array([12345], np.uint64)))
    with pytest.raises(TypeError, match="the store holds float32 values, got complex64"):
        worker.push(np.array([1], np.uint64), np.ones(1, np.complex64))
    with pytest.raises(ValueError, match="timestamp 99 was never issued"):
        worker.wait(99)
    with pytest.raises(ValueError, match=r"rank 3 is outside \[0, 1\); create the store with"):
        store.worker(3)


def test_pulls_of_never_pushed_keys_read_zeros_as_ps_lite(store):
    """PS-Lite's ``KVServerDefaultHandle`` (include/ps/kv_app.h) answers a pull of a key
    never pushed with a zero (``store[key]``). Here the length comes from ``pull(lens=)`` or
    the store's ``value_len``; the zeros are not stored."""
    store.reset(handle=None, consistency="eventual", num_workers=1, value_len=2)
    try:
        client = store.client()
        ranges = store.server_key_ranges()
        keys = np.array([ranges[0].begin + 1, ranges[1].begin + 1, ranges[2].begin + 1],
                        np.uint64)
        client.wait(client.push(keys[1:2], np.array([5.0, 6.0], np.float32)))
        values, lens = client.wait(client.pull(keys), with_lens=True)
        assert values.tolist() == [0, 0, 5, 6, 0, 0] and lens.tolist() == [2, 2, 2]
        assert [s["keys"] for s in store.stats()] == [0, 1, 0]  # nothing inserted
        assert client.wait(client.pull(keys[:1], lens=[3])).tolist() == [0, 0, 0]
        with pytest.raises(ValueError, match=r"KVWorker.push: key .* gets 3 values, but the "
                                             r"store was created with value_len=2"):
            client.push(keys[:1], np.ones(3, np.float32))
        store.reset(value_len=None)
        client = store.client()
        with pytest.raises(ValueError, match=r"keys were never pushed to this server .* pass "
                                             r"lens= to pull"):
            client.wait(client.pull(keys[:1]))
    finally:
        store.reset(value_len=None)
