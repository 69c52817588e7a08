"""GPU benchmark: MFU of px.train_step vs a hand-written jax.jit step, px.explain's predicted
step time vs the measured one, and the collectives of the devices present.

For each model (``gpt2_124m``, ``gpt2_350m``; ``tiny`` on CPU), in bfloat16 compute with
float32 parameters and AdamW, on one device: the same step written with ``px.train_step``
(``px.DataParallel`` over a one-device mesh, ``px.value_and_grad``) and by hand (``jax.jit``
of ``jax.value_and_grad`` and an optax update, donated state) are timed alternately (one
call of each per round, medians). MFU is the model's flops per step (PaLM's ``6 N + 12 L T
D`` per token) over the time and the chip's dense bf16 peak (``parallax.planner.roofline``).
``px.explain`` predicts the step time from its roofline; the ratio measured / predicted is
how far the step is from the roof. Then ``parallax bench comm`` runs on the devices present.
Every result is appended to ``--results`` (``benchmarks/RESULTS.md``) with the date, the
versions and the device.

Usage:
  python benchmarks/gpu.py                       # the GPU run (benchmarks/gpu.sh)
  python benchmarks/gpu.py --models tiny         # on CPU: the tiny config, for tests
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH = {"gpt2_124m": 16, "gpt2_350m": 8, "small": 8, "tiny": 8}
STEP_HEAD = ("| date | device | jax | parallax | model | batch x seq | px ms | jit ms | px / jit "
             "| MFU px | MFU jit | explain ms | measured / explain |")
COMM_HEAD = "| date | device | devices | op | algorithm | bytes | time us | busbw GB/s |"


def append_rows(path: pathlib.Path, title: str, head: str, rows: list[str]) -> None:
    """Appends ``rows`` to the table under ``## title`` in ``path`` (created when missing)."""
    text = path.read_text() if path.exists() else (
        "# Benchmark results\n\nRows appended by `benchmarks/gpu.sh` (`benchmarks/gpu.py`): "
        "one per model per run, with the date, versions and device.\n")
    if f"## {title}\n" not in text:
        separator = "|" + "---|" * (head.count("|") - 1)
        text = text.rstrip("\n") + f"\n\n## {title}\n\n{head}\n{separator}\n"
    before, after = text.split(f"## {title}\n", 1)
    lines = after.split("\n")
    last = max(i for i, line in enumerate(lines) if line.startswith("|"))
    lines[last + 1:last + 1] = rows
    path.write_text(before + f"## {title}\n" + "\n".join(lines))


def time_both(px_step, px_state, jit_step, jit_state, batch, steps: int, warmup: int):
    """Median seconds of each step, called alternately (the states are carried along)."""
    import jax

    times = {"px": [], "jit": []}
    for i in range(warmup + steps):
        for name in ("px", "jit"):
            start = time.perf_counter()
            if name == "px":
                px_state, metrics = px_step(px_state, batch)
                jax.block_until_ready(metrics)
            else:
                jit_state = jit_step(jit_state, batch)
                jax.block_until_ready(jit_state[2])
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return statistics.median(times["px"]), statistics.median(times["jit"])


def benchmark_model(name: str, args, device):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import parallax as px
    from parallax.planner import roofline

    config = getattr(px.models.GPTConfig, name)(dtype=jnp.bfloat16, param_dtype=jnp.float32)
    rows = args.batch or BATCH[name]
    tokens = np.random.default_rng(0).integers(
        0, config.vocab_size, (rows, config.max_seq_len + 1)).astype(np.int32)
    batch = {"tokens": jax.device_put(tokens, device)}
    tx = optax.adamw(1e-4)

    def make_state():
        return px.TrainState.create(px.models.GPT(config, rngs=nnx.Rngs(0)), tx)

    mesh = px.make_mesh(data=1, devices=[device])
    strategy = px.DataParallel("data")

    @px.train_step(mesh, strategy)
    def px_step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    with jax.default_device(device):
        plain = make_state()
    graphdef, rest = plain.graphdef, plain.rest

    def hand_written(state, batch):  # the same step with no parallax in it
        params, opt_state, _ = state

        def loss_fn(p):
            return px.models.next_token_loss(nnx.merge(graphdef, p, rest), batch)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    jit_step = jax.jit(hand_written, donate_argnums=0)
    jit_state = (plain.params, plain.opt_state, jnp.zeros((), jnp.float32))
    px_state = px.init(make_state, mesh, strategy)
    chip = roofline.chip(args.chip) if args.chip else roofline.chip_for(device)
    report = px.explain(px_step, jax.eval_shape(make_state), batch, chip=chip)
    px_s, jit_s = time_both(px_step, px_state, jit_step, jit_state, batch, args.steps,
                            args.warmup)
    flops = px.models.flops_per_token(config) * rows * config.max_seq_len
    predicted = report.row("step time").predicted
    return {"model": name, "batch": f"{rows} x {config.max_seq_len}", "px": px_s, "jit": jit_s,
            "mfu_px": roofline.mfu(flops, px_s, chip), "mfu_jit": roofline.mfu(flops, jit_s, chip),
            "predicted": predicted, "chip": chip.name}


