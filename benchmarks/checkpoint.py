"""What ``px.checkpoint`` costs over plain Orbax calls, and what an async save costs a step.

Three measurements on one training state (GPT-2 124M with AdamW by default: 124M parameters
and two moments, 1.5 GB in float32), laid out by ``--strategy`` on the devices present:

1. save: ``px.checkpoint.save`` against a plain ``orbax.checkpoint.StandardCheckpointer``
   save of the same arrays (the nested dict ``px.checkpoint`` hands to Orbax), synchronous,
   each into a fresh directory;
2. restore: ``px.checkpoint.restore(like=abstract state, mesh, strategy)`` against
   ``StandardCheckpointer.restore`` with the same target shardings;
3. step time: blocks of ``--block-steps`` train steps, one block with an asynchronous
   ``Manager.save`` started at its first step, the next without, alternating, so the two
   are measured under the same machine load.

Every pair alternates in one run (shared machines are noisy: only ratios measured together
mean anything); the table reports medians and the ratio parallax / plain (1: no overhead) and
async save / no save (1: the save is hidden behind training).

Usage:
  python benchmarks/checkpoint.py [--config gpt2_124m|small|tiny] [--strategy fsdp]
      [--repeats 3] [--blocks 3] [--block-steps 4] [--batch 8] [--seq 128] [--dir /tmp/x]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time


def _median_seconds(samples: list[float]) -> str:
    return f"{statistics.median(samples):10.3f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="gpt2_124m", choices=["gpt2_124m", "small", "tiny"])
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--repeats", type=int, default=3, help="saves and restores of each kind")
    parser.add_argument("--blocks", type=int, default=3, help="step blocks of each kind")
    parser.add_argument("--block-steps", type=int, default=4, help="steps per block")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128, help="sequence length of the steps")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--dir", default=None, help="where to write (a temporary directory)")
    args = parser.parse_args(argv)

    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(args.devices))
    import math

    import jax
    import numpy as np
    import optax
    import orbax.checkpoint as ocp
    from flax import nnx

    import parallax as px
    from parallax import layout
    from parallax.cli import presets
    from parallax.checkpoint.tree import to_nested
    from parallax.mesh import describe

    config = getattr(px.models.GPTConfig, args.config)()
    axes, strategy = presets.parse(args.strategy, devices=jax.device_count())
    mesh = px.make_mesh(**axes, devices=jax.devices()[: math.prod(axes.values())])
    tx = optax.adamw(1e-4)

    def make_state():
        return px.TrainState.create(px.models.GPT(config, rngs=nnx.Rngs(0)), tx)

    state = px.init(make_state, mesh, strategy)
    abstract = jax.eval_shape(make_state)
    nbytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    root = args.dir or tempfile.mkdtemp(prefix="parallax-ckpt-bench-")
    print(f"{args.config}: {nbytes / 2**30:.2f} GiB of state, {args.strategy} on "
          f"{describe(mesh)}, writing under {root}")

    nested = to_nested(state, "benchmark")
    shardings = jax.tree.leaves(layout.state_shardings(abstract, strategy, mesh))
    target = to_nested(jax.tree.unflatten(jax.tree.structure(abstract), [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
        for a, s in zip(jax.tree.leaves(abstract), shardings)]), "benchmark")
    plain = ocp.StandardCheckpointer()
    times = {key: [] for key in ("save px", "save orbax", "restore px", "restore orbax")}
    for i in range(args.repeats + 1):  # the first round warms up (not counted)
        order = ("px", "orbax") if i % 2 else ("orbax", "px")  # alternate, ABBA
        for kind in order:
            path = os.path.join(root, f"{kind}-{i}")
            start = time.perf_counter()
            if kind == "px":
                px.checkpoint.save(path, state, step=0)
            else:
                plain.save(os.path.join(path, "0"), nested)
                plain.wait_until_finished()
            times[f"save {kind}"].append(time.perf_counter() - start)
        for kind in order:
            path = os.path.join(root, f"{kind}-{i}")
            start = time.perf_counter()
            if kind == "px":
                out = px.checkpoint.restore(path, like=abstract, mesh=mesh, strategy=strategy).state
            else:
                out = plain.restore(os.path.join(path, "0"), target)
            jax.block_until_ready(out)
            times[f"restore {kind}"].append(time.perf_counter() - start)
            del out
            shutil.rmtree(path, ignore_errors=True)
    times = {key: samples[1:] for key, samples in times.items()}

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, config.vocab_size, (args.batch, args.seq + 1), np.int32)}
    state, metrics = step(state, batch)  # compile
    jax.block_until_ready(metrics)
    step_times = {"steps, async save running": [], "steps, no save": []}
    with px.checkpoint.Manager(os.path.join(root, "async"), async_save=True) as manager:
        for block in range(args.blocks):
            for kind in list(step_times)[:: 1 if block % 2 else -1]:  # alternate, ABBA
                start = time.perf_counter()
                for i in range(args.block_steps):
                    if i == 0 and kind.startswith("steps, async"):
                        manager.save(block, state, force=True)
                    state, metrics = step(state, batch)
                    jax.block_until_ready(metrics)
                step_times[kind].append((time.perf_counter() - start) / args.block_steps)
                manager.wait()  # the next block starts with no save in flight
    shutil.rmtree(root if args.dir is None else os.path.join(root, "async"), ignore_errors=True)

    rows = [("save (synchronous)", times["save px"], times["save orbax"]),
            ("restore (target shardings)", times["restore px"], times["restore orbax"])]
    print(f"\n{'seconds (median)':28s} {'parallax':>10s} {'orbax':>10s} {'ratio':>7s}")
    for name, ours, theirs in rows:
        ratio = statistics.median(ours) / statistics.median(theirs)
        print(f"{name:28s} {_median_seconds(ours)} {_median_seconds(theirs)} {ratio:7.2f}")
    with_save, without = step_times["steps, async save running"], step_times["steps, no save"]
    ratio = statistics.median(with_save) / statistics.median(without)
    print(f"\n{'seconds per step (median)':28s} {'async save':>10s} {'no save':>10s} {'ratio':>7s}")
    print(f"{'train step':28s} {_median_seconds(with_save)} {_median_seconds(without)} "
          f"{ratio:7.2f}")
    print(f"({args.blocks} blocks of {args.block_steps} steps each way, batch {args.batch} x "
          f"{args.seq} tokens; the save starts at each block's first step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
