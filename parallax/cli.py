"""The ``parallax`` command: ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import sys

import jax


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


def _demo(args) -> int:
    from parallax import demo

    print(f"parallax demo: {simulate_cpu_devices(args.devices)}")
    result = demo.run(args.strategy, steps=args.steps, batch=args.batch,
                      tensor=args.tensor, progress=not args.quiet)
    print(demo.report(result))
    if not demo.loss_gap_ok(result, args.tolerance):
        print(f"FAILED: the parallel run differs from one device by more than "
              f"{args.tolerance:g} (relative)", file=sys.stderr)
        return 1
    return 0


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
    demo.add_argument("--devices", type=int, default=8,
                      help="simulated CPU devices when no accelerator is present")
    demo.add_argument("--tensor", type=int, default=2, help="tensor-parallel size")
    demo.add_argument("--tolerance", type=float, default=1e-4,
                      help="largest relative loss difference accepted vs one device")
    demo.add_argument("--quiet", action="store_true", help="no progress bars")
    demo.set_defaults(run=_demo)

    bench = commands.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="kind", required=True)
    comm = kinds.add_parser("comm", help="nccl-tests style collective benchmark")
    comm.add_argument("--devices", type=int, default=8,
                      help="simulated CPU devices when no accelerator is present")
    from parallax.comm import bench as comm_bench

    comm_bench.add_arguments(comm)
    comm.set_defaults(run=_bench_comm)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
