"""The server's logic, in this process (no Ray): storage, handles, clocks, checkpoints."""

import asyncio

import jax
import numpy as np
import optax
import pytest

import parallax as px
from parallax.ps.keys import KeyRange
from parallax.ps.server import KVServer


def make_server(handle=None, consistency="eventual", num_workers=1):
    handle = handle or px.ps.SumHandle()
    if isinstance(handle, optax.GradientTransformation):
        handle = px.ps.OptaxHandle(handle)
    return KVServer(0, KeyRange(0, 1000), handle, px.ps.as_consistency(consistency), num_workers,
                    np.float32)


def run(coroutine):
    return asyncio.run(coroutine)


def keys(*values):
    return np.array(values, np.uint64)


def test_variable_lengths_inserted_out_of_order_keep_their_segments():
    server = make_server()
    run(server.push(keys(5, 9), np.array([1, 2, 3, 4, 5], np.float32), np.array([2, 3]), 0,
                    None, 0))
    run(server.push(keys(1, 7), np.array([10, 20], np.float32), np.array([1, 1]), 0, None, 0))
    values, lens, _ = run(server.pull(keys(1, 5, 7, 9), None, None, 0))
    assert values.tolist() == [10, 1, 2, 20, 3, 4, 5] and lens.tolist() == [1, 2, 1, 3]
    values, _, _ = run(server.pull(keys(5, 9), None, None, 0))
    assert values.tolist() == [1, 2, 3, 4, 5]


def test_sum_handle_sparse_and_dense_pushes():
    server = make_server()
    all_keys = np.arange(6, dtype=np.uint64)
    run(server.push(all_keys, np.ones(12, np.float32), None, 0, None, 0))
    run(server.push(keys(1, 4), np.full(4, 2, np.float32), None, 0, None, 0))
    values, _, _ = run(server.pull(all_keys, None, None, 0))
    assert values.reshape(6, 2)[:, 0].tolist() == [1, 3, 1, 1, 3, 1]


def test_optax_handle_sparse_rows_equal_optax_on_those_rows():
    tx = optax.adam(0.1)
    server = make_server(tx)
    table = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    row_keys = np.arange(8, dtype=np.uint64)
    run(server.push(row_keys, table, None, px.ps.ASSIGN, None, 0))
    grads = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    touched = keys(2, 6)
    run(server.push(touched, grads, None, px.ps.UPDATE, None, 0))
    rows = table[[2, 6]]
    updates, _ = tx.update(grads, tx.init(rows), rows)
    expected = table.copy()
    expected[[2, 6]] = optax.apply_updates(rows, updates)
    values, _, _ = run(server.pull(row_keys, None, None, 0))
    np.testing.assert_allclose(values.reshape(8, 3), expected, rtol=1e-6)
    mu, _, _ = run(server.pull(touched, 0, None, 0))  # slot 0: Adam's first moment
    np.testing.assert_allclose(mu.reshape(2, 3), 0.1 * grads, rtol=1e-6)


def test_optax_handle_dense_push_is_optax_on_the_array():
    tx = optax.sgd(0.1, momentum=0.9)
    handle = px.ps.OptaxHandle(tx)
    params = np.linspace(-1, 1, 5).astype(np.float32)
    state, expected, expected_state = handle.init(params), params, tx.init(params)
    for step in range(3):
        grads = np.full(5, step + 1.0, np.float32)
        params, state = handle.push(params, grads, state)
        updates, expected_state = tx.update(grads, expected_state, expected)
        expected = optax.apply_updates(expected, updates)
    np.testing.assert_array_equal(params, np.asarray(expected))


def test_pull_waits_for_the_bounded_delay():
    async def scenario():
        server = make_server(consistency=px.ps.BoundedDelay(1), num_workers=2)
        k = keys(3)
        await server.push(k, np.ones(1, np.float32), None, 0, 0, 0)   # worker 0 finishes 0
        await server.push(k, np.ones(1, np.float32), None, 0, 0, 1)   # worker 0 finishes 1
        waiting = asyncio.create_task(server.pull(k, None, 0, 2))     # needs all to finish 0
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await server.push(k, np.ones(1, np.float32), None, 0, 1, 0)   # worker 1 finishes 0
        _, _, staleness = await asyncio.wait_for(waiting, 1)
        return staleness, (await server.stats())

    staleness, stats = run(scenario())
    assert staleness == 1 and stats["staleness"].tolist() == [1]
    assert stats["clock"].tolist() == [2, 1]


def test_snapshot_round_trip_through_orbax(tmp_path):
    server = make_server(optax.adam(0.1))
    run(server.push(keys(1, 2), np.ones(4, np.float32), None, px.ps.ASSIGN, None, 0))
    run(server.push(keys(1, 2), np.ones(4, np.float32), None, px.ps.UPDATE, None, 0))
    run(server.save(tmp_path))
    fresh = make_server(optax.adam(0.1))
    run(fresh.restore(tmp_path))
    for a, b in zip(jax.tree.leaves(server.state), jax.tree.leaves(fresh.state)):
        np.testing.assert_array_equal(a, b)
    assert run(fresh.pull(keys(1, 2), None, None, 0))[0].tolist() == run(
        server.pull(keys(1, 2), None, None, 0))[0].tolist()


