"""The full communication sweep: every collective and algorithm over a wide range of sizes.

Runs ``parallax bench comm`` with a sweep sized for the platform (CPU: 1K..4M; GPU/TPU:
1K..256M), writes the rows as JSON, and fits the alpha-beta model (latency, bandwidth) to the
ring all-reduce times with :func:`parallax.comm.cost.fit_link`: that is how the ``cpu-sim``
preset was obtained, and how to make a preset for your own cluster.

Usage:
  python benchmarks/comm_sweep.py [--out comm_sweep.json] [--devices 8] [extra bench args]

Any further arguments go to the benchmark (e.g. ``-e 16M --dtype bfloat16``).
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="comm_sweep.json", help="JSON output path")
    parser.add_argument("--devices", type=int, default=8)
    ours, rest = parser.parse_known_args(argv)

    from parallax.comm import bench, cost

    devices = bench._devices(ours.devices)  # before anything else touches a device
    big = "4M" if devices[0].platform == "cpu" else "256M"
    args = ["-b", "1K", "-e", big, "-f", "4", "--devices", str(ours.devices),
            "--json", ours.out] + rest
    status = bench.main(args)
    with open(ours.out) as fh:
        rows = json.load(fh)["rows"]
    ring = [r for r in rows if r["op"] == "all_reduce" and r["algorithm"] == "ring"]
    if len(ring) >= 2:
        fit = cost.fit_link([r["size"] for r in ring], [r["time_us"] * 1e-6 for r in ring],
                            ours.devices, "ring", name=f"{devices[0].platform}-fitted")
        print(f"# alpha-beta fit to ring all-reduce: latency {fit.latency * 1e6:.1f} us per "
              f"step, bandwidth {fit.bandwidth / 1e9:.3f} GB/s")
    return status


if __name__ == "__main__":
    sys.exit(main())
