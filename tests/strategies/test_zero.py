"""ZeRO's promises, checked in the arrays and in the compiled program."""

import fixtures as fx
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import parallax as px
from parallax import layout
from parallax.analysis import hlo
from parallax.planner.predicted import zero as zero_memory

SHARDS = 8


def step_for(mesh, strategy):
    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss, "grads": grads}

    return step


@pytest.fixture(scope="module", params=[0, 1, 2, 3])
def zero_run(request):
    stage = request.param
    mesh = px.make_mesh(fsdp=SHARDS)
    strategy = px.ZeRO(stage, "fsdp") if stage else px.DataParallel("fsdp")
    state = px.init(fx.mlp_state, mesh, strategy)
    batch = fx.mlp_batches(steps=1)[0]
    step = step_for(mesh, strategy)
    compiled = step.lower(state, batch).compile()
    initial = jax.tree.map(lambda x: x.sharding.spec, state)
    new_state, metrics = step(state, batch)
    return stage, mesh, strategy, initial, new_state, metrics, compiled, batch


def expected_spec(lay, role, stage):
    sharded = {"param": stage >= 3, "opt": stage >= 1, "grad": stage >= 2}[role]
    return lay.spec(sharded, "fsdp")


def num_params(state):
    return sum(x.size for x in jax.tree.leaves(state.params))


def test_every_leaf_has_the_sharding_its_stage_promises(zero_run):
    stage, mesh, strategy, initial, new_state, metrics, _, _ = zero_run
    lays = layout.state_layout(new_state, strategy, mesh, "test")
    for when in (jax.tree.leaves(initial), [x.sharding.spec for x in jax.tree.leaves(new_state)]):
        for spec, want, role in zip(when, lays.specs, lays.roles):
            assert spec == want, role
    by_role = {"param": [], "opt": []}
    for leaf, role in zip(jax.tree.leaves(new_state), lays.roles):
        if role in by_role:
            by_role[role].append("fsdp" in str(leaf.sharding.spec))
    assert all(by_role["param"]) == (stage >= 3) and any(by_role["param"]) == (stage >= 3)
    assert all(by_role["opt"]) == (stage >= 1) and any(by_role["opt"]) == (stage >= 1)
    grads = jax.tree.leaves(metrics["grads"])
    assert all(("fsdp" in str(g.sharding.spec)) == (stage >= 2) for g in grads)


def test_state_bytes_per_device_match_the_zero_formula(zero_run):
    stage, _, _, _, new_state, _, compiled, batch = zero_run
    predicted = zero_memory.zero_state_bytes(num_params(new_state), stage, SHARDS)
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(new_state))
    assert abs(held - predicted) <= 0.05 * predicted
    batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batch)) / SHARDS
    arguments = hlo.memory(compiled).argument_bytes - batch_bytes
    assert abs(arguments - predicted) <= 0.05 * predicted


def test_collectives_follow_the_stage(zero_run):
    stage, mesh, _, _, new_state, _, compiled, _ = zero_run
    found = hlo.collectives(compiled, mesh)
    grad_bytes = 4 * num_params(new_state)
    reduce_scatter = hlo.total_bytes(found, "reduce-scatter", "fsdp")
    all_gather = hlo.total_bytes(found, "all-gather", "fsdp")
    all_reduce = hlo.total_bytes(found, "all-reduce", "fsdp")
    if stage <= 1:
        # Gradients are all-reduced once per step (plus the 4-byte loss).
        assert all_reduce == grad_bytes + 4 and reduce_scatter == 0
    else:
        assert reduce_scatter == grad_bytes and all_reduce == 4
    # Stage 1 and 2 gather the updated parameter slices; stage 3 gathers parameters before
    # the forward pass (once: the backward reuses them); stage 0 gathers nothing.
    assert all_gather == (0 if stage == 0 else grad_bytes)
    assert hlo.count(found, "all-gather", "fsdp") == (0 if stage == 0 else len(jax.tree.leaves(new_state.params)))


def test_hsdp_moves_only_the_owned_slice_across_data():
    mesh = px.make_mesh(data=2, fsdp=4)
    strategy = px.HSDP()
    state = px.init(fx.mlp_state, mesh, strategy)
    found = hlo.collectives(step_for(mesh, strategy).lower(state, fx.mlp_batches(1)[0]), mesh)
    grad_bytes = 4 * num_params(state)
    assert hlo.total_bytes(found, "reduce-scatter", "fsdp") == grad_bytes
    assert hlo.total_bytes(found, "all-reduce", "data") == grad_bytes // 4


@pytest.mark.slow
def test_gpt_state_is_created_sharded_and_matches_the_formula():
    mesh = px.make_mesh(fsdp=SHARDS)
    make = lambda: px.TrainState.create(px.models.GPT(fx.GPT_CONFIG, rngs=nnx.Rngs(0)), optax.adam(1e-3))
    state = px.init(make, mesh, px.FSDP("fsdp"))
    n = num_params(state)
    assert n == px.models.param_count(fx.GPT_CONFIG)
    held = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
    predicted = zero_memory.zero_state_bytes(n, 3, SHARDS)
    assert abs(held - predicted) <= 0.05 * predicted
    # Stacked layers keep their layer axis whole: ZeRO shards another dimension.
    kernel = state.params["blocks"]["mlp"]["fc"]["kernel"][...]
    assert kernel.sharding.spec[0] is None and "fsdp" in kernel.sharding.spec


def test_unannotated_tree_is_sharded_by_shape():
    mesh = px.make_mesh(fsdp=SHARDS)
    params, _ = px.init(fx.functional_mlp_state, mesh, px.FSDP("fsdp"))
    assert params["w1"].sharding.spec == P(None, "fsdp")   # the largest divisible dimension
    assert params["w2"].sharding.spec == P("fsdp")
    small = px.shard({"b": np.ones(6, np.float32)}, mesh, px.FSDP("fsdp"))
    assert small["b"].sharding.spec == P()                  # 6 is not divisible by 8: replicated
