"""The MoE layer on one device: routing and capacity against a loop, dropless against the
padded capacity path, the auxiliary losses, and the refusals (the MoE GPT:
tests/models/test_gpt_moe.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import parallax as px
from parallax.nn import MoE, MoEConfig
from parallax.nn.moe_routing import dispatch_tensors, route, slots


def test_slots_follow_gshard_priority_and_capacity():
    rng = np.random.default_rng(0)
    experts = rng.integers(0, 4, (3, 10, 2)).astype(np.int32)
    position, kept = slots(jnp.asarray(experts), 4, capacity=3)
    for g in range(3):  # first choices of all tokens first, then second choices
        seen = {}
        for k in range(2):
            for s in range(10):
                e = experts[g, s, k]
                assert position[g, s, k] == seen.get(e, 0)
                assert bool(kept[g, s, k]) == (seen.get(e, 0) < 3)
                seen[e] = seen.get(e, 0) + 1


def test_dispatch_places_each_kept_choice_once():
    logits = jax.random.normal(jax.random.key(0), (2, 12, 4))
    routing = route(logits, 2, "softmax")
    dispatch, combine, kept = dispatch_tensors(routing, 4, capacity=4)
    assert float(dispatch.sum()) == float(kept.sum())
    assert float(dispatch.sum(axis=1).max()) <= 1.0  # one token per slot
    np.testing.assert_allclose(combine.sum(axis=(2, 3)),
                               jnp.sum(routing.gates * kept, -1), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_dropless_grouped_matmuls_equal_padded_slots(score):
    x = jax.random.normal(jax.random.key(1), (2, 8, 16))
    ragged = MoE(16, MoEConfig(num_experts=4, top_k=2, capacity_factor=None, mlp_dim=32,
                               score=score, shared_mlp_dim=8), rngs=nnx.Rngs(0))
    padded = MoE(16, MoEConfig(num_experts=4, top_k=2, capacity_factor=2.0, mlp_dim=32,
                               score=score, shared_mlp_dim=8), rngs=nnx.Rngs(0))

    def loss(model):
        y, stats = model(x)
        return jnp.sum(y ** 2) + stats["load_balance_loss"]

    l1, g1 = nnx.value_and_grad(loss)(ragged)
    l2, g2 = nnx.value_and_grad(loss)(padded)
    assert abs(float(l1) - float(l2)) <= 1e-5 * abs(float(l2))
    assert px.testing.relative_difference(g1, g2) <= 1e-5


def test_auxiliary_losses():
    uniform = route(jnp.zeros((1, 8, 4)), 1, "softmax")
    from parallax.nn.moe_routing import router_stats
    stats = router_stats(jnp.zeros((1, 8, 4)), uniform, jnp.ones((1, 8, 1), bool), 4,
                         lambda v: v)
    # all tokens on expert 0 (ties), P uniform: E * (1 * 1/4) = 1; z = log(4)^2
    assert float(stats["load_balance_loss"]) == pytest.approx(1.0)
    assert float(stats["router_z_loss"]) == pytest.approx(np.log(4.0) ** 2, rel=1e-6)
    assert float(stats["dropped_fraction"]) == 0.0


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match=r"MoEConfig: top_k=2 > num_experts=1: a token "
                       r"cannot go to 2 different experts out of 1"):
        MoEConfig(num_experts=1, top_k=2)
    with pytest.raises(ValueError, match=r"MoEConfig: top_k=3 must be 1 \(Switch\) or 2"):
        MoEConfig(num_experts=8, top_k=3)
    with pytest.raises(ValueError, match=r"MoEConfig: capacity_factor=0 must be > 0 .* or "
                       r"None for dropless routing"):
        MoEConfig(capacity_factor=0)
    with pytest.raises(TypeError, match=r"MoEConfig: num_experts must be an int"):
        MoEConfig(num_experts=4.0)


def test_one_layer_under_its_public_names():
    assert px.nn.MoE is px.models.MoE and px.nn.MoEConfig is px.models.MoEConfig
