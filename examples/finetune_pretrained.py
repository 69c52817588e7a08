"""Fine-tune a pretrained checkpoint on a folder of text, then sample from it.

    python examples/finetune_pretrained.py                                   # all defaults
    python examples/finetune_pretrained.py --checkpoint my_gpt2/ --text my_text/ --steps 200
    python examples/finetune_pretrained.py --steps 20 --stop-after 8         # "crashes" ...
    python examples/finetune_pretrained.py --steps 20                        # ... and resumes
    python examples/finetune_pretrained.py --steps 6 --check                 # vs one device
    python examples/finetune_pretrained.py --steps 6 --check --precision bf16

The checkpoint is a Hugging Face folder (GPT-2 or Llama: ``config.json`` and safetensors, as
``transformers``' ``save_pretrained`` or ``px.models.save_pretrained`` write it), loaded
with ``px.models.from_pretrained`` straight into the FSDP x TP layout. Its own
``tokenizer.json`` tokenizes the text when it has one (``tokenizers`` needed), else UTF-8
bytes (nothing needed; the vocabulary must hold 256 ids). The text files are tokenized with a
progress bar, split into training and held-out documents, packed into rows of ``seq_len + 1``
tokens (``px.data``: documents kept apart by segment ids), and trained under
``px.compose(px.FSDP("fsdp"), px.TensorParallel("tensor"))`` with the progress bar's
throughput and memory. Every ``--eval-every`` steps the held-out loss and perplexity are
measured under the same layout (``px.metrics.Evaluation``) and shown in the bar. Every
``--save-every`` steps a ``px.checkpoint.Manager`` saves the state and the data iterator's
position, so a run started again with the same ``--run-dir`` carries on exactly. A few
prompts are continued before and after training (``px.models.generate``, greedy, with a
key/value cache, on the sharded weights).

Without ``--checkpoint`` a small GPT (byte vocabulary) is made and saved with
``px.models.save_pretrained``; without ``--text`` the text shipped with parallax is split
into a folder of files. ``--check`` trains the same steps on one device too and exits
non-zero unless every loss agrees within 1e-5 relative and the greedy samples are the same.
On a GPU or TPU it computes in bf16 with fp32 master parameters and optimizer
(``px.MixedPrecision``, and the loaded model's compute dtype set to bf16: its parameters stay
as ``from_pretrained`` read them, in float32), on CPU in fp32 (``--precision`` chooses). In
bf16 ``--check``'s one-device reference still computes in fp32, the losses must agree within
3e-2 relative and the greedy samples are compared but not required equal (a bf16 rounding
can turn a near-tie of the argmax). Without an accelerator it simulates 8 CPU devices.
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

from parallax.cli import simulate_cpu_devices
from parallax.metrics import add_arguments as px_metrics_arguments
from parallax.precision import add_arguments as add_precision_argument

PROMPTS = ["The ", "In the beginning", "Parallel "]


def default_checkpoint(folder: pathlib.Path) -> pathlib.Path:
    """A small GPT with a byte vocabulary, saved as a Hugging Face checkpoint."""
    from flax import nnx

    import parallax as px

    if not (folder / "config.json").exists():
        config = px.models.GPTConfig(vocab_size=256, max_seq_len=128, num_layers=2,
                                     num_heads=4, embed_dim=64, mlp_dim=256)
        px.models.save_pretrained(folder, px.models.GPT(config, rngs=nnx.Rngs(0)))
    return folder


def default_text(folder: pathlib.Path, files: int = 8) -> pathlib.Path:
    """The text shipped with parallax, in ``files`` files (one document each)."""
    from parallax.data import corpus

    text = (pathlib.Path(corpus.__file__).parent / "demo.txt").read_text()
    folder.mkdir(parents=True, exist_ok=True)
    size = len(text) // files
    for i in range(files):
        (folder / f"part{i}.txt").write_text(text[i * size:(i + 1) * size])
    return folder


def tokenizer_for(checkpoint: pathlib.Path):
    import parallax as px

    if (checkpoint / "tokenizer.json").exists():
        return px.data.load_tokenizer(checkpoint)
    return px.data.ByteTokenizer()


def samples(model, tokenizer, new_tokens: int, mesh, strategy) -> list[str]:
    """Greedy continuations of ``PROMPTS`` (cut to the shortest prompt's length)."""
    import numpy as np

    import parallax as px

    ids = [tokenizer.encode(p) for p in PROMPTS]
    length = min(len(i) for i in ids)
    rows = np.stack([i[:length] for i in ids] * 4)[:8].astype(np.int32)  # divides 8 devices
    out = px.models.generate(model, rows, new_tokens, mesh=mesh, strategy=strategy)
    return [tokenizer.decode(np.asarray(row)) for row in out[:len(PROMPTS)]]


def train(args, mesh, strategy, corpus, tokenizer, run_dir, *, compute="float32",
          progress=True):
    """Trains ``args.steps`` steps (resuming from ``run_dir``) computing in ``compute``;
    returns the losses and the samples after training."""
    import optax

    import parallax as px

    train_docs, held_out = corpus.split(0.2, seed=0)
    model = px.models.from_pretrained(args.checkpoint, mesh=mesh, strategy=strategy,
                                      compute_dtype=compute)  # parameters stay float32
    if compute != "float32":  # the step casts the float32 parameters to bf16
        strategy = px.compose(strategy, px.MixedPrecision(compute=compute))
    config = model.config
    if progress:
        print("before:", *samples(model, tokenizer, args.sample_tokens, mesh, strategy),
              sep="\n  ")
    state = px.init(lambda: px.TrainState.create(model, optax.adamw(args.lr)), mesh, strategy)
    batches = px.data.PackedBatches(train_docs, seq_len=args.seq_len, global_batch=args.batch,
                                    mesh=mesh, strategy=strategy, seed=0)
    evaluation = px.metrics.Evaluation(
        px.models.next_token_loss,
        px.data.PackedBatches(held_out, seq_len=args.seq_len, global_batch=args.batch,
                              mesh=mesh, strategy=strategy, epochs=1, shuffle=False),
        mesh=mesh, strategy=strategy, every=args.eval_every)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    it, losses = iter(batches), []
    tokens = args.batch * args.seq_len
    flops = (px.models.flops_per_token(config) if isinstance(model, px.models.GPT)
             else px.models.llama_flops_per_token(config)) * tokens
    with px.checkpoint.Manager(run_dir, save_every=args.save_every, max_to_keep=2) as manager:
        if manager.latest_step() is not None:
            state, at, extra = manager.restore(like=state, mesh=mesh, strategy=strategy)
            it.set_state(extra["data"])
            losses = extra["losses"]
            print(f"resumed from step {at} of {run_dir}")
        monitor = px.metrics.Monitor(items_per_step=tokens, flops_per_step=flops,
                                     logdir=args.logdir, first_step=len(losses) + 1,
                                     progress=progress, description=px.mesh.describe(mesh))
        with monitor:
            for _ in monitor.loop(range(int(state.step), args.steps)):
                state, metrics = step(state, next(it))
                losses.append(float(metrics["loss"]))
                monitor.step(metrics, loss=losses[-1])
                if evaluation.due(int(state.step)):
                    measured = evaluation(state)
                    monitor.record(measured)
                    if progress:
                        print(f"step {int(state.step)}: held-out loss "
                              f"{measured['eval_loss']:.4f}, perplexity "
                              f"{measured['eval_perplexity']:.2f}")
                extra = {"data": it.get_state(), "losses": losses}
                manager.save(int(state.step), state, extra)
                if args.stop_after is not None and len(losses) >= args.stop_after:
                    print(f"stopping after step {len(losses)} (newest checkpoint: step "
                          f"{manager.latest_step()})")
                    return losses, None
        if manager.latest_step() != len(losses):
            manager.save(len(losses), state, {"data": it.get_state(), "losses": losses},
                         force=True)
    if progress and monitor.meter.history:
        print(monitor.table())
    after = samples(state.model, tokenizer, args.sample_tokens, mesh, strategy)
    if progress:
        print("after:", *after, sep="\n  ")
    return losses, after


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    work = pathlib.Path(tempfile.gettempdir()) / "parallax_finetune"
    parser.add_argument("--checkpoint", type=pathlib.Path, default=None,
                        help="a Hugging Face GPT-2 or Llama folder (default: a small GPT)")
    parser.add_argument("--text", type=pathlib.Path, default=None,
                        help="a folder of .txt files (default: parallax's demo text)")
    parser.add_argument("--run-dir", type=pathlib.Path, default=work / "run",
                        help="training checkpoints: a second run here resumes")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--stop-after", type=int, default=None,
                        help="stop after this step without a final save, as a crash would")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--sample-tokens", type=int, default=24)
    parser.add_argument("--check", action="store_true",
                        help="train on one device too and compare")
    args = px_metrics_arguments(add_precision_argument(parser)).parse_args(argv)
    print(simulate_cpu_devices(8))

    import jax

    import parallax as px
    from parallax.precision import compute_dtype_from_flag

    compute = compute_dtype_from_flag(args.precision)  # auto: bf16 on GPU/TPU, fp32 on CPU

    args.checkpoint = args.checkpoint or default_checkpoint(work / "checkpoint")
    args.text = args.text or default_text(work / "text")
    tokenizer = tokenizer_for(args.checkpoint)
    corpus = px.data.tokenize_folder(args.text, tokenizer, append_eos=tokenizer.eos_id
                                     is not None)
    print(f"{corpus} from {args.text}, tokenizer {tokenizer!r}")
    mesh = px.make_mesh(fsdp=4, tensor=2, devices=jax.devices()[:8])
    strategy = px.compose(px.FSDP("fsdp"), px.TensorParallel("tensor"))
    print(f"computing in {compute} (parameters and optimizer float32)")
    losses, after = train(args, mesh, strategy, corpus, tokenizer, args.run_dir,
                          compute=compute)
    if after is None or not args.check:
        return losses
    one = px.make_mesh(data=1, devices=jax.devices()[:1])
    with tempfile.TemporaryDirectory() as fresh:
        args.stop_after = None
        base, base_after = train(args, one, px.DataParallel("data"), corpus, tokenizer,
                                 pathlib.Path(fresh), progress=False)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, base))
    same = after == base_after
    tolerance = 1e-5 if compute == "float32" else 3e-2  # the reference computes in fp32
    print(f"check: {len(losses)} losses vs one device (fp32), worst relative difference "
          f"{worst:.2e} (tolerance {tolerance:.0e}, {compute}); samples "
          f"{'equal' if same else 'DIFFER'}")
    if worst > tolerance or len(losses) != len(base) or (compute == "float32" and not same):
        raise SystemExit("check failed: the FSDP x TP run differs from one device")
    return losses


if __name__ == "__main__":
    main()