def comm_rows(args, devices: int, stamp: str, device: str) -> list[str]:
    """Runs ``parallax bench comm`` on the devices present; its rows for RESULTS.md."""
    out = pathlib.Path(tempfile.mkdtemp()) / "comm.json"
    command = [sys.executable, "-m", "parallax.cli", "bench", "comm", "--devices",
               str(devices), "-b", "1K", "-e", args.comm_max_bytes, "-f", "16", "--ops",
               args.comm_ops, "--algorithms", "xla", "--repeats", "3",
               "--iters", "3", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=ROOT)
    print(done.stdout[-4000:], done.stderr[-2000:] if done.returncode else "", sep="")
    if done.returncode or not out.exists():
        return []
    return [f"| {stamp} | {device} | {devices} | {r['op']} | {r['algorithm']} | {r['size']} | "
            f"{r['time_us']:.1f} | {r['busbw']:.2f} |"
            for r in json.loads(out.read_text())["rows"]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt2_124m,gpt2_350m")
    parser.add_argument("--batch", type=int, default=None, help="sequences (default per model)")
    parser.add_argument("--steps", type=int, default=10, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--chip", default=None, help="roofline preset (default: the device's)")
    parser.add_argument("--comm-max-bytes", default="256M")
    parser.add_argument("--comm-ops", default="all_reduce,all_gather,reduce_scatter")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    args = parser.parse_args(argv)

    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(8))
    import jax

    import parallax as px

    device = jax.devices()[0]
    name = f"{device.platform}: {getattr(device, 'device_kind', '')}".strip()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    results = [benchmark_model(m, args, device) for m in args.models.split(",")]
    print(f"\n{'model':<11}{'batch':>10}{'px ms':>9}{'jit ms':>9}{'px/jit':>8}{'MFU px':>8}"
          f"{'MFU jit':>9}{'explain ms':>12}{'meas/expl':>10}")
    rows = []
    for r in results:
        ratio, off = r["px"] / r["jit"], r["px"] / r["predicted"]
        print(f"{r['model']:<11}{r['batch']:>10}{r['px'] * 1e3:>9.2f}{r['jit'] * 1e3:>9.2f}"
              f"{ratio:>8.3f}{r['mfu_px']:>8.1%}{r['mfu_jit']:>9.1%}"
              f"{r['predicted'] * 1e3:>12.2f}{off:>10.2f}")
        rows.append(f"| {stamp} | {name} | {jax.__version__} | {px.__version__} | {r['model']} "
                    f"| {r['batch']} | {r['px'] * 1e3:.2f} | {r['jit'] * 1e3:.2f} | {ratio:.3f} "
                    f"| {r['mfu_px']:.1%} | {r['mfu_jit']:.1%} | {r['predicted'] * 1e3:.2f} "
                    f"| {off:.2f} |")
    print(f"(MFU against {results[0]['chip']}'s dense bf16 peak; targets on an H100/H200: MFU "
          ">= 45%, px / jit <= 1.02)")
    if device.platform == "cpu":
        print("(on CPU the chip preset is a rough stand-in for simulated devices: the MFU "
              "column means nothing there; this run checks that the benchmark works)")
    print()
    path = pathlib.Path(args.results)
    append_rows(path, "Train step (one device, bf16)", STEP_HEAD, rows)
    append_rows(path, "Collectives (parallax bench comm)", COMM_HEAD,
                comm_rows(args, jax.device_count(), stamp, name))
    print(f"results appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
