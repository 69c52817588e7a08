"""px.metrics.Evaluation and px.eval_step: held-out loss and perplexity under the training
strategy equal one device's per-token mean; logged and shown with the step's metrics."""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.data import Corpus, PackedBatches


def gpt_state():
    return px.TrainState.create(px.models.GPT(px.models.GPTConfig.tiny(), rngs=nnx.Rngs(0)),
                                optax.sgd(0.1))


def held_out_corpus():
    rng = np.random.RandomState(3)
    return Corpus.from_documents(rng.randint(1, 256, n) for n in rng.randint(1, 20, 13))


def per_token_loss_alone(model, corpus):
    """Each document alone on one device: the mean over all held-out targets."""
    total, count = 0.0, 0
    for d in range(corpus.num_documents):
        tokens = corpus.document(d)
        if len(tokens) < 2:
            continue
        loss = px.models.next_token_loss(model, {"tokens": jnp.asarray(tokens)[None]})
        total += float(loss) * (len(tokens) - 1)
        count += len(tokens) - 1
    return total / count, count


@pytest.mark.slow
def test_held_out_loss_under_fsdp_x_tp_is_the_per_token_mean_on_one_device(tmp_path):
    mesh = px.make_mesh(fsdp=4, tensor=2)
    strategy = px.compose(px.FSDP("fsdp"), px.TensorParallel("tensor"))
    corpus = held_out_corpus()
    held_out = PackedBatches(corpus, seq_len=23, global_batch=4, mesh=mesh, strategy=strategy,
                             epochs=1, shuffle=False, threads=0)
    assert len(held_out) >= 2  # several batches, the last one padded
    evaluation = px.metrics.Evaluation(px.models.next_token_loss, held_out, mesh=mesh,
                                       strategy=strategy, every=2)
    state = px.init(gpt_state, mesh, strategy)
    expected, count = per_token_loss_alone(gpt_state().model, corpus)
    metrics = evaluation(state)
    assert metrics["eval_tokens"] == count
    assert abs(metrics["eval_loss"] - expected) / expected < 1e-5
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    # the same compiled program reads the state's own shardings: nothing is donated or moved
    assert all(not leaf.is_deleted() for leaf in jax.tree.leaves(state.params))

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    train = iter(PackedBatches(corpus, seq_len=23, global_batch=4, mesh=mesh,
                               strategy=strategy, threads=0))
    monitor = px.metrics.Monitor(items_per_step=4 * 23, logdir=tmp_path, progress=False)
    with monitor:
        for batch in monitor.loop([next(train) for _ in range(4)]):
            state, out = step(state, batch)
            measured = monitor.step(out, loss=out["loss"])
            if evaluation.due(int(state.step)):
                monitor.record(evaluation(state))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evaluated = [(r["step"], r["eval_tokens"]) for r in rows if "eval_loss" in r]
    assert evaluated == [(2, count), (4, count)]
    shown = monitor.postfix(measured, loss=1.0)
    assert shown["eval_loss"] == f"{rows[-1]['eval_loss']:.4f}" and "eval_perplexity" in shown
    assert rows[-1]["eval_loss"] < metrics["eval_loss"]  # it trained on the same text


@pytest.mark.slow
def test_an_eval_step_reads_a_plain_batch_under_the_strategy():
    mesh, strategy = px.make_mesh(data=8), px.DataParallel("data")
    state = px.init(gpt_state, mesh, strategy)

    @px.eval_step(mesh, strategy)
    def evaluate(state, batch):
        return {"loss": px.models.next_token_loss(state.model, batch)}

    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 256, (8, 9)), jnp.int32)
    loss = float(evaluate(state, {"tokens": tokens})["loss"])
    assert loss == pytest.approx(float(px.models.next_token_loss(gpt_state().model,
                                                                 {"tokens": tokens})), rel=1e-5)
    assert "px.eval_step(evaluate, mesh=" in repr(evaluate)
    with pytest.raises(TypeError, match=r"px.eval_step: decorate a function"):
        px.eval_step(mesh, strategy)(3)


def test_bad_evaluation_settings_are_refused():
    mesh = px.make_mesh(data=8)
    with pytest.raises(TypeError, match=re.escape(
            "px.metrics.Evaluation: batches must be iterable again for every evaluation (a "
            "list, or px.data.PackedBatches(..., epochs=1)), not a one-shot iterator")):
        px.metrics.Evaluation(px.models.next_token_loss, iter([]), mesh=mesh, every=1)
    with pytest.raises(ValueError, match=r"every=0 must be an int >= 1"):
        px.metrics.Evaluation(px.models.next_token_loss, [], mesh=mesh, every=0)
    with pytest.raises(TypeError, match=r"loss_fn must be a function loss_fn\(model, batch\)"):
        px.metrics.Evaluation("loss", [], mesh=mesh, every=1)
    with pytest.raises(ValueError, match=r"the held-out batches hold no counted target"):
        px.metrics.Evaluation(px.models.next_token_loss, [], mesh=mesh, every=1)(None)
