"""PS-Lite's request handles, handle errors, slicers and callbacks (include/ps/kv_app.h)."""

import threading

import numpy as np
import pytest

import parallax.ps as ps
from parallax.ps.slicer import default_slicer

from ps.ps_testing import (RecordingHandle, SeenMetas, echo_simple_handle,
                           exploding_sum_handle)

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_cluster")]


def spread_keys(store, per_server=2):
    """``per_server`` keys at the start of each server's range (sorted)."""
    return np.array([r.begin + i for r in store.server_key_ranges() for i in range(per_server)],
                    np.uint64)


def test_a_request_handle_sees_ps_lites_meta_and_user_commands(store):
    store.reset(handle=SeenMetas(), consistency="eventual", num_workers=1)
    worker, keys = store.worker(0), spread_keys(store, 1)
    worker.wait(worker.push(keys, np.ones(3, np.float32), cmd=42))  # a user command
    rows = worker.wait(worker.pull(keys, lens=6, cmd=17)).reshape(3, 6)
    # cmd, push, pull, sender (rank 0), timestamp (the pull's: 1), customer_id
    np.testing.assert_array_equal(rows, np.tile([17, 0, 1, 0, 1, 0], (3, 1)))
    rows = worker.wait(worker.push_pull(keys, np.ones(18, np.float32), cmd=3)).reshape(3, 6)
    np.testing.assert_array_equal(rows, np.tile([3, 1, 1, 0, 2, 0], (3, 1)))
    client = store.client()
    rows = client.wait(client.pull(keys[:1], cmd=8)).reshape(1, 6)
    assert rows[0, 3] == -1  # no rank: sender -1


def test_a_request_handle_keeps_its_own_store_and_simple_handles_keep_working(store):
    store.reset(handle=RecordingHandle(), consistency="eventual", num_workers=1)
    worker, keys = store.worker(0), spread_keys(store)
    values = np.arange(1, 7, dtype=np.float32)
    worker.wait(worker.push(keys, values))
    worker.wait(worker.push(keys, values))
    worker.wait(worker.push(keys, np.full(6, 3, np.float32), cmd=5))  # user cmd: scale
    np.testing.assert_array_equal(worker.wait(worker.pull(keys)), 6 * values)
    store.reset(handle=None)  # back to the simple SumHandle
    worker = store.worker(0)
    worker.wait(worker.push(keys, values))
    np.testing.assert_array_equal(worker.wait(worker.pull(keys)), values)
    with pytest.raises(ValueError, match="other commands need a request handle"):
        worker.wait(worker.push(keys, values, cmd=5))


def test_a_handle_that_raises_on_one_server_fails_the_request_not_the_others(store):
    store.reset(handle=RecordingHandle(), consistency="sequential", num_workers=1)
    worker, keys = store.worker(0), spread_keys(store)
    values = np.ones(6, np.float32)
    values[3] = -1.0  # server 1's part makes its handle raise
    stamp = worker.push(keys, values)
    with pytest.raises(ps.HandleError) as info:
        worker.wait(stamp)
    begin, end = store.server_key_ranges()[1].begin, store.server_key_ranges()[1].end
    assert str(info.value).startswith(
        f"KVWorker.wait: the handle of server 1 of 3 (keys [{begin}, {end})) raised ValueError: "
        f"negative value pushed with cmd 0 while serving KVWorker.push (cmd=0); the other "
        f"servers' parts of the request were applied. Server traceback:")
    assert isinstance(info.value.__cause__, ValueError)
    # The other servers applied their parts, and the clocks moved: the next pull does not hang.
    pulled = worker.wait(worker.pull(keys))
    np.testing.assert_array_equal(pulled, [1, 1, 0, 0, 1, 1])


def test_a_simple_handle_that_raises_names_its_server(store):
    store.reset(handle=exploding_sum_handle(), consistency="eventual", num_workers=1)
    worker, keys = store.worker(0), spread_keys(store, 1)
    with pytest.raises(ps.HandleError, match=r"the handle of server 0 of 3 \(keys \[0, "
                                             r"\d+\)\) raised ZeroDivisionError: boom") as info:
        worker.wait(worker.push(keys, np.ones(3, np.float32)))
    assert "servers [1, 2] failed too" in str(info.value)


