"""float8 training of a stock Flax MLP: current and delayed scaling under data parallelism.

    python examples/float8_training.py --steps 20
    python examples/float8_training.py --history 4 --steps 12

The model is what a Flax user writes for one device: ``nnx.Linear`` layers, nothing about
float8. ``px.Float8()`` runs every dense layer's three matmuls in float8 (e4m3 forward, e5m2
gradients, tensorwise current scaling: torchao's default) inside the traced step only;
``px.Float8(delayed=True)`` is Transformer Engine's delayed scaling, which quantizes with
scales from an amax history of the steps before and keeps that history in the model:
``px.add_float8_histories(model, strategy)`` adds it once, then the train step carries it
like BatchNorm statistics. The script trains the same MLP in float32, with current and
with delayed float8 scaling, all under ``px.DataParallel`` over every device (8 simulated
CPU devices without an accelerator), prints how many float8 matmuls the emitted program
holds (5 here: two forward, two weight gradients, one input gradient, the first layer's
input needing none), the first layer's delayed scales step by step, and checks each float8
run against the same run on one device (the amaxes are max-reduced over the devices, so the
float8 values are one device's; 1e-5 relative) and the float8 losses against float32's.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--history", type=int, default=8, help="delayed scaling's amax history")
    args = parser.parse_args(argv)

    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(8))
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from tqdm import tqdm

    import parallax as px

    class MLP(nnx.Module):
        """Written for one device: stock layers only."""

        def __init__(self, rngs: nnx.Rngs):
            self.up = nnx.Linear(32, 128, rngs=rngs)
            self.down = nnx.Linear(128, 32, rngs=rngs)

        def __call__(self, x):
            return self.down(nnx.gelu(self.up(x)))

    def loss_fn(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()

    rng = np.random.default_rng(0)
    target = rng.standard_normal((32, 32), np.float32) / 4
    batches = []
    for _ in range(args.steps):
        x = rng.standard_normal((args.batch, 32), np.float32)
        batches.append({"x": x, "y": np.tanh(x @ target)})

    recipes = {"float32": None, "float8 current": px.Float8(),
               "float8 delayed": px.Float8(delayed=True, amax_history_len=args.history)}

    def run(name, recipe, devices):
        mesh = px.make_mesh(data=len(devices), devices=devices)
        strategy = px.DataParallel("data")
        if recipe is not None:
            strategy = px.compose(strategy, recipe)
            make = lambda: px.TrainState.create(  # noqa: E731
                px.add_float8_histories(MLP(nnx.Rngs(0)), strategy), optax.adam(3e-3))
        else:
            make = lambda: px.TrainState.create(MLP(nnx.Rngs(0)), optax.adam(3e-3))  # noqa: E731

        @px.train_step(mesh, strategy)
        def step(state, batch):
            loss, grads = px.value_and_grad(loss_fn)(state.model, batch)
            return state.apply_gradients(grads), {"loss": loss}

        state = px.init(make, mesh, strategy)
        text = step.lower(state, batches[0]).as_text()
        dots = sum("dot_general" in line and "f8E" in line  # float8 matmuls emitted
                   for line in text.splitlines())
        losses, scales = [], []
        for batch in tqdm(batches, desc=f"{name} on {len(devices)} device(s)", leave=False):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
            if recipe is not None and recipe.float8.recipe.delayed:
                scales.append(np.asarray(state.model.up.float8_scale[...]))
        return np.array(losses), scales, dots

    everything = jax.devices()
    results = {name: run(name, recipe, everything) for name, recipe in recipes.items()}
    print(f"{len(everything)} devices, batch {args.batch}, {args.steps} steps")
    print(f"{'run':<16}{'float8 matmuls':>16}{'first loss':>12}{'last loss':>11}"
          f"{'vs float32':>12}")
    plain = results["float32"][0]
    for name, (losses, _, dots) in results.items():
        print(f"{name:<16}{dots:>16}{losses[0]:>12.4f}{losses[-1]:>11.4f}"
              f"{abs(losses[-1] - plain[-1]) / plain[-1]:>12.2%}")
    print("\ndelayed scaling, layer 'up': the scales each step used next (x, w, g)")
    for t, scale in enumerate(results["float8 delayed"][1]):
        print(f"  after step {t}: " + "  ".join(f"{s:10.4g}" for s in scale))

    failures = 0
    for name in ("float8 current", "float8 delayed"):
        one, _, _ = run(name, recipes[name], everything[:1])
        worst = float(np.max(np.abs(results[name][0] - one) / np.abs(one)))
        ok = worst <= 1e-5
        failures += not ok
        print(f"{name}: {len(everything)} devices vs one, losses within {worst:.1e} relative "
              f"({'OK' if ok else 'MISMATCH'})")
    if results["float8 current"][2] == 0:
        print("no float8 matmul in the program")
        failures += 1
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
