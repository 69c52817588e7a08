"""A transformer of stock NNX layers (nnx.Embed, nnx.MultiHeadAttention, nnx.LayerNorm,
nnx.Linear, nnx.Dropout), with no annotations, under DP x TP with a plan: Megatron's layout,
Megatron's collectives on the tensor axis, and one device's numbers (dropout included)."""

import functools

import jax
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.analysis import hlo
from parallax.strategies.tensor_plan import TensorPlan

from .stock import (
    LM,
    LM_PLAN,
    assert_same_training,
    lm_batches,
    lm_loss,
    parallax_run,
    plain_nnx,
)

BATCHES = lm_batches()
MESH_AXES = dict(data=2, tensor=4)


@functools.cache
def reference():
    return plain_nnx(lambda: LM(rngs=nnx.Rngs(0)), lm_loss, BATCHES)


def spec(state, path):
    return dict(nnx.to_flat_state(state.params))[path].sharding.spec


@pytest.mark.slow
@pytest.mark.parametrize("plan", [LM_PLAN, "transformer"], ids=["plan", "preset"])
def test_planned_transformer_trains_as_on_one_device(plan):
    mesh = px.make_mesh(**MESH_AXES)
    strategy = px.compose(px.DataParallel("data"), px.TensorParallel("tensor", plan=plan))
    run = parallax_run(lambda: LM(rngs=nnx.Rngs(0)), lm_loss, BATCHES, mesh, strategy)
    assert_same_training(run, reference())
    state = run[2]
    # Megatron's layout: heads split in q/k/v and in the output projection's rows, the MLP
    # up-projection by columns and the down-projection by rows, the vocabulary split.
    assert spec(state, ("blocks", 0, "attn", "query", "kernel")) == jax.P(None, "tensor")
    assert spec(state, ("blocks", 0, "attn", "out", "kernel")) == jax.P("tensor")
    assert spec(state, ("blocks", 0, "mlp", "up", "kernel")) == jax.P(None, "tensor")
    assert spec(state, ("blocks", 0, "mlp", "down", "kernel")) == jax.P("tensor")
    assert spec(state, ("embed", "embedding")) == jax.P("tensor")
    assert spec(state, ("head", "kernel")) == jax.P(None, "tensor")
    assert spec(state, ("blocks", 0, "ln1", "scale")) == jax.P()


@pytest.mark.slow
def test_the_plan_gives_megatrons_collectives():
    """On the tensor axis only all-reduces: Megatron's g after attention and after the MLP
    (two of [B, T, D] per layer forward), their conjugates f in the backward pass, the
    vocabulary-parallel embedding and softmax; parameters are never gathered."""
    mesh = px.make_mesh(**MESH_AXES)
    strategy = px.compose(px.DataParallel("data"), px.TensorParallel("tensor", plan=LM_PLAN))
    state = px.shard(px.TrainState.create(LM(rngs=nnx.Rngs(0)), optax.sgd(0.1)), mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(lm_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    colls = hlo.collectives(step.lower(state, BATCHES[0]).compile(), mesh)
    table = hlo.table(colls)
    tensor = [c for c in colls if c.axes == ("tensor",)]
    assert {c.kind for c in tensor} == {"all-reduce"}, table
    residual = 4 * 8 * 16 * 4  # [B / data, T, D] in float32
    forward = [c for c in tensor if "dot_general" in c.op_name and "transpose" not in c.op_name]
    assert [c.message_bytes for c in forward] == [residual, residual], table  # g, g
    backward = sum(c.message_bytes for c in tensor if "transpose" in c.op_name)
    assert backward >= 2 * residual, table  # f, f (XLA may combine them with others)
    assert any("gather" in c.op_name and "transpose" not in c.op_name for c in tensor), table
    assert not [c for c in colls if c.kind in ("all-gather", "all-to-all")], table


@pytest.mark.slow
def test_sequence_parallel_plan_trains_as_on_one_device():
    mesh = px.make_mesh(**MESH_AXES)
    plan = dict(LM_PLAN, **{"blocks.*.ln*": "sequence", "blocks.*.drop": "sequence",
                            "ln": "sequence"})
    strategy = px.compose(px.DataParallel("data"),
                          px.TensorParallel("tensor", plan=plan, sequence_parallel=True))
    run = parallax_run(lambda: LM(rngs=nnx.Rngs(0)), lm_loss, BATCHES[:3], mesh, strategy)
    ref = plain_nnx(lambda: LM(rngs=nnx.Rngs(0)), lm_loss, BATCHES[:3])
    assert_same_training(run, ref)


def abstract_lm():
    return nnx.eval_shape(lambda: LM(rngs=nnx.Rngs(0)))


def test_plan_entry_that_matches_nothing_names_the_modules():
    plan = TensorPlan.of({"blocks.*.mlp.fc1": "colwise"}, "tensor")
    with pytest.raises(ValueError, match=r"px.TensorParallel: the tensor-parallel plan for mesh "
                       r"axis 'tensor' has entries that match no module: \['blocks.\*.mlp.fc1'\]. "
                       r"The model's modules are \['blocks', 'blocks.0', 'blocks.0.attn', "):
        plan(abstract_lm())


def test_style_on_the_wrong_layer_says_what_it_applies_to():
    plan = TensorPlan.of({"blocks.*.ln1": "colwise"}, "tensor")
    with pytest.raises(ValueError, match=r"the plan gives blocks.0.ln1 the style 'colwise', but it "
                       r"is an nnx.LayerNorm; 'colwise' applies to nnx.Linear, nnx.LinearGeneral, "
                       r"nnx.Einsum"):
        plan(abstract_lm())


def test_tensor_parallel_that_finds_nothing_to_split():
    mesh = px.make_mesh(**MESH_AXES)
    with pytest.raises(ValueError, match=r"px.init: TensorParallel\('tensor'\) finds nothing to "
                       r"split over the mesh axis tensor=4: no parameter is named 'heads', 'mlp' "
                       r"or 'vocab'. The model's parameters are \[.*'blocks'\]\[0\]\['attn'\].*"
                       r"Fix: annotate them .*or give a plan"):
        px.init(lambda: px.TrainState.create(LM(rngs=nnx.Rngs(0)), optax.sgd(0.1)),
                mesh, px.TensorParallel("tensor"))


def test_einsum_and_linear_general_styles():
    model = nnx.eval_shape(lambda: nnx.Sequential(
        nnx.Einsum("btd,dhk->bthk", (16, 4, 8), (4, 8), rngs=nnx.Rngs(0)),
        nnx.LinearGeneral((4, 8), 16, axis=(-2, -1), rngs=nnx.Rngs(0))))
    names = TensorPlan.of({"layers.0": "colwise", "layers.1": "rowwise"}, "tensor")(model)
    assert names["layers.0.kernel"] == (None, "mlp", None)
    assert names["layers.0.bias"] == ("mlp", None)
    assert names["layers.1.kernel"] == ("mlp", None, None)
    assert "layers.1.bias" not in names


def test_a_plan_needs_a_module():
    mesh = px.make_mesh(tensor=8)
    with pytest.raises(TypeError, match=r"a tensor-parallel plan reads the model's layers, so it "
                       r"needs an NNX model"):
        px.shard({"w": jax.numpy.ones((8, 8))}, mesh, px.TensorParallel(plan=LM_PLAN))
