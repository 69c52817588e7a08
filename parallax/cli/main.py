"""The ``parallax`` command: ``demo``, ``explain``, ``plan``, ``bench`` and ``launch``."""

from __future__ import annotations

import argparse
import sys

import jax

from parallax.cli import explain_and_plan
from parallax.distributed import launch as launch_lib
from parallax.distributed import runtime as distributed_runtime


def simulate_cpu_devices(count: int) -> str:
    """Asks for ``count`` CPU devices, which matters only when no accelerator is present.

    Must run before JAX first touches a device; when that has already happened (the CLI is
    called from a running program) the devices are left as they are.
    """
    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # backends already initialised: keep what the caller set up
    backend = jax.default_backend()
    if backend == "cpu":
        return f"no accelerator found: {jax.device_count()} simulated CPU devices"
    return f"{jax.device_count()} {backend} devices"


def _join_launched_job() -> bool:
    """Under ``parallax launch`` (or torchrun, TF_CONFIG): join the job before JAX starts."""
    return distributed_runtime.initialize().is_multiprocess


def _demo(args) -> int:
    from parallax.cli import demo

    launched = _join_launched_job() and args.devices is None
    if launched:
        print(f"parallax demo: process {jax.process_index()} of {jax.process_count()}, "
              f"{jax.device_count()} devices in all")
    else:
        print(f"parallax demo: {simulate_cpu_devices(args.devices or 8)}")
    result = demo.run(args.strategy, steps=args.steps, batch=args.batch,
                      tensor=args.tensor, progress=not args.quiet,
                      checkpoint_dir=args.checkpoint_dir, logdir=args.logdir,
                      profile_steps=args.profile_steps)
    print(demo.report(result))
    ok = demo.loss_gap_ok(result, args.tolerance)
    if not ok:
        print(f"FAILED: the parallel run differs from one device by more than "
              f"{args.tolerance:g} (relative)", file=sys.stderr)
    if launched:  # process 0 hosts the coordinator: it must not leave before the others
        distributed_runtime.shutdown()
    return 0 if ok else 1


def _simulated(args) -> int:
    """CPU devices to simulate: the devices asked for, but never more than 8 with a cluster
    (a cluster's larger counts are predicted, not simulated)."""
    count = args.devices or 8
    return min(count, 8) if args.cluster else count


def _explain(args) -> int:
    print(f"parallax explain: {simulate_cpu_devices(_simulated(args))}")
    return explain_and_plan.run_explain(args)


def _plan(args) -> int:
    print(f"parallax plan: {simulate_cpu_devices(_simulated(args))}")
    return explain_and_plan.run_plan(args)


def _bench_comm(args) -> int:
    simulate_cpu_devices(args.devices)
    from parallax.comm import bench

    return bench.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parallax", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train GPT tiny in parallel and check it on one device")
    demo.add_argument("--strategy", default="dp+fsdp+tp",
                      help="parts joined by '+': dp, fsdp, zero1, zero2, zero3, tp, tp-sp "
                           "(default dp+fsdp+tp: DP 2 x FSDP 2 x TP 2 on 8 devices; fitted to "
                           "the devices present)")
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--batch", type=int, default=16)
    demo.add_argument("--devices", type=int, default=None,
                      help="simulated CPU devices when no accelerator is present (default 8; "
                           "under parallax launch, --devices-per-process decides)")
    demo.add_argument("--tensor", type=int, default=2, help="tensor-parallel size")
    demo.add_argument("--tolerance", type=float, default=1e-4,
                      help="largest relative loss difference accepted vs one device")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.add_argument("--checkpoint-dir", default=None,
                      help="resume from the newest checkpoint in this directory (if any) and "
                           "save to it every 10 steps and at the end")
    demo.add_argument("--logdir", default=None,
                      help="write each step's loss, throughput, MFU and memory to "
                           "LOGDIR/metrics.jsonl and TensorBoard event files")
    demo.add_argument("--profile-steps", default=None, metavar="FIRST:STOP",
                      help="trace these steps with jax.profiler (e.g. 3:5) into --logdir "
                           "(./parallax-logs without one); open in Perfetto or TensorBoard")
    demo.set_defaults(run=_demo)

    explain = commands.add_parser(
        "explain", help="predicted vs compiled memory, collectives, flops and time of a step",
        description=explain_and_plan.__doc__)
    explain_and_plan.add_explain_arguments(explain)
    explain.set_defaults(run=_explain)

    plan = commands.add_parser("plan", help="propose a mesh and a strategy for a model",
                               description=explain_and_plan.__doc__)
    explain_and_plan.add_plan_arguments(plan)
    plan.set_defaults(run=_plan)

    bench = commands.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="kind", required=True)
    comm = kinds.add_parser("comm", help="nccl-tests style collective benchmark")
    comm.add_argument("--devices", type=int, default=8,
                      help="simulated CPU devices when no accelerator is present")
    from parallax.comm import bench as comm_bench

    comm_bench.add_arguments(comm)
    comm.set_defaults(run=_bench_comm)

    launch = commands.add_parser(
        "launch", help="start N processes of a program (like horovodrun / torchrun)",
        description=launch_lib.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False)
    launch_lib.add_arguments(launch)
    launch.set_defaults(run=launch_lib.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)

