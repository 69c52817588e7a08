"""PS-Lite's parameter server in JAX, on Ray: ``KVStore``, ``KVWorker``, consistency models.

Servers are Ray actors owning contiguous key ranges; workers push and pull sorted uint64
keys with timestamps; a server's handle sums pushes (PS-Lite's default) or applies an optax
optimizer; ``"sequential"``, ``"eventual"`` and ``BoundedDelay(tau)`` consistency are kept
with a vector clock per key range. See ``docs/parameter_server.md``.

Ray is an optional extra (``pip install parallax[ps]``). This package loads it, and its Ray
parts, only when one of their names is first used, so ``import parallax.ps`` (and
``import parallax``) never imports ray.
"""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # must precede `import ray`

from parallax.ps.consistency import BoundedDelay as BoundedDelay  # noqa: E402
from parallax.ps.consistency import as_consistency as as_consistency  # noqa: E402
from parallax.ps.errors import HandleError as HandleError  # noqa: E402
from parallax.ps.errors import ServerUnavailableError as ServerUnavailableError  # noqa: E402
from parallax.ps.handles import ADD as ADD  # noqa: E402
from parallax.ps.handles import ASSIGN as ASSIGN  # noqa: E402
from parallax.ps.handles import UPDATE as UPDATE  # noqa: E402
from parallax.ps.handles import SumHandle as SumHandle  # noqa: E402
from parallax.ps.keys import MAX_KEY as MAX_KEY  # noqa: E402
from parallax.ps.keys import KeyRange as KeyRange  # noqa: E402
from parallax.ps.keys import server_key_ranges as server_key_ranges  # noqa: E402
from parallax.ps.optax_handle import OptaxHandle as OptaxHandle  # noqa: E402
from parallax.ps.request import KVMeta as KVMeta  # noqa: E402
from parallax.ps.request import KVPairs as KVPairs  # noqa: E402
from parallax.ps.slicer import default_slicer as default_slicer  # noqa: E402
from parallax.ray_cluster.lazy_names import loader  # noqa: E402

# Names whose modules import ray: loaded on first use.
_LAZY = {
    "KVStore": "parallax.ps.kvstore",
    "KVWorker": "parallax.ps.worker",
    "init_cluster": "parallax.ray_cluster.connect",
    "shutdown_cluster": "parallax.ray_cluster.connect",
    "run_workers": "parallax.ps.workers",
    "SimpleApp": "parallax.ps.simple_app",
    "SimpleData": "parallax.ps.simple_app",
    "SERVER_GROUP": "parallax.ps.simple_app",
}

__getattr__ = loader("parallax.ps", _LAZY)


__all__ = [
    "ADD",
    "ASSIGN",
    "BoundedDelay",
    "HandleError",
    "KVMeta",
    "KVPairs",
    "KVStore",
    "KVWorker",
    "KeyRange",
    "MAX_KEY",
    "OptaxHandle",
    "SERVER_GROUP",
    "ServerUnavailableError",
    "SimpleApp",
    "SimpleData",
    "SumHandle",
    "UPDATE",
    "as_consistency",
    "default_slicer",
    "init_cluster",
    "run_workers",
    "server_key_ranges",
    "shutdown_cluster",
]
