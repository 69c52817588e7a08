"""px.nn.ParallelGPT: the reference GPT's parameters, its numbers, and the explicit wrapper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import parallax as px
import parallax.nn as pnn

from .nn_testing import tensor_mesh

CONFIG = px.models.GPTConfig.tiny(num_layers=1)
BATCH = {"tokens": np.random.default_rng(0).integers(0, 256, (2, 17)).astype(np.int32)}


def test_same_parameters_as_the_reference_gpt():
    ref = nnx.state(px.models.GPT(CONFIG, rngs=nnx.Rngs(0)), nnx.Param)
    par = nnx.state(pnn.ParallelGPT(CONFIG, rngs=nnx.Rngs(0)), nnx.Param)
    assert jax.tree.structure(ref) == jax.tree.structure(par)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(par)):
        np.testing.assert_array_equal(a, b)
    names = lambda s: [leaf.names for leaf in px.rules.annotated_leaves(s)]  # noqa: E731
    assert names(ref) == names(par)


@pytest.mark.slow
def test_explicit_loss_and_gradients_equal_the_reference_on_tensor_4():
    reference = px.models.GPT(CONFIG, rngs=nnx.Rngs(0))
    model = pnn.ParallelGPT(CONFIG, rngs=nnx.Rngs(0), sequence_parallel=True)
    explicit = pnn.tensor_parallel(pnn.parallel_next_token_loss, mesh=tensor_mesh(4))
    grad = lambda fn, m: nnx.grad(fn)(m, BATCH)  # noqa: E731
    value = jax.jit(explicit)(model, BATCH)
    np.testing.assert_allclose(value, px.models.next_token_loss(reference, BATCH), rtol=1e-5)
    ours = nnx.jit(lambda m: grad(explicit, m))(model)
    theirs = nnx.jit(lambda m: grad(px.models.next_token_loss, m))(reference)
    assert px.testing.relative_difference(ours, theirs) <= 1e-5


@pytest.mark.slow
def test_tensor_parallel_without_a_mesh_is_the_loss_itself_and_carries_aux():
    mlp = pnn.ParallelMLP(8, 32, rngs=nnx.Rngs(0))
    x = np.random.default_rng(1).standard_normal((2, 4, 8)).astype(np.float32)

    def with_aux(m, x):
        loss = jnp.mean(m(x) ** 2)
        return loss, {"twice": 2 * loss}

    assert pnn.tensor_parallel(with_aux, has_aux=True)(mlp, x) == with_aux(mlp, x)
    expected, expected_grads = nnx.value_and_grad(with_aux, has_aux=True)(mlp, x)
    mapped = pnn.tensor_parallel(with_aux, mesh=tensor_mesh(2), has_aux=True)
    (loss, aux), grads = jax.jit(nnx.value_and_grad(mapped, has_aux=True))(mlp, x)
    np.testing.assert_allclose(loss, expected[0], rtol=1e-5)
    np.testing.assert_allclose(aux["twice"], 2 * expected[0], rtol=1e-5)
    assert px.testing.relative_difference(grads, expected_grads, floor=0.0) <= 1e-5
