"""The MoE Llama (Mixtral) and the MoE GPT under px.Pipeline: the stages carry the router
statistics in a row after the stream (Switch's two summed losses, or Mixtral's per-expert
load and probability sums, pooled by the last stage); called without a pipeline they are
moe_next_token_loss, and under GPipe and 1F1B (2 stages) the whole state over 3 steps equals
one device computing the loss per (batch shard, micro-batch) block."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.analysis import hlo
from parallax.models import Llama, LlamaConfig, MoEConfig
from parallax.models.gpt_pipeline import next_token_stages

ROWS, SEQ, MICRO, CHUNKS = 16, 16, 2, 4  # CHUNKS: batch shards x micro-batches


def moe(aux_loss):
    return MoEConfig(num_experts=4, top_k=2, capacity_factor=None, aux_loss=aux_loss,
                     balance_coef=0.5)  # large, so a wrong router term shows in the state


def config(aux_loss="mixtral", **overrides):
    return LlamaConfig(**dict(vocab_size=96, max_seq_len=SEQ, num_layers=2, num_heads=4,
                              num_kv_heads=2, embed_dim=32, mlp_dim=48, moe=moe(aux_loss))
                       | overrides)


def test_stages_without_a_pipeline_are_the_loss():
    batch = {"tokens": jnp.arange(34, dtype=jnp.int32).reshape(2, 17) % 96}
    for aux_loss in ("mixtral", "switch"):
        model = Llama(config(aux_loss), rngs=nnx.Rngs(0))
        loss, _ = px.models.moe_next_token_loss(model, batch)
        assert px.testing.relative_difference(px.models.llama_stages(model, batch), loss) <= 1e-6
    gpt = px.models.GPT(px.models.GPTConfig.tiny(moe=moe("mixtral")), rngs=nnx.Rngs(0))
    loss, _ = px.models.moe_next_token_loss(gpt, batch)  # the GPT's stages pool them too
    assert px.testing.relative_difference(next_token_stages(gpt, batch), loss) <= 1e-6
    narrow = Llama(config(embed_dim=4, num_heads=2, num_kv_heads=1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"llama_stages: an MoE model under a pipeline "
                       r"carries its 8 pooled router statistics \(2 x 4 experts: the load and "
                       r"the router probability of each\) in the embedding dimension, which "
                       r"has 4 entries; use embed_dim >= 8"):
        px.models.llama_stages(narrow, batch)


def make(cfg):
    return lambda: px.TrainState.create(Llama(cfg, rngs=nnx.Rngs(0)),
                                        optax.sgd(0.1, momentum=0.9))


def data():
    rng = np.random.default_rng(0)
    return [{"tokens": rng.integers(0, 96, (ROWS, SEQ + 1)).astype(np.int32)}
            for _ in range(3)]


def trajectory(state, step):
    states = []
    for batch in data():
        state, loss = step(state, batch)
        states.append(jax.device_get((jax.tree.leaves(state), loss)))
    return states


def one_device_per_microbatch(cfg):
    """One device's loss as the pipeline over 2 batch shards computes it: the mean over the
    4 (shard, micro-batch) row blocks of each block's MoE loss (router statistics per block,
    Mixtral's pooled over the layers within the block)."""
    state = make(cfg)()

    @jax.jit
    def step(state, batch):
        def loss(params):
            model = nnx.merge(state.graphdef, params, state.rest)
            blocks = batch["tokens"].reshape(CHUNKS, -1, SEQ + 1)
            return sum(px.models.moe_next_token_loss(model, {"tokens": b})[0]
                       for b in blocks) / CHUNKS

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads), value

    return state, step


@pytest.mark.slow
@pytest.mark.parametrize("schedule, batch_axis, aux_loss", [
    ("gpipe", "data", "mixtral"), ("1f1b", "expert", "mixtral"), ("1f1b", "data", "switch")])
def test_pipeline_matches_one_device(schedule, batch_axis, aux_loss):
    cfg = config(aux_loss)
    mesh = px.make_mesh(stage=2, **{batch_axis: 2}, devices=jax.devices()[:4])
    split = px.DataParallel("data") if batch_axis == "data" else px.ExpertParallel("expert")
    strategy = px.compose(split, px.Pipeline("stage", microbatches=MICRO, schedule=schedule))
    state = px.init(make(cfg), mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        value, grads = px.value_and_grad(px.models.llama_stages)(state.model, batch)
        return state.apply_gradients(grads), value

    if batch_axis == "expert":  # the experts split over expert inside the stages
        assert state.params["blocks"]["mlp"]["w_up"].sharding.spec[:2] == ("stage", "expert")
        found = hlo.collectives(step.lower(state, data()[0]).compile(), mesh)
        assert {c.axes for c in found if c.kind == "all-to-all"} == {("expert",)}
    reference = trajectory(*one_device_per_microbatch(cfg))
    for i, (par, ref) in enumerate(zip(trajectory(state, step), reference)):
        diff = px.testing.relative_difference(par, ref)
        assert diff <= 1e-5, f"step {i + 1}: whole state and loss differ by {diff:.2e}"
