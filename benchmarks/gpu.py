"""GPU benchmark: MFU, tokens/s and memory of Llama ~1B and GPT-2 350M / 774M on one device,
the batch swept up to the largest that fits, px.train_step against a hand-written jax.jit step,
and which attention kernel the compiled program runs.

(Over 300 lines: one script the GPU run copies as is; the sweep, the timing, the kernel check
and the results file belong together.)

Models (sequence 2048): ``llama_1b`` (Llama 3.2 1B's shape: d 2048, 16 layers, 32 heads,
8 K/V heads, vocabulary 128,256, tied embeddings), ``gpt2_350m`` and ``gpt2_774m`` (GPT-2
medium and large, learned positions extended to 2048); ``gpt_tiny`` and ``llama_tiny``
(sequence 64) for the CPU run the tests make. Precision: on GPU and TPU bf16 compute with
float32 master parameters and AdamW state (``px.MixedPrecision(compute="bfloat16")`` and the
model's ``dtype``), on CPU float32 (``parallax.precision.default_compute_dtype``).

For each model the batch doubles from ``--min-batch`` while the compiled step fits the
device (``memory_analysis``'s peak against the allocator's ``bytes_limit``, or
``--max-batch``) and the model's share of ``--budget`` seconds lasts; each batch is timed
(median of ``--steps`` calls). At the largest batch that ran, the ``px.train_step`` step and
the same step written by hand (``jax.jit`` of ``jax.value_and_grad`` and an optax update on the
same ``TrainState``, donated) run alternately, one call of each per round; the ratio of their
medians is px / hand-written.

MFU = model flops per step / step time / the chip's dense bf16 peak, with the model flops
PaLM's (appendix B): ``6 N + 12 L T D`` per token (``N`` the matmul parameters, the output
projection counted whether tied or not; ``12 L T D`` attention's scores and weighted sum over
the whole ``T x T``), times batch x sequence; nothing recomputed is counted.

With ``--float8 MODELS`` (default ``llama_1b``; the issue's row) the model's bf16 step and the
same step under ``px.Float8()`` then alternate at that batch (``benchmarks/float8_compare.py``):
both MFUs over the bf16 peak and their time ratio, in a table of their own.

The attention kernel is read from the compiled HLO (``parallax.analysis.kernels``): on an
NVIDIA GPU in bf16 the check passes when the program holds cuDNN's fused attention custom
calls (``__cudnn$fmha...``), i.e. the fused kernel is the one running.

Usage:
  benchmarks/gpu.sh                               # the GPU run, <= 8 minutes
  python benchmarks/gpu.py --models gpt_tiny,llama_tiny --max-batch 2 --steps 2   # CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import float8_compare  # the float8 rows (benchmarks/ is on the path: this script's folder)

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEQ = 2048
HEAD = ("| date | device | jax | parallax | model | batch x seq | compute | remat | attention "
        "| px ms | tokens/s | MFU | compiled peak GiB | px / hand-written |")
TITLE = "Train step, batch sweep (one device; MFU: PaLM's 6N + 12LTD)"
COMM_HEAD = "| date | device | devices | op | algorithm | bytes | time us | busbw GB/s |"
MEMORY_MARGIN = 0.95  # of the allocator's limit: XLA's own workspace comes on top
FLOAT8_SHARE = 0.15  # of --budget, kept from the sweeps for the float8 rounds


def model_config(name: str, dtype, remat: str):
    """The config of a benchmarked model, computing in ``dtype``, float32 parameters."""
    import jax.numpy as jnp

    import parallax as px

    kw = dict(dtype=dtype, param_dtype=jnp.float32, remat=remat)
    if name == "llama_1b":
        return px.models.LlamaConfig.llama3_1b(max_seq_len=SEQ, **kw)
    if name == "gpt2_350m":
        return px.models.GPTConfig.gpt2_350m(max_seq_len=SEQ, **kw)
    if name == "gpt2_774m":  # GPT-2 large: 36 layers, 20 heads, d 1280
        return px.models.GPTConfig.gpt2_350m(max_seq_len=SEQ, num_layers=36, num_heads=20,
                                             embed_dim=1280, mlp_dim=5120, **kw)
    if name == "gpt_tiny":
        return px.models.GPTConfig.tiny(**kw)
    if name == "llama_tiny":
        return px.models.LlamaConfig.tiny(**kw)
    raise SystemExit(f"benchmarks/gpu.py: unknown model {name!r}; use llama_1b, gpt2_350m, "
                     "gpt2_774m, gpt_tiny or llama_tiny.")


def model_flops_per_token(config) -> int:
    import parallax as px

    if isinstance(config, px.models.LlamaConfig):
        return px.models.llama_flops_per_token(config)
    return px.models.flops_per_token(config)


def out_of_memory(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


@dataclasses.dataclass
class Point:
    """One batch of the sweep."""

    rows: int
    px_s: float
    peak_bytes: int
    attention: str
    jit_s: float | None = None


class Bench:
    """One model on one device: the px step per batch, the hand-written step, one state."""

    def __init__(self, name: str, args, device):
        import jax
        import optax
        from flax import nnx

        import parallax as px
        from parallax.precision import default_compute_dtype

        self.name, self.args, self.device = name, args, device
        self.compute = args.compute or default_compute_dtype(device.platform)
        self.config = model_config(name, self.compute, args.remat)
        self.tx = optax.adamw(1e-4)
        family = px.models.Llama if isinstance(self.config, px.models.LlamaConfig) else \
            px.models.GPT
        self.make_state = lambda: px.TrainState.create(family(self.config, rngs=nnx.Rngs(0)),
                                                       self.tx)
        self.mesh = px.make_mesh(data=1, devices=[device])
        parts = [px.DataParallel("data")]
        if self.compute != "float32":  # fp32 master parameters and optimizer
            parts.append(px.MixedPrecision(compute=self.compute))
        self.strategy = px.compose(*parts) if len(parts) > 1 else parts[0]
        self.abstract = jax.eval_shape(self.make_state)
        self.state = self.best_step = None

    def fresh_state(self):
        import parallax as px

        self.state = None  # free the old buffers first
        self.state = px.init(self.make_state, self.mesh, self.strategy)

    def batch(self, rows: int):
        import jax
        import numpy as np

        tokens = np.random.default_rng(rows).integers(
            0, self.config.vocab_size, (rows, self.config.max_seq_len + 1)).astype(np.int32)
        return {"tokens": jax.device_put(tokens, self.device)}

    def px_step(self):
        import parallax as px

        @px.train_step(self.mesh, self.strategy)
        def step(state, batch):
            loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
            return state.apply_gradients(grads), {"loss": loss}
        return step

    def hand_written(self, batch):
        """The same step with no parallax machinery: ``jax.jit`` of ``jax.value_and_grad``
        (parameters cast to the compute dtype inside, as ``px.MixedPrecision`` does) and the
        optax update, on the same ``TrainState`` (a pytree), donated."""
        import dataclasses as dc

        import jax
        import jax.numpy as jnp
        import optax
        from flax import nnx

        import parallax as px

        compute, tx = jnp.dtype(self.compute), self.tx

        def step(state, batch):
            def loss_fn(params):
                params = jax.tree.map(lambda p: p.astype(compute)
                                      if jnp.issubdtype(p.dtype, jnp.floating) else p, params)
                return px.models.next_token_loss(nnx.merge(state.graphdef, params, state.rest),
                                                 batch)

            loss, grads = jax.value_and_grad(loss_fn)(state.params)
            updates, opt_state = tx.update(grads, state.opt_state, state.params)
            return dc.replace(state, step=state.step + 1, opt_state=opt_state,
                              params=optax.apply_updates(state.params, updates)), loss

        return jax.jit(step, donate_argnums=0).lower(self.state, batch).compile()

    def memory_limit(self) -> int | None:
        stats = self.device.memory_stats() if hasattr(self.device, "memory_stats") else None
        limit = (stats or {}).get("bytes_limit")
        return int(limit * MEMORY_MARGIN) if limit else None

    def time_px(self, step, batch, calls: int) -> float:
        import jax

        times = []
        for _ in range(calls):
            start = time.perf_counter()
            self.state, metrics = step(self.state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:] if len(times) > 1 else times)

    def sweep(self, deadline: float, log) -> list[Point]:
        """The px step at each batch, doubling while it fits and time lasts."""
        from parallax.analysis import hlo
        from parallax.analysis.kernels import attention_kernels

        points, rows, limit = [], self.args.min_batch, self.memory_limit()
        self.fresh_state()
        while rows <= self.args.max_batch:
            started = time.perf_counter()
            step, batch = self.px_step(), self.batch(rows)
            compiled = step.compile(self.abstract, batch)
            peak = hlo.memory(compiled).peak_bytes
            if limit is not None and peak > limit:
                log(f"  batch {rows}: compiled peak {peak / 2**30:.1f} GiB > "
                    f"{limit / 2**30:.1f} GiB available: the sweep stops")
                break
            try:
                seconds = self.time_px(step, batch, self.args.warmup + self.args.steps)
            except Exception as error:  # noqa: BLE001 - the allocator's out-of-memory
                if not out_of_memory(error):
                    raise
                log(f"  batch {rows}: out of memory when run: the sweep stops")
                self.fresh_state()
                break
            points.append(Point(rows, seconds, peak, attention_kernels(compiled).summary()))
            self.best_step = step  # compiled for this batch: compare() reuses it
            log(f"  batch {rows}: {seconds * 1e3:.1f} ms, compiled peak "
                f"{peak / 2**30:.2f} GiB, attention {points[-1].attention}")
            cost = time.perf_counter() - started
            if time.perf_counter() + 1.5 * cost > deadline:  # compiling dominates the cost
                log(f"  (the model's time share is spent: the sweep stops at batch {rows})")
                break
            rows *= 2
        return points

    def compare(self, rows: int) -> tuple[float, float]:
        """Medians of the px step and the hand-written one at ``rows``, called alternately."""
        import jax

        step, batch = self.best_step, self.batch(rows)
        jit_step = self.hand_written(batch)
        times = {"px": [], "jit": []}
        for i in range(self.args.warmup + self.args.steps):
            for name in ("px", "jit"):
                start = time.perf_counter()
                if name == "px":
                    self.state, metrics = step(self.state, batch)
                    jax.block_until_ready(metrics)
                else:
                    self.state, loss = jit_step(self.state, batch)
                    jax.block_until_ready(loss)
                if i >= self.args.warmup:
                    times[name].append(time.perf_counter() - start)
        return statistics.median(times["px"]), statistics.median(times["jit"])


def fused_check(platform: str, compute: str, attention: str) -> str:
    """Whether the fused kernel that should run is in the program."""
    if platform == "gpu" and compute in ("bfloat16", "float16"):
        return ("PASS: cuDNN fused attention custom calls in the compiled HLO"
                if attention.startswith("cudnn (") and "NO fused" not in attention
                else f"FAIL: expected cuDNN's fused attention, the program runs {attention}")
    return f"n/a on {platform} in {compute} (runs {attention})"


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


def append_rows(path: pathlib.Path, title: str, head: str, rows: list[str]) -> None:
    """Appends ``rows`` to the table under ``## title`` in ``path`` (created when missing)."""
    text = path.read_text() if path.exists() else (
        "# Benchmark results\n\nRows appended by `benchmarks/gpu.sh` (`benchmarks/gpu.py`): "
        "one per model per run, with the date, versions and device.\n")
    if f"## {title}\n" not in text:
        separator = "|" + "---|" * (head.count("|") - 1)
        text = text.rstrip("\n") + f"\n\n## {title}\n\n{head}\n{separator}\n"
    before, after = text.split(f"## {title}\n", 1)
    section, heading, rest = after.partition("\n## ")  # this table's lines only
    lines = section.split("\n")
    last = max(i for i, line in enumerate(lines) if line.startswith("|"))
    lines[last + 1:last + 1] = rows
    path.write_text(before + f"## {title}\n" + "\n".join(lines) + heading + rest)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="llama_1b,gpt2_350m,gpt2_774m")
    parser.add_argument("--min-batch", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=5, help="timed calls per batch")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds for all the models (each gets an equal share)")
    parser.add_argument("--compute", default=None, choices=["float32", "bfloat16"],
                        help="compute dtype (default: bfloat16 on GPU/TPU, float32 on CPU)")
    parser.add_argument("--remat", default="none", choices=["none", "full", "dots", "offload"])
    parser.add_argument("--chip", default=None, help="roofline preset (default: the device's)")
    parser.add_argument("--explain", action="store_true",
                        help="also px.explain's predicted step time at the largest batch (one "
                             "more compile per model)")
    parser.add_argument("--float8", default="llama_1b",
                        help="models also timed under px.Float8() against bf16, alternating "
                             "('' for none)")
    parser.add_argument("--comm-max-bytes", default="256M")
    parser.add_argument("--comm-ops", default="all_reduce,all_gather,reduce_scatter")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "RESULTS.md"))
    args = parser.parse_args(argv)
    began = time.perf_counter()

    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(8))
    import jax

    import parallax as px
    from parallax.planner import roofline

    device = jax.devices()[0]
    name = f"{device.platform}: {getattr(device, 'device_kind', '')}".strip()
    chip = roofline.chip(args.chip) if args.chip else roofline.chip_for(device)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    models = args.models.split(",")
    float8_models = [m for m in args.float8.split(",") if m in models]
    reserve = FLOAT8_SHARE * args.budget * bool(float8_models)  # the float8 rounds' time
    rows, checks, fp8_rows = [], [], []
    for i, model in enumerate(models):
        share = (args.budget - reserve - (time.perf_counter() - began)) / (len(models) - i)
        deadline = time.perf_counter() + 0.7 * share  # the rest: the px / hand-written rounds
        bench = Bench(model, args, device)
        print(f"{model} ({bench.compute}, remat={args.remat!r}):", flush=True)
        points = bench.sweep(deadline, lambda line: print(line, flush=True))
        if not points:
            print(f"  {model}: not even batch {args.min_batch} fits", flush=True)
            continue
        best = points[-1]
        best.px_s, best.jit_s = bench.compare(best.rows)
        flops_token = model_flops_per_token(bench.config)
        seq = bench.config.max_seq_len
        checks.append(f"{model}: {fused_check(device.platform, bench.compute, best.attention)}")
        if args.explain:  # the roofline's step time against the measured one
            predicted = px.explain(bench.best_step, bench.abstract, bench.batch(best.rows),
                                   chip=chip).row("step time").predicted
            checks.append(f"{model}: px.explain predicts {predicted * 1e3:.1f} ms at batch "
                          f"{best.rows}, measured {best.px_s * 1e3:.1f} ms "
                          f"({best.px_s / predicted:.2f}x the roofline)")
        print(f"\n{'model':<11}{'batch x seq':>13}{'px ms':>10}{'tokens/s':>11}{'MFU':>8}"
              f"{'peak GiB':>10}{'px/hand':>9}  attention")
        for p in points:
            tokens = p.rows * seq
            mfu = roofline.mfu(flops_token * tokens, p.px_s, chip)
            ratio = f"{p.px_s / p.jit_s:.3f}" if p.jit_s else "-"
            print(f"{model:<11}{f'{p.rows} x {seq}':>13}{p.px_s * 1e3:>10.1f}"
                  f"{tokens / p.px_s:>11,.0f}{mfu:>8.1%}{p.peak_bytes / 2**30:>10.2f}"
                  f"{ratio:>9}  {p.attention}")
            rows.append(f"| {stamp} | {name} | {jax.__version__} | {px.__version__} | {model} "
                        f"| {p.rows} x {seq} | {bench.compute} | {args.remat} | {p.attention} "
                        f"| {p.px_s * 1e3:.1f} | {tokens / p.px_s:,.0f} | {mfu:.1%} "
                        f"| {p.peak_bytes / 2**30:.2f} | {ratio} |")
        if model in float8_models:
            fp8 = float8_compare.compare(bench, best.rows, flops_token, chip,
                                         lambda line: print(line, flush=True))
            if fp8 is not None:
                fp8_rows.append(float8_compare.row(fp8, stamp, name, jax.__version__,
                                                   px.__version__, model, seq, bench.compute))
                print(f"{model} float8 vs {bench.compute} at batch {fp8['rows']}: "
                      f"{fp8['float8_s'] * 1e3:.1f} ms vs {fp8['bf16_s'] * 1e3:.1f} ms, MFU "
                      f"{fp8['float8_mfu']:.1%} vs {fp8['bf16_mfu']:.1%} (bf16 peak), "
                      f"{bench.compute} / float8 time {fp8['bf16_s'] / fp8['float8_s']:.3f}")
        print(flush=True)
        del bench
    print(f"MFU: PaLM's model flops (6 N + 12 L T D per token, nothing recomputed) over "
          f"{chip.name}'s dense bf16 peak ({chip.flops_per_second('bfloat16'):.3g} FLOP/s). "
          "Targets on an H100/H200: MFU >= 45%, px / hand-written <= 1.02.")
    if device.platform == "cpu":
        print("(on CPU the chip preset is a rough stand-in: the MFU column means nothing there; "
              "this run checks that the benchmark works)")
    for line in checks:
        print(line if "px.explain" in line else f"fused attention check, {line}")
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            print(f"allocator peak over the run: {stats['peak_bytes_in_use'] / 2**30:.2f} GiB")
    path = pathlib.Path(args.results)
    append_rows(path, TITLE, HEAD, rows)
    if fp8_rows:
        append_rows(path, float8_compare.TITLE, float8_compare.HEAD, fp8_rows)
    if jax.device_count() > 1:  # one device has no collectives to time
        append_rows(path, "Collectives (parallax bench comm)", COMM_HEAD,
                    comm_rows(args, jax.device_count(), stamp, name))
    print(f"results appended to {path} ({time.perf_counter() - began:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
