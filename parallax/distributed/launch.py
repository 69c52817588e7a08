"""``parallax launch``: start N processes of one program, as ``horovodrun`` and ``torchrun`` do.

    parallax launch -np 2 python train.py
    parallax launch -np 2 --devices-per-process 2 parallax demo
    parallax launch -np 4 --nnodes 2 --node-rank 0 --coordinator 10.0.0.1:1234 python train.py

Each process gets the environment :func:`parallax.distributed.initialize` reads
(``PARALLAX_COORDINATOR``, ``PARALLAX_NUM_PROCESSES``, ``PARALLAX_PROCESS_ID``, ... see
:data:`parallax.distributed.environment.LAUNCH_VARIABLES`) and torchrun's variables with
torchrun's meanings (:data:`~parallax.distributed.torchrun_exports.TORCHRUN_EXPORTS`), for scripts, data loaders and loggers
written against torchrun. Output lines are prefixed with
the rank. The first process to fail stops the group (:mod:`parallax.distributed.supervisor`)
and the launcher exits with its code, naming it. With ``--max-restarts K`` the whole group is
started again, up to K times, with ``PARALLAX_RESTART`` counting the restarts (a program
resumes from its last checkpoint). With ``--min-np M`` each restart drops the failed slot,
down to M processes; the commits of ``hvd.elastic`` live in a RAM directory the launcher keeps
across restarts. Several nodes: the same command on every node, with
``--nnodes``, ``--node-rank`` and the coordinator's address; node 0 hosts the coordinator.

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

from parallax.distributed.coordinator_address import (LaunchError, check_port_free,
                                                       free_port, free_port_pair,
                                                       split_address, wait_for_coordinator)
from parallax.distributed.supervisor import GroupResult, ProcessGroup
from parallax.distributed.torchrun_exports import torchrun_environment

PROG = "parallax launch"



@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What to launch, validated (see :func:`config_from_args`).

    Attributes:
      command: the program and its arguments.
      nproc: processes on this node.
      devices_per_process: devices each process uses (None: JAX's default).
      nnodes, node_rank: nodes in the job and this node's index.
      coordinator: ``host:port`` of the coordination service (None: a free loopback port).
      max_restarts: how many times the whole group may be started again after a failure.
      grace_s: seconds between SIGTERM and SIGKILL when stopping the group.
      exit_grace_s: at most how long rank 0 keeps the coordination service up at exit for
        ranks still finishing (on other nodes, or that did not exit yet).
      connect_timeout_s: how long nodes other than 0 wait for the coordinator to answer.
      prefix: prefix output lines with the rank.
      min_np: elastic runs: after a failure, restart with one process fewer (the failed
        slot counts as a lost host), down to this many (None: always the full group).

    Example:
      >>> config = LaunchConfig(("python", "train.py"), nproc=2, nnodes=2, node_rank=1,
      ...                       coordinator="10.0.0.1:29400")
      >>> config.world_size, group_start(config, attempt=0).ranks
      (4, (2, 3))
    """

    command: tuple[str, ...]
    nproc: int
    devices_per_process: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    coordinator: str | None = None
    max_restarts: int = 0
    grace_s: float = 3.0
    exit_grace_s: float = 5.0
    connect_timeout_s: float = 60.0
    prefix: bool = True
    min_np: int | None = None

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


