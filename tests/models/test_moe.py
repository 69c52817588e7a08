"""The MoE layer on one device: routing and capacity against a loop, dropless against the
padded capacity path, the auxiliary losses, the MoE GPT, and the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import parallax as px
from parallax.models import MoEConfig
from parallax.models.moe import MoE
from parallax.models.moe_routing import dispatch_tensors, route, slots


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
    from parallax.models.moe_routing import router_stats
    stats = router_stats(jnp.zeros((1, 8, 4)), uniform, jnp.ones((1, 8, 1), bool), 4,
                         lambda v: v)
    # all tokens on expert 0 (ties), P uniform: E * (1 * 1/4) = 1; z = log(4)^2
    assert float(stats["load_balance_loss"]) == pytest.approx(1.0)
    assert float(stats["router_z_loss"]) == pytest.approx(np.log(4.0) ** 2, rel=1e-6)
    assert float(stats["dropped_fraction"]) == 0.0


def test_moe_gpt_counts_and_dense_default_unchanged():
    assert px.models.GPTConfig.tiny().moe is None
    assert px.models.param_count(px.models.GPTConfig.tiny()) == 120448  # as on main
    cfg = px.models.GPTConfig.tiny(moe=MoEConfig(num_experts=4, shared_mlp_dim=32))
    model = px.models.GPT(cfg, rngs=nnx.Rngs(0))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert px.models.param_count(cfg) == sum(x.size for x in leaves)
    assert model.blocks.mlp.w_gate.get_metadata()["out_sharding"] == ("layers", "expert",
                                                                       "embed", "mlp")


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
    with pytest.raises(TypeError, match=r"GPTConfig: moe must be a MoEConfig or None"):
        px.models.GPTConfig.tiny(moe={"num_experts": 4})


def test_pipeline_stages_are_the_moe_loss():
    """Without a pipeline the stages (router losses carried in a row of the stream) are
    moe_next_token_loss; a width too small to carry the two losses is refused."""
    from parallax.models.gpt_pipeline import next_token_stages
    model = px.models.GPT(px.models.GPTConfig.tiny(moe=MoEConfig()), rngs=nnx.Rngs(0))
    batch = {"tokens": jnp.arange(18, dtype=jnp.int32).reshape(2, 9)}
    both = nnx.jit(lambda m, b: (px.models.moe_next_token_loss(m, b)[0],
                                 next_token_stages(m, b)))  # one compile
    loss, staged = both(model, batch)
    assert px.testing.relative_difference(staged, loss) <= 1e-6
    from parallax.models.gpt_moe import with_stats_row
    with pytest.raises(ValueError, match=r"next_token_stages: an MoE GPT under a pipeline "
                       r"carries its 2 auxiliary losses in the embedding dimension, which has "
                       r"1 entries; use embed_dim >= 2"):
        with_stats_row(jnp.ones((2, 8, 1)))
