"""``parallax demo``: train a small GPT with a composed strategy, then check it on one device.

The demo trains ``GPT tiny`` (byte-level, on text shipped with the package: no downloads)
with DP 2 x FSDP 2 x TP 2 by default, then runs the same steps as a plain ``jax.jit`` program
on a single device, and prints the largest relative difference between the two loss curves,
the bytes each device holds, and the collectives each step runs (read from the compiled
program).

With ``checkpoint_dir`` the demo resumes where a previous demo with that directory stopped
(state, data position and loss curve come back from the checkpoint, under whatever strategy
this run uses) and saves every 10 steps and at the end (``px.checkpoint.Manager``).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import time

import jax
import numpy as np
import optax
from flax import nnx

from parallax import checkpoint, metrics, testing
from parallax.cli import presets
from parallax.analysis import hlo
from parallax.distributed.batches import process_slice
from parallax.mesh import describe, make_mesh
from parallax.state import TrainState
from parallax.step.placement import init
from parallax.step.spmd_step import train_step
from parallax.grad.gradients import value_and_grad


def demo_tokens() -> np.ndarray:
    """The shipped demo text as bytes (a vocabulary of 256)."""
    text = importlib.resources.files("parallax").joinpath("data/demo.txt").read_bytes()
    return np.frombuffer(text, dtype=np.uint8).astype(np.int32)


def batches(tokens: np.ndarray, batch: int, seq_len: int, steps: int, seed: int = 0):
    """``steps`` batches of random windows ``[batch, seq_len + 1]``, the same every run."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=batch)
        yield {"tokens": np.stack([tokens[s : s + seq_len + 1] for s in starts])}


@dataclasses.dataclass
class DemoResult:
    strategy: str
    mesh: str
    losses: list[float]
    reference_losses: list[float]
    max_relative_difference: float
    collectives: list[hlo.Collective]
    memory: hlo.Memory
    state_bytes_per_device: int
    seconds: float
    resumed_from: int | None = None
    checkpoint_dir: str | None = None
    throughput: str = ""  # px.metrics.Throughput's table
    logdir: str | None = None


def _state_bytes_on_first_device(state) -> int:
    total = 0
    for leaf in jax.tree.leaves(state):
        shard = leaf.addressable_shards[0]
        total += shard.data.size * shard.data.dtype.itemsize
    return total


SAVE_EVERY = 10


def _resume(saver: checkpoint.Manager, make_state, mesh, strategy, steps: int, settings: dict):
    """(state, losses so far) from the newest checkpoint of ``saver``, or None."""
    if saver.latest_step() is None:
        return None
    restored = saver.restore(like=make_state, mesh=mesh, strategy=strategy)
    saved = {key: restored.extra.get(key) for key in settings}
    if saved != settings:
        raise ValueError(f"parallax demo: the checkpoint in {saver.path} was trained with "
                         f"{saved}, this run asks for {settings}; pass the same values to "
                         "resume it, or another --checkpoint-dir.")
    if restored.step > steps:
        raise ValueError(f"parallax demo: the checkpoint in {saver.path} is at step "
                         f"{restored.step}, past --steps {steps}; pass --steps {restored.step} "
                         "or more to resume it.")
    return restored.state, list(restored.extra["losses"])


