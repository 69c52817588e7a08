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
import warnings

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # single-node mode, before ray

import ray  # noqa: E402

from parallax.ray_cluster.loopback import (LOOPBACK, exposed_listeners,  # noqa: E402
                                           is_loopback_host, loopback_only)

# where a cluster that listens beyond this machine must be opened (docs/parameter_server.md)
MULTI_HOST_DOCS = "docs/parameter_server.md, section 'Safety'"


class ExposedClusterWarning(RuntimeWarning):
    """parallax runs on a Ray cluster whose services the network can reach (the user's)."""


def init_cluster(address: str | None = None, *, num_cpus: int | None = None,
                 object_store_memory: int | None = None, **ray_init_kwargs) -> bool:
    """Starts a local Ray cluster on 127.0.0.1, or joins ``address``; no-op if Ray is up.

    The local cluster listens on 127.0.0.1 only, whatever was imported first (ray before
    parallax) and whatever the environment says (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1``,
    ``RAY_ADDRESS``: a new local cluster is started, not the one it names); see
    :mod:`parallax.ray_cluster.loopback`. If it would listen anywhere else it is stopped and
    this raises. If Ray is already initialised in this process on an address the network can
    reach, this warns (:class:`ExposedClusterWarning`), naming what listens there.

    Args:
      address: None (or ``"local"``) for a new local cluster on loopback; otherwise an
        existing cluster's address (``"auto"``, ``"HOST:6379"``, ``"ray://HOST:10001"``),
        passed to ``ray.init``: a multi-host cluster, on purpose (its ports must be open
        between the hosts: docs/parameter_server.md, "Safety").
      num_cpus: CPUs the local cluster offers (servers and workers ask for none, so this
        only bounds ordinary Ray tasks).
      object_store_memory: bytes of shared memory for the local object store.
      **ray_init_kwargs: anything else ``ray.init`` takes.

    Returns:
      True if this call started or joined a cluster, False if Ray was already initialised.

    Raises:
      RuntimeError: the local cluster listened beyond loopback (it was stopped).

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
        _warn_if_exposed()
        return False
    if address is not None and address != "local":
        host = address.split("://")[-1].rsplit(":", 1)[0]
        if is_loopback_host(host):  # else ray.init would dial the routable address instead
            with loopback_only():
                ray.init(address=address, **ray_init_kwargs)
        else:
            ray.init(address=address, **ray_init_kwargs)
        return True
    options = {"include_dashboard": False, "_node_ip_address": LOOPBACK}
    options.update(ray_init_kwargs)
    sealed = is_loopback_host(str(options["_node_ip_address"]))
    before = set(exposed_listeners() or ()) if sealed else set()
    with loopback_only():
        ray.init(address="local", num_cpus=num_cpus, object_store_memory=object_store_memory,
                 **options)
    if sealed:
        _stop_if_exposed(before)
    return True


def _stop_if_exposed(before: set) -> None:
    """Stops the cluster just started if it listens beyond loopback (``before``: what this
    process tree exposed already, not Ray's)."""
    exposed = [listener for listener in exposed_listeners() or () if listener not in before]
    if exposed:
        ray.shutdown()
        raise RuntimeError(
            "parallax.ps.init_cluster: the local Ray cluster listened beyond 127.0.0.1 ("
            + "; ".join(map(str, exposed)) + f"), so it was stopped. This Ray ({ray.__version__}) "
            "does not take parallax's single-machine switch; start Ray yourself on purpose "
            f"(ray.init(_node_ip_address=...)) and read {MULTI_HOST_DOCS}")


def _warn_if_exposed() -> None:
    try:
        node = ray.util.get_node_ip_address()
    except Exception:  # a Ray client connection (ray://): the cluster is elsewhere
        return
    if is_loopback_host(node):
        return
    listeners = exposed_listeners() or []
    what = ("its services, on " + node + (": listening here beyond loopback, "
                                          + "; ".join(map(str, listeners)) if listeners else ""))
    warnings.warn(
        f"parallax: Ray was already initialised in this process on {node}, not {LOOPBACK}: "
        f"{what}; they can be reached from the network, and whoever reaches them can run code "
        "in these processes. parallax's servers and workers will run on this cluster. To keep "
        "everything on this machine, let parallax start Ray (parallax.ps.init_cluster() before "
        "anything calls ray.init); for several hosts on purpose, see " + MULTI_HOST_DOCS,
        ExposedClusterWarning, stacklevel=3)


def shutdown_cluster() -> None:
    """Stops this process's connection to Ray (and the local cluster it started).

    Example:
      >>> import parallax as px
      >>> callable(px.ps.shutdown_cluster)
      True
    """
    ray.shutdown()
