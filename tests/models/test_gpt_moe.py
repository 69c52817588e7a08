"""The GPT with MoE blocks: its parameter count, the dense default unchanged, its
pipeline stages, and the config's refusal (the layer itself: tests/nn/test_moe.py)."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import parallax as px
from parallax.models import MoEConfig


def test_moe_gpt_counts_and_dense_default_unchanged():
    assert px.models.GPTConfig.tiny().moe is None
    assert px.models.param_count(px.models.GPTConfig.tiny()) == 120448  # as on main
    cfg = px.models.GPTConfig.tiny(moe=MoEConfig(num_experts=4, shared_mlp_dim=32))
    model = px.models.GPT(cfg, rngs=nnx.Rngs(0))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert px.models.param_count(cfg) == sum(x.size for x in leaves)
    assert model.blocks.mlp.w_gate.get_metadata()["out_sharding"] == ("layers", "expert",
                                                                       "embed", "mlp")


def test_a_gpt_config_takes_only_a_moe_config():
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
    with pytest.raises(ValueError, match=r"next_token_stages: an MoE model under a pipeline "
                       r"carries its 2 auxiliary losses in the embedding dimension, which has "
                       r"1 entries; use embed_dim >= 2"):
        with_stats_row(jnp.ones((2, 8, 1)), MoEConfig())
