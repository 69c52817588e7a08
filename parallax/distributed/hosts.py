"""Hosts and slots in horovodrun's spellings, and the placement of ranks on them.

``-H a:2,b:2``, a hostfile of ``host slots=N`` lines and a host-discovery script's output
(``host:N`` or ``host`` lines) become :class:`Host` values; :func:`place` numbers the ranks
host by host, filling each host's slots before the next (horovodrun's assignment: rank 0 on
the first host, ``HOROVOD_CROSS_RANK`` = the host's index).

Example:
  >>> hosts = parse_hosts("localhost:2,127.0.0.1:1")
  >>> [(p.rank, p.host, p.local_rank, p.local_size, p.node_rank) for p in place(hosts, 3)]
  [(0, 'localhost', 0, 2, 0), (1, 'localhost', 1, 2, 0), (2, '127.0.0.1', 0, 1, 1)]

References:
  Horovod horovod/runner/common/util/hosts.py (``parse_hosts``, ``parse_host_files``,
  ``get_host_assignments``) and horovod/runner/elastic/discovery.py (the script's output).
"""

from __future__ import annotations

import dataclasses
import re
import socket
import subprocess
from collections.abc import Sequence

from parallax.distributed.coordinator_address import LaunchError

_HOST = re.compile(r"[A-Za-z0-9_.\-\[\]:]+")


@dataclasses.dataclass(frozen=True)
class Host:
    """A host and how many processes it may run (its slots)."""

    name: str
    slots: int


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one rank runs: its host, its index and count there, the host's index."""

    rank: int
    host: str | None  # None: this machine, node mode (torchrun's spelling)
    local_rank: int
    local_size: int
    node_rank: int
    nnodes: int


def _host(text: str, where: str) -> Host:
    name, sep, slots = text.strip().rpartition(":")
    if not sep or name.endswith(":") or not slots.isdigit():
        raise LaunchError(f"{where}: {text.strip()!r} is not HOST:SLOTS (e.g. node1:2).")
    if not _HOST.fullmatch(name):
        raise LaunchError(f"{where}: {name!r} is not a host name or address.")
    if int(slots) < 1:
        raise LaunchError(f"{where}: host {name!r} has {slots} slots; a host runs at least one "
                          "process (leave it out instead).")
    return Host(name, int(slots))


def _unique(hosts: list[Host], where: str) -> tuple[Host, ...]:
    names = [h.name for h in hosts]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise LaunchError(f"{where}: host {twice[0]!r} is listed twice; give each host once "
                          "with all its slots (e.g. node1:4).")
    if not hosts:
        raise LaunchError(f"{where}: no hosts given.")
    return tuple(hosts)


def parse_hosts(text: str) -> tuple[Host, ...]:
    """``-H host1:2,host2:2`` -> hosts, in order (horovodrun's ``-H``)."""
    where = f"-H {text}"
    return _unique([_host(part, where) for part in text.split(",") if part.strip()], where)


def parse_hostfile(path: str) -> tuple[Host, ...]:
    """A hostfile of ``host slots=N`` lines (``#`` comments, blank lines) -> hosts."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as error:
        raise LaunchError(f"--hostfile {path}: cannot read it ({error.strerror}).") from None
    hosts = []
    for number, line in enumerate(lines, 1):
        text = line.partition("#")[0].strip()
        if not text:
            continue
        match = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", text)
        if match is None:
            raise LaunchError(f"--hostfile {path}, line {number}: {text!r} is not `HOST "
                              "slots=N` (horovodrun's hostfile: every line names its slots, "
                              "e.g. `node1 slots=4`).")
        hosts.append(_host(f"{match.group(1)}:{match.group(2)}", f"--hostfile {path}, line "
                                                                   f"{number}"))
    if not hosts:
        raise LaunchError(f"--hostfile {path}: no hosts in it (lines `HOST slots=N`).")
    return _unique(hosts, f"--hostfile {path}")


def parse_discovered(output: str, slots_per_host: int | None, script: str) -> tuple[Host, ...]:
    """A discovery script's output, one ``host:slots`` (or ``host``, with
    ``--slots-per-host``) per line -> hosts; no line means no host is available now."""
    where = f"--host-discovery-script {script}"
    hosts = []
    for line in output.splitlines():
        text = line.strip()
        if not text:
            continue
        if ":" not in text:
            if slots_per_host is None:
                raise LaunchError(f"{where} printed {text!r} without slots; print HOST:SLOTS "
                                  "lines or pass --slots-per-host N.")
            text = f"{text}:{slots_per_host}"
        hosts.append(_host(text, where))
    return _unique(hosts, where) if hosts else ()


def discover(script: str, slots_per_host: int | None, timeout_s: float = 10.0
             ) -> tuple[Host, ...]:
    """Runs the discovery script once; its hosts (``LaunchError`` if it fails)."""
    try:
        done = subprocess.run([script], capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise LaunchError(f"--host-discovery-script {script}: {error}") from None
    if done.returncode != 0:
        raise LaunchError(f"--host-discovery-script {script} exited with code "
                          f"{done.returncode}: {done.stderr.strip()[-300:]}")
    return parse_discovered(done.stdout, slots_per_host, script)


def place(hosts: Sequence[Host], count: int) -> tuple[Placement, ...]:
    """The first ``count`` slots, host by host; hosts left without a rank are not used."""
    total = sum(h.slots for h in hosts)
    if count > total:
        raise LaunchError(f"-np {count} is more than the {total} slots of the hosts "
                          f"({', '.join(f'{h.name}:{h.slots}' for h in hosts)}); horovodrun "
                          "runs one process per slot: lower -np or add slots.")
    used, left = [], count
    for host in hosts:
        if left == 0:
            break
        used.append((host.name, min(host.slots, left)))
        left -= used[-1][1]
    placements, rank = [], 0
    for node, (name, size) in enumerate(used):
        for local in range(size):
            placements.append(Placement(rank, name, local, size, node, len(used)))
            rank += 1
    return tuple(placements)


def without_slot(hosts: Sequence[Host], name: str) -> tuple[Host, ...]:
    """``hosts`` with one slot fewer on host ``name`` (a failed slot), dropped at zero."""
    return tuple(Host(h.name, h.slots - (h.name == name)) for h in hosts
                 if h.slots - (h.name == name) > 0)


def total_slots(hosts: Sequence[Host]) -> int:
    return sum(h.slots for h in hosts)


def is_local(name: str) -> bool:
    """Whether ranks on host ``name`` run here directly rather than through ssh.

    By name, with no DNS lookup: ``localhost`` and this machine's own host name are local;
    any other name, even another address of this machine (``127.0.0.1``), is reached with
    ssh. (horovodrun resolves the name and compares addresses instead.)
    """
    return name in ("localhost", socket.gethostname())
