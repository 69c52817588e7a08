"""Gradient accumulation: a large batch in micro-batches, the same numbers, less memory.

    python examples/gradient_accumulation.py --steps 10
    python examples/gradient_accumulation.py --batch 64 --microbatches 8

``px.GradientAccumulation(k)`` splits each device's share of the batch into ``k``
micro-batches and sums their gradients in a ``lax.scan`` (GPipe's accumulation), so the
activations of only one micro-batch are alive at a time, and the optimizer still sees the
full batch's gradient. The script compiles a data-parallel GPT step without accumulation
and with ``--microbatches`` and prints the temporaries each device needs (from the compiled
programs), then trains with ``--microbatches`` (throughput, MFU and memory in the progress bar and a
table at the end; ``--logdir`` and ``--profile-steps`` as for ``parallax demo``) and checks
the loss curve against the full batch on one device. On a GPU or TPU it computes in bf16
with fp32 master parameters and optimizer (``px.MixedPrecision``), on CPU in fp32
(``--precision`` chooses); the comparison's tolerance is 1e-4 in fp32, 3e-2 in bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    parser.add_argument("--microbatches", type=int, default=4)
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
    from parallax.analysis import hlo
    from parallax.cli.demo import batches, demo_tokens
    from parallax.precision import compute_dtype_from_flag

    compute = compute_dtype_from_flag(args.precision)  # auto: bf16 on GPU/TPU, fp32 on CPU

    config = px.models.GPTConfig.tiny(dtype=compute)
    mesh = px.make_mesh(data=jax.device_count())
    data = list(batches(demo_tokens(), args.batch, config.max_seq_len, args.steps))

    def make_state(config=config):
        return px.TrainState.create(px.models.GPT(config, rngs=nnx.Rngs(0)), optax.sgd(0.3))

    precision = [px.MixedPrecision(compute=compute)] if compute != "float32" else []

    def step_for(k):
        strategy = px.compose(px.DataParallel("data"), px.GradientAccumulation(k),
                              *precision)

        @px.train_step(mesh, strategy)
        def step(state, batch):
            loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
            return state.apply_gradients(grads), {"loss": loss}

        return strategy, step

    rows = args.batch // mesh.size
    counts = sorted({1, args.microbatches})
    print(f"{mesh.size} devices, {rows} sequences each per step\n")
    print(f"{'micro-batches':>14}{'rows each':>11}{'temporaries per device':>25}")
    abstract = jax.eval_shape(make_state)
    for k in counts:
        _, step = step_for(k)
        temps = hlo.memory(step.lower(abstract, data[0]).compile()).temp_bytes
        print(f"{k:>14}{rows // k:>11}{temps / 1e6:>22.2f} MB")

    strategy, step = step_for(args.microbatches)
    state = px.init(make_state, mesh, strategy)
    losses = []
    tokens = args.batch * config.max_seq_len
    with px.metrics.Monitor(items_per_step=tokens,
                            flops_per_step=px.models.flops_per_token(config) * tokens,
                            logdir=args.logdir, profile_steps=args.profile_steps,
                            description=strategy.name) as monitor:
        for batch in monitor.loop(data):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
            monitor.step(metrics, loss=losses[-1])
    print(monitor.table())
    fp32 = dataclasses.replace(config, dtype=jnp.float32)  # the reference computes in fp32
    reference = px.testing.train(lambda: make_state(fp32), px.models.next_token_loss,
                                 data).losses
    gap = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    tolerance = 1e-4 if compute == "float32" else 3e-2
    print(f"\n{strategy.name}: loss {losses[0]:.4f} -> {losses[-1]:.4f}; largest relative "
          f"difference vs the full batch on one device (fp32) {gap:.1e} (tolerance "
          f"{tolerance:.0e}, {compute})")
    return 0 if gap < tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
