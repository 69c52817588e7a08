"""px.plan against brute force, by timed steps: does its first choice run fast?

Every candidate of a small search space is compiled and run (brute force); their steps are
timed alternately, one call of each per round, and the medians compared. The planner's first
choice (``px.plan`` with its default pruning) should be within 10% of the fastest
configuration that fits the budget. On 8 simulated CPU devices sharing two cores, step times
are dominated by per-operation overhead and by whatever else the machine runs: read the
ratios of one run, and repeat it (the test suite checks the same choice against brute force
by the compiled programs' estimates, which are deterministic).

``--validate`` prints, without running any step, the brute-force table by the compiled
programs' rooflines (what ``tests/planner/test_plan_validated.py`` checks): every
candidate's predicted and compiled peak, their ratio, its compiled roofline over the best
that fits, and the planner's choice.

Usage:
  python benchmarks/plan.py [--model mlp|gpt] [--devices 4] [--rounds 15]
                            [--budget-quantile 0.5] [--validate]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp", choices=["mlp", "gpt"])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15, help="timed calls of each")
    parser.add_argument("--budget-quantile", type=float, default=0.5,
                        help="memory budget: this quantile of the compiled peaks (1: none)")
    parser.add_argument("--validate", action="store_true",
                        help="print the compiled-roofline table against brute force; no runs")
    args = parser.parse_args(argv)

    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(8))
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import parallax as px
    from parallax.planner.candidates import SearchSpace
    from parallax.cli.demo import batches, demo_tokens

    space = SearchSpace(zero_stages=(1, 3), sequence_parallel=(False,), schedules=("1f1b",),
                        microbatches_per_stage=(2,), max_tensor=2, max_stages=2)
    if args.model == "mlp":
        def make_state():
            return px.TrainState.create(
                px.models.MLP(64, [1024, 1024], 64, rngs=nnx.Rngs(0)), optax.adam(1e-3))
        rng = np.random.default_rng(0)
        batch = {"x": jnp.asarray(rng.standard_normal((64, 64)), jnp.float32),
                 "y": jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)}
        loss_fn = px.models.mse_loss
    else:
        config = px.models.GPTConfig.tiny()

        def make_state():
            return px.TrainState.create(px.models.GPT(config, rngs=nnx.Rngs(0)),
                                        optax.adam(1e-3))
        batch = next(batches(demo_tokens(), 16, config.max_seq_len, 1))
        loss_fn = px.models.next_token_stages

    brute = px.plan(make_state, loss_fn, batch, devices=args.devices, space=space,
                    exhaustive=True)
    compiled = [e for e in brute.evaluations if e.compiled_peak is not None]
    peaks = sorted(e.compiled_peak for e in compiled)
    budget = (None if args.budget_quantile >= 1
              else peaks[int(args.budget_quantile * (len(peaks) - 1))])
    chosen = px.plan(make_state, loss_fn, batch, devices=args.devices, space=space,
                     memory_per_device=budget).best
    if args.validate:
        fit = [e for e in compiled if budget is None or e.compiled_peak <= budget]
        best = min(e.compiled_time for e in fit)
        print(f"\n{args.model} on {args.devices} devices, budget "
              f"{'none' if budget is None else f'{budget / 1e6:.2f} MB'}")
        print(f"{'configuration':<42}{'pred MB':>9}{'peak MB':>9}{'ratio':>7}"
              f"{'roofline ms':>13}{'/ best':>8}")
        for e in sorted(compiled, key=lambda e: e.compiled_time):
            mark = " <- planner" if e.candidate.label == chosen.candidate.label else ""
            over = "" if e in fit else " (does not fit)"
            print(f"{e.candidate.label:<42}{e.predicted_peak / 1e6:>9.2f}"
                  f"{e.compiled_peak / 1e6:>9.2f}{e.compiled_peak / e.predicted_peak:>7.2f}"
                  f"{e.compiled_time * 1e3:>13.2f}{e.compiled_time / best:>8.2f}{mark}{over}")
        return 0
    runs = []
    for e in compiled:
        mesh = px.make_mesh(**e.candidate.axes, devices=jax.devices()[: args.devices])

        @px.train_step(mesh, e.candidate.strategy)
        def step(state, b):
            loss, grads = px.value_and_grad(loss_fn)(state.model, b)
            return state.apply_gradients(grads), {"loss": loss}

        state = px.init(make_state, mesh, e.candidate.strategy)
        state, metrics = step(state, batch)  # compiles
        jax.block_until_ready(metrics)
        runs.append([e, step, state, []])
    for _ in range(args.rounds):
        for run in runs:
            start = time.perf_counter()
            run[2], metrics = run[1](run[2], batch)
            jax.block_until_ready(metrics)
            run[3].append(time.perf_counter() - start)
    fits = [r for r in runs if budget is None or r[0].compiled_peak <= budget]
    fastest = min(statistics.median(r[3]) for r in fits)
    shown = "none" if budget is None else f"{budget / 1e6:.2f} MB"
    print(f"\n{args.model} on {args.devices} devices, budget {shown}, {args.rounds} rounds")
    print(f"{'configuration':<42}{'peak MB':>9}{'roofline ms':>13}{'measured ms':>13}"
          f"{'/ fastest':>10}")
    for e, _, _, times in sorted(runs, key=lambda r: statistics.median(r[3])):
        mark = " <- planner" if e.candidate.label == chosen.candidate.label else ""
        over = "" if budget is None or e.compiled_peak <= budget else " (does not fit)"
        t = statistics.median(times)
        print(f"{e.candidate.label:<42}{e.compiled_peak / 1e6:>9.2f}"
              f"{e.compiled_time * 1e3:>13.2f}{t * 1e3:>13.2f}{t / fastest:>10.2f}{mark}{over}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
