"""px.nn.tensor_parallel outside a step: the loss itself without a mesh, aux outputs kept."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import parallax as px
import parallax.nn as pnn

from .nn_testing import tensor_mesh


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
