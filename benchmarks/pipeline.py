"""Each pipeline schedule through the SPMD runtime: bubble, memory, traffic, work and time.

For GPipe, 1F1B (PipeDream-flush), 1F1B with the split backward, interleaved 1F1B, the
zero-bubble schedules (ZB-H1, ZB-H2, interleaved ZB, ZB-V, DualPipeV) and GPipe by autodiff
of a forward scan, on the same model, mesh and batch, one run prints:

- ``ticks`` and ``bubble``: the schedule's lock-step length and bubble fraction (f=b=w=1),
  read from its table; GPipe by autodiff has no table, so its row shows ``-`` and the
  footnote gives its formula value;
- ``temp MB``: the compiled step's temporary bytes per device (``memory_analysis``);
- ``permute MB``: collective-permute bytes per device per step, from the partitioned HLO
  (the two per-tick ``ppermute``s; for interleaved also the layer moves of
  ``parallax.pipeline.interleave``), and ``all-reduce MB`` (gradients of the parameters
  outside the stack, summed over stages);
- ``flops`` and ``bytes``: what the compiled program executes, summed over the stages,
  relative to the sequential program's (printed in the header):
  ``parallax.analysis.executed`` counts each instruction as XLA's cost analysis
  does, loop bodies times their trip counts, and the runtime's guarded actions as often as
  the table runs them (XLA's own ``cost_analysis()`` counts a loop body once). ``bytes``
  is relative to the sequential program's bytes plus the permuted bytes;
- ``own``: the runtime's own bytes overhead, relative to the same arithmetic on one device
  plus the permuted bytes: for a schedule that splits the backward into ``B`` and ``W``,
  the ``sequential split`` row (``px.pipeline.split_value_and_grad``: the same split, one
  device, whole batch, whose ``W`` reads what ``B`` stored and the stashed operands again),
  for the others the sequential program (``own`` = ``bytes``);
- ``time``: the median step time relative to the sequential model (``jax.value_and_grad``
  of the same ``Stages`` loss, jitted on one device), timed alternately in one run.

On simulated CPU devices all stages share the host's cores, so the time ratio measures
the pipeline's overhead and bubble on a machine with no parallel hardware, not a speedup;
the HLO columns are exact on any backend.

Usage:
  python benchmarks/pipeline.py [--model toy|gpt] [--stages 4] [--microbatches 8]
                                [--batch 32] [--steps 10] [--remat never]
                                [--schedules "gpipe,1f1b,zbv,gpipe autodiff"]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


TABLES = {  # row -> (schedule, virtual stages, split backward), run by the table runtime
    "gpipe": ("gpipe", 1, False),
    "1f1b": ("1f1b", 1, False),
    "1f1b split": ("1f1b", 1, True),
    "interleaved v=2": ("interleaved_1f1b", 2, False),
    "zb_h1": ("zb_h1", 1, True),
    "zb_h2": ("zb_h2", 1, True),
    "interleaved_zb": ("interleaved_zb", 2, True),
    "zbv": ("zbv", 2, True),
    "dualpipev": ("dualpipev", 2, True),
}
ROWS = (*TABLES, "gpipe autodiff")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt", choices=["toy", "gpt"])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10, help="timed calls of each program")
    parser.add_argument("--remat", default="never")
    parser.add_argument("--schedules", default=",".join(ROWS),
                        help="comma-separated rows to run, of: " + ", ".join(ROWS))
    args = parser.parse_args(argv)
    rows = [name.strip() for name in args.schedules.split(",") if name.strip()]
    unknown = [name for name in rows if name not in ROWS]
    if unknown or not rows:
        parser.error(f"--schedules: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
                     f"use a comma-separated list of: {', '.join(ROWS)}")

    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(max(8, args.stages)))
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import parallax as px
    from parallax import pipeline as pp
    from parallax.analysis import hlo
    from parallax.analysis.executed import executed_cost
    from parallax.pipeline.runtime.guard_shares import table_fractions
    from parallax.pipeline.runtime.lowering import lower_schedule
    from parallax.strategies.pipeline import Pipeline

    p, m = args.stages, args.microbatches
    if args.model == "gpt":
        from parallax.cli.demo import batches, demo_tokens
        from parallax.models.gpt_pipeline import next_token_stages as loss

        config = px.models.GPTConfig.tiny(num_layers=2 * p)
        target = px.models.GPT(config, rngs=nnx.Rngs(0))
        batch = next(batches(demo_tokens(), args.batch, config.max_seq_len, 1))
        what = f"GPT tiny with {config.num_layers} layers"
    else:
        width = 256
        loss = pp.Stages(lambda q, b: b["x"] @ q["w_in"], lambda w, x: jnp.tanh(x @ w) + x,
                         lambda q, x, b: jnp.mean((x @ q["w_out"] - b["y"]) ** 2),
                         lambda q: q["layers"])
        rng = np.random.default_rng(0)
        target = {"w_in": rng.standard_normal((16, width), np.float32) / 4,
                  "layers": rng.standard_normal((2 * p, width, width), np.float32) / 32,
                  "w_out": rng.standard_normal((width, 4), np.float32)}
        batch = {"x": rng.standard_normal((args.batch, 16), np.float32),
                 "y": rng.standard_normal((args.batch, 4), np.float32)}
        what = f"tanh(x @ w) + x, width {width}, {2 * p} layers"

    mesh = px.make_mesh(stage=p, devices=jax.devices()[:p])
    strategy = Pipeline("stage", microbatches=m)

    def placed(tree):  # stacked layers over "stage", the rest replicated, as px.Pipeline does
        if isinstance(tree, nnx.Module):
            graphdef, state = nnx.split(tree)
            return nnx.merge(graphdef, px.shard(state, mesh, strategy))
        return px.shard(tree, mesh, strategy)

    tables = {}  # row -> its table; rows a size cannot run (DualPipeV: m < 2p) are skipped
    for name, (kind, v, split) in TABLES.items():
        if name in rows:
            try:
                tables[name] = pp.schedule(kind, p, m, v, split_backward=split)
            except ValueError as error:
                print(f"{name}: skipped ({error})")
    programs = {
        name: pp.value_and_grad(loss, t.name, microbatches=m, virtual_stages=t.virtual_stages,
                                split_backward=t.split_backward, remat=args.remat)
        for name, t in tables.items()
    }
    if "gpipe autodiff" in rows:
        programs["gpipe autodiff"] = pp.gpipe_value_and_grad(
            loss, microbatches=m, remat="always" if args.remat == "always" else "never")

    device = jax.devices()[0]
    seq_target = jax.device_put(target, device)
    seq_batch = jax.device_put(batch, device)
    sequential = jax.jit(jax.value_and_grad(loss)).lower(seq_target, seq_batch).compile()
    singles = {"sequential": sequential}  # one-device programs, timed on one device
    if any(t.split_backward for t in tables.values()):  # the split's own cost, no pipeline
        split_remat = "never" if args.remat in ("always", "except_last") else args.remat
        singles["sequential split"] = jax.jit(pp.split_value_and_grad(
            loss, remat=split_remat)).lower(seq_target, seq_batch).compile()
    compiled = {}
    with jax.set_mesh(mesh):
        dist_target, dist_batch = placed(target), jax.device_put(batch)
        for name, fn in programs.items():  # seconds each: only the rows asked for
            compiled[name] = jax.jit(fn).lower(dist_target, dist_batch).compile()

    def timed(fn, *xs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*xs))
        return time.perf_counter() - start

    runs = {name: (c, (seq_target, seq_batch)) for name, c in singles.items()}
    runs |= {name: (c, (dist_target, dist_batch)) for name, c in compiled.items()}
    times = {name: [] for name in runs}
    for fn, xs in runs.values():
        jax.block_until_ready(fn(*xs))  # warm up
    for _ in range(args.steps):  # alternate, so load changes hit every program alike
        for name, (fn, xs) in runs.items():
            times[name].append(timed(fn, *xs))
    base = statistics.median(times["sequential"])

    seq_cost = executed_cost(sequential)
    split_cost = executed_cost(singles["sequential split"]) if len(singles) > 1 else None
    print(f"\n{what}; {p} stages, {m} micro-batches of {args.batch // m}, remat={args.remat!r}; "
          f"sequential step: {seq_cost.flops / 1e9:.2f} GFLOP, {seq_cost.bytes / 1e9:.2f} GB")
    head = (f"{'schedule':<16}{'ticks':>6}{'bubble':>8}{'temp MB':>9}{'permute MB':>12}"
            f"{'all-reduce MB':>15}{'flops':>7}{'bytes':>7}{'own':>7}{'time':>7}")  # 3 places
    print(head)
    print("-" * len(head))
    for name, c in singles.items():
        cost = executed_cost(c)
        print(f"{name:<16}{'':>6}{'':>8}{hlo.memory(c).temp_bytes / 1e6:>9.2f}{0:>12.2f}"
              f"{0:>15.2f}{cost.flops / seq_cost.flops:>7.3f}{cost.bytes / seq_cost.bytes:>7.3f}"
              f"{1:>7.3f}{statistics.median(times[name]) / base:>7.2f}")
    remat_mode = args.remat if args.remat in ("always", "except_last") else "never"
    for name, c in compiled.items():
        found = hlo.collectives(c, mesh)
        sched = tables.get(name)
        ticks = f"{sched.ticks}" if sched else "-"  # no table: nothing to read
        bubble = f"{sched.bubble_fraction():.3f}" if sched else "-"
        permuted = hlo.total_bytes(found, "collective-permute")
        # summed over the stages; a table's actions weighed by the table, GPipe by
        # autodiff's conditionals (first, last) at their most expensive branch
        cost = executed_cost(c, table_fractions(lower_schedule(sched, remat_mode))
                             if sched else None)
        same = split_cost if sched and sched.split_backward else seq_cost  # its arithmetic
        print(f"{name:<16}{ticks:>6}{bubble:>8}{hlo.memory(c).temp_bytes / 1e6:>9.2f}"
              f"{permuted / 1e6:>12.2f}"
              f"{hlo.total_bytes(found, 'all-reduce') / 1e6:>15.2f}"
              f"{p * cost.flops / seq_cost.flops:>7.3f}"
              f"{p * cost.bytes / (seq_cost.bytes + p * permuted):>7.3f}"
              f"{p * cost.bytes / (same.bytes + p * permuted):>7.3f}"
              f"{statistics.median(times[name]) / base:>7.2f}")
    print("\nticks, bubble: read from each schedule's table (f = b = w = 1: F = B = W).")
    if "gpipe autodiff" in compiled:
        print(f"gpipe autodiff has no table (-): its scan runs m + p - 1 = {m + p - 1} forward "
              "ticks and autodiff reverses them; by formula, not measured, its lock-step "
              f"bubble is GPipe's, (p - 1) / (m + p - 1) = {(p - 1) / (m + p - 1):.3f}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
