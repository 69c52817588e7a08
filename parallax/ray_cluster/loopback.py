"""Keeping a local Ray cluster on 127.0.0.1 whatever was imported first, and saying what is
exposed when a cluster is not.

Ray decides a new node's address from a switch it reads once, when ``ray`` is imported:
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (Ray's single-machine mode) makes the node's address
127.0.0.1; otherwise ``ray.init`` turns ``_node_ip_address="127.0.0.1"`` into the machine's
routable address (``resolve_ip_for_localhost``), and the GCS, the raylet, the agents and every
worker listen there (or on ``*``). Setting the variable in parallax's ``__init__`` works only
when parallax is imported before ray. So :func:`loopback_only` turns the switch on for the
duration of ``ray.init`` itself: the variable (read by the processes Ray starts) and the value
Ray already read (read by the driver's ``ray.init``), both restored afterwards.

The same context turns Ray's usage statistics off unless the user chose
(``RAY_USAGE_STATS_ENABLED``, read by the processes Ray starts): Ray reports them to its
servers by default, and a local cluster parallax starts does not talk beyond the machine.
One request it cannot switch off: Ray 2.60's dashboard process (started even with
``include_dashboard=False``, which loads only its usage-statistics module) asks the cloud
metadata address 169.254.169.254 once at start which cloud it runs on, whether or not usage
statistics are on (``ray/dashboard/modules/usage_stats/usage_stats_head.py``, ``run``;
``ray/_common/usage/usage_lib.py``, ``get_cloud_from_metadata_requests``, 1 s timeouts). It
listens on nothing and sends nothing of the user's; docs/parameter_server.md, "Safety".

The switch is Ray's (``ray._private.ray_constants.ENABLE_RAY_CLUSTER``, no public API sets it
after import), so a Ray release may move it: :func:`exposed_listeners` reads what the
cluster's processes really listen on (Linux ``/proc``), and ``init_cluster`` stops a cluster
that listens beyond loopback and says so, rather than run exposed.

References:
  Ray, ``ray/_private/ray_constants.py`` (``ENABLE_RAY_CLUSTER``) and
  ``ray/_private/services.py`` (``get_node_ip_address``, ``resolve_ip_for_localhost``).
"""

from __future__ import annotations

import contextlib
import importlib
import ipaddress
import os
from collections.abc import Iterator
from typing import NamedTuple

LOOPBACK = "127.0.0.1"
SINGLE_NODE_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
USAGE_STATS_SWITCH = "RAY_USAGE_STATS_ENABLED"


@contextlib.contextmanager
def loopback_only() -> Iterator[None]:
    """Ray's single-machine mode, and its usage statistics off unless the user set them,
    while the body runs (a local ``ray.init``); then the environment as it was.

    Example:
      >>> import os
      >>> with loopback_only():
      ...     os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"], os.environ["RAY_USAGE_STATS_ENABLED"]
      ('0', '0')
    """
    constants = importlib.import_module("ray._private.ray_constants")
    saved = {name: os.environ.get(name) for name in (SINGLE_NODE_SWITCH, USAGE_STATS_SWITCH)}
    saved_flag = getattr(constants, "ENABLE_RAY_CLUSTER", None)
    os.environ[SINGLE_NODE_SWITCH] = "0"
    os.environ.setdefault(USAGE_STATS_SWITCH, "0")  # the user's explicit choice stands
    if saved_flag is not None:
        constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if saved_flag is not None:
            constants.ENABLE_RAY_CLUSTER = saved_flag
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) names this machine's loopback.

    Example:
      >>> is_loopback_host("127.0.0.1"), is_loopback_host("::ffff:127.0.0.1")
      (True, True)
      >>> is_loopback_host("0.0.0.0"), is_loopback_host("10.0.0.2")
      (False, False)
    """
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


class Listener(NamedTuple):
    """A listening TCP socket of a process: who (name, pid) and where (host, port)."""

    process: str
    pid: int
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.process} (pid {self.pid}) on {self.host}:{self.port}"


def _address(hex_address: str) -> tuple[str, int]:
    """``/proc/net/tcp{,6}``'s ``0100007F:1F90`` as ``("127.0.0.1", 8080)``."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    # the kernel prints each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw)), int(port, 16)


def _listening_inodes() -> dict[int, tuple[str, int]]:
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as lines:
                next(lines)
                for line in lines:
                    fields = line.split()
                    if fields[3] == "0A":  # TCP_LISTEN
                        found[int(fields[9])] = _address(fields[1])
        except OSError:
            continue
    return found


def _process_tree(root: int) -> list[int]:
    """``root`` and its descendants (``/proc/<pid>/stat``'s parent field)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return "?"


def exposed_listeners(root: int | None = None) -> list[Listener] | None:
    """The TCP listeners of ``root`` (this process by default) and its descendants that are
    not on loopback; None where this cannot be read (no ``/proc``: not Linux).

    A local Ray cluster's processes (GCS, raylet, agents, workers) are this process's
    descendants, so this lists what of it the network can reach.

    Example:
      >>> exposed_listeners() in ([], None)  # this process listens on nothing beyond loopback
      True
    """
    if not os.path.isdir("/proc/self/fd") or not os.path.exists("/proc/net/tcp"):
        return None
    listening = _listening_inodes()
    exposed = []
    for pid in _process_tree(os.getpid() if root is None else root):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if not target.startswith("socket:["):
                continue
            where = listening.get(int(target[8:-1]))
            if where is not None and not is_loopback_host(where[0]):
                exposed.append(Listener(_name(pid), pid, *where))
    return sorted(set(exposed), key=lambda listener: (listener.pid, listener.port))
