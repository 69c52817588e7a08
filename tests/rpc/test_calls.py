"""rpc_sync, rpc_async and its Future, calls to oneself, @async_execution, remote errors."""

import numpy as np
import pytest

from rpc import rpc_testing as t

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_cluster")]
T = 30  # seconds: no wait in these tests is longer


def test_rpc_sync_runs_on_the_named_worker_by_name_rank_or_info(group):
    pids = {name: group.rpc_sync(name, t.pid, timeout=T) for name in ("w1", "w2", "w3")}
    assert len(set(pids.values())) == 3
    import os

    assert group.rpc_sync("driver", t.pid, timeout=T) == os.getpid()  # a call to self: local
    assert group.rpc_sync(2, t.pid, timeout=T) == pids["w2"]
    assert group.rpc_sync(group.get_worker_info("w3"), t.pid, timeout=T) == pids["w3"]
    assert group.get_worker_info("w2") == group.WorkerInfo("w2", 2)


def test_arrays_and_pytrees_travel_and_big_results_arrive_without_a_copy(group):
    x = {"a": np.arange(6.0).reshape(2, 3), "b": [np.ones(2, np.int32)]}
    out = group.rpc_sync("w1", t.tree_add, args=(x,), kwargs={"b": x}, timeout=T)
    np.testing.assert_array_equal(out["a"], 2 * x["a"])
    np.testing.assert_array_equal(out["b"][0], [2, 2])
    big = group.rpc_sync("w1", t.ones, args=(1 << 18,), timeout=T)  # 1 MB
    np.testing.assert_array_equal(big, np.ones(1 << 18, np.float32))
    # a view of the buffer the socket was read into, not a copy of it
    assert big.base.dtype == np.uint8 and big.base.nbytes == big.nbytes and big.flags.aligned


def test_rpc_async_future_wait_then_collect_all_wait_all(group):
    futures = [group.rpc_async(f"w{i}", t.add, args=(i, 1), timeout=T) for i in (1, 2, 3)]
    assert group.wait_all(futures, timeout=T) == [2, 3, 4]
    chained = futures[0].then(lambda f: f.wait() * 100)
    assert chained.wait(T) == 200
    together = group.collect_all(futures).wait(T)
    assert [f.value() for f in together] == [2, 3, 4]


def test_async_execution_returns_the_value_of_the_future_the_function_returns(group):
    assert group.rpc_sync("w1", t.add_on, args=("w2", 3, 4), timeout=T) == 70


def test_an_exception_raised_by_the_function_is_raised_in_the_caller(group):
    with pytest.raises(KeyError, match="no such key"):
        group.rpc_sync("w2", t.fail, args=("no such key",), timeout=T)
    with pytest.raises(KeyError, match="here too"):
        group.rpc_async("driver", t.fail, args=("here too",), timeout=T).wait(T)


def test_timeout_is_honoured(group):
    import time

    start = time.monotonic()
    future = group.rpc_async("w3", t.sleep_then, args=(3, "late"), timeout=0.5)
    with pytest.raises(group.RPCTimeoutError, match=r"rpc_async\(sleep_then\) on worker 'w3' "
                       r"\(rank 3\) did not answer within its timeout of 0.5 s"):
        future.wait(T)
    assert time.monotonic() - start < 2.5
    assert group.rpc_sync("w3", t.sleep_then, args=(0.1, "ok"), timeout=T) == "ok"


def test_workers_call_the_driver_and_fetch_the_values_it_owns(group):
    import os

    assert group.rpc_sync("w2", t.pid_of, args=("driver",), timeout=T) == os.getpid()
    mine = group.RRef(np.arange(3.0))
    np.testing.assert_array_equal(group.rpc_sync("w1", t.value_of, args=(mine,), timeout=T),
                                  [0.0, 1.0, 2.0])
