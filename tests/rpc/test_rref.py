"""RRef: remote(), to_here(), local_value(), the proxies, and reference counting."""

import gc
import time

import numpy as np
import pytest

from rpc import rpc_testing as t

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_cluster")]
T = 30


def owned(group, worker):
    return group.rpc_sync(worker, t.num_owned, timeout=T)


def wait_until(condition, seconds=10):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        gc.collect()
        time.sleep(0.05)


def test_remote_to_here_and_the_proxies(group):
    rref = group.remote("w1", t.add, args=(np.arange(3.0), 1.0), timeout=T)
    assert rref.owner() == group.WorkerInfo("w1", 1) and not rref.is_owner()
    np.testing.assert_array_equal(rref.to_here(T), [1.0, 2.0, 3.0])
    counter = group.remote("w2", t.Counter, args=(10,), timeout=T)
    assert counter.rpc_sync(T).bump(5) == 15
    assert counter.rpc_async(T).bump(1).wait(T) == 16
    bumped = counter.remote(T).bump(4)
    assert bumped.owner().name == "w2" and bumped.to_here(T) == 20
    with pytest.raises(RuntimeError, match=r"RRef.local_value: called on worker 'driver', but "
                       r"the value is owned by 'w2'; use to_here\(\)"):
        counter.local_value()


def test_a_local_rref_and_an_rref_sent_along(group):
    mine = group.RRef(np.float32(2.5))
    assert mine.is_owner() and mine.local_value() == 2.5
    rref = group.remote("w1", t.ones, args=(4,), timeout=T)
    held = group.rpc_sync("w3", t.hold, args=(rref,), timeout=T)  # w3 keeps a copy
    assert held.owner().name == "w3"
    copy = held.to_here(T)[0]  # the RRef inside w3's value, sent on to the driver
    assert copy == rref and copy.owner().name == "w1"
    np.testing.assert_array_equal(copy.to_here(T), np.ones(4))


def test_a_value_is_freed_when_its_last_user_goes_and_not_before(group):
    gc.collect()
    wait_until(lambda: owned(group, "w1") == 0 and owned(group, "w3") == 0)
    rref = group.remote("w1", t.ones, args=(8,), timeout=T)
    rref.to_here(T)
    assert owned(group, "w1") == 1
    held = group.rpc_sync("w3", t.hold, args=(rref,), timeout=T)  # w3 now uses it too
    del rref
    gc.collect()
    time.sleep(0.3)
    assert owned(group, "w1") == 1  # still used by w3
    del held  # w3's value (holding the only other user) goes, then w1's
    wait_until(lambda: owned(group, "w3") == 0 and owned(group, "w1") == 0)
