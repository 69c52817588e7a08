"""ZeRO and FSDP: train a model whose training state does not fit on one device.

    python examples/zero_fsdp_big_model.py --steps 10
    python examples/zero_fsdp_big_model.py --memory-per-device 64e6 --layers 8
    python examples/zero_fsdp_big_model.py --offload optimizer

Adam keeps two moments per parameter, so a float32 model needs 16 bytes per parameter in
training (parameters, gradients, two moments) before any activation. This script builds a
GPT whose training state is larger than ``--memory-per-device`` (a budget: 48 MB per
simulated CPU device by default, the device's own limit on a GPU or TPU), shows per device
what data parallelism and ZeRO stages 1, 2 and 3 would hold (the ZeRO paper's formulas, and
the compiled programs' own peak for DP and FSDP), then trains it with FSDP (ZeRO 3), the
state created already sharded by ``px.init``: no device ever holds it whole (throughput, MFU
and memory in the progress bar and a table at the end; ``--logdir`` and ``--profile-steps``
as for ``parallax demo``). ``--offload optimizer`` (or ``params``) adds ZeRO-Offload: FSDP
with the optimizer state (and the parameters) in the host's pinned memory between steps, its
device peak in the table, and trains with it (docs/offload.md).

FSDP runs in the ``"gspmd"`` style here: XLA gathers each layer's parameters inside the
layer loop, as PyTorch FSDP does, so the step's peak holds one layer's full parameters at a
time. The default explicit style gathers them all at the start of the step (the state at
rest is sharded all the same; see docs/design.md), which needs more memory for a deep model.

On a GPU or TPU it computes in bf16 with fp32 master parameters and optimizer
(``px.MixedPrecision``, composed with each strategy), on CPU in fp32 (``--precision``
chooses): the training state is the same 16 bytes per parameter either way.
"""

from __future__ import annotations

import argparse
import math
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embed", type=int, default=256)
    parser.add_argument("--offload", choices=("optimizer", "params"), default=None,
                        help="also ZeRO-Offload: this state in pinned host memory")
    parser.add_argument("--memory-per-device", type=float, default=None,
                        help="bytes per device (default: 48e6 on CPU, the device's limit else)")
    from parallax.metrics import add_arguments
    from parallax.precision import add_arguments as add_precision_argument

    args = add_arguments(add_precision_argument(parser)).parse_args(argv)

    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(8))
    import jax
    import optax
    from flax import nnx

    import parallax as px
    from parallax.planner import setting
    from parallax.planner.predicted import memory as predicted_memory
    from parallax.cli.demo import batches, demo_tokens
    from parallax.precision import compute_dtype_from_flag

    compute = compute_dtype_from_flag(args.precision)  # auto: bf16 on GPU/TPU, fp32 on CPU

    device = jax.devices()[0]
    budget = args.memory_per_device or (
        48e6 if device.platform == "cpu" else (device.memory_stats() or {}).get("bytes_limit"))
    config = px.models.GPTConfig(vocab_size=256, max_seq_len=64, num_layers=args.layers,
                                 num_heads=4, embed_dim=args.embed, mlp_dim=4 * args.embed,
                                 dtype=compute)
    params = px.models.param_count(config)
    print(f"GPT with {params / 1e6:.2f}M parameters: {16 * params / 1e6:.1f} MB of training "
          f"state (float32 + Adam; computing in {compute}); budget {budget / 1e6:.1f} MB per "
          "device\n")

    def make_state():
        return px.TrainState.create(px.models.GPT(config, rngs=nnx.Rngs(0)), optax.adam(1e-3))

    n = jax.device_count()
    mesh = px.make_mesh(fsdp=n)
    abstract = jax.eval_shape(make_state)
    data = list(batches(demo_tokens(), args.batch, config.max_seq_len, args.steps))

    def step_for(strategy):
        @px.train_step(mesh, strategy)
        def step(state, batch):
            loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
            return state.apply_gradients(grads), {"loss": loss}
        return step

    def with_precision(strategy):  # float32 master parameters and optimizer in bf16
        if compute == "float32":
            return strategy
        return px.compose(strategy, px.MixedPrecision(compute=compute))

    mb = lambda x: f"{x / 1e6:.2f} MB"  # noqa: E731
    print(f"{'strategy':<22}{'params':>10}{'grads':>10}{'Adam':>10}{'compiled peak':>15}  fits")
    chosen = None
    for name, strategy, compile_it in [
            ("data parallel", px.DataParallel("fsdp"), True),
            ("ZeRO 1", px.ZeRO(1, "fsdp"), False), ("ZeRO 2", px.ZeRO(2, "fsdp"), False),
            ("FSDP (ZeRO 3)", px.FSDP("fsdp", style="gspmd"), True)] + (
            [("FSDP + offload",
              px.FSDP("fsdp", style="gspmd", offload=args.offload), True)]
            if args.offload else []):
        strategy = with_precision(strategy)
        s = setting.read_setting(mesh, strategy, abstract, data[0])
        formula = predicted_memory.state_bytes(s)
        on_host = predicted_memory.offloaded_bytes(s).value  # not device memory
        host_note = f"  ({mb(on_host)} of it on the host)" if on_host else ""
        # the compiled program's own peak, for the two ends of the table
        peak = (px.explain(step_for(strategy), abstract, data[0]).row("peak").measured
                if compile_it else None)
        fits = "" if peak is None else "yes" if peak <= budget else "no"
        print(f"{name:<22}{mb(formula['parameters'].value):>10}"
              f"{mb(formula['gradients'].value):>10}{mb(formula['optimizer state'].value):>10}"
              f"{mb(peak) if peak else '-':>15}  {fits}{host_note}")
        chosen = (strategy, fits != "no")

    strategy, fits = chosen
    if not fits:
        print("\neven FSDP does not fit: use more devices or a larger --memory-per-device")
        return 1
    step = step_for(strategy)
    state = px.init(make_state, mesh, strategy)
    wte = state.params["wte"][...]
    print(f"\n{strategy.name} on {px.mesh.describe(mesh)}: each device holds "
          f"{wte.addressable_shards[0].data.shape} of the {wte.shape} embedding")
    tokens = args.batch * config.max_seq_len
    with px.metrics.Monitor(items_per_step=tokens,
                            flops_per_step=px.models.flops_per_token(config) * tokens,
                            logdir=args.logdir, profile_steps=args.profile_steps,
                            description="FSDP") as monitor:
        for batch in monitor.loop(data):
            state, metrics = step(state, batch)
            monitor.step(metrics, loss=metrics["loss"])
    print(monitor.table())
    held = sum(math.prod(x.addressable_shards[0].data.shape) * x.dtype.itemsize
               for x in jax.tree.leaves(state))
    hosted = sum(math.prod(x.addressable_shards[0].data.shape) * x.dtype.itemsize
                 for x in jax.tree.leaves(state) if x.sharding.memory_kind == "pinned_host")
    print(f"training state of device 0 after training: {held / 1e6:.2f} MB"
          + (f", {hosted / 1e6:.2f} MB of it in pinned host memory" if hosted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
