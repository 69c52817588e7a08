"""ZeRO-Offload: the device memory it frees, the transfers it adds, what it costs a step.

For each model of ``--models`` (``px.models.GPTConfig`` presets; ``name:L`` overrides the
layer count, so ``gpt2_350m:48`` is a 0.7B GPT) the step under ``px.ZeRO(--stage)`` over
``--devices`` devices is compiled from an abstract state three times: without offload,
``offload="optimizer"`` and ``offload="params"``. Each row reports, per device:

- ``device MB``: the compiled program's peak in device memory
  (``parallax.analysis.program.device_memory``: ``memory_analysis`` less the arguments in
  host memory, which the CPU backend counts with the device's);
- ``host MB``: the state it keeps in pinned host memory (``host_argument_bytes``);
- ``moves``: host-to-device and device-to-host placements in the program (the lowering for
  the device's platform; on CPU the GPU lowering, read but not compiled: the CPU backend
  lowers the copies to nothing);
- ``fits``: the device peak against the device's memory (``memory_stats()["bytes_limit"]``;
  unknown on CPU);
- ``tok/s``: tokens per second when it fits, median of ``--repeats`` blocks of ``--steps``
  steps, and the ratio to the run without offload. On CPU the three variants alternate block
  by block (a shared machine is noisy: only ratios measured together mean anything); on a
  device with a memory limit they run one after another, one state alive at a time (the
  largest model's three states would not fit together).

On a GPU the largest model that fits is the last row with ``fits`` yes, with and without
offload; ``--results PATH`` appends the rows to a RESULTS.md table. ``--tiny`` is the CPU
dry run the test suite runs (GPT tiny, 2 devices, one step).

Usage:
  python benchmarks/offload.py --tiny
  python benchmarks/offload.py --models gpt2_124m,gpt2_350m,gpt2_350m:48 --devices 1 \\
      --batch 8 --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import pathlib
import re
import statistics
import sys
import time

VARIANTS = (None, "optimizer", "params")
HEAD = ("| date | device | jax | model | params | stage | offload | device MB | host MB "
        "| moves | fits | tok/s | / no offload |")


def parse_model(text: str):
    import parallax as px

    name, _, layers = text.partition(":")
    preset = getattr(px.models.GPTConfig, name, None)
    if preset is None or name.startswith("_"):
        sys.exit(f"--models: unknown {name!r}; use GPTConfig presets (tiny, small, gpt2_124m, "
                 "gpt2_350m), optionally with :LAYERS")
    return preset(**({"num_layers": int(layers)} if layers else {}))


def compiled_variant(config, offload, args, mesh, batch):
    """(step, abstract state, device peak, host bytes, moves) of one variant."""
    import jax
    import optax
    from flax import nnx

    import parallax as px
    from parallax.analysis import program

    def make_state():
        return px.TrainState.create(px.models.GPT(config, rngs=nnx.Rngs(0)),
                                    optax.adamw(1e-4))

    strategy = px.ZeRO(args.stage, "fsdp", offload=offload)

    @px.train_step(mesh, strategy)
    def step(state, b):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, b)
        return state.apply_gradients(grads), {"loss": loss}

    abstract = jax.eval_shape(make_state)
    compiled = step.compile(abstract, batch)
    peak = program.device_memory(compiled, (abstract, batch)).peak_bytes
    host = program.host_argument_bytes(compiled, (abstract, batch))
    platform = mesh.devices.flat[0].platform
    text = step.lower(abstract, batch, platforms=("cuda",) if platform == "cpu"
                      else (platform,)).as_text()
    moves = len(re.findall(r"_xla_buffer_placement", text))
    return step, make_state, strategy, peak, host, moves


def time_blocks(runs: dict, batch, args) -> dict:
    """Median tokens/s of each variant, its blocks alternating with the others'."""
    import jax

    tokens = batch["tokens"].shape[0] * (batch["tokens"].shape[1] - 1) * args.steps
    samples = {k: [] for k in runs}
    for _ in range(args.repeats):
        for key, run in runs.items():
            state = run["state"]
            start = time.perf_counter()
            for _ in range(args.steps):
                state, metrics = run["step"](state, batch)
            jax.block_until_ready(metrics["loss"])
            samples[key].append(tokens / (time.perf_counter() - start))
            run["state"] = state
    return {k: statistics.median(v) for k, v in samples.items()}


