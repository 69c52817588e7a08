"""GPT with 3D parallelism: data x tensor (Megatron) x pipeline (1F1B), checked against one device.

    python examples/gpt_3d.py --steps 20
    python examples/gpt_3d.py --schedule interleaved_1f1b --microbatches 4 --steps 20

Megatron-LM's "3D parallelism" (Narayanan et al., SC 2021) on 8 devices is 2 pipeline stages
x 2 data-parallel replicas x 2 tensor-parallel ranks: each stage holds half the layers, each
layer's matrices are split over the tensor axis, and each replica sees half the batch. Here
it is one ``px.compose``; the model is the plain ``px.models.GPT``, its loss split into
pipeline pieces by ``px.models.next_token_stages``. The script prints what ``px.explain``
predicts and what the compiled step really holds and sends, trains on the text shipped with
parallax (tokens/s per device, MFU and memory in the progress bar, ``px.metrics``' table at
the end; ``--logdir`` and ``--profile-steps`` as for ``parallax demo``), and compares the loss
curve with the same steps on one device. The mesh fits the
devices present (one GPU: every axis 1); without an accelerator it simulates 8 CPU devices.
On a GPU or TPU it computes in bf16 with fp32 master parameters and optimizer
(``px.MixedPrecision``), on CPU in fp32 (``--precision`` chooses); the comparison's
tolerance is 1e-3 in fp32, 3e-2 in bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def mesh_sizes(devices: int) -> dict[str, int]:
    """2 stages x 2 tensor ranks when the device count allows, the rest data parallel."""
    stage = 2 if devices % 2 == 0 else 1
    tensor = 2 if (devices // stage) % 2 == 0 else 1
    return {"stage": stage, "data": devices // stage // tensor, "tensor": tensor}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    parser.add_argument("--schedule", default="1f1b",
                        choices=["gpipe", "1f1b", "interleaved_1f1b"])
    parser.add_argument("--microbatches", type=int, default=2, help="per data-parallel slice")
    parser.add_argument("--lr", type=float, default=3e-3)
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
    from parallax.cli.demo import batches, demo_tokens
    from parallax.precision import compute_dtype_from_flag

    compute = compute_dtype_from_flag(args.precision)  # auto: bf16 on GPU/TPU, fp32 on CPU
    layers = 4 if args.schedule == "interleaved_1f1b" else 2  # 2 chunks on each of 2 stages
    config = px.models.GPTConfig.tiny(num_layers=layers, dtype=compute)
    mesh = px.make_mesh(**mesh_sizes(jax.device_count()))
    strategy = px.compose(
        px.DataParallel("data"),
        px.TensorParallel("tensor"),
        px.Pipeline("stage", microbatches=args.microbatches, schedule=args.schedule),
        *([px.MixedPrecision(compute=compute)] if compute != "float32" else []),
    )

    def make_state(config=config):
        return px.TrainState.create(px.models.GPT(config, rngs=nnx.Rngs(0)),
                                    optax.adamw(args.lr))

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_stages)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    data = list(batches(demo_tokens(), args.batch, config.max_seq_len, args.steps))
    print(f"{strategy.name}\non {px.mesh.describe(mesh)}\n")
    print(px.explain(step, jax.eval_shape(make_state), data[0]).text(), "\n")

    state = px.init(make_state, mesh, strategy)  # created sharded: no device holds it whole
    losses = []
    tokens = args.batch * config.max_seq_len  # MFU from the model's FLOPs (PaLM's formula)
    with px.metrics.Monitor(items_per_step=tokens,
                            flops_per_step=px.models.flops_per_token(config) * tokens,
                            logdir=args.logdir, profile_steps=args.profile_steps,
                            description=px.mesh.describe(mesh)) as monitor:
        for batch in monitor.loop(data):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
            monitor.step(metrics, loss=losses[-1])
    print(monitor.table())

    fp32 = dataclasses.replace(config, dtype=jnp.float32)  # the reference computes in fp32
    reference = px.testing.train(lambda: make_state(fp32), px.models.next_token_loss,
                                 data).losses
    gap = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    tolerance = 1e-3 if compute == "float32" else 3e-2
    print(f"\nlargest relative loss difference vs one device (fp32): {gap:.2e} (tolerance "
          f"{tolerance:.0e}, {compute})")
    return 0 if gap < tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
