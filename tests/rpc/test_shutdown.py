"""shutdown(graceful=True) waits for every worker's calls, a call between two workers that the
driver never waited for included, and loses none; PyTorch's timeout=0 waits as long as it
takes; graceful=False stops at once. The next init_rpc reuses the worker processes, each with
a fresh state."""

import os
import time

import pytest

from rpc import conftest, rpc_testing as t

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_cluster")]
T = 30


def test_graceful_shutdown_waits_for_a_call_between_two_workers(group, tmp_path):
    marker = tmp_path / "w2-wrote-this"
    pids = {name: group.rpc_sync(name, t.pid, timeout=T) for name in ("w1", "w2", "w3")}
    # w1 calls w2 from a thread of its own; the driver holds no future of it
    assert group.rpc_sync("w1", t.call_in_background, args=("w2", str(marker), 1.0),
                          timeout=T) == "started"
    start = time.monotonic()
    group.shutdown()  # timeout=0, PyTorch's default: as long as it takes
    assert marker.read_text() == "done"  # the call completed: not lost
    assert time.monotonic() - start >= 0.5
    conftest.start(group)  # the same processes again, each with a fresh state
    assert {name: group.rpc_sync(name, t.pid, timeout=T) for name in pids} == pids
    assert all(group.rpc_sync(name, t.num_owned, timeout=T) == 0 for name in pids)


def test_a_graceful_shutdown_past_its_timeout_stops_anyway_and_names_the_busy(group, tmp_path):
    marker = tmp_path / "never"
    future = group.rpc_async("w3", t.write_after, args=(str(marker), 5.0), timeout=T)
    with pytest.raises(RuntimeError, match=r"shutdown: workers \[.*'w3'.*\] still had calls in "
                       r"flight after timeout=0.5 s; the group was stopped anyway"):
        group.shutdown(timeout=0.5)
    with pytest.raises(RuntimeError):  # the call failed: its worker was stopped
        future.wait(T)
    assert not os.path.exists(marker)


def test_shutdown_without_grace_fails_the_calls_in_flight_at_once(group):
    future = group.rpc_async("w2", t.sleep_then, args=(20, "late"), timeout=T)
    time.sleep(0.2)
    start = time.monotonic()
    group.shutdown(graceful=False)
    with pytest.raises(RuntimeError):
        future.wait(T)
    assert time.monotonic() - start < 10
