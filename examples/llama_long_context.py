"""A tiny Llama at a long-ish sequence under context x data x tensor parallelism.

    python examples/llama_long_context.py --steps 10
    python examples/llama_long_context.py --method all_gather --seq-len 1024 --check
    python examples/llama_long_context.py --precision bf16 --check
    python examples/llama_long_context.py --precision fp32     # also on a GPU/TPU

Context parallelism splits every sequence over a mesh axis (the zigzag split: device ``i``
of ``n`` holds chunks ``i`` and ``2n-1-i`` of ``2n``, so causal attention costs every device
the same); attention runs across the axis either as a ring of K/V blocks (Liu et al. 2023,
Ring Attention) or as one all-gather of K and V per layer (Llama 3, section 3.3.2). Here it
is composed with data parallelism and Megatron tensor parallelism on
``px.make_mesh(data=2, context=2, tensor=2)`` (8 simulated CPU devices without an
accelerator), with ``px.MixedPrecision`` (bf16 compute, fp32 master weights and optimizer)
by default on a GPU or TPU and float32 on CPU (``--precision`` chooses).

The script prints the per-device memory of the compiled step (XLA's ``memory_analysis``:
arguments, temporaries) next to the same step compiled for one device, trains a few steps
on the text shipped with parallax, and with ``--check`` compares the losses with a plain
one-device fp32 run (fp32: 1e-4 relative; bf16: 3e-2). See docs/context_parallel.md.

On jax 0.12 XLA's SPMD partitioner aborted the process compiling this step (the token
embedding's lookup and its gradient left to GSPMD); parallax's models read their embeddings
through ``parallax.attention.token_embeddings``, which splits the lookup itself, so the step
compiles on jax 0.10.2 and 0.12.1 (checked from 16 to 4096 tokens; docs/context_parallel.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    parser.add_argument("--method", default="ring", choices=["ring", "all_gather"])
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--check", action="store_true",
                        help="also train on one device (fp32) and compare the losses")
    from parallax.precision import add_arguments as add_precision_argument

    args = add_precision_argument(parser).parse_args(argv)

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
    # The model computes in its own dtype: bf16 needs it there as well as in the policy.
    config = px.models.LlamaConfig.tiny(max_seq_len=args.seq_len, dtype=compute)
    mesh = px.make_mesh(devices=jax.devices()[:8], data=2, context=2, tensor=2)
    parts = [px.DataParallel("data"), px.ContextParallel("context", method=args.method),
             px.TensorParallel("tensor")]
    if compute == "bfloat16":  # float32 master parameters and optimizer
        parts.append(px.MixedPrecision(compute=compute))
    strategy = px.compose(*parts)

    def make_state(config=config):
        return px.TrainState.create(px.models.Llama(config, rngs=nnx.Rngs(0)),
                                    optax.adam(args.lr))

    def train_step(mesh, strategy):
        @px.train_step(mesh, strategy)
        def step(state, batch):
            loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
            return state.apply_gradients(grads), {"loss": loss}
        return step

    data = list(batches(demo_tokens(), args.batch, args.seq_len, args.steps))
    step = train_step(mesh, strategy)
    print(f"{strategy.name}\non {px.mesh.describe(mesh)}, sequence {args.seq_len} tokens "
          f"({args.seq_len // mesh.shape.get('context', 1)} per context rank)\n")

    one = px.make_mesh(devices=jax.devices()[:1], data=1)
    one_step = train_step(one, px.compose(px.DataParallel("data"), *parts[3:]))
    state = px.init(make_state, mesh, strategy)  # created sharded: no device holds it whole
    print(f"{'compiled step, per device':<28}{'arguments MiB':>15}{'temporaries MiB':>17}")
    one_state = jax.eval_shape(make_state)  # one device: compiled only, never created
    for label, step_, state_ in (("one device", one_step, one_state),
                                 (f"{mesh.size} devices", step, state)):
        memory = hlo.memory(step_.lower(state_, data[0]).compile())
        print(f"{label:<28}{memory.argument_bytes / 2**20:>15.2f}"
              f"{memory.temp_bytes / 2**20:>17.2f}")
    print()

    losses = []
    for i, batch in enumerate(data):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if i % 5 == 0 or i == len(data) - 1:
            print(f"step {i:3d}  loss {losses[-1]:.4f}")

    if not args.check:
        return 0
    fp32 = dataclasses.replace(config, dtype=jnp.float32)  # the reference computes in fp32
    reference = px.testing.train(lambda: make_state(fp32), px.models.next_token_loss,
                                 data).losses
    gap = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    tolerance = 1e-4 if compute == "float32" else 3e-2
    print(f"\nlargest relative loss difference vs one device (fp32): {gap:.2e} "
          f"(tolerance {tolerance:.0e})")
    return 0 if gap < tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
