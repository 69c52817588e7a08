"""Tensor-parallel bytes per GPT step, measured from the compiled program, next to Megatron's formula.

For several model sizes, tensor sizes, with and without sequence parallelism and in both
styles (GSPMD rules on ``px.models.GPT``; ``px.nn.ParallelGPT`` in ``px.nn.tensor_parallel``),
one training step is compiled (nothing runs) and the activation traffic over the ``tensor``
axis is read from its HLO (``parallax.analysis.tensor_traffic.measured_traffic``). The formula
(``megatron_traffic``) is what Shoeybi et al. (2019) and Korthikanti et al. (2022) count:
per layer 4 all-reduces of ``[B, T, D]`` (2 forward, 2 backward), the vocabulary-parallel
embedding and tied output layer one each, the loss 3 of ``[B, T]``; with sequence
parallelism every layer all-reduce becomes a reduce-scatter plus an all-gather.

Columns: message bytes by kind (nccl-tests' "size": the full array of an all-reduce, the
gathered result of an all-gather, the input of a reduce-scatter), their sum measured and by
the formula, the ratio, and the bytes each device sends on a ring (an all-reduce sends twice
what a reduce-scatter or all-gather does, so sequence parallelism's wire bytes per layer
equal plain tensor parallelism's). The CPU compiler leaves GSPMD's reduce-scatters as
all-reduce + slice (GPU and TPU fuse them): in those rows the reduce-scatter bytes appear
under all-reduce and their wire bytes double; the explicit style issues reduce-scatters.

Usage:
  python benchmarks/tensor_parallel.py [--sizes tiny,tiny-l4,wide] [--tensor 2,4] [--batch 16]
"""

from __future__ import annotations

import argparse
import sys

SIZES = {  # name -> GPTConfig.tiny overrides (compiles in seconds on CPU)
    "tiny": {},
    "tiny-l4": {"num_layers": 4},
    "wide": {"embed_dim": 128, "mlp_dim": 512, "num_heads": 8, "max_seq_len": 128},
}


def _compiled(config, mesh, style, sequence_parallel, batch):
    import numpy as np
    import optax
    from flax import nnx

    import parallax as px

    strategy = px.TensorParallel("tensor", sequence_parallel=sequence_parallel)
    if style == "gspmd":
        model_cls, loss_fn = px.models.GPT, px.models.next_token_loss
        make = lambda: px.TrainState.create(model_cls(config, rngs=nnx.Rngs(0)), optax.sgd(0.1))  # noqa: E731
    else:
        loss_fn = px.nn.tensor_parallel(px.nn.parallel_next_token_loss)
        make = lambda: px.TrainState.create(  # noqa: E731
            px.nn.ParallelGPT(config, rngs=nnx.Rngs(0), sequence_parallel=sequence_parallel),
            optax.sgd(0.1))
    state = px.init(make, mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(loss_fn)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    tokens = {"tokens": np.zeros((batch, config.max_seq_len + 1), np.int32)}
    return step.lower(state, tokens).compile()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="tiny,tiny-l4,wide")
    parser.add_argument("--tensor", default="2,4")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--styles", default="gspmd,explicit")
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args(argv)

    from parallax.cli import simulate_cpu_devices

    print(simulate_cpu_devices(args.devices))
    import jax

    import parallax as px
    from parallax.analysis import tensor_traffic as tp

    header = (f"{'model':<8}{'L':>3}{'D':>5}{'T':>5}{'TP':>4}{'SP':>4} {'style':<9}"
              f"{'all-reduce':>12}{'all-gather':>12}{'red-scatter':>12}{'measured':>12}"
              f"{'Megatron':>12}{'ratio':>7}{'wire/dev':>12}")
    print(header)
    worst = 0.0
    for size in args.sizes.split(","):
        config = px.models.GPTConfig.tiny(**SIZES[size])
        for n in (int(v) for v in args.tensor.split(",")):
            mesh = px.make_mesh(tensor=n, devices=jax.devices()[:n])
            for sp in (False, True):
                for style in args.styles.split(","):
                    compiled = _compiled(config, mesh, style, sp, args.batch)
                    measured = tp.measured_traffic(compiled, mesh, args.batch)
                    formula = tp.megatron_traffic(config, args.batch, sequence_parallel=sp)
                    ratio = measured.message_bytes / formula.message_bytes
                    worst = max(worst, abs(ratio - 1))
                    print(f"{size:<8}{config.num_layers:>3}{config.embed_dim:>5}"
                          f"{config.max_seq_len:>5}{n:>4}{'on' if sp else 'off':>4} {style:<9}"
                          f"{measured.all_reduce:>12,}{measured.all_gather:>12,}"
                          f"{measured.reduce_scatter:>12,}{measured.message_bytes:>12,}"
                          f"{formula.message_bytes:>12,}{ratio:>7.2f}"
                          f"{measured.wire_bytes(n):>12,.0f}", flush=True)
    print(f"largest deviation from the formula: {worst:.2e}")
    return 0 if worst < 1e-9 else 1


if __name__ == "__main__":
    sys.exit(main())
