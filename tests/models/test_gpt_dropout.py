"""GPT-2's dropout in px.models.GPT: off by default, the stock nnx.Dropout semantics, and under
every strategy GPT runs under the masks one device draws: losses, gradients, parameters,
momentum and the RNG counters and keys after several steps, against a plain nnx loop."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.models.gpt_pipeline import next_token_stages
from parallax.nn.attention_dropout import attention_with_dropout

from byom.stock import assert_same_training, parallax_run

TX = optax.sgd(0.1, momentum=0.9)  # the byom tests' optimizer (docs/design.md: "Equivalence metric")
RATES = dict(embed_dropout=0.2, attention_dropout=0.2, residual_dropout=0.2)
CONFIG = px.models.GPTConfig.tiny(max_seq_len=16, **RATES)
STEPS = 3


def make(dropout_seed=1, config=CONFIG):
    return px.models.GPT(config, rngs=nnx.Rngs(0, dropout=dropout_seed))


def batches(steps=STEPS, rows=8):
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, 256, (rows, 17)).astype(np.int32)} for _ in range(steps)]


@functools.cache
def reference(dropout_seed=1, stages=False):
    """One device: nnx.jit, nnx.value_and_grad and nnx.Optimizer over the whole batch."""
    model = make(dropout_seed)
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    loss_fn = next_token_stages if stages else px.models.next_token_loss

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss, grads

    losses, first = [], None
    for batch in batches():
        loss, grads = step(model, optimizer, batch)
        losses.append(float(loss))
        first = jax.device_get(grads) if first is None else first
    return losses, first, model, jax.device_get(nnx.state(optimizer.opt_state))


@pytest.mark.slow
def test_dropout_is_off_by_default_and_leaves_the_parameters_alone():
    """No rate, no layer and no RNG state; with rates the parameters are the same values."""
    plain = px.models.GPT(px.models.GPTConfig.tiny(), rngs=nnx.Rngs(0))
    assert not jax.tree.leaves(nnx.state(plain, nnx.RngState)) and not plain.dropout_active()
    dropped = px.models.GPT(px.models.GPTConfig.tiny(**RATES), rngs=nnx.Rngs(0))
    assert px.testing.relative_difference(nnx.state(dropped, nnx.Param),
                                          nnx.state(plain, nnx.Param)) == 0.0
    counts = nnx.state(dropped, nnx.RngCount)
    assert set(counts["blocks"]) == {"attn_dropout", "resid_dropout"} and "embed_dropout" in counts


@pytest.mark.slow
def test_train_mode_drops_and_eval_mode_is_the_plain_model():
    model, batch = make(), batches(1)[0]
    plain = px.models.GPT(px.models.GPTConfig.tiny(max_seq_len=16), rngs=nnx.Rngs(0))
    first, second = (float(px.models.next_token_loss(model, batch)) for _ in range(2))
    expected = float(px.models.next_token_loss(plain, batch))
    assert first != second and abs(first - expected) > 1e-4  # a fresh mask per call
    model.eval()
    assert not model.dropout_active()
    assert float(px.models.next_token_loss(model, batch)) == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_attention_probabilities_are_dropped_as_nnx_dropout_drops_them():
    """dropout(softmax(q k^T / sqrt(K), causal)) v, with the mask nnx.Dropout draws."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 5, 3, 4)), jnp.float32) for _ in range(3))
    drop = nnx.Dropout(0.3, rngs=nnx.Rngs(dropout=7))
    got = attention_with_dropout(q, k, v, drop)
    keep = jax.random.bernoulli(nnx.Dropout(0.3, rngs=nnx.Rngs(dropout=7)).rngs(), 0.7,
                                (2, 3, 5, 5))
    scores = jnp.einsum("bthk,bshk->bhts", q, k) / 2.0
    probs = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((5, 5), bool)), scores, -jnp.inf))
    want = jnp.einsum("bhts,bshk->bthk", jnp.where(keep, probs / 0.7, 0.0), v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    drop.eval()  # inactive: the plain attention
    np.testing.assert_allclose(attention_with_dropout(q, k, v, drop),
                               jax.nn.dot_product_attention(q, k, v, is_causal=True),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_dropout_seed_moves_the_losses_by_far_more_than_the_tolerance():
    """So the equivalence below checks the masks: another mask is another trajectory."""
    ours, other = reference(1)[0], reference(2)[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(ours, other)) > 1e-3


def mesh(**axes):
    return px.make_mesh(devices=jax.devices()[:int(np.prod(list(axes.values())))], **axes)


# Three compositions cover every axis (each case compiles a GPT step with partitionable
# draws, 10-40 s on CPU): data, fsdp and Megatron's tensor layout (probabilities split by
# head, masks of the sharded activations); sequence parallelism (the residual stream split
# by sequence); a pipeline with data parallelism.
CASES = {
    "dp-fsdp-tp": (dict(data=2, fsdp=2, tensor=2),
                   px.compose(px.DataParallel(), px.FSDP(), px.TensorParallel())),
    "sp": (dict(tensor=2), px.TensorParallel(sequence_parallel=True)),
    "dp-pipeline": (dict(stage=2, data=2),
                    px.compose(px.DataParallel(), px.Pipeline("stage", microbatches=2))),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_training_with_dropout_equals_one_device(name):
    axes, strategy = CASES[name]
    stages = "pipeline" in name
    loss_fn = next_token_stages if stages else px.models.next_token_loss
    run = parallax_run(make, loss_fn, batches(), mesh(**axes), strategy)
    assert_same_training(run, reference(stages=stages))


def test_context_parallelism_refuses_dropout():
    strategy = px.ContextParallel()
    m = mesh(context=2)
    state = px.shard(px.TrainState.create(make(), TX), m, strategy)

    @px.train_step(m, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), loss

    with pytest.raises(ValueError, match=(
            r"px.models.GPT: dropout is not taken under context parallelism \(ContextParallel"
            r".*axis 'context' of size 2\).*Set GPTConfig's embed_dropout, attention_dropout "
            r"and residual_dropout to 0")):
        step(state, batches(1)[0])


def test_a_fused_attention_kernel_refuses_attention_dropout():
    m = mesh(data=2)
    state = px.shard(px.TrainState.create(make(), TX), m, px.DataParallel())

    @px.train_step(m, px.DataParallel(), attention="cudnn")
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), loss

    with pytest.raises(ValueError, match=(
            r"px.models.GPT \(attention dropout\): px.train_step\(attention='cudnn'\) cannot "
            r"apply attention dropout.*attention='auto' or 'xla'")):
        step(state, batches(1)[0])


def test_parallel_gpt_refuses_a_config_with_dropout():
    with pytest.raises(ValueError, match=(
            r"ParallelGPT: GPTConfig's dropout \(embed_dropout=0.2, attention_dropout=0.2, "
            r"residual_dropout=0.2\) is not built into the explicit Megatron GPT")):
        px.nn.ParallelGPT(CONFIG, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("rate", [1.0, -0.1, "0.1", True])
def test_a_bad_rate_is_refused(rate):
    with pytest.raises(ValueError, match=r"GPTConfig: attention_dropout must be a dropout rate "
                                         r"in \[0, 1\), got"):
        px.models.GPTConfig.tiny(attention_dropout=rate)


@pytest.mark.slow
def test_each_dropout_call_advances_its_layers_counter():
    """Per step: the embeddings' stream once, each layer's attention stream once and its
    residual stream twice (after attention, after the MLP); the equivalence tests above
    check that every strategy leaves the same counters and keys."""
    counts = jax.device_get(nnx.state(reference()[2], nnx.RngCount))
    assert int(counts["embed_dropout"]["rngs"]["count"]) == STEPS
    assert counts["blocks"]["attn_dropout"]["rngs"]["count"].tolist() == [STEPS] * 2
    assert counts["blocks"]["resid_dropout"]["rngs"]["count"].tolist() == [2 * STEPS] * 2


@pytest.mark.slow
def test_recomputed_blocks_draw_the_same_masks():
    """remat="full" recomputes each block in the backward: the same masks, the same
    gradients, and each counter advanced once per call, not once more for the recompute."""
    batch = batches(1)[0]

    def run(remat):
        model = make(config=px.models.GPTConfig.tiny(max_seq_len=16, remat=remat, **RATES))
        loss, grads = nnx.jit(nnx.value_and_grad(px.models.next_token_loss))(model, batch)
        return float(loss), grads, jax.device_get(nnx.state(model, nnx.RngCount))

    (loss, grads, counts), (ref_loss, ref_grads, ref_counts) = run("full"), run("none")
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert px.testing.relative_difference(grads, ref_grads) <= 1e-5
    jax.tree.map(np.testing.assert_array_equal, counts, ref_counts)
