"""px.models.ParallelGPT: the reference GPT's parameters and numbers, in the explicit wrapper."""

import jax
import numpy as np
import pytest
from flax import nnx

import parallax as px
import parallax.nn as pnn

CONFIG = px.models.GPTConfig.tiny(num_layers=1)
BATCH = {"tokens": np.random.default_rng(0).integers(0, 256, (2, 17)).astype(np.int32)}


def test_same_parameters_as_the_reference_gpt():
    ref = nnx.state(px.models.GPT(CONFIG, rngs=nnx.Rngs(0)), nnx.Param)
    par = nnx.state(px.models.ParallelGPT(CONFIG, rngs=nnx.Rngs(0)), nnx.Param)
    assert jax.tree.structure(ref) == jax.tree.structure(par)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(par)):
        np.testing.assert_array_equal(a, b)
    names = lambda s: [leaf.names for leaf in px.rules.annotated_leaves(s)]  # noqa: E731
    assert names(ref) == names(par)


@pytest.mark.slow
def test_explicit_loss_and_gradients_equal_the_reference_on_tensor_4():
    reference = px.models.GPT(CONFIG, rngs=nnx.Rngs(0))
    model = px.models.ParallelGPT(CONFIG, rngs=nnx.Rngs(0), sequence_parallel=True)
    mesh = px.make_mesh(tensor=4, devices=jax.devices()[:4])
    explicit = pnn.tensor_parallel(px.models.parallel_next_token_loss, mesh=mesh)
    grad = lambda fn, m: nnx.grad(fn)(m, BATCH)  # noqa: E731
    value = jax.jit(explicit)(model, BATCH)
    np.testing.assert_allclose(value, px.models.next_token_loss(reference, BATCH), rtol=1e-5)
    ours = nnx.jit(lambda m: grad(explicit, m))(model)
    theirs = nnx.jit(lambda m: grad(px.models.next_token_loss, m))(reference)
    assert px.testing.relative_difference(ours, theirs) <= 1e-5


def test_parallax_nn_still_answers_the_networks_names():
    assert pnn.ParallelGPT is px.models.ParallelGPT
    assert pnn.ParallelBlock is px.models.ParallelBlock
    assert pnn.parallel_next_token_loss is px.models.parallel_next_token_loss
    from parallax.nn import ParallelGPT
    assert ParallelGPT is px.models.ParallelGPT
