"""The coordinator's address: parsing ``HOST:PORT``, a free port on loopback, binding it on
node 0 and waiting for it on the other nodes, with the launcher's errors."""

from __future__ import annotations

import socket
import time


class LaunchError(Exception):
    """A launch that cannot start: bad arguments, a busy port, an unreachable coordinator."""


def split_address(address: str, flag: str = "--coordinator") -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``, checked (the message names ``flag``)."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"{flag} {address!r} is not HOST:PORT (e.g. 10.0.0.1:29400).")
    return host.strip("[]"), int(port)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port_pair(host: str = "127.0.0.1", tries: int = 50) -> int:
    """A free port ``p`` whose neighbour ``p - 1`` is free too: the coordinator takes ``p``
    and torchrun's ``MASTER_PORT`` (a ``torch.distributed`` store) ``p - 1``."""
    for _ in range(tries):
        port = free_port(host)
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, port - 1))
            return port
        except OSError:
            continue
    return free_port(host)


def check_port_free(address: str) -> None:
    """Node 0: the coordinator's port must be free to bind."""
    host, port = split_address(address)
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as error:
        raise LaunchError(f"cannot use the coordinator address {address}: {error.strerror} "
                          "(port in use? pick another with --coordinator HOST:PORT).") from None


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Nodes other than 0: the coordinator must answer within ``timeout_s``."""
    host, port = split_address(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise LaunchError(
                    f"cannot reach the coordinator {address} after {timeout_s:g} s "
                    f"({error.strerror or error}); start node 0 with the same --coordinator, "
                    "or raise --start-timeout.") from None
            time.sleep(0.2)
