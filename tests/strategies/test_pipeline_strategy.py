"""``px.Pipeline``: the GPT pipelined inside ``px.train_step``, alone and in 3D parallelism."""

import functools
import re

import fixtures as fx
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import parallax as px
from parallax import layout
from parallax.analysis import hlo
from parallax.models.gpt_pipeline import next_token_stages
from parallax.strategies.pipeline import Pipeline
from pipeline.runtime_testing import LOSS, Toy, toy_batch


@pytest.mark.slow
def test_the_gpt_stages_are_the_gpt_loss():
    model = px.models.GPT(fx.GPT_CONFIG, rngs=nnx.Rngs(0))
    batch = fx.gpt_batches(1, batch=4)[0]
    both = nnx.jit(lambda m, b: (nnx.value_and_grad(px.models.next_token_loss)(m, b),
                                 nnx.value_and_grad(next_token_stages)(m, b)))  # one compile
    (ref_loss, ref_grads), (loss, grads) = both(model, batch)
    assert px.testing.relative_difference(loss, ref_loss) <= 1e-6
    assert px.testing.relative_difference(grads, ref_grads) <= 1e-6


def test_the_strategy_is_a_rule_and_a_producer():
    s = Pipeline("stage", microbatches=4, schedule="interleaved_1f1b", virtual_stages=2)
    assert s.rules == (("layers", "stage"),) and s.microbatches == 4 and s.batch_axes == ()
    assert s.name == ("Pipeline('stage', microbatches=4, schedule='interleaved_1f1b', "
                      "virtual_stages=2)")
    composed = px.compose(px.DataParallel("data"), px.TensorParallel("tensor"), s)
    assert composed.batch_axes == ("data",) and composed.grad_fn is s.grad_fn
    assert dict(composed.rules)["layers"] == "stage" and dict(composed.rules)["mlp"] == "tensor"
    with pytest.raises(ValueError, match=re.escape("both decide how gradients are produced")):
        px.compose(s, px.GradientAccumulation(2))


@pytest.fixture(scope="module")
def pp_state():
    mesh = px.make_mesh(stage=2, devices=jax.devices()[:2])
    strategy = Pipeline("stage", microbatches=2)
    return mesh, strategy, px.init(fx.gpt_state, mesh, strategy)


def test_the_stacked_blocks_are_laid_out_over_stages(pp_state):
    mesh, _, state = pp_state
    kernel = state.params["blocks"]["mlp"]["fc"]["kernel"]
    assert kernel.sharding.spec[0] == "stage"
    assert kernel.addressable_shards[0].data.shape[0] == fx.GPT_CONFIG.num_layers // 2
    assert state.params["wte"].sharding.is_fully_replicated


def _step(mesh, strategy, loss_fn, **kwargs):
    @px.train_step(mesh, strategy, donate=False)
    def step(state, batch):
        loss, grads = px.value_and_grad(loss_fn, **kwargs)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    return step


def test_the_loss_must_be_stages(pp_state):
    mesh, strategy, state = pp_state
    batch = fx.gpt_batches(1, batch=4)[0]
    with pytest.raises(TypeError, match=re.escape(
            "px.Pipeline: the loss given to px.value_and_grad must be a "
            "px.pipeline.Stages(first, stage, last, layers), so the pipeline can place its "
            "pieces on the stages; got next_token_loss. For the GPT use "
            "parallax.models.gpt_pipeline.next_token_stages.")):
        _step(mesh, strategy, px.models.next_token_loss).lower(state, batch)
    with pytest.raises(ValueError, match=re.escape(
            "px.Pipeline: a pipelined loss takes (model, batch) and returns the loss only; "
            "got has_aux=True")):
        _step(mesh, strategy, next_token_stages, has_aux=True).lower(state, batch)
    with pytest.raises(ValueError, match=re.escape(
            "px.value_and_grad: microbatches=2 was given, but the strategy Pipeline('stage', "
            "microbatches=2, schedule='1f1b') already decides how gradients are produced")):
        _step(mesh, strategy, next_token_stages, microbatches=2).lower(state, batch)


def test_the_batch_must_split_into_microbatches(pp_state):
    mesh, strategy, state = pp_state
    batch = {"tokens": np.zeros((3, fx.GPT_CONFIG.max_seq_len + 1), np.int32)}
    with pytest.raises(ValueError, match=re.escape(
            "px.value_and_grad: microbatches=2 does not divide the batch: leaf ['tokens'] has "
            "3 examples; use a batch size that is a multiple of 2")):
        _step(mesh, strategy, next_token_stages).lower(state, batch)


