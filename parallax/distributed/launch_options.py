"""``parallax launch``'s options, in its own, torchrun's and horovodrun's spellings.

One meaning per flag, whichever launcher's spelling it is (docs/distributed.md has the
table): ``-np`` is the TOTAL number of processes, as horovodrun's (until this version it
counted the processes of one node); ``--nproc-per-node`` is the number on each node, as
torchrun's. ``-H``/``--hostfile``/``--host-discovery-script`` make this launcher start every
rank of every host (remote ones with ssh), as horovodrun does; ``--nnodes``/``--node-rank``
mean the same command runs on every node, as torchrun. Combinations that disagree or mean
nothing are refused here, naming the flags, their values, the rule and a fix.

Example:
  >>> import argparse
  >>> parser = argparse.ArgumentParser()
  >>> add_arguments(parser)
  >>> config = config_from_args(parser.parse_args(
  ...     ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1",
  ...      "--master-addr", "10.0.0.1", "--master-port", "29500", "-m", "json.tool"]))
  >>> config.nproc, config.world_size, config.coordinator, config.command[1:]
  (2, 4, '10.0.0.1:29501', ('-m', 'json.tool'))

References:
  PyTorch torch/distributed/run.py (torchrun's arguments); Horovod horovod/runner/launch.py
  (horovodrun's arguments).

(Over 300 lines: one table of flags in three launchers' spellings and the checks between
them, kept together so that each flag's meaning and its refusals are in one place.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

from parallax.distributed import hosts as hosts_lib
from parallax.distributed.coordinator_address import LaunchError, split_address
from parallax.distributed.launch_config import LaunchConfig
from parallax.distributed.remote import SshOptions

TORCHRUN_MASTER_PORT = 29500  # torchrun's default --master-port


def _both(parser, *names, **kwargs):
    """An option under its torchrun spellings (dashes and underscores)."""
    parser.add_argument(*names, *["--" + n[2:].replace("-", "_") for n in names
                                  if n.startswith("--") and "-" in n[2:]], **kwargs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``parallax launch``."""
    count = parser.add_argument_group("how many processes")
    count.add_argument("-np", "--num-proc", dest="np", type=int, default=None, metavar="N",
                       help="TOTAL processes in the job (horovodrun's -np; it counted "
                            "processes per node before)")
    _both(count, "--nproc-per-node", dest="nproc_per_node", default=None, metavar="N",
          help="processes on each node (torchrun's; an integer or 'cpu')")
    count.add_argument("--nproc", dest="old_nproc", type=int, default=None,
                       help=argparse.SUPPRESS)  # gone: a pinned error says what replaced it
    count.add_argument("--devices-per-process", type=int, default=None, metavar="K",
                       help="devices per process (on CPU: K simulated devices each)")
    nodes = parser.add_argument_group("nodes (torchrun: the same command on every node)")
    nodes.add_argument("--nnodes", default=None, metavar="N", help="nodes in the job (N, or "
                       "torchrun's MIN:MAX with MIN == MAX)")
    _both(nodes, "--node-rank", type=int, default=None, help="this node's index (default 0)")
    nodes.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       help="the coordination service, on node 0 (default: a free port on "
                            "127.0.0.1)")
    _both(nodes, "--master-addr", default=None, metavar="HOST",
          help="torchrun's: node 0's address (the coordinator is MASTER_ADDR:MASTER_PORT+1)")
    _both(nodes, "--master-port", type=int, default=None, metavar="PORT",
          help=f"torchrun's: MASTER_PORT (default {TORCHRUN_MASTER_PORT} with --master-addr)")
    nodes.add_argument("--standalone", action="store_true",
                       help="torchrun's: one node, a free local port (the default here)")
    _both(nodes, "--rdzv-backend", default=None, metavar="static",
          help="torchrun's: only 'static' (fixed nodes and node ranks)")
    _both(nodes, "--rdzv-endpoint", default=None, metavar="HOST:PORT",
          help="torchrun's static rendezvous: = --master-addr HOST --master-port PORT")
    _both(nodes, "--rdzv-id", default=None, metavar="ID", help="TORCHELASTIC_RUN_ID")
    remote = parser.add_argument_group("hosts (horovodrun: this launcher starts every rank)")
    remote.add_argument("-H", "--hosts", default=None, metavar="HOST:SLOTS,...",
                        help="hosts and their slots; ranks fill them in order")
    remote.add_argument("-hostfile", "--hostfile", default=None, metavar="FILE",
                        help="a file of `HOST slots=N` lines")
    remote.add_argument("--host-discovery-script", default=None, metavar="SCRIPT",
                        help="elastic: prints the available HOST:SLOTS lines; the job grows "
                             "back when it reports more")
    remote.add_argument("--slots-per-host", "--slots", dest="slots_per_host", type=int,
                        default=None, metavar="N", help="slots of a discovered host printed "
                                                        "without them")
    remote.add_argument("-p", "--ssh-port", type=int, default=None, help="ssh's port")
    remote.add_argument("-i", "--ssh-identity-file", default=None, metavar="FILE",
                        help="ssh's identity file")
    faults = parser.add_argument_group("faults and restarts")
    _both(faults, "--max-restarts", type=int, default=0, metavar="K",
          help="start the whole group again after a failure, up to K times")
    faults.add_argument("--min-np", type=int, default=None, metavar="M",
                        help="elastic: after each failure restart one process smaller, down "
                             "to M (with a discovery script: wait for M slots)")
    faults.add_argument("--max-np", type=int, default=None, metavar="M",
                        help="elastic, with --host-discovery-script: at most M processes")
    faults.add_argument("--start-timeout", "--connect-timeout", dest="start_timeout",
                        type=float, default=60.0, metavar="S",
                        help="how long the job may take to start: other nodes wait for the "
                             "coordinator, a discovery script for --min-np slots (default 60)")
    faults.add_argument("--grace", type=float, default=3.0, metavar="S",
                        help="seconds between SIGTERM and SIGKILL when stopping (default 3)")
    faults.add_argument("--exit-grace", type=float, default=5.0, metavar="S",
                        help="at most how long rank 0 keeps the coordinator up for ranks "
                             "still finishing (default 5)")
    program = parser.add_argument_group("the program")
    program.add_argument("--no-prefix", action="store_true",
                         help="do not prefix output lines")
    program.add_argument("-m", "--module", action="store_true",
                         help="torchrun's: run `python -m COMMAND` with this Python")
    _both(program, "--no-python", action="store_true",
          help="torchrun's: run COMMAND as an executable even if it ends in .py")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program and its arguments: train.py (run with this Python), "
                             "python train.py, or any executable")


