"""Packed rows through GPT and Llama: attention never crosses a document, positions restart,
a document's last label is not trained; the same under FSDP x TP as on one device."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.attention import document_mask, dot_product_attention
from parallax.data import Corpus, PackedBatches

MODELS = {
    "gpt": lambda: px.models.GPT(px.models.GPTConfig.tiny(), rngs=nnx.Rngs(0)),
    "llama": lambda: px.models.Llama(px.models.LlamaConfig.tiny(), rngs=nnx.Rngs(0)),
}


def documents(seed=0, lengths=(5, 9, 5, 9, 5, 2, 9, 1, 5, 2)):
    """Documents of a few lengths: run alone, those of one length make one batch (one
    compiled program per length)."""
    rng = np.random.RandomState(seed)
    return Corpus.from_documents(rng.randint(1, 256, n) for n in lengths)


def packed_batch(corpus, rows=4, seq_len=15):
    batches = PackedBatches(corpus, seq_len=seq_len, global_batch=rows, epochs=1, threads=0)
    return batches, jax.tree.map(jnp.asarray, next(iter(batches)))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_packed_batch_is_its_documents_run_alone(name):
    """The loss (a mean over B * T positions, uncounted targets adding zero) times B * T is
    the sum of each document's own loss (one document per row, no packing) times its
    T_d = length - 1 targets; the gradients likewise."""
    model = MODELS[name]()
    corpus = documents()
    batches, batch = packed_batch(corpus)
    plan = batches.plan(0)
    assert plan.num_rows <= 4 and (plan.begin == 0).all()  # every document in this batch
    assert int(batch["segment_ids"].max()) >= 2  # several documents share a row
    graphdef, params = nnx.split(model)
    by_length = {}
    for d in range(corpus.num_documents):
        by_length.setdefault(int(corpus.lengths[d]), []).append(corpus.document(d))
    alone_batches = {n: jnp.asarray(np.stack(docs)) for n, docs in by_length.items() if n > 1}

    @jax.jit
    def packed(params):
        b, t = batch["tokens"].shape[0], batch["tokens"].shape[1] - 1
        return px.models.next_token_loss(nnx.merge(graphdef, params), batch) * b * t

    @jax.jit
    def alone(params):
        return sum(px.models.next_token_loss(nnx.merge(graphdef, params), {"tokens": tokens})
                   * tokens.shape[0] * (n - 1) for n, tokens in alone_batches.items())

    (mine, grads), (ref, ref_grads) = (jax.value_and_grad(f)(params) for f in (packed, alone))
    assert px.testing.relative_difference(mine, ref) < 1e-5
    assert px.testing.relative_difference(grads, ref_grads) < 1e-5
    assert int(px.models.packed_batch.counted_targets(batch)) == int(
        sum(max(n - 1, 0) for n in corpus.lengths))


def test_attention_stays_inside_each_document():
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 7, 4, 8)), jnp.float32) for _ in range(3))
    segments = jnp.array([[1, 1, 1, 2, 2, 2, 0]])
    out = dot_product_attention(q, k, v, segment_ids=segments)
    for lo, hi in ((0, 3), (3, 6)):
        alone = dot_product_attention(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi])
        np.testing.assert_allclose(out[:, lo:hi], alone, rtol=1e-6, atol=1e-6)
    assert document_mask(segments)[0, 0, 6].tolist() == [False] * 6 + [True]
    with pytest.raises(ValueError, match=re.escape(
            "parallax.attention.dot_product_attention: segment_ids must be integer ids [1, 7] "
            "(one per query token, self-attention), got shape [1, 8] dtype int32 with 7 keys;")):
        dot_product_attention(q, k, v, segment_ids=jnp.ones((1, 8), jnp.int32))


def packed_stream(steps=3, rows=8, seq_len=16):
    corpus = Corpus.from_documents(np.random.RandomState(i).randint(1, 256, n) for i, n in
                                   enumerate(np.random.RandomState(9).randint(1, 24, 60)))
    it = iter(PackedBatches(corpus, seq_len=seq_len, global_batch=rows, seed=1, threads=0))
    return [next(it) for _ in range(steps)]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_training_under_fsdp_x_tp_equals_one_device(name):
    """Under FSDP x TP with sequence parallelism and 2 micro-batches: losses, gradients,
    parameters and optimizer state equal one device's full batches."""
    make = lambda: px.TrainState.create(MODELS[name](), optax.sgd(0.1, 0.9))  # noqa: E731
    data = packed_stream()
    reference = px.testing.train(make, px.models.next_token_loss, data)
    strategy = px.compose(px.FSDP("fsdp"), px.TensorParallel("tensor", sequence_parallel=True))
    parallel = px.testing.train(make, px.models.next_token_loss, data,  # 2 micro-batches:
                                mesh=px.make_mesh(fsdp=4, tensor=2), strategy=strategy,
                                microbatches=2)  # the mean over B * T splits evenly
    px.testing.assert_equivalent(parallel, reference, rtol=1e-5)
    assert px.testing.relative_difference(jax.device_get(parallel.final_state.opt_state),
                                          jax.device_get(reference.final_state.opt_state)) < 1e-5


@pytest.mark.slow
def test_where_packed_rows_are_not_carried_they_are_refused():
    batch = jax.tree.map(jnp.asarray, packed_stream(steps=1, rows=8, seq_len=32)[0])
    state = px.init(lambda: px.TrainState.create(MODELS["gpt"](), optax.sgd(0.1)),
                    px.make_mesh(data=4, context=2),
                    px.compose(px.DataParallel("data"), px.ContextParallel("context")))
    strategy = px.compose(px.DataParallel("data"), px.ContextParallel("context"))

    @px.train_step(px.make_mesh(data=4, context=2), strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    with pytest.raises(ValueError, match=re.escape(
            "parallax.attention.dot_product_attention: segment_ids (packed documents) are not "
            "taken under context parallelism (")):
        step(state, batch)
    model = MODELS["gpt"]()
    with pytest.raises(ValueError, match=re.escape(
            "next_token_stages: the batch has ['segment_ids', 'positions'] (packed documents), "
            "which a pipeline's stages does not carry")):
        px.models.next_token_stages.first(model, batch)
    with pytest.raises(ValueError, match=r"llama_stages: the batch has \['segment_ids'"):
        px.models.llama_stages.first(MODELS["llama"](), batch)
    with pytest.raises(ValueError, match=re.escape(
            "next_token_loss: batch['positions'] must be integer ids shaped like "
            "batch['tokens'] [8, 33] (one per token, [batch, seq + 1]), got shape [8, 32]")):
        px.models.next_token_loss(model, batch | {"positions": batch["positions"][:, 1:]})