def test_a_custom_slicer_is_used_and_checked(store):
    store.reset(handle=None, consistency="eventual", num_workers=1)
    worker, keys = store.client(), spread_keys(store)
    calls = []

    def logging_slicer(request_keys, ranges):
        calls.append(request_keys.size)
        return default_slicer(request_keys, ranges)

    worker.set_slicer(logging_slicer)
    worker.wait(worker.push(keys, np.ones(6, np.float32)))
    np.testing.assert_array_equal(worker.wait(worker.pull(keys)), np.ones(6))
    assert calls == [6, 6]

    worker.set_slicer(lambda k, r: [np.arange(k.size), None, None])
    with pytest.raises(ValueError, match=f"KVWorker.push: the slicer sent key {keys[2]} to "
                                         f"server 0, whose range .* does not hold it"):
        worker.push(keys, np.ones(6, np.float32))
    worker.set_slicer(lambda k, r: [p[:-1] for p in default_slicer(k, r)])
    with pytest.raises(ValueError, match=f"KVWorker.pull: the slicer lost key {keys[1]}"):
        worker.pull(keys)
    worker.set_slicer(lambda k, r: default_slicer(k, r)[:2])
    with pytest.raises(ValueError, match="the slicer returned 2 parts for 3 servers"):
        worker.pull(keys)
    with pytest.raises(TypeError, match="KVWorker.set_slicer: the slicer must be callable"):
        worker.set_slicer("range")
    worker.set_slicer(default_slicer)


def test_callbacks_run_in_issue_order_before_wait_returns(store):
    store.reset(handle=None, consistency="eventual", num_workers=1)
    worker, keys = store.worker(0), spread_keys(store)
    events = []
    stamps = [worker.push(keys, np.ones(6, np.float32),
                          cb=lambda i=i: events.append(("push", i, threading.current_thread().name)))
              for i in range(3)]
    pull = worker.pull(keys, cb=lambda values: events.append(("pull", values.tolist(), None)))
    assert worker.wait(pull).tolist() == [3.0] * 6  # its callback ran before wait returned
    assert [e[:2] for e in events] == [("push", 0), ("push", 1), ("push", 2),
                                       ("pull", [3.0] * 6)]
    assert all(e[2].startswith("parallax-ps-callbacks") for e in events[:3])
    assert [worker.wait(s) for s in stamps] == [None] * 3
    with pytest.raises(TypeError, match="KVWorker.pull: cb must be callable"):
        worker.pull(keys, cb=3)


def test_simple_app_requests_reach_one_or_every_server_as_ps_lite(store):
    """PS-Lite's tests/test_simple_app.cc: requests with a head and a body, replies waited."""
    app = store.simple_app(app_id=3, rank=1)
    default = [r.body for r in app.wait(app.request(1, "x", recv_id=2))]
    assert default == [""]  # PS-Lite's default handle replies with an empty body
    app.set_request_handle(echo_simple_handle)
    stamps = [app.request(head, "abc") for head in range(3)]
    replies = [app.wait(stamp) for stamp in stamps]
    assert [[r.body for r in rs] for rs in replies] == [
        [f"{head}:cba:1:{server}" for server in range(3)] for head in range(3)]
    assert [r.sender for r in replies[0]] == [0, 1, 2]
    assert [r.body for r in app.wait(app.request(7, "", recv_id=1))] == ["7::1:1"]
    with pytest.raises(ps.HandleError, match=r"SimpleApp.wait: the handle of server 0 of 3 "
                                             r"\(keys \[0, \d+\)\) raised KeyError: 'unlucky "
                                             r"head' while serving SimpleApp.request \(head=13\)"):
        app.wait(app.request(13, "x"))
    with pytest.raises(ValueError, match="recv_id 5 is not a server"):
        app.request(1, "x", recv_id=5)