@pytest.mark.slow
def test_3d_parallel_gpt_matches_one_device():
    """DP 2 x TP 2 x PP 2 (1F1B): 5 momentum-SGD steps equal the single-device run."""
    make, _, data, _, ref = fx.reference("gpt")
    mesh = px.make_mesh(stage=2, data=2, tensor=2)
    strategy = px.compose(px.DataParallel("data"), px.TensorParallel("tensor"),
                          Pipeline("stage", microbatches=2, schedule="1f1b"))
    run = px.testing.train(make, next_token_stages, data, mesh=mesh, strategy=strategy)
    assert len(run.losses) == fx.STEPS
    px.testing.assert_equivalent(run, ref, rtol=1e-5)


def make_gpt4():
    config = px.models.GPTConfig.tiny(num_layers=4)
    return px.TrainState.create(px.models.GPT(config, rngs=nnx.Rngs(1)), fx.GPT_TX)


@functools.cache
def gpt4_reference():
    """A 4-layer GPT on one device, 5 momentum-SGD steps (two chunks per stage on 2 stages)."""
    data = fx.gpt_batches(fx.STEPS, batch=8)
    return data, px.testing.train(make_gpt4, px.models.next_token_loss, data)


@pytest.mark.slow
def test_fsdp_tensor_and_interleaved_pipeline_gpt_matches_one_device():
    """ZeRO 3 x TP x interleaved 1F1B on a 4-layer GPT (2 chunks per stage), 5 steps."""
    data, ref = gpt4_reference()
    mesh = px.make_mesh(stage=2, fsdp=2, tensor=2)
    strategy = px.compose(px.FSDP("fsdp"), px.TensorParallel("tensor"),
                          Pipeline("stage", microbatches=2, schedule="interleaved_1f1b",
                                   virtual_stages=2, remat="always"))
    run = px.testing.train(make_gpt4, next_token_stages, data, mesh=mesh, strategy=strategy)
    px.testing.assert_equivalent(run, ref, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zbv", "dualpipev"])
def test_v_shaped_zero_bubble_schedules_train_the_gpt_like_one_device(schedule):
    """ZB-V and DualPipeV (two chunks per stage in the V placement, B and W split) on a
    4-layer GPT over 2 stages, 4 micro-batches: 5 steps equal the one-device run."""
    data, ref = gpt4_reference()
    mesh = px.make_mesh(stage=2, devices=jax.devices()[:2])
    strategy = Pipeline("stage", microbatches=4, schedule=schedule, remat="never")
    run = px.testing.train(make_gpt4, next_token_stages, data, mesh=mesh, strategy=strategy)
    px.testing.assert_equivalent(run, ref, rtol=1e-5)


@pytest.mark.slow
def test_uneven_stages_from_a_partition_train_like_one_device():
    """Layers [3, 2, 2, 1] over 4 stages (torchgpipe's balance, or a px.pipeline.Partition):
    5 steps equal one device."""
    def make():  # a step small enough for the toy's 8 layers to train, not to blow up
        return px.TrainState.create(Toy(layers=8), optax.sgd(0.01, momentum=0.9))

    data = [toy_batch(16, seed=s) for s in range(fx.STEPS)]
    ref = px.testing.train(make, LOSS, data)
    split = px.pipeline.Partition.from_boundaries([1.0] * 8, (0, 3, 5, 7, 8))
    assert split.layers_per_stage == (3, 2, 2, 1)
    mesh = px.make_mesh(stage=4, devices=jax.devices()[:4])
    strategy = Pipeline("stage", microbatches=4, schedule="1f1b", balance=split)
    run = px.testing.train(make, LOSS, data, mesh=mesh, strategy=strategy)
    px.testing.assert_equivalent(run, ref, rtol=1e-5)


@pytest.mark.slow
def test_zero3_parameters_are_gathered_once_per_step_not_per_microbatch():
    """ZeRO 3 x PP (explicit style): one all-gather per parameter, outside the tick loop,
    whatever the number of micro-batches (the gather runs before the pipeline, once per
    step, on each stage's own layers)."""
    mesh = px.make_mesh(stage=2, fsdp=2, devices=jax.devices()[:4])
    state = jax.eval_shape(lambda: px.TrainState.create(Toy(), fx.GPT_TX))
    gathers = {}
    for m in (2, 4):
        strategy = px.compose(px.ZeRO(3, "fsdp"), Pipeline("stage", microbatches=m))
        program = _step(mesh, strategy, LOSS).lower(state, toy_batch(16)).compile()
        found = [c for c in hlo.collectives(program, mesh) if c.kind == "all-gather"]
        assert all(c.axes == ("fsdp",) and c.count == 1 and c.in_entry for c in found)
        gathers[m] = len(found)
    assert gathers == {2: 3, 4: 3}  # w_in, the stacked blocks, w_out: once each


@pytest.mark.slow
def test_zero2_pipeline_gpt_matches_one_device_with_gradients_and_momenta_over_fsdp():
    """ZeRO 2 x PP 2 (1F1B): 5 steps equal one device, and ZeRO 2's layout holds."""
    make, _, data, _, ref = fx.reference("gpt")
    mesh = px.make_mesh(stage=2, fsdp=2, devices=jax.devices()[:4])
    strategy = px.compose(px.ZeRO(2, "fsdp"), Pipeline("stage", microbatches=2, schedule="1f1b"))

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(next_token_stages)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss, "grads": grads}

    state, losses, grads = px.init(make, mesh, strategy), [], []
    for batch in data:  # px.testing.train, keeping the gradients on the devices
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        grads.append(metrics["grads"])
    run = px.testing.Trajectory(losses, jax.device_get(grads[0]), jax.device_get(state.params),
                                state)
    px.testing.assert_equivalent(run, ref, rtol=1e-5)

    # ZeRO 2: gradients and optimizer state sharded over fsdp, parameters not; the stacked
    # blocks stay split over the stages (ZeRO picks another dimension than "layers")
    lays = layout.state_layout(state, strategy, mesh, "test")
    assert all(lay.shard_dim is not None for lay in lays.params)  # every leaf can shard
    for g, lay in zip(jax.tree.leaves(grads[-1]), lays.params, strict=True):
        want = NamedSharding(mesh, lay.spec("grad"))
        assert g.sharding.is_equivalent_to(want, g.ndim), (lay.path, g.sharding.spec)
    for leaf, spec, role in zip(jax.tree.leaves(state), lays.specs, lays.roles, strict=True):
        assert leaf.sharding.spec == spec, role
        assert ("fsdp" in jax.tree.leaves(tuple(spec))) == (role == "opt"), role
    assert lays.roles.count("opt") == lays.roles.count("param")  # one momentum per parameter
    kernel = state.opt_state[0].trace["blocks"]["mlp"]["fc"]["kernel"]
    assert kernel.sharding.spec[0] == "stage" and "fsdp" in kernel.sharding.spec


