"""Pipeline parallelism: GPipe, 1F1B and interleaved 1F1B, drawn, costed and trained.

    python examples/pipeline_schedules.py --steps 10 --plot-dir pipeline_plots
    python examples/pipeline_schedules.py --stages 4 --microbatches 8 --steps 0   # tables only

A schedule is data: a table of ticks x stages that parallax validates, prints, plots and
costs before anything runs. The script draws GPipe, 1F1B (PipeDream-flush) and Megatron's
interleaved 1F1B for ``--stages`` and ``--microbatches`` (ASCII, and PNG Gantt charts in
``--plot-dir`` when matplotlib is installed), puts their bubble and peak activations in
flight side by side, then trains a GPT with ``px.Pipeline`` under 1F1B and interleaved 1F1B
(data parallel over the remaining devices; throughput, MFU and memory in the progress bar,
a table after each; ``--logdir DIR`` logs to ``DIR/<schedule>``) and checks each loss curve
against one device. On a GPU or TPU the GPT computes in bf16 with fp32 master parameters and
optimizer (``px.MixedPrecision``), on CPU in fp32 (``--precision`` chooses); the comparison's
tolerance is 1e-4 in fp32, 3e-2 in bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--stages", type=int, default=4, help="stages of the drawn schedules")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--plot-dir", default=None, help="save Gantt charts (PNG) here")
    from parallax.metrics import add_arguments
    from parallax.precision import add_arguments as add_precision_argument

    args = add_arguments(add_precision_argument(parser)).parse_args(argv)

    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(8))
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import parallax as px
    from parallax.cli.demo import batches, demo_tokens
    from parallax.precision import compute_dtype_from_flag

    compute = compute_dtype_from_flag(args.precision)  # auto: bf16 on GPU/TPU, fp32 on CPU

    s, m = args.stages, args.microbatches
    print(f"{'schedule':<18}{'ticks':>6}{'bubble':>8}{'classic':>9}{'peak in flight':>16}")
    chunks = {"interleaved_1f1b": 2}  # model chunks per stage
    for name in SCHEDULES:
        sched = px.pipeline.schedule(name, s, m, chunks.get(name, 1))
        v = sched.virtual_stages
        classic = (s - 1) / (v * m + s - 1)  # Narayanan et al. 2021: (p - 1) / (v m + p - 1)
        peaks = [sched.peak_in_flight(stage) for stage in range(s)]
        print(f"{name:<18}{sched.ticks:>6}{sched.bubble_fraction():>8.1%}{classic:>9.1%}"
              f"{str(peaks):>16}")
    print()
    print(px.pipeline.schedule("1f1b", stages=s, microbatches=m).text())
    if args.plot_dir:
        try:
            import matplotlib

            matplotlib.use("Agg")
        except ImportError:
            print("matplotlib is not installed: no plots (pip install matplotlib)")
        else:
            out = pathlib.Path(args.plot_dir)
            out.mkdir(parents=True, exist_ok=True)
            for name in SCHEDULES:
                px.pipeline.schedule(name, s, m, chunks.get(name, 1)).plot(out / f"{name}.png")
            print(f"Gantt charts in {out}: {', '.join(f'{n}.png' for n in SCHEDULES)}")
    if args.steps <= 0:
        return 0

    n = jax.device_count()
    stages = 2 if n % 2 == 0 else 1
    mesh = px.make_mesh(stage=stages, data=n // stages)
    # 2 chunks x 2 stages when interleaved
    config = px.models.GPTConfig.tiny(num_layers=4, dtype=compute)
    data = list(batches(demo_tokens(), args.batch, config.max_seq_len, args.steps))

    def make_state(config=config):
        return px.TrainState.create(px.models.GPT(config, rngs=nnx.Rngs(0)), optax.adam(1e-3))

    fp32 = dataclasses.replace(config, dtype=jnp.float32)  # the reference computes in fp32
    reference = px.testing.train(lambda: make_state(fp32), px.models.next_token_loss,
                                 data).losses
    precision = [px.MixedPrecision(compute=compute)] if compute != "float32" else []
    worst = 0.0
    for name in ("1f1b", "interleaved_1f1b"):
        strategy = px.compose(px.DataParallel("data"),
                              px.Pipeline("stage", microbatches=2 * stages, schedule=name,
                                          virtual_stages=chunks.get(name, 1)),
                              *precision)

        @px.train_step(mesh, strategy)
        def step(state, batch):
            loss, grads = px.value_and_grad(px.models.next_token_stages)(state.model, batch)
            return state.apply_gradients(grads), {"loss": loss}

        state = px.init(make_state, mesh, strategy)
        losses = []
        tokens = args.batch * config.max_seq_len
        with px.metrics.Monitor(items_per_step=tokens,
                                flops_per_step=px.models.flops_per_token(config) * tokens,
                                logdir=args.logdir and f"{args.logdir}/{name}",
                                profile_steps=args.profile_steps, description=name) as monitor:
            for batch in monitor.loop(data):
                state, metrics = step(state, batch)
                losses.append(float(metrics["loss"]))
                monitor.step(metrics, loss=losses[-1])
        print(monitor.table())
        gap = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        worst = max(worst, gap)
        print(f"\n{strategy.name} on {px.mesh.describe(mesh)}\n  loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}; largest relative difference vs one device (fp32) {gap:.1e} "
              f"({compute})")
    return 0 if worst < (1e-4 if compute == "float32" else 3e-2) else 1


if __name__ == "__main__":
    sys.exit(main())