def test_an_empty_server_round_trips_too(tmp_path):
    server = make_server(optax.adam(0.1))
    run(server.save(tmp_path))
    fresh = make_server(optax.adam(0.1))
    run(fresh.push(keys(1), np.ones(2, np.float32), None, px.ps.ASSIGN, None, 0))
    run(fresh.restore(tmp_path))
    assert fresh.table.keys.size == 0 and fresh.table.offsets.tolist() == [0]


def test_server_errors_are_named():
    server = make_server()
    run(server.push(keys(1), np.ones(2, np.float32), None, 0, None, 0))
    with pytest.raises(ValueError, match="key 1 holds 2 values on the server but 3 were pushed"):
        run(server.push(keys(1), np.ones(3, np.float32), None, 0, None, 0))
    with pytest.raises(ValueError, match=r"1 of 2 keys were never pushed .*first: 4"):
        run(server.pull(keys(1, 4), None, None, 0))
    with pytest.raises(ValueError, match=r"cmd must be px.ps.UPDATE \(0\), px.ps.ASSIGN \(1\) "
                                         r"or px.ps.ADD \(2\)"):
        run(server.push(keys(1), np.ones(2, np.float32), None, 7, None, 0))
    with pytest.raises(ValueError, match="slot 0 does not exist"):
        run(server.pull(keys(1), 0, None, 0))
    with pytest.raises(FileNotFoundError, match="no server checkpoint"):
        run(server.restore("/nonexistent/checkpoint"))


def test_a_never_pushed_key_reads_as_zeros_of_the_stated_length():
    """PS-Lite's ``KVServerDefaultHandle`` (include/ps/kv_app.h) answers ``store[key]``: a
    zero for a key never pushed. Here the pull states the length (lens=); nothing is stored."""
    server = make_server()
    run(server.push(keys(5), np.array([1, 2], np.float32), None, 0, None, 0))
    values, lens, _ = run(server.pull(keys(1, 5, 9), None, None, 0, np.array([3, 2, 1])))
    assert values.tolist() == [0, 0, 0, 1, 2, 0] and lens.tolist() == [3, 2, 1]
    assert server.table.keys.tolist() == [5]  # not inserted (PS-Lite's operator[] would)
    run(server.push(keys(1), np.ones(4, np.float32), None, 0, None, 0))  # any length still
    assert run(server.pull(keys(1), None, None, 0))[0].tolist() == [1, 1, 1, 1]
    with pytest.raises(ValueError, match=r"KVWorker.pull \(server 0\): key 5 holds 2 values but "
                                         r"the pull asked for 3 \(lens=\)"):
        run(server.pull(keys(5), None, None, 0, np.array([3])))
    with pytest.raises(ValueError, match=r"1 of 2 keys were never pushed to this server "
                                         r"\(first: 9\), and the pull does not say how many "
                                         r"values they hold\. PS-Lite's default handle answers "
                                         r"zeros for them: pass lens= to pull \(values per key\) "
                                         r"or create the KVStore with value_len=k"):
        run(server.pull(keys(5, 9), None, None, 0))


def test_a_never_pushed_key_reads_its_initial_optimizer_state():
    server = make_server(optax.adam(0.1))
    run(server.push(keys(2), np.ones(2, np.float32), None, px.ps.ASSIGN, None, 0))
    run(server.push(keys(2), np.ones(2, np.float32), None, 0, None, 0))
    first_moment, _, _ = run(server.pull(keys(2, 7), 0, None, 0, np.array([2, 2])))
    assert first_moment.tolist()[2:] == [0.0, 0.0] and first_moment[0] != 0.0


def test_add_adds_whatever_the_handle_and_a_new_handle_keeps_the_values():
    """``px.ps.ADD`` is TensorFlow's ``assign_add`` next to an optimizer (values += pushed,
    the optimizer's slots untouched); ``set_handle`` swaps the handle and keeps the values
    (an optimizer given after the variables), its slots starting fresh."""
    server = make_server()  # sums, as PS-Lite's default handle
    run(server.push(keys(1, 2), np.array([1, 2], np.float32), None, px.ps.ASSIGN, None, 0))
    run(server.set_handle(px.ps.OptaxHandle(optax.sgd(0.5, momentum=0.9))))
    values, _, _ = run(server.pull(keys(1, 2), None, None, 0))
    trace, _, _ = run(server.pull(keys(1, 2), 0, None, 0))
    assert values.tolist() == [1, 2] and trace.tolist() == [0, 0]
    run(server.push(keys(1, 2), np.ones(2, np.float32), None, px.ps.UPDATE, None, 0))  # sgd
    run(server.push(keys(1, 2), np.full(2, 10, np.float32), None, px.ps.ADD, None, 0))
    values, _, _ = run(server.pull(keys(1, 2), None, None, 0))
    trace, _, _ = run(server.pull(keys(1, 2), 0, None, 0))
    assert values.tolist() == [10.5, 11.5] and trace.tolist() == [1, 1]  # momentum kept
