"""PyTorch's RPC on Ray and JAX: remote calls, RRefs, distributed autograd and optimizer.

``init_rpc`` makes this process a worker and starts the group's others as Ray actors (on
loopback); ``rpc_sync``/``rpc_async``/``remote`` run functions on them (over Unix sockets
between the workers of one machine); an ``RRef`` points at a value one worker owns; under
``dist_autograd.context()`` the calls record their ``jax.vjp`` and ``dist_autograd.backward``
runs the backward across the workers; ``DistributedOptimizer`` updates parameters where they
live. PyTorch's names, signatures and defaults; every difference is listed in
``docs/rpc.md``.

Ray is an optional extra (``pip install parallax[ps]``): this package loads it only when a
Ray-backed name is first used.
"""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # must precede `import ray`

import importlib.util  # noqa: E402

from parallax.ray_cluster.lazy_names import loader  # noqa: E402
from parallax.rpc.errors import RemoteTraceback as RemoteTraceback  # noqa: E402
from parallax.rpc.errors import RemoteWorkerError as RemoteWorkerError  # noqa: E402
from parallax.rpc.errors import RPCTimeoutError as RPCTimeoutError  # noqa: E402
from parallax.rpc.errors import UnknownWorkerError as UnknownWorkerError  # noqa: E402
from parallax.rpc.future import Future as Future  # noqa: E402
from parallax.rpc.future import collect_all as collect_all  # noqa: E402
from parallax.rpc.future import wait_all as wait_all  # noqa: E402
from parallax.rpc.options import BackendType as BackendType  # noqa: E402
from parallax.rpc.options import TensorPipeRpcBackendOptions as TensorPipeRpcBackendOptions  # noqa: E402, E501


def is_available() -> bool:
    """Whether RPC can run here: parallax.rpc needs Ray (the ``ps`` extra), not imported here.

    Example:
      >>> import parallax.rpc as rpc
      >>> isinstance(rpc.is_available(), bool)
      True

    References:
      PyTorch, ``torch.distributed.rpc.is_available``.
    """
    return importlib.util.find_spec("ray") is not None


_LAZY = {
    "init_rpc": "parallax.rpc.api",
    "shutdown": "parallax.rpc.api",
    "rpc_sync": "parallax.rpc.api",
    "rpc_async": "parallax.rpc.api",
    "remote": "parallax.rpc.api",
    "get_worker_info": "parallax.rpc.api",
    "get_rpc_timeout": "parallax.rpc.api",
    "WorkerInfo": "parallax.rpc.agent",
    "RRef": "parallax.rpc.rref",
    "DistributedOptimizer": "parallax.rpc.optim",
}
_MODULES = {"dist_autograd": "parallax.rpc.dist_autograd", "functions": "parallax.rpc.functions"}
_names = loader("parallax.rpc", _LAZY)


def __getattr__(name: str):
    if name in _MODULES:  # submodules that import ray, as attributes
        import importlib

        return importlib.import_module(_MODULES[name])
    return _names(name)


__all__ = [
    "BackendType",
    "DistributedOptimizer",
    "Future",
    "RPCTimeoutError",
    "RRef",
    "RemoteTraceback",
    "RemoteWorkerError",
    "TensorPipeRpcBackendOptions",
    "UnknownWorkerError",
    "WorkerInfo",
    "collect_all",
    "dist_autograd",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
    "wait_all",
]
