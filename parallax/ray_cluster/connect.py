"""Starting or joining the Ray cluster that runs servers and workers, on loopback by default.

``parallax.ps``'s servers and workers, ``parallax.rpc``'s workers and ``parallax.tf``'s
parameter-server strategy all start here. PS-Lite's *scheduler* node (which registers servers
and workers and hands out their addresses) is Ray's head: the GCS keeps the actors'
addresses, the raylet starts their processes. ``init_cluster()`` starts a one-machine
cluster bound to 127.0.0.1; ``init_cluster(address)`` joins an existing one.

Safety: a Ray cluster executes the pickled functions and objects its members send it. Keep
it on a trusted network (the local default never leaves the machine); parallax never reads
pickles from files (checkpoints are Orbax arrays).
"""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # single-node mode, before ray

import ray  # noqa: E402

LOOPBACK = "127.0.0.1"


def init_cluster(address: str | None = None, *, num_cpus: int | None = None,
                 object_store_memory: int | None = None, **ray_init_kwargs) -> bool:
    """Starts a local Ray cluster on 127.0.0.1, or joins ``address``; no-op if Ray is up.

    Args:
      address: None for a new local cluster on loopback; otherwise an existing cluster's
        address (``"auto"``, ``"HOST:6379"``, ``"ray://HOST:10001"``), passed to ``ray.init``.
      num_cpus: CPUs the local cluster offers (servers and workers ask for none, so this
        only bounds ordinary Ray tasks).
      object_store_memory: bytes of shared memory for the local object store.
      **ray_init_kwargs: anything else ``ray.init`` takes.

    Returns:
      True if this call started or joined a cluster, False if Ray was already initialised.

    Example:
      >>> import parallax as px
      >>> _ = px.ps.init_cluster()      # starts one, or finds the one already running
      >>> px.ps.init_cluster()
      False

    References:
      Moritz et al., "Ray: A Distributed Framework for Emerging AI Applications", OSDI 2018;
      PS-Lite's scheduler node (``Postoffice``/``Van`` start-up).
    """
    if ray.is_initialized():
        return False
    if address is not None:
        ray.init(address=address, **ray_init_kwargs)
        return True
    options = {"include_dashboard": False, "_node_ip_address": LOOPBACK}
    options.update(ray_init_kwargs)
    ray.init(num_cpus=num_cpus, object_store_memory=object_store_memory, **options)
    return True


def shutdown_cluster() -> None:
    """Stops this process's connection to Ray (and the local cluster it started).

    Example:
      >>> import parallax as px
      >>> callable(px.ps.shutdown_cluster)
      True
    """
    ray.shutdown()
