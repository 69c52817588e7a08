"""The other transport: every call through Ray's actor calls (what workers on different
machines use), selected with ``TensorPipeRpcBackendOptions(_transports=["ray"])``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rpc import conftest, rpc_testing as t

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.usefixtures("ray_cluster")]
T = 30


def test_calls_rrefs_errors_and_the_backward_through_ray(group):
    rpc, dist_autograd = group, group.dist_autograd
    rpc.shutdown()
    options = rpc.TensorPipeRpcBackendOptions(_transports=["ray"],
                                               rpc_timeout=conftest.RPC_TIMEOUT)
    rpc.init_rpc("driver", rank=0, world_size=len(conftest.NAMES),
                 worker_names=conftest.NAMES, rpc_backend_options=options)
    try:
        assert rpc.rpc_sync("w1", t.add, args=(1, 2), timeout=T) == 3
        assert rpc.rpc_sync("w1", t.add_on, args=("w2", 3, 4), timeout=T) == 70  # w1 -> w2
        big = rpc.rpc_sync("w3", t.ones, args=(1 << 18,), timeout=T)
        assert not big.flags.writeable  # Ray's object store hands out a read-only view
        with pytest.raises(ValueError) as caught:
            rpc.rpc_sync("w2", t.fail_with_value_error, args=("through Ray",), timeout=T)
        assert (caught.value.__cause__.worker, caught.value.__cause__.rank) == ("w2", 2)
        with pytest.raises(RuntimeError, match=r"worker 'driver' cannot be reached from 'w1': it "
                           r"is the driver \(the process that called init_rpc\), a Ray driver "
                           r"that hosts no actor, and this group's transports are \['ray'\]"):
            rpc.rpc_sync("w1", t.pid_of, args=("driver",), timeout=T)
        rng = np.random.default_rng(0)
        x, w = rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(4, 3)).astype(
            np.float32)
        r = rpc.remote("w1", np.asarray, args=(w,), timeout=T)
        with dist_autograd.context() as ctx:
            h = rpc.rpc_sync("w1", t.layer, args=(r, x), timeout=T)
            loss = rpc.rpc_sync("w2", t.squared_error, args=(h, np.float32(0.5)), timeout=T)
            dist_autograd.backward(ctx, [loss])
            got = rpc.rpc_sync("w1", dist_autograd.get_gradients, args=(ctx,), timeout=T)[r]
        want = jax.grad(lambda w: t.squared_error(jnp.tanh(x @ w), np.float32(0.5)))(w)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    finally:
        rpc.shutdown()  # the next test's fixture starts the usual group again