def _program(args: argparse.Namespace) -> tuple[str, ...]:
    command = list(args.command[1:] if args.command[:1] == ["--"] else args.command)
    if not command:
        raise LaunchError("no command given; e.g. `parallax launch -np 2 python train.py` or "
                          "`parallax launch --nproc-per-node 2 train.py`.")
    if args.module and args.no_python:
        raise LaunchError("-m/--module and --no-python exclude each other (torchrun's rule): "
                          "-m runs `python -m MODULE`, --no-python runs an executable.")
    if args.module:
        return (sys.executable, "-m", *command)
    if command[0].endswith(".py") and not args.no_python:
        if not os.path.isfile(command[0]):
            raise LaunchError(f"script not found: {command[0]!r} (in {os.getcwd()}); a "
                              "COMMAND ending in .py runs with this Python, as torchrun does.")
        return (sys.executable, *command)
    if shutil.which(command[0]) is None:
        raise LaunchError(f"command not found: {command[0]!r} is not an executable on PATH "
                          f"(PATH={os.environ.get('PATH', '')}).")
    return tuple(command)


def _nnodes(text: str | None) -> int:
    if text is None:
        return 1
    low, sep, high = text.partition(":")
    if not low.isdigit() or (sep and not high.isdigit()):
        raise LaunchError(f"--nnodes {text!r} is not N or MIN:MAX.")
    if sep and low != high:
        raise LaunchError(
            f"--nnodes {text}: an elastic node count (torchrun's MIN:MAX, where the c10d "
            "rendezvous admits MIN to MAX nodes as they come) is not supported: the "
            "coordinator and node ranks are fixed at start. Use --nnodes N; to outlive "
            "failures use --max-restarts, and to grow and shrink with the hosts, -H with "
            "--host-discovery-script and --min-np/--max-np.")
    if int(low) < 1:
        raise LaunchError(f"--nnodes {text} must be >= 1.")
    return int(low)


