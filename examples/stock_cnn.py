"""A stock Flax CNN (Conv, BatchNorm, Dropout), not written for parallax, under DP x FSDP.

    python examples/stock_cnn.py --steps 20
    python examples/stock_cnn.py --batch-stats per_replica --steps 20

The model below is what a Flax user writes for one device: ``nnx.Conv``, ``nnx.BatchNorm``
and ``nnx.Dropout`` in training mode, no sharding annotations. ``px.compose(DataParallel,
FSDP)`` splits the batch over both axes and shards each parameter and optimizer moment by
shape. The forward pass writes the BatchNorm running statistics and the Dropout RNG counter
into the model; ``px.value_and_grad`` returns them as ``nnx.value_and_grad`` does and
``state.apply_gradients`` keeps them. By default the statistics are the whole batch's and
the Dropout masks are the ones one device draws, so the script checks the run against the
same steps as a plain ``nnx`` loop on one device: losses, parameters and running
statistics. ``--batch-stats per_replica`` (DDP's statistics) and ``--rng per_shard``
(independent dropout streams) show the opt-in modes, which are not one device's numbers.
The progress bar shows examples/s per device, MFU and memory (``px.metrics``), a table sums
them up, and ``--logdir`` and ``--profile-steps`` work as for ``parallax demo``. Without an
accelerator it simulates 8 CPU devices.
"""

from __future__ import annotations

import argparse
import sys


def cnn_flops_per_image(height: int, width: int, channels: int = 16, classes: int = 10) -> int:
    """Training FLOPs of one image through ``CNN`` below: its two 3x3 convolutions (padding
    SAME) and the head, 2 per multiply-add, times 3 for forward and backward (PaLM's count)."""
    macs = height * width * 9 * (3 * channels + channels * channels) + channels * classes
    return 6 * macs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32, help="global batch (images)")
    parser.add_argument("--batch-stats", default="global",
                        choices=["global", "per_replica", "per_microbatch"])
    parser.add_argument("--rng", default="global", choices=["global", "per_shard"])
    parser.add_argument("--microbatches", type=int, default=None)
    from parallax.metrics import add_arguments

    args = add_arguments(parser).parse_args(argv)

    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(8))
    import jax
    import numpy as np
    import optax
    from flax import nnx

    import parallax as px

    class CNN(nnx.Module):
        """A small ResNet-style classifier, exactly as written for one device."""

        def __init__(self, *, rngs: nnx.Rngs, channels: int = 16, classes: int = 10):
            self.stem = nnx.Conv(3, channels, (3, 3), use_bias=False, rngs=rngs)
            self.bn1 = nnx.BatchNorm(channels, momentum=0.9, rngs=rngs)
            self.conv = nnx.Conv(channels, channels, (3, 3), use_bias=False, rngs=rngs)
            self.bn2 = nnx.BatchNorm(channels, momentum=0.9, rngs=rngs)
            self.drop = nnx.Dropout(0.3, rngs=rngs)
            self.head = nnx.Linear(channels, classes, rngs=rngs)

        def __call__(self, x):
            x = nnx.relu(self.bn1(self.stem(x)))
            x = nnx.relu(x + self.bn2(self.conv(x)))  # a residual block
            return self.head(self.drop(x.mean(axis=(1, 2))))

    def loss_fn(model, batch):
        logits = model(batch["image"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    rng = np.random.default_rng(0)
    batches = [{"image": rng.standard_normal((args.batch, 16, 16, 3), np.float32),
                "label": rng.integers(0, 10, args.batch).astype(np.int32)}
               for _ in range(args.steps)]
    tx = optax.sgd(0.05, momentum=0.9)

    devices = jax.device_count()
    fsdp = 2 if devices % 2 == 0 else 1
    mesh = px.make_mesh(data=devices // fsdp, fsdp=fsdp)
    strategy = px.compose(px.DataParallel("data"), px.FSDP("fsdp"))
    state = px.init(lambda: px.TrainState.create(CNN(rngs=nnx.Rngs(0)), tx), mesh, strategy)
    options = {"batch_stats": args.batch_stats, "rng": args.rng}
    if args.microbatches:
        options["microbatches"] = args.microbatches

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(loss_fn, **options)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    # The same steps as a plain nnx loop on one device.
    model = CNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def reference_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    print(f"mesh {dict(mesh.shape)}, {strategy.name}, batch_stats={args.batch_stats!r}, "
          f"rng={args.rng!r}")
    losses = []
    with px.metrics.Monitor(items_per_step=args.batch, unit="ex",
                            flops_per_step=cnn_flops_per_image(16, 16) * args.batch,
                            logdir=args.logdir, profile_steps=args.profile_steps,
                            description=strategy.name) as monitor:
        for batch in monitor.loop(batches):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
            monitor.step(metrics, loss=losses[-1])
    print(monitor.table())
    worst = 0.0
    for i, (batch, loss) in enumerate(zip(batches, losses)):
        ref = float(reference_step(model, optimizer, batch))
        worst = max(worst, abs(loss - ref) / abs(ref))
        print(f"step {i:3d}  loss {loss:.6f}  one device {ref:.6f}")
    params = px.testing.relative_difference(jax.device_get(state.params),
                                            jax.device_get(nnx.state(model, nnx.Param)))
    stats = px.testing.relative_difference(
        jax.device_get(nnx.state(nnx.merge(state.graphdef, state.params, state.rest),
                                 nnx.BatchStat)),
        jax.device_get(nnx.state(model, nnx.BatchStat)))
    print(f"largest relative difference to one device: losses {worst:.1e}, parameters "
          f"{params:.1e}, BatchNorm running statistics {stats:.1e}")
    one_device = args.batch_stats == "global" and args.rng == "global"
    if one_device and max(worst, params, stats) > 1e-4:
        print("expected one device's numbers (global statistics, one device's masks)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
