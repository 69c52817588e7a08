"""Narayanan et al. 2021 (Megatron-LM on Selene), Table 1, as parallax configurations.

The table is ``data/megatron_lm_2021_table1.csv`` (its header comments cite it): GPT models
of 1.7B to 1T parameters on 32 to 3,072 DGX A100 GPUs, sequence 2048, vocabulary 51,200,
with the throughput each run reached. The paper's FLOP count per step, with activation
recomputation (its equation 3), is ``96 B s l h^2 (1 + s / 6h + V / 16 l h)``.

Each row becomes the closest parallax configuration of what the paper ran (section 5.1):
tensor parallelism over ``t`` with sequence parallelism (each rank then sends ``1/t`` of an
activation between stages: the paper's scatter/gather optimisation), the interleaved 1F1B
schedule over ``p`` stages (two chunks per stage, or the smallest count above that divides
the stage's layers; one stage is gradient accumulation), micro-batches of one sequence
(the paper does not give Table 1's micro-batch size), every layer recomputed in its backward
(``remat="nothing_saveable"``), data parallelism over the rest, mixed precision (bfloat16
compute, float32 parameters and Adam). The prediction is ``px.explain``'s on the
``dgx-a100`` cluster, from sizes only.

``python tests/planner/published_runs.py`` prints the comparison as docs/explain.md's table.
"""

from __future__ import annotations

import csv
import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AbstractMesh, AxisType

import parallax as px
from parallax.planner.predicted import memory as pm
from parallax.planner.predicted import pipeline as pp
from parallax.planner.predicted import step_time
from parallax.planner.setting import read_setting
from parallax.planner.topology import cluster

TABLE = pathlib.Path(__file__).parent / "data" / "megatron_lm_2021_table1.csv"
SEQ, VOCAB = 2048, 51200


@dataclasses.dataclass(frozen=True)
class Run:
    """One row of the table."""

    params_billion: float
    heads: int
    hidden: int
    layers: int
    tensor: int
    stages: int
    gpus: int
    batch: int
    tflops: float
    aggregate_pflops: float

    @property
    def data(self) -> int:
        return self.gpus // (self.tensor * self.stages)

    @property
    def paper_flops(self) -> float:
        """The paper's equation 3: FLOPs per step, with activation recomputation."""
        b, s, l, h = self.batch, SEQ, self.layers, self.hidden
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + VOCAB / (16 * l * h))

    @property
    def chunks(self) -> int:
        per_stage = self.layers // self.stages
        return next((v for v in range(2, per_stage + 1) if per_stage % v == 0), 1)


def runs() -> list[Run]:
    lines = [line for line in TABLE.read_text().splitlines() if not line.startswith("#")]
    return [Run(float(r["params_billion"]), int(r["heads"]), int(r["hidden"]),
                int(r["layers"]), int(r["tensor_parallel"]), int(r["pipeline_parallel"]),
                int(r["gpus"]), int(r["global_batch"]), float(r["tflops_per_gpu"]),
                float(r["aggregate_pflops"]))
            for r in csv.DictReader(lines)]


def config(run: Run) -> px.models.GPTConfig:
    return px.models.GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, num_layers=run.layers,
                               num_heads=run.heads, embed_dim=run.hidden,
                               mlp_dim=4 * run.hidden, dtype=jnp.bfloat16)


def state_fn(run: Run):
    cfg = config(run)
    return lambda: px.TrainState.create(px.models.GPT(cfg, rngs=nnx.Rngs(0)),
                                        optax.adamw(1e-4))


def batch(run: Run) -> dict:
    return {"tokens": jax.ShapeDtypeStruct((run.batch, SEQ + 1), jnp.int32)}


def published(run: Run) -> tuple[dict, px.Strategy]:
    """The mesh's axis sizes and the strategy closest to the paper's run (module docstring)."""
    parts = [px.DataParallel("data")] if run.data > 1 else []
    if run.tensor > 1:
        parts.append(px.TensorParallel("tensor", sequence_parallel=True))
    interleaved = run.stages > 1 and run.chunks > 1
    parts.append(px.Pipeline("stage", microbatches=run.batch // run.data,
                             schedule="interleaved_1f1b" if interleaved else "1f1b",
                             virtual_stages=run.chunks if interleaved else None,
                             remat="nothing_saveable"))
    return {"data": run.data, "stage": run.stages, "tensor": run.tensor}, px.compose(*parts)


@dataclasses.dataclass(frozen=True)
class Prediction:
    run: Run
    split: step_time.StepSplit
    peak_bytes: float

    @property
    def tflops(self) -> float:
        """Predicted teraFLOP/s per GPU, counted as the paper counts (equation 3)."""
        return self.run.paper_flops / self.split.total / self.run.gpus / 1e12

    @property
    def error(self) -> float:
        return self.tflops / self.run.tflops - 1


def predict(run: Run, state=None) -> Prediction:
    """The published configuration's predicted split and peak memory on ``dgx-a100``."""
    axes, strategy = published(run)
    if state is None:
        with nnx.use_eager_sharding(False):
            state = jax.eval_shape(state_fn(run))
    mesh = AbstractMesh(tuple(axes.values()), tuple(axes), (AxisType.Auto,) * len(axes))
    s = read_setting(mesh, strategy, state, batch(run), config(run), backend="gpu")
    split = step_time.estimate(s, cluster("dgx-a100"))
    state_bytes = pm.state_bytes(s)
    temps, _ = pp.stage_temporaries(s, state, batch(run))
    peak = sum(state_bytes[k].value for k in ("parameters", "optimizer state", "other state"))
    return Prediction(run, split, peak + temps.value + s.batch_bytes / s.size(s.batch_axes))


def markdown(predictions: list[Prediction]) -> str:
    head = ("| model | t x p x d | GPUs | published TFLOP/s | predicted | error | matmuls "
            "| memory-bound | bubble | in a node | across nodes | peak GB |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for p in predictions:
        r, sp = p.run, p.split
        lines.append(
            f"| {r.params_billion:g}B | {r.tensor} x {r.stages} x {r.data} | {r.gpus} | "
            f"{r.tflops:g} | {p.tflops:.0f} | {100 * p.error:+.0f}% | {sp.matmul:.2f} s | "
            f"{sp.memory_bound:.2f} s | {sp.bubble:.2f} s | "
            f"{sp.communication['intra-node']:.2f} s | "
            f"{sp.communication['inter-node']:.2f} s | {p.peak_bytes / 1e9:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown([predict(run) for run in runs()]))
