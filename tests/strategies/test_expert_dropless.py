"""Dropless expert parallelism in rounds: px.models' MoE GPT and a model of stock Flax layers
around ``px.nn.MoE`` equal one device (whole state after each of 3 steps, router statistics)
under expert=8 and data=2 x expert=4, and the compiled step's all-to-alls move one round's
``E c D`` slots, not the padded ``G E S D``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_expert as te
from flax import nnx

import parallax as px
from parallax.analysis import hlo
from parallax.nn.moe import aux_loss
from parallax.nn.moe_dropless import most_rounds, round_slots

MESHES = {
    "expert": ({"expert": 8}, px.ExpertParallel("expert")),
    "data x expert": te.DP_EP,
}
DROPLESS = px.nn.MoEConfig(num_experts=te.EXPERTS, top_k=2, capacity_factor=None, mlp_dim=32)


class StockMoE(nnx.Module):
    """nnx.Linear, nnx.LayerNorm and nnx.Linear around one dropless px.nn.MoE."""

    def __init__(self, rngs: nnx.Rngs):
        self.inp = nnx.Linear(8, te.EMBED, rngs=rngs)
        self.norm = nnx.LayerNorm(te.EMBED, rngs=rngs)
        self.moe = px.nn.MoE(te.EMBED, DROPLESS, rngs=rngs)
        self.out = nnx.Linear(te.EMBED, 4, rngs=rngs)

    def __call__(self, x):
        h = self.norm(self.inp(x))
        y, stats = self.moe(h)
        return self.out(h + y), stats


def stock_loss(model, batch):
    pred, stats = model(batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2) + aux_loss(stats, DROPLESS), stats


def stock_data():
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((te.ROWS, te.SEQ, 8)).astype(np.float32),
             "y": rng.standard_normal((te.ROWS, te.SEQ, 4)).astype(np.float32)}
            for _ in range(te.STEPS)]


def stock_state():
    return px.TrainState.create(StockMoE(nnx.Rngs(0)), optax.sgd(0.1, momentum=0.9))


def stock_trajectory(state, step):
    states, stats = [], []
    for batch in stock_data():
        state, aux = step(state, batch)
        states.append(jax.device_get(jax.tree.leaves(state)))
        stats.append(jax.device_get(aux))
    return states, stats


def one_device_step():
    """The plain program for the stock model: jax.value_and_grad under jax.jit."""
    @jax.jit
    def one_step(state, batch):
        def loss(params):
            return stock_loss(nnx.merge(state.graphdef, params, state.rest), batch)

        (_, aux), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads), aux

    return one_step


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(MESHES))
def test_moe_gpt_matches_one_device_with_one_round_of_slots_per_exchange(layout):
    cfg = te.config(capacity_factor=None)
    ref = te.trajectory(*te.one_device(cfg))
    shape, strategy = MESHES[layout]
    mesh = px.make_mesh(**shape)
    state, step = te.parallel(cfg, mesh, strategy)
    found = [c for c in hlo.collectives(step.lower(state, te.data()[0]).compile(), mesh)
             if c.kind == "all-to-all"]
    assert_same = te.assert_same_trajectory
    assert_same(te.trajectory(state, step), ref)
    tokens = te.ROWS // mesh.size * te.SEQ
    c = round_slots(tokens, 2, te.EXPERTS)
    # Per layer: 2 all-to-alls forward and 2 backward, inside the round's conditional, in a
    # scan of most_rounds; each moves E c D floats (the padded path: G E S D, E / k times).
    assert len(found) == 4
    assert all(f.axes == ("expert",) and f.conditional for f in found)
    assert {f.count for f in found} == {te.LAYERS * most_rounds(tokens, 2, te.EXPERTS)}
    assert {f.message_bytes for f in found} == {te.EXPERTS * c * te.EMBED * 4}
    padded = te.ROWS // mesh.size * te.EXPERTS * te.SEQ * te.EMBED * 4
    assert padded == te.EXPERTS // 2 * te.EXPERTS * c * te.EMBED * 4


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(MESHES))
def test_stock_layers_around_moe_match_one_device(layout):
    ref = stock_trajectory(stock_state(), one_device_step())
    shape, strategy = MESHES[layout]
    assert_stock_layers_match(px.make_mesh(**shape), strategy, ref)


def assert_stock_layers_match(mesh, strategy, ref) -> None:
    """The stock-layer model's trajectory on ``mesh`` under ``strategy`` equals ``ref``."""

    @px.train_step(mesh, strategy)
    def step(state, batch):
        (_, aux), grads = px.value_and_grad(stock_loss, has_aux=True)(state.model, batch)
        return state.apply_gradients(grads), aux

    state = px.init(stock_state, mesh, strategy)
    te.assert_same_trajectory(stock_trajectory(state, step), ref)


@pytest.mark.slow
def test_pipeline_stages_pad_dropless_and_match_one_device():
    """In a pipeline stage (1F1B, stage=2 x expert=2) dropless pads to C = S (no rounds)."""
    from parallax.models.gpt_pipeline import next_token_stages
    cfg = te.config(capacity_factor=None)
    mesh = px.make_mesh(stage=2, expert=2, devices=jax.devices()[:4])
    strategy = px.compose(px.ExpertParallel("expert"),
                          px.Pipeline("stage", microbatches=te.MICRO, schedule="1f1b"))
    state = px.init(te.make(cfg), mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        value, grads = px.value_and_grad(next_token_stages)(state.model, batch)
        return state.apply_gradients(grads), value

    found = [c for c in hlo.collectives(step.lower(state, te.data()[0]).compile(), mesh)
             if c.kind == "all-to-all"]
    rows = te.ROWS // 2 // te.MICRO  # a micro-batch's rows on one expert device
    assert {(c.axes, c.conditional) for c in found} == {(("expert",), False)}
    assert {c.message_bytes for c in found} == {rows * te.EXPERTS * te.SEQ * te.EMBED * 4}
    te.assert_same_trajectory(te.trajectory(state, step),
                              te.trajectory(*te.one_device_per_microbatch(cfg)))
