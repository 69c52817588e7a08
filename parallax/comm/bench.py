"""``parallax bench comm``: an nccl-tests style benchmark of the collectives.

For each message size ``S`` (bytes), collective and algorithm it compiles one program over a
1D mesh, checks the result against numpy (``#wrong``: mismatching elements; the inputs are
small integers, so sums are exact in any order), and times it: ``--warmup`` calls, then
``--repeats`` timings of ``--iters`` calls each, ``block_until_ready`` after each batch; the
reported time is the median per call. As in nccl-tests (``doc/PERFORMANCE.md``):

* ``algbw = S / time``;
* ``busbw = algbw * factor``: ``2(n-1)/n`` for all-reduce, ``(n-1)/n`` for all-gather,
  reduce-scatter and all-to-all, ``1`` for broadcast;
* ``S`` is the full array: the all-reduce operand, the all-gather result, the reduce-scatter
  operand, the broadcast message, what each device holds for all-to-all.

``model(us)`` is the alpha-beta prediction of :mod:`parallax.comm.cost` for ``--link``.

Without an accelerator, ``--devices`` CPU devices are simulated in one process. They share the
host's cores, so times measure XLA's CPU runtime, not a network; compare algorithms with each
other in one run, not with real hardware.

Tested on simulated CPU devices only: the GPU/TPU path is the same code but has not been run
on real accelerators yet.

Usage: ``python -m parallax.comm.bench -b 1K -e 1M`` (``parallax bench comm`` takes the same
arguments).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

ALGORITHMS = {
    "all_reduce": ("xla", "ring", "tree"),
    "all_gather": ("xla", "ring"),
    "reduce_scatter": ("xla", "ring"),
    "broadcast": ("xla", "tree"),
    "all_to_all": ("xla",),
}
COLUMNS = ("size", "count", "type", "op", "algorithm", "time_us", "algbw", "busbw",
           "model_us", "wrong")
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30}


def parse_size(text: str | int) -> int:
    """``"64K"`` -> 65536 (K, M, G are powers of 1024, as in nccl-tests).

    Example:
      >>> parse_size("1K"), parse_size("2M"), parse_size(8)
      (1024, 2097152, 8)
    """
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d+)\s*([KMGB]?)B?\s*", str(text).upper())
    if not match:
        raise ValueError(f"bench: size {text!r} is not a number with an optional K, M or G.")
    return int(match.group(1)) * _UNITS[match.group(2)]


def message_sizes(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """``min_bytes``, ``min_bytes * factor``, ... up to ``max_bytes`` (nccl-tests ``-b -e -f``)."""
    if min_bytes <= 0 or max_bytes < min_bytes or factor < 2:
        raise ValueError(
            f"bench: need 0 < min_bytes <= max_bytes and factor >= 2; got {min_bytes}, "
            f"{max_bytes}, {factor}."
        )
    out, s = [], min_bytes
    while s <= max_bytes:
        out.append(s)
        s *= factor
    return out


def _local_fn(op: str, algorithm: str, axis: str, compression):
    from parallax import comm

    if op == "all_reduce":
        return lambda v: comm.all_reduce(v, axis, algorithm=algorithm, compression=compression)
    if op == "all_gather":
        f = comm.ring_all_gather if algorithm == "ring" else comm.all_gather
        return lambda v: f(v, axis)
    if op == "reduce_scatter":
        f = comm.ring_reduce_scatter if algorithm == "ring" else comm.reduce_scatter
        return lambda v: f(v, axis)
    if op == "broadcast":
        return lambda v: comm.broadcast(v, axis, 0, algorithm=algorithm)
    return lambda v: comm.all_to_all(v, axis, 0, 0)


def _expected(op: str, x, n: int):
    import numpy as np

    if op == "all_reduce":
        return np.broadcast_to(x.sum(0), x.shape)
    if op == "all_gather":
        return np.broadcast_to(x.reshape(-1), (n, x.size))
    if op == "reduce_scatter":
        return x.sum(0).reshape(n, -1)
    if op == "broadcast":
        return np.broadcast_to(x[0], x.shape)
    return x.reshape(n, n, -1).transpose(1, 0, 2).reshape(n, -1)  # all_to_all


def _model_us(op: str, algorithm: str, nbytes: int, n: int, link) -> float:
    from parallax.comm import cost

    if op == "all_reduce":
        t = cost.all_reduce_time(nbytes, n, link, algorithm)
    elif op in ("all_gather", "reduce_scatter", "all_to_all"):
        t = cost.ring_all_gather_time(nbytes, n, link)
    elif algorithm == "tree":
        t = cost.broadcast_time(nbytes, n, link)
    else:  # the xla broadcast is a masked psum: an all-reduce
        t = cost.all_reduce_time(nbytes, n, link, "xla")
    return t * 1e6


def bench_one(mesh, op: str, algorithm: str, nbytes: int, dtype="float32", *, warmup: int = 2,
              iters: int = 5, repeats: int = 5, link=None, compression=None) -> dict:
    """Compiles, checks and times one collective; returns one row of the table."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from parallax.comm import cost

    axis = mesh.axis_names[0]
    n = mesh.size
    dtype = jnp.dtype(dtype)
    count = max(n, nbytes // dtype.itemsize // n * n)  # elements of the message S
    local = count // n if op == "all_gather" else count
    x = np.random.default_rng(0).integers(-4, 5, (n, local)).astype(dtype)
    fn = _local_fn(op, algorithm, axis, compression)
    spec = jax.P(axis)
    f = jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=spec,
                              out_specs=spec))
    xs = jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
    compiled = f.lower(xs).compile()
    out = compiled(xs)
    for _ in range(max(0, warmup - 1)):
        out = compiled(xs)
    out = np.asarray(jax.block_until_ready(out), np.float64)
    wrong = int(np.sum(out != _expected(op, np.asarray(x, np.float64), n)))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            y = compiled(xs)
        jax.block_until_ready(y)
        times.append((time.perf_counter() - start) / iters)
    seconds = statistics.median(times)
    size = count * dtype.itemsize
    algbw = size / seconds / 1e9
    link = cost.default_link() if link is None else cost.preset(link)
    return {
        "size": size, "count": count, "type": dtype.name, "op": op, "algorithm": algorithm,
        "time_us": seconds * 1e6, "algbw": algbw,
        "busbw": algbw * cost.bus_bandwidth_factor(op, n),
        "model_us": _model_us(op, algorithm, size, n, link), "wrong": wrong,
    }


