"""``parallax launch``: start N processes of one program, as ``horovodrun`` and ``torchrun`` do.

    parallax launch -np 2 python train.py                      # horovodrun's spelling
    parallax launch --nproc-per-node 2 train.py --lr 1         # torchrun's: .py runs here
    parallax launch -np 2 --devices-per-process 2 parallax demo
    parallax launch --nproc-per-node 2 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 train.py
    parallax launch -np 4 -H node1:2,node2:2 python train.py   # ranks on node2 started with ssh

Each process gets the environment :func:`parallax.distributed.initialize` reads
(``PARALLAX_COORDINATOR``, ``PARALLAX_NUM_PROCESSES``, ``PARALLAX_PROCESS_ID``, ... see
:data:`parallax.distributed.environment.LAUNCH_VARIABLES`) and torchrun's variables with
torchrun's meanings (:data:`~parallax.distributed.torchrun_exports.TORCHRUN_EXPORTS`), for
scripts, data loaders and loggers written against torchrun. Output lines are prefixed with
the rank. The first process to fail stops the group (:mod:`parallax.distributed.supervisor`)
and the launcher exits with its code, naming it. With ``--max-restarts K`` the whole group is
started again, up to K times, with ``PARALLAX_RESTART`` counting the restarts (a program
resumes from its last checkpoint). With ``--min-np M`` each restart drops the failed slot,
down to M processes; on one machine the commits of ``hvd.elastic`` live in a RAM directory
the launcher keeps across restarts. With ``--host-discovery-script`` the group is sized by
the hosts the script reports at each start, and started again larger when it reports more
(:mod:`parallax.distributed.elastic_hosts`).

Two ways to span machines. torchrun's: the same command on every node, with ``--nnodes``,
``--node-rank`` and node 0's address; node 0 hosts the coordinator. horovodrun's: one
command on one machine with ``-H``/``--hostfile``; this launcher starts every rank, those on
other hosts through ssh (:mod:`parallax.distributed.remote`); rank 0's host hosts the
coordinator. Options and their meanings: :mod:`parallax.distributed.launch_options`.

The coordinator binds to 127.0.0.1 on one node unless ``--coordinator`` says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence

from parallax.distributed import elastic_hosts
from parallax.distributed import hosts as hosts_lib
from parallax.distributed.coordinator_address import (LaunchError, check_port_free,
                                                       free_port, free_port_pair,
                                                       split_address, wait_for_coordinator)
from parallax.distributed.hosts import Host, Placement
from parallax.distributed.launch_config import LaunchConfig
from parallax.distributed.launch_options import add_arguments, config_from_args
from parallax.distributed.remote import ssh_command
from parallax.distributed.supervisor import GroupResult, ProcessGroup
from parallax.distributed.torchrun_exports import torchrun_environment

PROG = "parallax launch"
__all__ = ["LaunchConfig", "GroupStart", "LaunchError", "add_arguments", "config_from_args",
           "group_start", "environment", "run_group", "run", "main", "free_port",
           "split_address"]


@dataclasses.dataclass(frozen=True)
class GroupStart:
    """One start of the group: the coordinator, and where the ranks this launcher starts run."""

    coordinator: str
    bind: str
    placements: tuple[Placement, ...]
    world_size: int
    attempt: int
    memory: str | None = None  # a directory in RAM that outlives restarts (elastic commits)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(p.rank for p in self.placements)

    def placement(self, rank: int) -> Placement:
        return next(p for p in self.placements if p.rank == rank)


def runs_here(placement: Placement) -> bool:
    """A rank this machine runs directly (not through ssh)."""
    return placement.host is None or hosts_lib.is_local(placement.host)


def group_start(config: LaunchConfig, attempt: int, nproc: int | None = None,
                memory: str | None = None, hosts: Sequence[Host] | None = None) -> GroupStart:
    """Where and which ranks this launcher starts on ``attempt`` (0 = the first start).

    ``nproc`` and ``hosts`` replace the configured count and hosts for this start (an
    elastic policy: ``--min-np`` after a failure, a discovery script's hosts).
    """
    if config.starts_every_rank:
        placements = hosts_lib.place(hosts or config.hosts, nproc or config.nproc)
        if config.coordinator is None:
            coordinator = f"{placements[0].host}:{free_port_pair()}"
        else:
            coordinator = config.coordinator
        return GroupStart(coordinator, coordinator, placements, len(placements), attempt,
                          memory)
    if config.coordinator is None:
        coordinator = f"127.0.0.1:{free_port_pair()}"  # and MASTER_PORT one below
        bind = coordinator
    else:
        coordinator = bind = config.coordinator
    if nproc is None or nproc == config.nproc:
        first = config.node_rank * config.nproc
        placements = tuple(Placement(r, None, r - first, config.nproc, config.node_rank,
                                     config.nnodes)
                           for r in range(first, first + config.nproc))
        return GroupStart(coordinator, bind, placements, config.world_size, attempt, memory)
    placements = tuple(Placement(r, None, r, nproc, 0, 1) for r in range(nproc))  # --min-np
    return GroupStart(coordinator, bind, placements, nproc, attempt, memory)


def environment(config: LaunchConfig, group: GroupStart, rank: int,
                base: dict | None = None) -> dict:
    """The environment of one process (what ``px.distributed.initialize()`` reads)."""
    env = dict(os.environ if base is None else base)
    where = group.placement(rank)
    env.update({
        "PARALLAX_COORDINATOR": group.coordinator,
        "PARALLAX_COORDINATOR_BIND": group.bind,
        "PARALLAX_NUM_PROCESSES": str(group.world_size),
        "PARALLAX_PROCESS_ID": str(rank),
        "PARALLAX_LOCAL_RANK": str(where.local_rank),
        "PARALLAX_LOCAL_SIZE": str(where.local_size),
        "PARALLAX_NODE_RANK": str(where.node_rank),
        "PARALLAX_NUM_NODES": str(where.nnodes),
        "PARALLAX_RESTART": str(group.attempt),
        "PARALLAX_EXIT_GRACE": str(config.exit_grace_s),
        "PYTHONUNBUFFERED": "1",  # a failing rank's last lines must not die in a buffer
    })
    first = rank - where.local_rank
    env.update(torchrun_environment(group.coordinator, rank,
                                    tuple(range(first, first + where.local_size)),
                                    group.world_size, where.node_rank, where.nnodes,
                                    group.attempt, config.max_restarts))
    if config.run_id is not None:
        env["TORCHELASTIC_RUN_ID"] = config.run_id
    env.pop("PARALLAX_EXIT_GATE_FD", None)
    if group.memory is not None:
        env["PARALLAX_ELASTIC_MEMORY"] = group.memory
    if config.devices_per_process is not None:
        env["PARALLAX_DEVICES_PER_PROCESS"] = str(config.devices_per_process)
    return env


def run_group(config: LaunchConfig, group: GroupStart, watch=None) -> GroupResult:
    """Starts one group and supervises it to its end (``watch``: see ``ProcessGroup.run``)."""
    rank0_here = any(p.rank == 0 and runs_here(p) for p in group.placements)
    if rank0_here:
        if config.coordinator is not None:
            check_port_free(group.bind)
    elif not config.starts_every_rank:
        wait_for_coordinator(group.coordinator, config.connect_timeout_s)
    envs = [environment(config, group, p.rank) for p in group.placements]
    commands = [list(config.command) if runs_here(p) else
                ssh_command(p.host, config.command, env, os.getcwd(), port=config.ssh.port,
                            identity_file=config.ssh.identity_file)
                for p, env in zip(group.placements, envs)]
    alone = config.starts_every_rank or config.nnodes == 1  # every rank is started here
    gate = 0 if rank0_here and alone else None
    procs = ProcessGroup(config.command, envs, grace_s=config.grace_s, prefix=config.prefix,
                         gate_rank=gate, commands=commands)
    procs.start()
    return procs.run(watch)


def report(result: GroupResult, log) -> int:
    """Says how the group ended; returns the launcher's exit code."""
    if result.interrupted:
        log(f"interrupted; stopped ranks {', '.join(str(e.rank) for e in result.exits)}")
        return 130
    failure = result.failure
    log(f"rank {failure.rank} (pid {failure.pid}) {failure.status()} after "
        f"{failure.seconds:.1f} s; the other ranks were stopped")
    others = [e for e in result.exits if e is not failure and e.failed]
    for e in others:
        log(f"  then rank {e.rank} {e.status()}")
    if failure.shown_lines():
        log(f"last lines of rank {failure.rank}:\n" + "\n".join(
            f"    [{failure.rank}] {line}" for line in failure.shown_lines()))
    return failure.exit_code()


def run(config: LaunchConfig, log=None) -> int:
    """Launches the group, restarting it up to ``config.max_restarts`` times; the exit code."""
    log = log or (lambda text: print(f"{PROG}: {text}", file=sys.stderr, flush=True))
    memory = elastic_memory(config)
    try:
        if config.discovery is not None:
            return _run_discovered(config, log, memory)
        return _run_fixed(config, log, memory)
    finally:
        if memory is not None:
            shutil.rmtree(memory, ignore_errors=True)


def _run_fixed(config: LaunchConfig, log, memory: str | None) -> int:
    code, nproc, hosts = 0, config.nproc, config.hosts
    for attempt in range(config.max_restarts + 1):
        group = group_start(config, attempt, nproc, memory, hosts)
        result = run_group(config, group)
        if result.ok:
            return 0
        code = report(result, log)
        if result.interrupted:
            return code
        if attempt < config.max_restarts:
            if config.min_np is not None and nproc > config.min_np:
                nproc -= 1
                if hosts is not None:
                    hosts = hosts_lib.without_slot(hosts, group.placement(
                        result.failure.rank).host)
                log(f"rank {result.failure.rank}'s slot is dropped (a failed slot counts as "
                    f"a lost host); {nproc} remain (--min-np {config.min_np})")
            log(f"restarting the group ({attempt + 1} of {config.max_restarts} restarts) "
                f"with {nproc} process{'es' if nproc > 1 else ''}")
    return code


def _run_discovered(config: LaunchConfig, log, memory: str | None) -> int:
    """The elastic loop (:mod:`parallax.distributed.elastic_hosts` says what it does)."""
    failures, attempt = 0, 0
    while True:
        hosts = elastic_hosts.wait_for_slots(config, log)
        count = elastic_hosts.process_count(config, hosts, first=attempt == 0)
        group = group_start(config, attempt, count, memory, hosts)
        log(f"starting {count} process{'es' if count > 1 else ''} on "
            f"{', '.join(dict.fromkeys(p.host for p in group.placements))}")
        result = run_group(config, group, elastic_hosts.growth_watch(config, count))
        if result.ok:
            return 0
        attempt += 1
        if result.stopped_for is not None:
            continue
        code = report(result, log)
        if result.interrupted or failures >= config.max_restarts:
            return code
        failures += 1
        log(f"restarting the group ({failures} of {config.max_restarts} restarts) on the "
            "hosts the discovery script reports")


def elastic_memory(config: LaunchConfig) -> str | None:
    """A directory in this machine's RAM (tmpfs) for elastic commits, kept across restarts
    and removed at the end (``parallax.checkpoint.elastic``); None without restarts, or when
    a rank may run on another machine (several nodes, hosts reached by ssh, discovered
    hosts): those runs keep commits in a ``directory=`` every process can reach."""
    if config.max_restarts == 0 or config.nnodes > 1 or config.discovery is not None:
        return None
    if config.hosts is not None and not all(hosts_lib.is_local(h.name) for h in config.hosts):
        return None
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="parallax-elastic-", dir=shm)


def main(args: argparse.Namespace | Sequence[str]) -> int:
    """``parallax launch``'s entry point: parsed options (or argv) -> exit code."""
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog=PROG, allow_abbrev=False)
        add_arguments(parser)
        args = parser.parse_args(list(args))
    try:
        return run(config_from_args(args))
    except LaunchError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
        return 2
