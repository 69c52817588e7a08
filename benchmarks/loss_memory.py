"""Compiled peak memory of one training step with the chunked loss and with whole logits.

One ``px.train_step`` (AdamW, one device) of a ``px.models`` GPT is lowered for abstract
inputs and compiled on CPU (nothing runs); ``memory_analysis`` gives its per-device peak
(arguments + outputs - donated + temporaries, ``parallax.analysis.hlo.memory``). Each row
compiles the same step with ``loss_chunks=None`` (the default: logits a chunk of the
sequence at a time, ``px.nn.chunked_cross_entropy``) and ``loss_chunks=1`` (all ``[B, T, V]``
float32 logits at once, the loss before chunking). Run against a parallax without
``loss_chunks`` it measures that parallax's only loss (the "before" row).

Usage:
  python benchmarks/loss_memory.py [--model gpt2_124m] [--batch 16] [--seq 1024] [--layers N]
                                   [--remat full|dots]
"""

from __future__ import annotations

import argparse
import dataclasses


def peak_bytes(model: str, batch: int, seq: int, chunks, layers=None,
               remat: str = "none") -> tuple[int, bool]:
    """(peak bytes, whether a float32 [B, T, V] buffer is in the HLO) of one compiled step."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import parallax as px
    from parallax.analysis import hlo

    config = getattr(px.models.GPTConfig, model)(max_seq_len=seq)
    if layers is not None:
        config = dataclasses.replace(config, num_layers=layers)
    if any(f.name == "loss_chunks" for f in dataclasses.fields(config)):
        config = dataclasses.replace(config, loss_chunks=chunks)
    if remat != "none":
        config = dataclasses.replace(config, remat=remat)
    state = jax.eval_shape(lambda: px.TrainState.create(
        px.models.GPT(config, rngs=nnx.Rngs(0)), optax.adamw(1e-3)))
    mesh = px.make_mesh(data=1, devices=jax.devices()[:1])

    @px.train_step(mesh, px.DataParallel("data"))
    def step(state, tokens):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, tokens)
        return state.apply_gradients(grads), {"loss": loss}

    tokens = {"tokens": jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)}
    compiled = step.lower(state, tokens).compile()
    logits = f"f32[{batch},{seq},{config.padded_vocab_size}]"
    return hlo.memory(compiled).peak_bytes, logits in compiled.as_text()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2_124m")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=None, help="override num_layers")
    parser.add_argument("--remat", default=None,
                        help="also compile the chunked loss with this remat policy (full, dots)")
    args = parser.parse_args(argv)
    import jax

    import parallax as px

    print(f"{args.model} (layers: {args.layers or 'all'}), {args.batch} x {args.seq} tokens, "
          f"jax {jax.__version__}, "
          f"parallax {px.__version__}")
    print(f"{'loss':<32}{'peak GiB':>10}  f32 [B, T, V] in HLO")
    import dataclasses as dc

    rows = (("chunked (default)", None), ("whole logits (loss_chunks=1)", 1))
    if not any(f.name == "loss_chunks" for f in dc.fields(px.models.GPTConfig)):
        rows = (("its only loss (no loss_chunks)", None),)  # a parallax before chunking
    if args.remat:
        rows = (*rows, (f"chunked, remat={args.remat!r}", None))
    for label, chunks in rows:
        remat = args.remat if label.startswith("chunked, remat") else "none"
        peak, has_logits = peak_bytes(args.model, args.batch, args.seq, chunks, args.layers,
                                      remat)
        print(f"{label:<32}{peak / 2**30:>10.2f}  {'yes' if has_logits else 'no'}", flush=True)


if __name__ == "__main__":
    main()
