"""px.models.MLP and mse_loss: shapes, Megatron-style logical names, the loss."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from parallax.models import MLP, mse_loss
from parallax.rules import annotated_leaves


def _names(model):
    return {
        jax.tree_util.keystr(a.path[:-1], simple=True, separator="/"): (a.leaf.shape, a.names)
        for a in annotated_leaves(nnx.state(model, nnx.Param))
    }


def test_shapes():
    model = MLP(4, [16, 8], 3, rngs=nnx.Rngs(0))
    assert model(jnp.ones((5, 4))).shape == (5, 3)
    assert MLP(4, [], 3, rngs=nnx.Rngs(0))(jnp.ones((5, 4))).shape == (5, 3)


def test_names_alternate_column_row():
    names = _names(MLP(4, [16, 8], 3, rngs=nnx.Rngs(0)))
    assert names == {
        "layers/0/kernel": ((4, 16), ("embed", "mlp")),
        "layers/0/bias": ((16,), ("mlp",)),
        "layers/1/kernel": ((16, 8), ("mlp", "embed")),
        "layers/1/bias": ((8,), ("embed",)),
        "layers/2/kernel": ((8, 3), ("embed", "mlp")),
        "layers/2/bias": ((3,), ("mlp",)),
    }


def test_every_param_annotated_outside_a_mesh():
    assert nnx.using_eager_sharding()  # flax's default: annotated params would need a mesh
    model = MLP(4, [8, 8, 8], 2, rngs=nnx.Rngs(0))
    for leaf in annotated_leaves(nnx.state(model, nnx.Param)):
        assert leaf.names is not None and len(leaf.names) == leaf.leaf.ndim


def test_activation_is_applied_between_layers_only():
    model = MLP(2, [4], 2, rngs=nnx.Rngs(0), activation=lambda x: jnp.zeros_like(x))
    # A zeroed hidden layer leaves only the last layer's bias (zeros at init): no activation
    # on the output.
    model.layers[1].bias[...] = jnp.array([1.0, 2.0])
    np.testing.assert_array_equal(model(jnp.ones((3, 2))), jnp.tile(jnp.array([1.0, 2.0]), (3, 1)))


def test_mse_loss_is_a_plain_mean_in_fp32():
    model = MLP(4, [8], 2, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8, 4))
    y = jax.random.normal(jax.random.key(2), (8, 2))
    loss = mse_loss(model, {"x": x, "y": y})
    assert loss.shape == () and loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, jnp.mean((model(x) - y) ** 2), rtol=1e-6)
    halves = [mse_loss(model, {"x": x[i : i + 4], "y": y[i : i + 4]}) for i in (0, 4)]
    np.testing.assert_allclose(loss, sum(halves) / 2, rtol=1e-6)


def test_mse_loss_fp32_for_bf16_model():
    model = MLP(4, [8], 2, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    loss = mse_loss(model, {"x": jnp.ones((4, 4)), "y": jnp.zeros((4, 2))})
    assert loss.dtype == jnp.float32


def test_training_lowers_the_loss():
    model = MLP(4, [32], 1, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    x = jax.random.normal(jax.random.key(1), (32, 4))
    batch = {"x": x, "y": jnp.sin(x.sum(-1, keepdims=True))}
    tx = optax.adam(1e-2)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(lambda p: mse_loss(nnx.merge(graphdef, p), batch))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    opt_state, losses = tx.init(params), []
    for _ in range(30):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    assert losses[-1] < 0.5 * losses[0]


def test_errors():
    with pytest.raises(ValueError, match=r"MLP: in_features must be positive, got 0"):
        MLP(0, [8], 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"MLP: every hidden size must be positive"):
        MLP(4, [8, 0], 2, rngs=nnx.Rngs(0))
    model = MLP(4, [8], 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"mse_loss: the model's output has shape \(4, 2\)"):
        mse_loss(model, {"x": jnp.ones((4, 4)), "y": jnp.zeros((4, 3))})