def test_optax_state_follows_the_stage_layout(pp_state):
    _, _, state = pp_state
    momentum = state.opt_state[0].trace["blocks"]["mlp"]["fc"]["kernel"]
    assert momentum.sharding.spec[0] == "stage"


def test_gspmd_style_data_parallelism_is_refused():
    mesh = px.make_mesh(stage=2, data=2, devices=jax.devices()[:4])
    strategy = px.compose(px.DataParallel("data", style="gspmd"), Pipeline("stage", microbatches=2))
    state = jax.eval_shape(fx.gpt_state)  # abstract: the error comes while tracing
    with pytest.raises(ValueError, match=re.escape(
            "px.Pipeline: the batch axes ('data',) of DataParallel('data') + "
            "Pipeline('stage', microbatches=2, schedule='1f1b') are left to GSPMD "
            "(style='gspmd')")):
        _step(mesh, strategy, next_token_stages).lower(state, fx.gpt_batches(1, batch=4)[0])


@pytest.mark.parametrize("kwargs,message", [
    (dict(microbatches=2, schedule="interleaved_1f1b", virtual_stages=2),
     "px.Pipeline: the model's 2 stacked layers do not split into stages=2 (mesh axis 'stage') "
     "x virtual_stages=2 = 4 equal chunks; use a multiple of 4 layers (e.g. 4), stages and "
     "virtual_stages whose product divides 2, or balance= to give each stage its own number of "
     "layers"),
    (dict(microbatches=1, schedule="interleaved_1f1b", virtual_stages=2),
     "px.Pipeline on mesh axis 'stage' of size 2: schedule: interleaved with too few "
     "micro-batches: 1 for 2 stages"),
])
def test_bad_pipelines_of_the_gpt(kwargs, message):
    mesh = px.make_mesh(stage=2, devices=jax.devices()[:2])
    strategy = Pipeline("stage", **kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        _step(mesh, strategy, next_token_stages).lower(
            jax.eval_shape(fx.gpt_state), fx.gpt_batches(1, batch=4)[0])