def run(strategy: str = "dp+fsdp+tp", steps: int = 30, batch: int = 16,
        learning_rate: float = 3e-3, tensor: int = 2, progress: bool = True,
        checkpoint_dir: str | None = None, logdir: str | None = None,
        profile_steps: str | None = None) -> DemoResult:
    """Trains GPT tiny under ``strategy`` and on one device; returns what it measured.

    With ``checkpoint_dir``, resumes from the newest checkpoint there (if any) and saves to
    it; the loss curve compared with one device covers every step, before and after. With
    ``logdir``, each step's loss and ``px.metrics`` go to ``logdir/metrics.jsonl`` and
    TensorBoard event files; with ``profile_steps`` (``"3:5"``), those steps are traced
    with ``jax.profiler`` into ``logdir`` (``./parallax-logs`` when no ``logdir``).
    """
    from parallax.models import GPT, GPTConfig, next_token_loss

    config = GPTConfig.tiny()
    axes, composed = presets.parse(strategy, tensor=tensor, devices=jax.device_count())
    mesh = make_mesh(**axes, devices=jax.devices()[: math.prod(axes.values())])
    data = list(batches(demo_tokens(), batch, config.max_seq_len, steps))

    def make_state():
        return TrainState.create(GPT(config, rngs=nnx.Rngs(0)), optax.adamw(learning_rate))

    @train_step(mesh, composed)
    def step(state, batch):
        loss, grads = value_and_grad(next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    start = time.perf_counter()
    settings = {"batch": batch, "learning_rate": learning_rate}
    saver = checkpoint.Manager(checkpoint_dir, save_every=SAVE_EVERY) if checkpoint_dir else None
    resumed = saver and _resume(saver, make_state, mesh, composed, steps, settings)
    state, losses = resumed or (init(make_state, mesh, composed), [])
    resumed_from = len(losses) if resumed else None
    rows = process_slice(batch, mesh, composed)  # this process's share (all rows in one)
    compiled = step.compile(state, _share(data[0], rows))  # the loop runs this program
    monitor = metrics.Monitor.for_compiled(
        compiled, items_per_step=batch * config.max_seq_len, logdir=logdir,
        profile_steps=profile_steps, progress=progress,
        description=f"{strategy} on {describe(mesh)}", first_step=len(losses) + 1)
    with monitor:
        for b in monitor.loop(data[len(losses):]):
            state, out = step(state, _share(b, rows))
            losses.append(float(out["loss"]))
            monitor.step(out, loss=losses[-1])
            if saver:  # the data position is the step: the batches are the same every run
                saver.save(len(losses), state,
                           settings | {"losses": losses, "strategy": strategy})
    if saver:
        if saver.latest_step() != len(losses):  # the last step, when off the schedule
            saver.save(len(losses), state, settings | {"losses": losses, "strategy": strategy},
                       force=True)
        saver.close()
    state_bytes = _state_bytes_on_first_device(state)
    seconds = time.perf_counter() - start

    if progress:
        print("the same steps as a plain jax.jit program on one device ...", flush=True)
    reference = testing.train(make_state, next_token_loss, data).losses
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    return DemoResult(strategy, describe(mesh), losses, reference, diff,
                      hlo.collectives(compiled, mesh), hlo.memory(compiled), state_bytes, seconds,
                      resumed_from, checkpoint_dir and str(checkpoint_dir),
                      monitor.meter.table() if monitor.meter.history else "",
                      logdir and str(logdir))


def _share(batch: dict, rows: slice) -> dict:
    """This process's rows of a global batch (under ``parallax launch``, each process feeds
    its own share, as in DDP; with one process, the whole batch)."""
    return {key: value[rows] for key, value in batch.items()}


def report(result: DemoResult) -> str:
    """The demo's summary as text."""
    mem = result.memory
    lines = [
        f"strategy {result.strategy} on {result.mesh}",
        f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f} over {len(result.losses)} steps "
        f"({result.seconds:.1f} s with compilation)",
        f"largest relative loss difference vs one device: {result.max_relative_difference:.2e}",
        "",
        "bytes per device (compiled step)",
        f"  training state (params + optimizer) {result.state_bytes_per_device:>12,}",
        f"  arguments (state + batch)           {mem.argument_bytes:>12,}",
        f"  temporaries                          {mem.temp_bytes:>12,}",
        "",
        "collectives per step",
        hlo.table(result.collectives),
    ]
    if result.throughput:
        lines += ["", "throughput (px.metrics)", result.throughput]
    if result.logdir:
        lines += [f"metrics logged to {result.logdir} (metrics.jsonl, TensorBoard events)"]
    if result.checkpoint_dir:
        resumed = (f"resumed from step {result.resumed_from}" if result.resumed_from is not None
                   else "started afresh")
        lines[2:2] = [f"checkpoints in {result.checkpoint_dir}: {resumed}, saved step "
                      f"{len(result.losses)}"]
    return "\n".join(lines)


def loss_gap_ok(result: DemoResult, tolerance: float = 1e-4) -> bool:
    """True when the parallel loss curve is within ``tolerance`` (relative) of one device's."""
    return math.isfinite(result.max_relative_difference) and (
        result.max_relative_difference <= tolerance
    )
