"""px.nn.chunked_cross_entropy: the loss of the whole logits, without them.

Values and gradients equal the unchunked loss (fp32: losses within 1e-6, gradients 1e-5), on
one device and inside ``shard_map`` over the tensor axis; training the reference models with
it follows the unchunked trajectory; the compiled step holds no float32 ``[B, T, V]`` buffer.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
import parallax.nn as pnn
from parallax.analysis import hlo
from parallax.nn.chunked_loss import default_chunks
from parallax.nn.loss import cross_entropy
from parallax.nn.padding import mask_padded_logits

B, T, D, V = 2, 16, 8, 40


def _arrays(transposed=False, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (B, T, D))
    w = jax.random.normal(keys[1], (D, V) if transposed else (V, D))
    y = jax.random.randint(keys[2], (B, T), 0, V)
    return x, w, y


def _whole(x, w, y, transposed=False, vocab_size=None):
    logits = jnp.einsum("btd,dv->btv" if transposed else "btd,vd->btv", x, w)
    if vocab_size is not None:
        logits = mask_padded_logits(logits, vocab_size)
    return cross_entropy(logits, y)


@pytest.mark.parametrize("chunks", [None, 1, 2, 4, 16])
@pytest.mark.parametrize("transposed", [False, True], ids=["tied", "head"])
@pytest.mark.parametrize("vocab_size", [None, 37], ids=["whole", "padded"])
def test_values_and_gradients_equal_the_whole_loss(chunks, transposed, vocab_size):
    x, w, y = _arrays(transposed)
    y = y % (vocab_size or V)
    weights = jax.random.uniform(jax.random.key(3), (B, T))  # a cotangent that is not 1

    def loss(fn):
        return lambda x, w: jnp.sum(weights * fn(x, w))

    chunked = loss(lambda x, w: pnn.chunked_cross_entropy(
        x, w, y, transposed=transposed, vocab_size=vocab_size, chunks=chunks))
    whole = loss(lambda x, w: _whole(x, w, y, transposed, vocab_size))
    np.testing.assert_allclose(
        pnn.chunked_cross_entropy(x, w, y, transposed=transposed, vocab_size=vocab_size,
                                  chunks=chunks), _whole(x, w, y, transposed, vocab_size),
        rtol=1e-6)
    for got, want in zip(jax.grad(chunked, (0, 1))(x, w), jax.grad(whole, (0, 1))(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_default_keeps_chunk_logits_within_the_hidden_states():
    assert default_chunks(1024, 50304, 768) == 128  # 66 rounded up to a divisor of 1024
    assert default_chunks(2048, 128256, 2048) == 64  # Llama 3.2 1B: 63 -> 64
    assert default_chunks(12, 1000, 10) == 12  # more chunks than positions: one per position
    assert default_chunks(64, 100, 200) == 1  # a vocabulary smaller than the width: whole


def test_inside_shard_map_each_rank_its_vocabulary_slice():
    # The explicit layers' form: this rank's [V/4, D] rows, the three all-reduces issued by
    # vocab_parallel_cross_entropy per chunk; the table's gradient is this rank's slice, the
    # hidden states' gradient summed over ranks (as JAX differentiates a replicated input).
    x, w, y = _arrays()
    y = y % 37
    mesh = px.make_mesh(tensor=4, devices=jax.devices()[:4])

    def loss(x, w):
        return jnp.sum(pnn.chunked_cross_entropy(x, w, y, chunks=4, vocab_size=37))

    f = jax.shard_map(jax.value_and_grad(loss, (0, 1)), mesh=mesh,
                      in_specs=(jax.P(), jax.P("tensor")),
                      out_specs=(jax.P(), (jax.P(), jax.P("tensor"))))
    value, grads = jax.jit(f)(x, w)
    whole = jax.value_and_grad(lambda x, w: jnp.sum(_whole(x, w, y, vocab_size=37)), (0, 1))
    want_value, want_grads = whole(x, w)
    np.testing.assert_allclose(value, want_value, rtol=1e-6)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model, config", [
    (px.models.GPT, px.models.GPTConfig.tiny()),
    (px.models.Llama, px.models.LlamaConfig.tiny(vocab_size=250, vocab_pad_multiple=64)),
    (px.models.GPT, px.models.GPTConfig.tiny(tie_embeddings=False,
                                             moe=px.models.MoEConfig(num_experts=4))),
], ids=["gpt", "llama-padded", "moe-head"])
def test_training_follows_the_unchunked_trajectory(model, config):
    # Three steps of the default loss (4 chunks here) and of the whole logits (loss_chunks=1,
    # the loss before chunking): losses within 1e-6, the state within 1e-5. Momentum SGD, as
    # the other GPT equivalence tests (tests/fixtures.py: Adam would test rounding).
    moe = getattr(config, "moe", None)
    loss_fn = px.models.moe_next_token_loss if moe else px.models.next_token_loss
    tokens = jax.random.randint(jax.random.key(1), (3, 4, 17), 0, config.vocab_size)
    runs = []
    for chunks in (None, 1):
        c = dataclasses.replace(config, loss_chunks=chunks)
        state = px.TrainState.create(model(c, rngs=nnx.Rngs(0)), optax.sgd(0.1, momentum=0.9))

        @jax.jit
        def step(state, batch):
            def f(p):
                out = loss_fn(nnx.merge(state.graphdef, p, state.rest), batch)
                return out[0] if isinstance(out, tuple) else out
            loss, grads = jax.value_and_grad(f)(state.params)
            return state.apply_gradients(grads), loss

        trajectory = []
        for batch in tokens:
            state, loss = step(state, {"tokens": batch})
            trajectory.append((float(loss), jax.device_get(state.params)))
        runs.append(trajectory)
    for (loss, params), (ref_loss, ref_params) in zip(*runs):
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        assert px.testing.relative_difference(params, ref_params) <= 1e-5


@pytest.mark.slow
def test_the_step_holds_no_float32_logits():
    # GPT-2's vocabulary and width, one layer, 16 x 1024 tokens: the compiled step of the
    # default loss has no f32[16,1024,50304] buffer and needs at least two fewer of that
    # size than the whole logits (their value and their gradient; measured 6.5 GiB less
    # for all of gpt2_124m: benchmarks/loss_memory.py).
    def compiled(chunks):
        config = px.models.GPTConfig.gpt2_124m(num_layers=1, loss_chunks=chunks)
        state = jax.eval_shape(lambda: px.TrainState.create(
            px.models.GPT(config, rngs=nnx.Rngs(0)), optax.adamw(1e-3)))
        mesh = px.make_mesh(data=1, devices=jax.devices()[:1])

        @px.train_step(mesh, px.DataParallel("data"))
        def step(state, batch):
            loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
            return state.apply_gradients(grads), {"loss": loss}

        return step.lower(state, {"tokens": jax.ShapeDtypeStruct((16, 1025), jnp.int32)}
                          ).compile()

    chunked, whole = compiled(None), compiled(1)
    logits = "f32[16,1024,50304]"
    assert logits in whole.as_text() and logits not in chunked.as_text()
    assert re.search(r"f32\[16,8,50304\]", chunked.as_text())  # 128 chunks of 8 positions
    saved = hlo.memory(whole).peak_bytes - hlo.memory(chunked).peak_bytes
    assert saved >= 2 * 16 * 1024 * 50304 * 4


def test_bad_input():
    x, w, y = _arrays()
    with pytest.raises(ValueError, match=re.escape(
            "px.nn.chunked_cross_entropy: 3 loss chunks do not divide the sequence length 16 "
            "(hidden states (2, 16, 8)); use a divisor of 16 (the models' loss_chunks), or None "
            "to let it choose.")):
        pnn.chunked_cross_entropy(x, w, y, chunks=3)
    with pytest.raises(ValueError, match=re.escape(
            "px.nn.chunked_cross_entropy: chunks must be None (chosen per sequence length) or a "
            "positive int, got 0")):
        pnn.chunked_cross_entropy(x, w, y, chunks=0)
    with pytest.raises(ValueError, match=re.escape(
            "px.nn.chunked_cross_entropy: the output matrix must be [V, D] with D = 8 (the "
            "hidden states' last dimension), got shape (8, 40).")):
        pnn.chunked_cross_entropy(x, w.T, y)
    with pytest.raises(ValueError, match=re.escape(
            "px.nn.chunked_cross_entropy: labels have shape (2, 15) but hidden states "
            "(2, 16, 8)")):
        pnn.chunked_cross_entropy(x, w, y[:, 1:])
    with pytest.raises(ValueError, match=re.escape(
            "GPTConfig: loss_chunks must be None (chosen per sequence length) or a positive "
            "int, got -1; e.g. loss_chunks=1 computes all logits at once.")):
        px.models.GPTConfig.tiny(loss_chunks=-1)
    model = px.models.Llama(px.models.LlamaConfig.tiny(loss_chunks=3), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=re.escape("3 loss chunks do not divide the sequence "
                                                   "length 16")):
        px.models.next_token_loss(model, {"tokens": jnp.zeros((1, 17), jnp.int32)})