def benchmark_model(text: str, args, mesh, limit):
    import numpy as np

    import parallax as px

    config = parse_model(text)
    tokens = np.random.default_rng(0).integers(
        0, config.vocab_size, (args.batch, config.max_seq_len + 1)).astype(np.int32)
    batch = {"tokens": tokens}
    rows, runs = [], {}
    for offload in VARIANTS:
        step, make_state, strategy, peak, host, moves = compiled_variant(
            config, offload, args, mesh, batch)
        fits = None if limit is None else peak <= limit
        rows.append({"model": text, "params": px.models.param_count(config),
                     "offload": offload or "-", "peak": peak, "host": host, "moves": moves,
                     "fits": fits})
        if fits is not False:
            runs[offload] = {"step": step, "init": (make_state, mesh, strategy)}
    if limit is None:  # no memory limit known (CPU): every state alive, blocks alternating
        for run in runs.values():
            run["state"] = px.init(*run.pop("init"))
        speeds = time_blocks(runs, batch, args) if runs else {}
    else:  # a device's memory holds one variant's state at a time
        speeds = {}
        for key, run in runs.items():
            run["state"] = px.init(*run.pop("init"))
            speeds.update(time_blocks({key: run}, batch, args))
            del run["state"]
    for offload, row in zip(VARIANTS, rows):
        row["tok/s"] = speeds.get(offload)
        base = speeds.get(None)
        row["ratio"] = row["tok/s"] / base if base and row["tok/s"] else None
    return rows


def append_rows(path: pathlib.Path, rows: list[str]) -> None:
    """Appends ``rows`` to the end of this benchmark's table in ``path`` (its section and
    table created at the end of the file when missing)."""
    title = "## ZeRO-Offload (benchmarks/offload.py)"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if title not in text:
        separator = "|" + "---|" * (HEAD.count("|") - 1)
        text = text.rstrip("\n") + f"\n\n{title}\n\n{HEAD}\n{separator}\n"
    before, after = text.split(title, 1)
    lines = after.split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")),
               len(lines))
    lines[end:end] = rows
    path.write_text(before + title + "\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt2_124m,gpt2_350m")
    parser.add_argument("--stage", type=int, default=1, choices=(1, 2, 3))
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed block")
    parser.add_argument("--repeats", type=int, default=3, help="timed blocks per variant")
    parser.add_argument("--results", default=None, help="a RESULTS.md to append rows to")
    parser.add_argument("--tiny", action="store_true",
                        help="the CPU dry run: GPT tiny, 2 devices, one step of one block")
    args = parser.parse_args(argv)
    if args.tiny:
        args.models, args.devices, args.batch, args.steps, args.repeats = "tiny", 2, 4, 1, 1

    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(max(args.devices, 1)))
    import jax

    import parallax as px

    devices = jax.devices()[: args.devices]
    mesh = px.make_mesh(fsdp=len(devices), devices=devices)
    stats = devices[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    where = f"{devices[0].platform}: {devices[0].device_kind}"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    lines = []
    for text in args.models.split(","):
        for r in benchmark_model(text, args, mesh, limit):
            fits = "?" if r["fits"] is None else ("yes" if r["fits"] else "no")
            speed = f"{r['tok/s']:.0f}" if r["tok/s"] else "-"
            ratio = f"{r['ratio']:.3f}" if r["ratio"] else "-"
            lines.append(f"| {stamp} | {where} | {jax.__version__} | {r['model']} | "
                         f"{r['params'] / 1e6:.1f}M | {args.stage} | {r['offload']} | "
                         f"{r['peak'] / 1e6:.2f} | {r['host'] / 1e6:.2f} | {r['moves']} | "
                         f"{fits} | {speed} | {ratio} |")
    print(HEAD)
    print("|" + "---|" * (HEAD.count("|") - 1))
    print("\n".join(lines))
    if args.results:
        append_rows(pathlib.Path(args.results), lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