def _per_node(args: argparse.Namespace, nnodes: int) -> int:
    per_node = args.nproc_per_node
    if per_node is not None:
        if per_node == "cpu":
            per_node = os.cpu_count() or 1
        elif not str(per_node).isdigit():
            raise LaunchError(f"--nproc-per-node {per_node!r} must be an integer or 'cpu' "
                              "('gpu' and 'auto' would need the accelerators counted before "
                              "any process starts: give the number).")
        per_node = int(per_node)
        if per_node < 1:
            raise LaunchError(f"--nproc-per-node {per_node} must be >= 1.")
    if args.np is not None and args.np < 1:
        raise LaunchError(f"-np {args.np}: the number of processes must be >= 1.")
    if args.np is None:
        return per_node or 1  # torchrun's default: one process per node
    if per_node is not None and per_node * nnodes != args.np:
        raise LaunchError(
            f"-np {args.np} and --nproc-per-node {per_node} disagree: -np is the TOTAL number "
            f"of processes (horovodrun's meaning), --nproc-per-node the number per node "
            f"(torchrun's); {per_node} per node x {nnodes} node(s) = {per_node * nnodes}. "
            "Give one of them.")
    if args.np % nnodes:
        raise LaunchError(
            f"-np {args.np} with --nnodes {nnodes}: -np is the TOTAL number of processes "
            "(horovodrun's meaning; it counted processes per node before), so it must be a "
            f"multiple of --nnodes. For {args.np} per node use --nproc-per-node {args.np}.")
    return args.np // nnodes


def _coordinator(args: argparse.Namespace) -> str | None:
    given = [flag for flag, value in (("--coordinator", args.coordinator),
                                      ("--master-addr/--master-port",
                                       args.master_addr or args.master_port),
                                      ("--rdzv-endpoint", args.rdzv_endpoint)) if value]
    if len(given) > 1:
        raise LaunchError(f"{' and '.join(given)} both name the coordinator: give one "
                          "(--coordinator HOST:PORT is --master-addr HOST --master-port "
                          "PORT-1).")
    if args.rdzv_backend not in (None, "static"):
        raise LaunchError(
            f"--rdzv-backend {args.rdzv_backend}: only 'static' is supported (fixed nodes, "
            "each with its --node-rank); torchrun's c10d and etcd rendezvous assign node "
            "ranks as nodes join, which a fixed coordinator cannot. Use --nnodes N --node-rank "
            "R --master-addr HOST --master-port PORT on every node.")
    if args.coordinator is not None:
        split_address(args.coordinator)
        return args.coordinator
    if args.rdzv_endpoint is not None:
        host, port = split_address(args.rdzv_endpoint, "--rdzv-endpoint")
        return f"{host}:{port + 1}"
    if args.master_addr or args.master_port:
        port = args.master_port or TORCHRUN_MASTER_PORT
        if not 0 < port < 65535:
            raise LaunchError(f"--master-port {port} must be in 1 .. 65534.")
        return f"{args.master_addr or '127.0.0.1'}:{port + 1}"
    return None


def _host_mode_conflicts(args: argparse.Namespace) -> None:
    source = ("--host-discovery-script" if args.host_discovery_script else
              "-H" if args.hosts else "--hostfile")
    if sum(bool(x) for x in (args.hosts, args.hostfile, args.host_discovery_script)) > 1:
        raise LaunchError("-H, --hostfile and --host-discovery-script each list the hosts: "
                          "give one of them (horovodrun's rule).")
    for flag, value in (("--nnodes", args.nnodes), ("--node-rank", args.node_rank),
                        ("--nproc-per-node", args.nproc_per_node),
                        ("--standalone", args.standalone),
                        ("--rdzv-backend", args.rdzv_backend),
                        ("--rdzv-endpoint", args.rdzv_endpoint)):
        if value not in (None, False):
            raise LaunchError(
                f"{flag} with {source}: {flag} is torchrun's (the same command on every node), "
                f"while with {source} this launcher starts every rank on every host itself "
                "(horovodrun's way). Leave it out; -np is the total and each host's slots "
                "say how many run there.")


