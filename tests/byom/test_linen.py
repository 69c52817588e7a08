"""A Linen model with no annotations trains under ZeRO 3 as a plain Linen loop on one device:
ZeRO shards each parameter's largest divisible dimension by shape alone."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import parallax as px

TX = optax.adam(1e-2)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(64)(x))
        x = nn.gelu(nn.Dense(32)(x))
        return nn.Dense(4)(x)


MODEL = LinenMLP()


def make_state():
    params = MODEL.init(jax.random.key(0), jnp.ones((1, 16)))["params"]
    return params, TX.init(params)


def loss_fn(params, batch):
    return jnp.mean((MODEL.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)


def batches():
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((16, 16), np.float32),
             "y": rng.standard_normal((16, 4), np.float32)} for _ in range(5)]


@pytest.mark.slow
def test_unannotated_linen_model_under_zero3_matches_one_device():
    data = batches()
    mesh = px.make_mesh(fsdp=8)
    ref = px.testing.train(make_state, loss_fn, data, tx=TX)
    run = px.testing.train(make_state, loss_fn, data, mesh=mesh, strategy=px.FSDP("fsdp"), tx=TX)
    px.testing.assert_equivalent(run, ref, rtol=1e-5)
    params = run.final_state[0]
    # Sharded by shape: each kernel along its largest dimension that 8 divides.
    assert params["Dense_0"]["kernel"].sharding.spec == jax.P(None, "fsdp")  # (16, 64)
    assert params["Dense_2"]["kernel"].sharding.spec == jax.P("fsdp")  # (32, 4)
    assert params["Dense_2"]["bias"].sharding.spec == jax.P()  # 4 does not split over 8
