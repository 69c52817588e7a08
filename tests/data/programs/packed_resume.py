"""Launched with 2 processes x 2 devices: packed text batches under FSDP x TP, each process
loading its own rows; killed mid-run and resumed from a checkpoint, the run gets exactly
the batches, losses and parameters of a run never interrupted.

    parallax launch -np 2 --devices-per-process 2 python packed_resume.py DIR --kill-after 3
    parallax launch -np 2 --devices-per-process 2 python packed_resume.py DIR --resume

The first form trains, saving the state and the data iterator's state (``extra``) after
every step, prints ``saved K`` and, after step ``--kill-after``, waits to be killed (the
test kills it by pid). The second restores the latest step, trains to ``--steps``, then
trains the same steps from scratch without a stop in the same processes, and compares:
each process's rows of every batch, the global batches (gathered, against the stream's
rows), the losses, the held-out evaluation and the final parameters. Prints ``agree {...}``
or exits non-zero.
"""

import argparse
import hashlib
import importlib.resources
import json
import time

import parallax as px

px.distributed.initialize()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

SEQ_LEN, BATCH = 32, 8


def make_state():
    return px.TrainState.create(px.models.GPT(px.models.GPTConfig.tiny(), rngs=nnx.Rngs(0)),
                                optax.adam(1e-2))


def corpora():
    text = importlib.resources.files("parallax").joinpath("data/demo.txt").read_text()
    texts = [t for t in text.split("\n\n") if t.strip()]
    corpus = px.data.tokenize(texts, px.data.ByteTokenizer())  # a bar on process 0
    return corpus.split(0.1, seed=0)


def digest(batch) -> str:
    h = hashlib.blake2b(digest_size=8)
    for key in sorted(batch):
        h.update(np.ascontiguousarray(batch[key]).tobytes())
    return h.hexdigest()


def train(state, it, steps, step, evaluation, ckpt=None, kill_after=None):
    seen, losses, evals = [], [], []
    while int(state.step) < steps:
        batch = next(it)
        seen.append((int(state.step) + 1, digest(batch), batch))
        state, out = step(state, batch)
        losses.append(float(out["loss"]))
        if evaluation.due(int(state.step)):
            evals.append(evaluation(state)["eval_loss"])
        if ckpt is not None:
            px.checkpoint.save(ckpt, state, step=int(state.step),
                               extra={"data": it.get_state()})
            print(f"saved {int(state.step)}", flush=True)
            if int(state.step) == kill_after:
                time.sleep(600)  # killed here
    return state, seen, losses, evals


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--kill-after", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    assert jax.process_count() == 2 and jax.local_device_count() == 2
    mesh = px.make_mesh(fsdp=2, tensor=2)  # fsdp across the processes, tensor inside each
    strategy = px.compose(px.FSDP("fsdp"), px.TensorParallel("tensor"))
    train_corpus, held_out = corpora()
    loader = lambda: px.data.PackedBatches(train_corpus, seq_len=SEQ_LEN,  # noqa: E731
                                           global_batch=BATCH, mesh=mesh, strategy=strategy,
                                           seed=7)
    evaluation = px.metrics.Evaluation(
        px.models.next_token_loss,
        px.data.PackedBatches(held_out, seq_len=SEQ_LEN, global_batch=BATCH, mesh=mesh,
                              strategy=strategy, epochs=1, shuffle=False), mesh=mesh,
        strategy=strategy, every=2)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    if not args.resume:
        train(px.init(make_state, mesh, strategy), iter(loader()), args.steps, step,
              evaluation, ckpt=args.directory, kill_after=args.kill_after)
        return
    restored = px.checkpoint.restore(args.directory, like=make_state, mesh=mesh,
                                     strategy=strategy)
    it = iter(loader())
    it.set_state(restored.extra["data"])
    state, seen, losses, evals = train(restored.state, it, args.steps, step, evaluation)
    straight, seen0, losses0, evals0 = train(px.init(make_state, mesh, strategy),
                                             iter(loader()), args.steps, step, evaluation)
    skip = restored.step
    rows = it.batches.rows
    stream = loader()
    for k, _, batch in seen:  # the global batch is the stream's rows k*B .. (k+1)*B - 1
        gathered = multihost_utils.process_allgather(batch, tiled=True)
        want = px.data.materialize(stream.plan(0), np.arange((k - 1) * BATCH, k * BATCH),
                                   train_corpus.tokens, train_corpus.offsets)
        assert all((gathered[key] == want[key]).all() for key in want), k
        assert batch["tokens"].shape == (rows.stop - rows.start, SEQ_LEN + 1)
    params = px.testing.relative_difference(
        multihost_utils.process_allgather(state.params, tiled=True),
        multihost_utils.process_allgather(straight.params, tiled=True))
    result = {
        "resumed_from": skip, "rows": [rows.start, rows.stop],
        "batches": [d for _, d, _ in seen] == [d for _, d, _ in seen0[skip:]],
        "losses": losses == losses0[skip:], "evals": evals, "straight_evals": evals0,
        "params": params,
    }
    ok = (result["batches"] and result["losses"] and params == 0.0
          and evals == evals0[len(evals0) - len(evals):])
    print(("agree " if ok else "DIFFER ") + json.dumps(result), flush=True)
    if not ok:
        raise SystemExit("the resumed run differs from the straight one")
    px.distributed.shutdown()


if __name__ == "__main__":
    main()