def sweep(mesh, ops=tuple(ALGORITHMS), algorithms=("xla", "ring", "tree"),
          min_bytes: int = 1024, max_bytes: int = 1 << 20, factor: int = 2,
          dtype="float32", **kwargs) -> list[dict]:
    """Runs :func:`bench_one` for every size, collective and applicable algorithm."""
    rows = []
    for op in ops:
        if op not in ALGORITHMS:
            raise ValueError(f"bench: unknown op {op!r}; use {', '.join(ALGORITHMS)}.")
        for algorithm in [a for a in algorithms if a in ALGORITHMS[op]]:
            for nbytes in message_sizes(min_bytes, max_bytes, factor):
                rows.append(bench_one(mesh, op, algorithm, nbytes, dtype, **kwargs))
    return rows


def format_table(rows: list[dict], header: str = "") -> str:
    """The rows as an nccl-tests style text table."""
    lines = [f"# {header}"] if header else []
    lines.append(f"#{'size':>11} {'count':>10} {'type':>9} {'op':>15} {'algorithm':>9} "
                 f"{'time(us)':>10} {'algbw':>8} {'busbw':>8} {'model(us)':>10} {'#wrong':>6}")
    lines.append(f"#{'(B)':>11} {'(elements)':>10} {'':>9} {'':>15} {'':>9} {'':>10} "
                 f"{'(GB/s)':>8} {'(GB/s)':>8} {'':>10} {'':>6}")
    for r in rows:
        lines.append(f"{r['size']:>12} {r['count']:>10} {r['type']:>9} {r['op']:>15} "
                     f"{r['algorithm']:>9} {r['time_us']:>10.1f} {r['algbw']:>8.3f} "
                     f"{r['busbw']:>8.3f} {r['model_us']:>10.1f} {r['wrong']:>6}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the benchmark's options to ``parser`` (``--devices`` only if it lacks one)."""
    parser.add_argument("-b", "--min-bytes", default="1K", help="smallest message (1K)")
    parser.add_argument("-e", "--max-bytes", default="1M", help="largest message (1M)")
    parser.add_argument("-f", "--factor", type=int, default=4, help="size step factor (4)")
    parser.add_argument("--ops", default=",".join(ALGORITHMS),
                        help=f"comma-separated collectives ({','.join(ALGORITHMS)})")
    parser.add_argument("--algorithms", default="xla,ring,tree",
                        help="comma-separated: xla, ring, tree (where they apply)")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16, int32, ...")
    parser.add_argument("--compression", default=None, choices=("none", "bf16", "fp16"),
                        help="wire compression for all_reduce")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5, help="calls per timing")
    parser.add_argument("--repeats", type=int, default=5, help="timings; the median is shown")
    parser.add_argument("--link", default=None,
                        help="cost-model preset for model(us) (default: by backend)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="write the rows as JSON to PATH ('-': print JSON, no table)")
    try:
        parser.add_argument("--devices", type=int, default=8,
                            help="devices to use; simulated CPU devices without an accelerator")
    except argparse.ArgumentError:
        pass  # the parallax CLI adds --devices itself


def _devices(count: int):
    """Asks for ``count`` simulated CPU devices (only possible before JAX starts)."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", count)
    except RuntimeError:
        pass  # a backend is already running: use the devices it has
    return jax.devices()


def run(args) -> int:
    """Runs the benchmark for parsed ``args``; prints the table (or JSON); returns 0."""
    import jax

    from parallax.comm import cost

    devices = _devices(args.devices)
    count = args.devices
    if len(devices) < count:
        if devices[0].platform == "cpu":
            print(f"parallax bench comm: --devices {count} requested but JAX already runs "
                  f"with {len(devices)} CPU devices; pass --devices {len(devices)} or fewer, "
                  "or start a fresh process.", file=sys.stderr)
            return 2
        print(f"parallax bench comm: {count} devices requested, {len(devices)} "
              f"{devices[0].platform} devices present: using {len(devices)}.", file=sys.stderr)
        count = len(devices)
    mesh = jax.make_mesh((count,), ("data",), devices=devices[:count],
                         axis_types=(jax.sharding.AxisType.Auto,))
    link = cost.default_link() if args.link is None else cost.preset(args.link)
    rows = sweep(
        mesh, ops=[o.strip() for o in args.ops.split(",") if o.strip()],
        algorithms=[a.strip() for a in args.algorithms.split(",") if a.strip()],
        min_bytes=parse_size(args.min_bytes), max_bytes=parse_size(args.max_bytes),
        factor=args.factor, dtype=args.dtype, warmup=args.warmup, iters=args.iters,
        repeats=args.repeats, link=link, compression=args.compression,
    )
    platform = devices[0].platform
    header = (f"parallax bench comm: {count} {platform} devices"
              f"{' (simulated, sharing the host cores)' if platform == 'cpu' else ''}, "
              f"axis 'data', model link {link.name}")
    if args.json == "-":
        print(json.dumps({"header": header, "rows": rows}, indent=1))
    else:
        print(format_table(rows, header))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"header": header, "rows": rows}, fh, indent=1)
    wrong = sum(r["wrong"] for r in rows)
    if wrong:
        print(f"parallax bench comm: {wrong} wrong elements", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m parallax.comm.bench [options]``."""
    parser = argparse.ArgumentParser(prog="parallax bench comm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
