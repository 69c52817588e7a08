"""Leaving a job under ``parallax launch``: the exit status reaches the launcher at once.

Installed by :func:`parallax.distributed.initialize` when ``parallax launch`` started the
process (see :mod:`parallax.distributed.runtime` for why): an uncaught exception is recorded
(``sys.excepthook``, chained), and an ``atexit`` handler, which runs before JAX's own, makes a
program that raised exit at once with status 1, and makes rank 0, which hosts the
coordination service, wait for the other ranks before the service goes.

Example:
  >>> DEFAULT_EXIT_GRACE_S
  5.0
"""

from __future__ import annotations

import atexit
import os
import select
import sys
import time

import jax

DEFAULT_EXIT_GRACE_S = 5.0

# Whether this process's program raised (then it exits at once, and rank 0 does not hold the
# coordination service for ranks that are waiting for it).
_failed: list[bool] = []


def install(hosts_service: bool) -> None:
    """Records uncaught exceptions and registers :func:`_leave` (once per process)."""
    sys.excepthook = _recording_failures(sys.excepthook)
    atexit.register(_leave, hosts_service)


def _recording_failures(previous):
    def hook(kind, value, traceback):
        _failed.append(True)
        previous(kind, value, traceback)

    return hook


def _leave(hosts_service: bool) -> None:
    """At exit under ``parallax launch`` (runs before JAX's own exit handler).

    A program that raised exits at once with status 1: JAX's disconnect would wait for, or
    abort on, peers that are themselves failing, and the launcher needs the real status.
    Otherwise rank 0 keeps the coordination service up until the other ranks are gone: the
    launcher closes the pipe ``PARALLAX_EXIT_GATE_FD`` when every other local rank has
    exited; across nodes, or without the pipe, rank 0 waits ``PARALLAX_EXIT_GRACE`` seconds
    at most.
    """
    if _failed:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(1)
    if not hosts_service or not jax.distributed.is_initialized():
        return
    grace = float(os.environ.get("PARALLAX_EXIT_GRACE", DEFAULT_EXIT_GRACE_S))
    fd = os.environ.get("PARALLAX_EXIT_GATE_FD")
    if fd is None:
        time.sleep(grace)
        return
    deadline = time.monotonic() + grace
    try:
        while (left := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([int(fd)], [], [], left)
            if ready and not os.read(int(fd), 64):
                return  # EOF: the launcher saw every other rank exit
    except OSError:
        return