def _host_config(args: argparse.Namespace, command: tuple[str, ...], common: dict):
    _host_mode_conflicts(args)
    if args.host_discovery_script:
        script = args.host_discovery_script
        if shutil.which(script) is None:
            raise LaunchError(f"--host-discovery-script {script!r} is not an executable (a "
                              "path, or a name on PATH, with its x bit set).")
        min_np = args.min_np if args.min_np is not None else args.np
        if min_np is None:
            raise LaunchError("--host-discovery-script needs --min-np M (or -np N): the "
                              "fewest processes the job runs with.")
        if min_np < 1 or (args.max_np is not None and args.max_np < min_np):
            raise LaunchError(f"--min-np {min_np} and --max-np {args.max_np}: need 1 <= "
                              "--min-np <= --max-np.")
        if args.np is not None and not (min_np <= args.np <= (args.max_np or args.np)):
            raise LaunchError(f"-np {args.np} must be in --min-np {min_np} .. --max-np "
                              f"{args.max_np}.")
        return LaunchConfig(command, args.np or 0, min_np=min_np, max_np=args.max_np,
                            discovery=script, **common)
    hosts = (hosts_lib.parse_hosts(args.hosts) if args.hosts
             else hosts_lib.parse_hostfile(args.hostfile))
    if args.max_np is not None:
        raise LaunchError("--max-np needs --host-discovery-script: with a fixed host list the "
                          "job never grows (use -np).")
    nproc = args.np if args.np is not None else hosts_lib.total_slots(hosts)
    if nproc < 1:
        raise LaunchError(f"-np {nproc}: the number of processes must be >= 1.")
    hosts_lib.place(hosts, nproc)  # enough slots?
    if args.min_np is not None and not 1 <= args.min_np <= nproc:
        raise LaunchError(f"--min-np {args.min_np} must be in 1 .. -np {nproc}.")
    return LaunchConfig(command, nproc, min_np=args.min_np, hosts=hosts, **common)


def config_from_args(args: argparse.Namespace):
    """Validates the parsed options into a :class:`~parallax.distributed.launch.LaunchConfig`
    (:class:`LaunchError` naming the flags, the rule and the fix otherwise)."""
    if getattr(args, "old_nproc", None) is not None:
        raise LaunchError(f"--nproc {args.old_nproc}: --nproc is gone (it counted the "
                          "processes of one node); use --nproc-per-node N for N per node "
                          "(torchrun's) or -np N for N in all (horovodrun's).")
    command = _program(args)
    if args.devices_per_process is not None and args.devices_per_process < 1:
        raise LaunchError(f"--devices-per-process {args.devices_per_process} must be >= 1.")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts {args.max_restarts} must be >= 0.")
    for name in ("grace", "exit_grace", "start_timeout"):
        if getattr(args, name) < 0:
            raise LaunchError(f"--{name.replace('_', '-')} must be >= 0 seconds.")
    common = dict(devices_per_process=args.devices_per_process,
                  coordinator=_coordinator(args), max_restarts=args.max_restarts,
                  grace_s=args.grace, exit_grace_s=args.exit_grace,
                  connect_timeout_s=args.start_timeout, prefix=not args.no_prefix,
                  run_id=args.rdzv_id)
    if args.hosts or args.hostfile or args.host_discovery_script:
        ssh = SshOptions(args.ssh_port, args.ssh_identity_file)
        return _host_config(args, command, {**common, "ssh": ssh,
                                            "slots_per_host": args.slots_per_host})
    for flag, value in (("--max-np", args.max_np), ("--slots-per-host", args.slots_per_host),
                        ("-p/--ssh-port", args.ssh_port),
                        ("-i/--ssh-identity-file", args.ssh_identity_file)):
        if value is not None:
            raise LaunchError(f"{flag} needs -H, --hostfile or --host-discovery-script "
                              "(horovodrun's hosts); without them every process runs here.")
    nnodes = _nnodes(args.nnodes)
    nproc = _per_node(args, nnodes)
    node_rank = 0 if args.node_rank is None else args.node_rank
    if args.min_np is not None and not (1 <= args.min_np <= nproc and nnodes == 1):
        raise LaunchError(f"--min-np {args.min_np} must be in 1 .. {nproc} (the processes), "
                          "on one node (--nnodes 1); across hosts use -H or "
                          "--host-discovery-script with --min-np.")
    if args.standalone and (nnodes > 1 or common["coordinator"] is not None):
        raise LaunchError("--standalone is one node with a free local port (torchrun's "
                          "meaning): it excludes --nnodes > 1, --coordinator, --master-addr/"
                          "--master-port and --rdzv-endpoint.")
    if not 0 <= node_rank < nnodes:
        raise LaunchError(f"--node-rank {node_rank} must be in 0 .. {nnodes - 1} "
                          f"(--nnodes {nnodes}).")
    if nnodes > 1 and common["coordinator"] is None:
        raise LaunchError(f"--nnodes {nnodes} needs --coordinator HOST:PORT (or --master-addr "
                          "HOST --master-port PORT): an address of node 0 that every node "
                          "can reach.")
    return LaunchConfig(command, nproc, nnodes=nnodes, node_rank=node_rank,
                        min_np=args.min_np, **common)
