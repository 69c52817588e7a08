"""Errors as PyTorch users catch them: a function's exception (its type, chained from the
remote traceback naming the worker), timeouts and unknown workers as ``RuntimeError``,
PyTorch's timeout values (-1: the default, 0: none), and the options' checks."""

import time
import traceback

import pytest

from rpc import conftest, rpc_testing as t

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_cluster")]
T = 30


def test_a_remote_exception_keeps_its_type_and_names_the_worker_its_rank_and_traceback(group):
    with pytest.raises(ValueError) as caught:
        group.rpc_sync("w2", t.fail_with_value_error, args=("bad input",), timeout=T)
    assert str(caught.value) == "bad input" and caught.value.args == ("bad input",)
    cause = caught.value.__cause__
    assert isinstance(cause, group.RemoteTraceback)
    assert (cause.worker, cause.rank) == ("w2", 2)
    assert "in fail_with_value_error" in cause.traceback and "ValueError: bad input" in cause.traceback
    assert str(cause).startswith("On worker 'w2' (rank 2):\nTraceback (most recent call last):")
    assert caught.value.__notes__ == ["raised on worker 'w2' (rank 2) of the parallax.rpc group"]
    printed = "".join(traceback.format_exception(caught.value))
    assert "On worker 'w2' (rank 2):" in printed and "direct cause" in printed
    future = group.rpc_async("w3", t.fail, args=("k",), timeout=T)  # through a future too
    with pytest.raises(KeyError) as caught:
        future.wait(T)
    assert caught.value.__cause__.worker == "w3"
    with pytest.raises(ValueError) as caught:  # a call to oneself, the same way
        group.rpc_sync("driver", t.fail_with_value_error, args=("here",), timeout=T)
    assert (caught.value.__cause__.worker, caught.value.__cause__.rank) == ("driver", 0)


def test_timeouts_and_unknown_workers_are_runtime_errors(group):
    with pytest.raises(RuntimeError, match=r"rpc_sync\(sleep_then\) on worker 'w1' \(rank 1\) "
                       r"did not answer within its timeout of 0.2 s") as caught:
        group.rpc_sync("w1", t.sleep_then, args=(1, None), timeout=0.2)
    assert isinstance(caught.value, (group.RPCTimeoutError, TimeoutError))
    with pytest.raises(RuntimeError, match=r"rpc_async: no worker named 'w9' in this RPC group; "
                       r"its workers are \['driver', 'w1', 'w2', 'w3'\]") as caught:
        group.rpc_async("w9", t.pid)
    assert isinstance(caught.value, (group.UnknownWorkerError, ValueError))


def test_timeout_minus_one_is_the_default_and_zero_is_none(group):
    assert group.get_rpc_timeout() == conftest.RPC_TIMEOUT  # the group's rpc_timeout
    start = time.monotonic()
    assert group.rpc_sync("w1", t.sleep_then, args=(0.3, "ok"), timeout=-1) == "ok"
    assert group.rpc_async("w1", t.sleep_then, args=(0.3, "ok"), timeout=0).wait() == "ok"
    rref = group.remote("w2", t.sleep_then, args=(0.3, "ok"), timeout=-1)
    assert rref.to_here(timeout=-1) == "ok" and rref.to_here(timeout=0) == "ok"
    assert rref.rpc_sync(timeout=-1).upper() == "OK"
    assert time.monotonic() - start >= 0.6
    with pytest.raises(ValueError, match=r"rpc_sync: timeout must be >= 0 seconds, or -1 for the "
                       r"default \(180.0 s\), got -2"):
        group.rpc_sync("w1", t.pid, timeout=-2)
    with pytest.raises(TypeError, match=r"rpc_async: timeout must be seconds"):
        group.rpc_async("w1", t.pid, timeout="soon")


def test_backend_options_and_init_arguments_are_checked(group):
    Options = group.TensorPipeRpcBackendOptions
    options = Options()
    assert (options.num_worker_threads, options.rpc_timeout, options.init_method) == (
        16, 60.0, "env://")
    with pytest.raises(NotImplementedError, match=r"device_maps/devices maps accelerator "
                       r"tensors between workers; parallax.rpc sends arrays as host NumPy arrays"):
        Options(device_maps={"w1": {0: 1}})
    with pytest.raises(NotImplementedError, match=r"set_device_map\('w1', ...\)"):
        options.set_device_map("w1", {0: 1})
    with pytest.raises(ValueError, match=r"_transports must be a non-empty subset of "
                       r"\['unix', 'ray'\], got \['shm'\]"):
        Options(_transports=["shm"])
    with pytest.raises(ValueError, match=r"rpc_timeout must be seconds >= 0"):
        Options(rpc_timeout=-1)
    from parallax.rpc import api

    with pytest.raises(TypeError, match=r"backend must be a member of BackendType"):
        api.init_rpc("a", backend="tensorpipe", rank=0, world_size=1)
    with pytest.raises(TypeError, match=r"rpc_backend_options must be a "
                       r"TensorPipeRpcBackendOptions, got dict"):
        api.init_rpc("a", rank=0, world_size=1, rpc_backend_options={"rpc_timeout": 5})
    with pytest.raises(ValueError, match=r"`name` must be 1 to 127 letters, digits, '_', ':' or "
                       r"'-' \(PyTorch's rule\), got 'a b'"):
        api.init_rpc("a b", rank=0, world_size=1)
