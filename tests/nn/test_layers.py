"""Every parallax.nn layer equals its dense version on tensor=2 and tensor=4 (values, grads).

Outputs, parameter gradients and input gradients, fp32, relative 1e-5; the dense version is
the same module on one device, which is checked against the reference models' layers.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
import parallax.nn as pnn
from parallax.nn.layers import CausalSelfAttention, FeedForward
from parallax.nn.padding import MASKED

from .nn_testing import P, compare, inputs, ints, tensor_mesh

T = "tensor"
X = inputs((2, 8, 16))  # [batch, sequence, embed]


@pytest.mark.slow
def test_column_parallel_linear():
    layer = pnn.ColumnParallelLinear(16, 32, rngs=nnx.Rngs(0))
    compare(layer, X, out_spec=P(None, None, T))
    gathered = pnn.ColumnParallelLinear(16, 32, gather_output=True, rngs=nnx.Rngs(0))
    compare(gathered, X, out_spec=P())
    heads = pnn.ColumnParallelLinear(16, (4, 4), names=("embed", "heads", "kv"),
                                     rngs=nnx.Rngs(0))
    compare(heads, X, out_spec=P(None, None, T, None))


def test_row_parallel_linear():
    split = pnn.RowParallelLinear(32, 16, rngs=nnx.Rngs(0))
    compare(split, inputs((2, 8, 32)), in_spec=P(None, None, T))
    whole = pnn.RowParallelLinear(32, 16, input_is_parallel=False, rngs=nnx.Rngs(0))
    compare(whole, inputs((2, 8, 32)))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_parallel_mlp(sequence_parallel):
    mlp = pnn.ParallelMLP(16, 64, sequence_parallel=sequence_parallel, rngs=nnx.Rngs(0))
    spec = P(None, T) if sequence_parallel else P()
    compare(mlp, X, in_spec=spec, out_spec=spec)


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [None, 4, 2, 1], ids=["mha", "gqa4", "gqa2", "mqa"])
def test_parallel_self_attention(kv_heads):
    # 8 heads over 2 or 4 ranks; key/value heads split (4 over 2 or 4, 2 over 2) or
    # replicated (2 over 4, 1 over both).
    attn = pnn.ParallelSelfAttention(32, 8, num_kv_heads=kv_heads, rngs=nnx.Rngs(0))
    compare(attn, inputs((2, 8, 32)))


@pytest.mark.slow
def test_parallel_self_attention_sequence_parallel():
    attn = pnn.ParallelSelfAttention(32, 8, num_kv_heads=2, sequence_parallel=True,
                                     rngs=nnx.Rngs(0))
    compare(attn, inputs((2, 8, 32)), in_spec=P(None, T), out_spec=P(None, T))


@pytest.mark.slow
def test_vocab_parallel_embedding():
    ids = ints((2, 8), 250, seed=1)
    emb = pnn.VocabParallelEmbedding(250, 16, pad_to_multiple_of=4, rngs=nnx.Rngs(0))
    compare(emb, ids, wrt_input=False)
    sp = pnn.VocabParallelEmbedding(250, 16, pad_to_multiple_of=4, sequence_parallel=True,
                                    rngs=nnx.Rngs(0))
    compare(sp, ids, out_spec=P(None, T), wrt_input=False)
    tied = pnn.VocabParallelEmbedding(256, 16, rngs=nnx.Rngs(0))
    compare(tied, X, out_spec=P(None, None, T), call=lambda m, x: m.attend(x))


def test_vocab_parallel_cross_entropy():
    logits, labels = inputs((2, 8, 256), seed=2) * 3, ints((2, 8), 256, seed=3)
    expected, expected_grad = jax.value_and_grad(
        lambda l: optax.softmax_cross_entropy_with_integer_labels(l, labels).sum())(logits)
    for n in (2, 4):
        f = jax.shard_map(lambda l, y: pnn.vocab_parallel_cross_entropy(l, y, axis=T),
                          mesh=tensor_mesh(n), in_specs=(P(None, None, T), P()), out_specs=P())
        value, grad = jax.jit(jax.value_and_grad(lambda l: f(l, labels).sum()))(logits)
        np.testing.assert_allclose(value, expected, rtol=1e-5)
        assert px.testing.relative_difference(grad, expected_grad, floor=0.0) <= 1e-5


def test_cross_entropy_is_optaxs_and_nan_outside_the_vocabulary():
    """The models' loss (a masked sum, not a gather, so GSPMD splits it as Megatron does)
    has optax's values and gradients, and NaN for an id with no logit, as optax's."""
    logits, labels = inputs((2, 8, 256), seed=2) * 3, ints((2, 8), 256, seed=3)
    expected, expected_grad = jax.value_and_grad(
        lambda l: optax.softmax_cross_entropy_with_integer_labels(l, labels).sum())(logits)
    value, grad = jax.jit(jax.value_and_grad(lambda l: pnn.cross_entropy(l, labels).sum()))(
        logits)
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    assert px.testing.relative_difference(grad, expected_grad, floor=0.0) <= 1e-6
    outside = labels.at[0, 0].set(256).at[1, 1].set(-1)
    losses = np.asarray(pnn.cross_entropy(logits, outside))
    assert np.isnan(losses[0, 0]) and np.isnan(losses[1, 1])
    assert np.isfinite(np.delete(losses.ravel(), [0, 9])).all()


def test_padded_vocabulary_masks_the_extra_logits():
    emb = pnn.VocabParallelEmbedding(250, 16, pad_to_multiple_of=8, rngs=nnx.Rngs(0))
    assert emb.embedding.shape == (256, 16)
    assert not np.any(emb.embedding[...][250:])  # padded rows start at zero
    plain = pnn.VocabParallelEmbedding(250, 16, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(emb.embedding[...][:250], plain.embedding[...])
    labels = ints((2, 8), 250, seed=4)

    def loss(m, x):
        return pnn.vocab_parallel_cross_entropy(m.attend(x), labels, axis=T).mean()

    mesh = tensor_mesh(4)
    padded = jax.jit(pnn.tensor_parallel(loss, mesh=mesh))(emb, X)
    np.testing.assert_allclose(padded, loss(plain, X), rtol=1e-6)
    assert float(emb.attend(X)[..., 250:].max()) == MASKED


def test_dense_versions_are_the_reference_layers():
    # One device: the parallel layers compute what px.models' layers compute, with the
    # same parameter trees (so states load across).
    x = inputs((2, 8, 32))
    ref, par = CausalSelfAttention(32, 8, rngs=nnx.Rngs(0)), pnn.ParallelSelfAttention(
        32, 8, rngs=nnx.Rngs(0))
    assert jax.tree.structure(nnx.state(ref)) == jax.tree.structure(nnx.state(par))
    nnx.update(par, nnx.state(ref))
    np.testing.assert_allclose(par(x), ref(x), rtol=1e-5, atol=1e-6)
    ref, par = FeedForward(32, 64, rngs=nnx.Rngs(0)), pnn.ParallelMLP(32, 64, rngs=nnx.Rngs(0))
    nnx.update(par, nnx.state(ref))
    np.testing.assert_allclose(par(x), ref(x), rtol=1e-5, atol=1e-6)


def test_wrong_local_shape_names_param_specs():
    layer = pnn.ColumnParallelLinear(16, 32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=(
            r"ColumnParallelLinear: inside shard_map over 'tensor' \(tensor=4\) the kernel has "
            r"local shape \(16, 32\), but its split dimension 1 has 32 entries, so each rank "
            r"should hold 8. Shard the parameters with in_specs from px.nn.param_specs")):
        # The layer's full kernel closed over, instead of its shard passed in.
        jax.jit(jax.shard_map(lambda x: layer(x), mesh=tensor_mesh(4), in_specs=P(),
                              out_specs=P(None, None, T)))(X)


@pytest.mark.slow
def test_the_layers_also_run_gspmd_style_under_the_rules():
    # Outside shard_map the layers are the dense layers with logical names: under
    # px.TensorParallel's rules XLA shards them, and training matches one device.
    import optax

    make = lambda: px.TrainState.create(  # noqa: E731
        pnn.ParallelSelfAttention(32, 8, num_kv_heads=4, rngs=nnx.Rngs(0)), optax.sgd(0.1))
    loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)  # noqa: E731
    data = [{"x": inputs((4, 8, 32), seed=s), "y": inputs((4, 8, 32), seed=s + 9)}
            for s in range(2)]
    ref = px.testing.train(make, loss, data)
    run = px.testing.train(make, loss, data, mesh=tensor_mesh(4),
                           strategy=px.TensorParallel("tensor"))
    px.testing.assert_equivalent(run, ref, rtol=1e-5)
