import pytest

import parallax.ps  # sets Ray's single-node mode before ray is imported
import ray.cloudpickle  # noqa: E402

from rpc import rpc_testing

# Ray workers do not have tests/ on sys.path: ship the functions they run by value.
ray.cloudpickle.register_pickle_by_value(rpc_testing)

NAMES = ["driver", "w1", "w2", "w3"]
# the group's default timeout, which (as in PyTorch) also bounds the workers' start: a loaded
# test machine may take more than PyTorch's 60 s to start three Python processes
RPC_TIMEOUT = 180.0


def start(rpc):
    rpc.init_rpc("driver", rank=0, world_size=len(NAMES), worker_names=NAMES,
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(rpc_timeout=RPC_TIMEOUT))


@pytest.fixture(scope="session")
def rpc_group(ray_cluster):
    """One RPC group of the driver and three worker actors for the session (processes cost
    seconds); see ``group`` for the one a test uses."""
    import parallax.rpc as rpc

    from parallax.rpc.agent import agent_or_none

    start(rpc)
    yield rpc
    if agent_or_none() is not None:  # a test may have shut it down
        rpc.shutdown(timeout=10)


@pytest.fixture
def group(rpc_group):
    """The session's RPC group with all workers alive (restarted if a test killed one)."""
    rpc = rpc_group
    try:
        rpc.wait_all([rpc.rpc_async(name, rpc_testing.pid, timeout=10) for name in NAMES], 10)
    except Exception:  # a worker was killed, or the group shut down
        try:
            rpc.shutdown(graceful=False)
        except RuntimeError:
            pass  # already shut down
        start(rpc)
    return rpc
