"""A callee killed by pid, bad input, and use after shutdown: clear errors, nothing hangs."""

import os
import signal
import threading
import time

import numpy as np
import pytest

from rpc import rpc_testing as t

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_cluster")]
# the kill and the shutdown each cost a restart of the session's group (seconds): slow

T = 30


@pytest.mark.slow
def test_a_killed_callee_fails_the_callers_future_naming_the_worker(group):
    pid = group.rpc_sync("w3", t.pid, timeout=T)
    in_flight = group.rpc_async("w3", t.sleep_then, args=(20, "never"), timeout=T)
    time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(group.RemoteWorkerError, match=r"worker 'w3' \(rank 3\) died before "
                       r"answering rpc_async\(sleep_then\) on worker 'w3'"):
        in_flight.wait(T)
    with pytest.raises(group.RemoteWorkerError, match=r"worker 'w3' \(rank 3\) died"):
        group.rpc_sync("w3", t.pid, timeout=T)
    assert time.monotonic() - start < 10
    assert group.rpc_sync("w1", t.add, args=(1, 2), timeout=T) == 3  # the others carry on


def test_unknown_worker_and_bad_arguments(group):
    with pytest.raises(ValueError, match=r"rpc_sync: no worker named 'w9' in this RPC group; "
                       r"its workers are \['driver', 'w1', 'w2', 'w3'\]"):
        group.rpc_sync("w9", t.pid, timeout=T)
    with pytest.raises(TypeError, match=r"rpc_async: `to` must be a worker name \(str\), a rank"):
        group.rpc_async(1.5, t.pid, timeout=T)
    with pytest.raises(TypeError, match=r"remote: `func` must be callable, got int 3"):
        group.remote("w1", 3, timeout=T)
    with pytest.raises(RuntimeError, match=r"init_rpc: RPC is already running in this process "
                       r"as worker 'driver'"):
        group.init_rpc("again", rank=0, world_size=1)


def test_a_function_that_does_not_pickle(group):
    lock = threading.Lock()

    def locked():
        with lock:
            return 1

    with pytest.raises(TypeError, match=r"cannot send rpc_sync\(.*locked\) on worker 'w1' "
                       r"\(rank 1\): its function or arguments do not pickle"):
        group.rpc_sync("w1", locked, timeout=T)
    assert group.rpc_sync("driver", locked, timeout=T) == 1  # to oneself nothing is pickled


def test_backward_of_a_value_no_call_produced(group):
    dist_autograd = group.dist_autograd
    with dist_autograd.context() as ctx:
        y = group.rpc_sync("w1", t.ones, args=(3,), timeout=T)
        with pytest.raises(ValueError, match=r"roots\[0\] \(shape \(3,\)\) is not an output of "
                           r"an RPC call in this context; local JAX work is not recorded"):
            dist_autograd.backward(ctx, [y * 2])


def test_init_rpc_validates_its_arguments(group):
    from parallax.rpc import api

    with pytest.raises(ValueError, match=r"rank must be in 0..1 \(world_size=2\), got 2"):
        api.init_rpc("a", rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"worker_names must be 2 distinct names with "
                       r"worker_names\[0\] == 'a'"):
        api.init_rpc("a", rank=0, world_size=2, worker_names=["b", "a"])


@pytest.mark.slow
def test_to_here_after_shutdown(group):
    rref = group.remote("w1", np.ones, args=(2,), timeout=T)
    rref.to_here(T)
    group.shutdown(timeout=T)
    with pytest.raises(RuntimeError, match=r"RRef.to_here: RPC was shut down in this process .*"
                       r"owned by 'w1', is out of reach"):
        rref.to_here(T)
    with pytest.raises(RuntimeError, match=r"rpc_sync: RPC is not running in this process"):
        group.rpc_sync("w1", t.pid, timeout=T)