@dataclasses.dataclass(frozen=True)
class GroupStart:
    """One start of the group: the coordinator, and the global ranks run on this node."""

    coordinator: str
    bind: str
    ranks: tuple[int, ...]
    world_size: int
    attempt: int
    memory: str | None = None  # a directory in RAM that outlives restarts (elastic commits)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``parallax launch``."""
    parser.add_argument("-np", "--nproc", type=int, required=True,
                        help="processes to start on this node")
    parser.add_argument("--devices-per-process", type=int, default=None, metavar="K",
                        help="devices per process (on CPU: K simulated devices each)")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes in the job")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index")
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="the coordination service, on node 0 (default: a free port on "
                             "127.0.0.1; required with --nnodes > 1)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="start the whole group again after a failure, up to K times")
    parser.add_argument("--min-np", type=int, default=None, metavar="M",
                        help="elastic: restart with one process fewer after each failure, "
                             "down to M (one node; default: always -np)")
    parser.add_argument("--grace", type=float, default=3.0, metavar="S",
                        help="seconds between SIGTERM and SIGKILL when stopping (default 3)")
    parser.add_argument("--exit-grace", type=float, default=5.0, metavar="S",
                        help="at most how long rank 0 keeps the coordinator up for ranks "
                             "still finishing (default 5)")
    parser.add_argument("--connect-timeout", type=float, default=60.0, metavar="S",
                        help="how long other nodes wait for the coordinator (default 60)")
    parser.add_argument("--no-prefix", action="store_true", help="do not prefix output lines")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program to run and its arguments")


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Validates the parsed options (:class:`LaunchError` with the fix otherwise)."""
    command = tuple(args.command[1:] if args.command[:1] == ["--"] else args.command)
    if not command:
        raise LaunchError("no command given; e.g. `parallax launch -np 2 python train.py`.")
    if args.nproc < 1:
        raise LaunchError(f"-np {args.nproc}: the number of processes must be >= 1.")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        raise LaunchError(f"--devices-per-process {args.devices_per_process} must be >= 1.")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        raise LaunchError(f"--node-rank {args.node_rank} must be in 0 .. {args.nnodes - 1} "
                          f"(--nnodes {args.nnodes}).")
    if args.nnodes > 1 and args.coordinator is None:
        raise LaunchError(f"--nnodes {args.nnodes} needs --coordinator HOST:PORT (an address "
                          "of node 0 that every node can reach).")
    if args.coordinator is not None:
        split_address(args.coordinator)
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts {args.max_restarts} must be >= 0.")
    if args.min_np is not None and not (1 <= args.min_np <= args.nproc and args.nnodes == 1):
        raise LaunchError(f"--min-np {args.min_np} must be in 1 .. -np {args.nproc}, on one "
                          "node (--nnodes 1).")
    for name in ("grace", "exit_grace", "connect_timeout"):
        if getattr(args, name) < 0:
            raise LaunchError(f"--{name.replace('_', '-')} must be >= 0 seconds.")
    if shutil.which(command[0]) is None:
        raise LaunchError(f"command not found: {command[0]!r} is not an executable on PATH "
                          f"(PATH={os.environ.get('PATH', '')}).")
    return LaunchConfig(command, args.nproc, args.devices_per_process, args.nnodes,
                        args.node_rank, args.coordinator, args.max_restarts, args.grace,
                        args.exit_grace, args.connect_timeout, not args.no_prefix,
                        args.min_np)


def group_start(config: LaunchConfig, attempt: int, nproc: int | None = None,
         memory: str | None = None) -> GroupStart:
    """Where and which ranks this node starts on ``attempt`` (0 = the first start).

    Every start runs the full world; a policy that shrinks the group after failures
    (``--min-np``, elastic training) replaces this function's choice of ``world_size``.
    """
    if config.coordinator is None:
        coordinator = f"127.0.0.1:{free_port_pair()}"  # and MASTER_PORT one below
        bind = coordinator
    else:
        coordinator = bind = config.coordinator
    if nproc is None or nproc == config.nproc:
        first = config.node_rank * config.nproc
        return GroupStart(coordinator, bind, tuple(range(first, first + config.nproc)),
                         config.world_size, attempt, memory)
    return GroupStart(coordinator, bind, tuple(range(nproc)), nproc, attempt, memory)  # --min-np


def environment(config: LaunchConfig, group: GroupStart, rank: int,
                base: dict | None = None) -> dict:
    """The environment of one process (what ``px.distributed.initialize()`` reads)."""
    env = dict(os.environ if base is None else base)
    env.update({
        "PARALLAX_COORDINATOR": group.coordinator,
        "PARALLAX_COORDINATOR_BIND": group.bind,
        "PARALLAX_NUM_PROCESSES": str(group.world_size),
        "PARALLAX_PROCESS_ID": str(rank),
        "PARALLAX_LOCAL_RANK": str(rank - group.ranks[0]),
        "PARALLAX_LOCAL_SIZE": str(len(group.ranks)),
        "PARALLAX_NODE_RANK": str(config.node_rank),
        "PARALLAX_NUM_NODES": str(config.nnodes),
        "PARALLAX_RESTART": str(group.attempt),
        "PARALLAX_EXIT_GRACE": str(config.exit_grace_s),
        "PYTHONUNBUFFERED": "1",  # a failing rank's last lines must not die in a buffer
    })
    env.update(torchrun_environment(group.coordinator, rank, group.ranks, group.world_size,
                                    config.node_rank, config.nnodes, group.attempt,
                                    config.max_restarts))
    env.pop("PARALLAX_EXIT_GATE_FD", None)
    if group.memory is not None:
        env["PARALLAX_ELASTIC_MEMORY"] = group.memory
    if config.devices_per_process is not None:
        env["PARALLAX_DEVICES_PER_PROCESS"] = str(config.devices_per_process)
    return env


def run_group(config: LaunchConfig, group: GroupStart) -> GroupResult:
    """Starts one group and supervises it to its end."""
    if config.node_rank == 0:
        if config.coordinator is not None:
            check_port_free(group.bind)
    else:
        wait_for_coordinator(group.coordinator, config.connect_timeout_s)
    envs = [environment(config, group, r) for r in group.ranks]
    gate = 0 if config.node_rank == 0 and config.nnodes == 1 else None
    procs = ProcessGroup(config.command, envs, grace_s=config.grace_s, prefix=config.prefix,
                         gate_rank=gate)
    procs.start()
    return procs.run()


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
    code, nproc = 0, config.nproc
    memory = elastic_memory(config)
    try:
        for attempt in range(config.max_restarts + 1):
            group = group_start(config, attempt, nproc, memory)
            result = run_group(config, group)
            if result.ok:
                return 0
            code = report(result, log)
            if result.interrupted:
                return code
            if attempt < config.max_restarts:
                if config.min_np is not None and nproc > config.min_np:
                    nproc -= 1
                    log(f"rank {result.failure.rank}'s slot is dropped (a failed slot counts as "
                        f"a lost host); {nproc} remain (--min-np {config.min_np})")
                log(f"restarting the group ({attempt + 1} of {config.max_restarts} restarts) "
                    f"with {nproc} process{'es' if nproc > 1 else ''}")
        return code
    finally:
        if memory is not None:
            shutil.rmtree(memory, ignore_errors=True)


def elastic_memory(config: LaunchConfig) -> str | None:
    """A directory in the node's RAM (tmpfs) for elastic commits, kept across restarts and
    removed at the end (``parallax.checkpoint.elastic``); None without restarts or on
    several nodes."""
    if config.max_restarts == 0 or config.nnodes > 1:
        return None
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="parallax-elastic-", dir=shm)


def main(args: argparse.Namespace | Sequence[str]) -> int:
    """``parallax launch``'s entry point: parsed options (or argv) -> exit code."""
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(prog=PROG)
        add_arguments(parser)
        args = parser.parse_args(list(args))
    try:
        return run(config_from_args(args))
    except LaunchError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr, flush=True)
        return 2
