"""Megatron tensor parallelism with sequence parallelism, in both of JAX's styles.

    python examples/megatron_tp_sp.py --steps 10
    python examples/megatron_tp_sp.py --tensor 4 --no-sequence-parallel

Megatron-LM splits each layer's matrices over ``--tensor`` devices (column-parallel then
row-parallel), so attention and MLP each need one all-reduce of the ``[B, T, D]``
activations forward and one backward; sequence parallelism (Korthikanti et al. 2022) splits
the residual stream's sequence too and turns each all-reduce into a reduce-scatter plus an
all-gather of the same bytes. This script builds the same GPT twice: ``px.models.GPT`` under
``px.TensorParallel`` (GSPMD: XLA inserts the collectives) and ``px.nn.ParallelGPT`` with
Megatron's explicit ``f``/``g`` operators; reads what each compiled step sends over the
tensor axis next to the papers' formula; trains both for ``--steps`` with data parallelism
on the remaining devices (throughput, MFU and memory in the progress bar, a table after each;
``--logdir DIR`` logs to ``DIR/GPT`` and ``DIR/ParallelGPT``); and compares their loss curves
with one device. On a GPU or TPU it computes in bf16 with fp32 master parameters and
optimizer (``px.MixedPrecision``; the formula counts bf16 activations), on CPU in fp32
(``--precision`` chooses); the comparison's tolerance is 1e-4 in fp32, 3e-2 in bf16. (With
``--precision bf16`` on CPU the compiler converts each bf16 collective to float32, so the
measured bytes are twice the formula's.)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tensor", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--no-sequence-parallel", dest="sp", action="store_false")
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
    from parallax.analysis import tensor_traffic
    from parallax.cli.demo import batches, demo_tokens
    from parallax.precision import compute_dtype_from_flag

    compute = compute_dtype_from_flag(args.precision)  # auto: bf16 on GPU/TPU, fp32 on CPU

    n = jax.device_count()
    tensor = max(d for d in range(1, min(args.tensor, n) + 1) if n % d == 0)
    mesh = px.make_mesh(data=n // tensor, tensor=tensor)
    strategy = px.compose(px.DataParallel("data"),
                          px.TensorParallel("tensor", sequence_parallel=args.sp),
                          *([px.MixedPrecision(compute=compute)] if compute != "float32" else []))
    config = px.models.GPTConfig.tiny(dtype=compute)
    data = list(batches(demo_tokens(), args.batch, config.max_seq_len, args.steps))
    styles = {
        "GSPMD (px.models.GPT)": (px.models.GPT, px.models.next_token_loss, {}),
        "explicit (px.nn.ParallelGPT)": (
            px.nn.ParallelGPT, px.nn.tensor_parallel(px.nn.parallel_next_token_loss),
            {"sequence_parallel": args.sp}),
    }
    formula = tensor_traffic.megatron_traffic(config, args.batch // (n // tensor),
                                              sequence_parallel=args.sp)
    print(f"{strategy.name} on {px.mesh.describe(mesh)}")
    print(f"Megatron's formula over the tensor axis: all-reduce {formula.all_reduce:,} B, "
          f"all-gather {formula.all_gather:,} B, reduce-scatter {formula.reduce_scatter:,} B")

    def make_state(config=config):
        return px.TrainState.create(px.models.GPT(config, rngs=nnx.Rngs(0)), optax.sgd(0.3))

    fp32 = dataclasses.replace(config, dtype=jnp.float32)  # the reference computes in fp32
    reference = px.testing.train(lambda: make_state(fp32), px.models.next_token_loss,
                                 data).losses
    worst = 0.0
    for name, (model_cls, loss_fn, extra) in styles.items():
        def make(model_cls=model_cls, extra=extra):
            return px.TrainState.create(model_cls(config, rngs=nnx.Rngs(0), **extra),
                                        optax.sgd(0.3))

        @px.train_step(mesh, strategy)
        def step(state, batch, loss_fn=loss_fn):
            loss, grads = px.value_and_grad(loss_fn)(state.model, batch)
            return state.apply_gradients(grads), {"loss": loss}

        state = px.init(make, mesh, strategy)
        compiled = step.compile(state, data[0])  # the training below runs this program
        sent = tensor_traffic.measured_traffic(compiled, mesh, args.batch // (n // tensor))
        found = tensor_traffic.tensor_collectives(compiled, mesh)
        per_layer = [c for c in found if c.in_loop]
        on_cpu = jax.default_backend() == "cpu"
        note = (" (the CPU compiler writes GSPMD's reduce-scatters as all-reduces)"
                if args.sp and name.startswith("GSPMD") and on_cpu else "")
        if on_cpu and compute != "float32":
            note += " (the CPU compiler sends bf16 as float32: twice the bytes)"
        print(f"\n{name}: all-reduce {sent.all_reduce:,} B, all-gather {sent.all_gather:,} B, "
              f"reduce-scatter {sent.reduce_scatter:,} B{note}")
        print("  per layer: " + ", ".join(f"{c.collective.kind} ({c.phase})"
                                          for c in per_layer))
        losses = []
        with px.metrics.Monitor.for_compiled(
                compiled, items_per_step=args.batch * config.max_seq_len, description=name,
                logdir=args.logdir and f"{args.logdir}/{model_cls.__name__}",
                profile_steps=args.profile_steps) as monitor:
            for batch in monitor.loop(data):
                state, metrics = step(state, batch)
                losses.append(float(metrics["loss"]))
                monitor.step(metrics, loss=losses[-1])
        print(monitor.table())
        gap = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        worst = max(worst, gap)
        print(f"  loss {losses[0]:.4f} -> {losses[-1]:.4f}; vs one device (fp32) {gap:.1e} "
              f"(relative, {compute})")
    return 0 if worst < (1e-4 if compute == "float32" else 3e-2) else 1


if __name__ == "__main__":
    sys.exit(main())
