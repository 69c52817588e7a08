"""float8 against bf16 in one run: the same model, batch and state, the two steps alternating.

Used by ``benchmarks/gpu.py`` (``--float8 MODELS``, default ``llama_1b``) after a model's
batch sweep: at the largest batch that ran, the bf16 step (``px.MixedPrecision``, the
sweep's) and the same strategy composed with ``px.Float8()`` (tensorwise current scaling,
torchao's default recipe: every dense layer's three matmuls in e4m3 / e5m2) are called
alternately, one call of each per round, ``--steps`` rounds after ``--warmup``. The row
reports both medians, both MFUs over the chip's dense **bf16** peak (the same denominator,
so the MFU ratio is the speed ratio; torchtitan and torchao report float8 so), and
bf16 time / float8 time (above 1: float8 is faster; torchao reports 1.2-1.5x on H100s for
Llama). Attention and the loss head stay in bf16 under both.

On CPU (``--tiny``) the float8 step runs, XLA converting the float8 operands back to
float32 for its dot: the ratio there says nothing about a GPU.
"""

from __future__ import annotations

import statistics
import time

HEAD = ("| date | device | jax | parallax | model | batch x seq | compute | bf16 ms "
        "| float8 ms | bf16 MFU | float8 MFU | bf16 / float8 time |")
TITLE = "float8 against bf16 (benchmarks/gpu.sh; MFU over the bf16 peak)"


def float8_step(bench):
    """The sweep's step with ``px.Float8()`` composed in (same mesh, same state)."""
    import parallax as px

    strategy = px.compose(bench.strategy, px.Float8())

    @px.train_step(bench.mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    return step


def alternate(bench, rows: int) -> tuple[float, float]:
    """Medians (seconds) of the bf16 and float8 steps at ``rows``, called alternately."""
    import jax

    batch = bench.batch(rows)
    steps = {"bf16": bench.best_step, "float8": float8_step(bench)}
    times = {name: [] for name in steps}
    for i in range(bench.args.warmup + bench.args.steps):
        for name, step in steps.items():
            start = time.perf_counter()
            bench.state, metrics = step(bench.state, batch)
            jax.block_until_ready(metrics)
            if i >= bench.args.warmup:
                times[name].append(time.perf_counter() - start)
    return statistics.median(times["bf16"]), statistics.median(times["float8"])


def compare(bench, rows: int, flops_per_token: int, chip, log) -> dict | None:
    """The comparison at ``rows``, or at half of it when the float8 step runs out of memory
    there (it holds float8 copies next to the bf16 activations); None when neither fits."""
    from parallax.planner import roofline

    for batch_rows in (rows, rows // 2):
        if batch_rows < 1:
            break
        try:
            bf16_s, fp8_s = alternate(bench, batch_rows)
        except Exception as error:  # noqa: BLE001 - only the allocator's out-of-memory
            if "RESOURCE_EXHAUSTED" not in str(error) and "out of memory" not in str(error).lower():
                raise
            log(f"  float8 at batch {batch_rows}: out of memory")
            bench.fresh_state()
            continue
        flops = flops_per_token * batch_rows * bench.config.max_seq_len
        return {"rows": batch_rows, "bf16_s": bf16_s, "float8_s": fp8_s,
                "bf16_mfu": roofline.mfu(flops, bf16_s, chip),
                "float8_mfu": roofline.mfu(flops, fp8_s, chip)}
    return None


def row(result: dict, stamp: str, device: str, jax_version: str, px_version: str,
        model: str, seq: int, compute: str) -> str:
    """The RESULTS.md row of one comparison."""
    r = result
    return (f"| {stamp} | {device} | {jax_version} | {px_version} | {model} "
            f"| {r['rows']} x {seq} | {compute} | {r['bf16_s'] * 1e3:.1f} "
            f"| {r['float8_s'] * 1e3:.1f} | {r['bf16_mfu']:.1%} | {r['float8_mfu']:.1%} "
            f"| {r['bf16_s'] / r['float8_s']:.3f} |")
