"""Every bad input parallax guards against, each with the message it pins.

One table, one row per careless mistake, across meshes, strategies, steps, the new
mutable-state and tensor-plan APIs, comm, nn, models, pipelines, and the distributed APIs
(px.distributed, parallax.horovod, px.tf, px.ps, px.checkpoint). A row is
``(area, what, call, error type, regex of the message)``; ``call`` takes a temporary
directory. The test ids count the rows (``017/101 ...``), so the number of guarded inputs
is in the output of every run. Most rows compile nothing: the check runs before (or
instead of) any XLA work; the few that need a compiled step share one tiny program.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
import parallax.horovod as hvd
from parallax import comm
from parallax.planner.predicted import zero as zero_memory
from parallax.strategies.tensor_plan import TensorPlan

MESH = px.make_mesh(data=8)
DP = px.DataParallel()
BATCH = {"x": np.ones((8, 4), np.float32), "y": np.zeros((8, 2), np.float32)}


# --- helpers: tiny states and steps -------------------------------------------------------

def dict_state():
    return {"w": jnp.ones((4, 2))}


def dict_loss(state, batch):
    return jnp.mean((batch["x"] @ state["w"] - batch["y"]) ** 2)


def sgd_step(mesh=MESH, strategy=DP, loss=dict_loss, donate=True, **options):
    @px.train_step(mesh, strategy, donate=donate)
    def step(state, batch):
        value, grads = px.value_and_grad(loss, **options)(state, batch)
        return jax.tree.map(lambda w, g: w - 0.1 * g, state, grads), {"loss": value}

    return step


def rank_changed(_):
    step = sgd_step(donate=False)
    step(dict_state(), BATCH)
    step(dict_state(), {"x": np.ones((8, 4, 1), np.float32), "y": BATCH["y"]})


def donated_twice(_):
    step = sgd_step()
    state = px.shard(dict_state(), MESH, DP)
    step(state, BATCH)
    step(state, BATCH)  # reusing donated buffers crashed simulated devices with SIGSEGV


def donated_train_state(_):
    state = px.shard(px.TrainState.create(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), optax.sgd(0.1)),
                     MESH, DP)

    @px.train_step(MESH, DP)
    def step(state, batch):
        return state.replace(step=state.step + 1), {}

    step(state, BATCH)
    step(state, BATCH)


def on_another_mesh(_):
    four = px.make_mesh(data=4, devices=jax.devices()[:4])
    sgd_step()(px.shard(dict_state(), four, DP), BATCH)


def step_returning(out):
    @px.train_step(MESH, DP, donate=False)
    def step(state, batch):
        return out(state)

    return lambda _: step(dict_state(), BATCH)


def with_finite_check(batch, loss_fn=dict_loss):
    def call(_):
        @px.train_step(MESH, DP, check_finite=True, donate=False)
        def step(state, batch):
            loss, grads = px.value_and_grad(loss_fn)(state, batch)
            return state, {"loss": loss}

        step(dict_state(), batch)

    return call


def gpt_with_ids(_):
    config = px.models.GPTConfig.tiny(num_layers=1, embed_dim=16, num_heads=2, mlp_dim=32,
                                      max_seq_len=8, vocab_size=32)
    mesh = px.make_mesh(data=2, devices=jax.devices()[:2])
    state = px.shard(px.TrainState.create(px.models.GPT(config, rngs=nnx.Rngs(0)),
                                          optax.sgd(0.1)), mesh, DP)

    @px.train_step(mesh, DP, check_finite=True)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.next_token_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    tokens = np.arange(18, dtype=np.int32).reshape(2, 9) * 3  # ids up to 51 >= 32
    step(state, {"tokens": tokens})


class Stateful(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(4, 2, rngs=rngs)
        self.bn = nnx.BatchNorm(2, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.drop(self.bn(self.lin(x)))


def stateful_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def stateful_step(strategy=DP, rngs=None, mesh=MESH, **options):
    def call(_):
        model = Stateful(rngs or nnx.Rngs(0))
        state = px.shard(px.TrainState.create(model, optax.sgd(0.1)), mesh, strategy)

        @px.train_step(mesh, strategy)
        def step(state, batch):
            loss, grads = px.value_and_grad(stateful_loss, **options)(state.model, batch)
            return state.apply_gradients(grads), {"loss": loss}

        step.lower(state, BATCH)

    return call


class PipelinedWithBatchNorm(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(4, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.stack = nnx.Param(jnp.zeros((2, 4, 4)))


PIPELINED = px.pipeline.Stages(
    first=lambda m, b: m.bn(m.inp(b["x"])),
    stage=lambda w, x: jnp.tanh(x @ w) + x,
    last=lambda m, x, b: jnp.mean((x[:, :2] - b["y"]) ** 2),
    layers=lambda m: m.stack[...],
)


def pipelined_batch_norm(_):
    mesh = px.make_mesh(stage=2, data=4)
    strategy = px.compose(DP, px.Pipeline("stage", microbatches=2))
    state = px.shard(px.TrainState.create(PipelinedWithBatchNorm(nnx.Rngs(0)), optax.sgd(0.1)),
                     mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(PIPELINED)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    step.lower(state, BATCH)


def rebuilding(request, params, batch):
    loss, grads = jax.value_and_grad(lambda p: stateful_loss(request.rebuild(p), batch))(params)
    return (loss, None), grads


def without_partitionable_threefry(call):
    def run(tmp):
        with jax.threefry_partitionable(False):
            call(tmp)

    return run


def varying_int_aux(_):
    def counts(state, batch):
        return dict_loss(state, batch), {"positive": jnp.sum(batch["x"] > 0)}

    sgd_step(loss=counts, has_aux=True).lower(dict_state(), BATCH)


def abstract(make):
    return nnx.eval_shape(make)


def in_shard_map(fn, mesh=None):
    mesh = mesh or px.make_mesh(data=2, tensor=4)
    return jax.make_jaxpr(jax.shard_map(fn, mesh=mesh, in_specs=jax.P("data", "tensor"),
                                        out_specs=jax.P("data", "tensor")))(jnp.ones((2, 8)))


def tiny_mlp():
    return px.models.MLP(4, [8], 2, rngs=nnx.Rngs(0))


def stock_mlp():
    return nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 2, rngs=nnx.Rngs(0)))


GPT_CONFIG = px.models.GPTConfig.tiny(num_layers=1)


def tf_strategy():
    return px.tf.MirroredStrategy(devices=[0, 1])


def ps_worker_strategy():
    """A parameter-server strategy as a scheduled function sees it (no servers needed)."""
    from parallax.tf.parameter_server.replica_api import WorkerStrategy

    return WorkerStrategy(num_workers=1, num_ps=1)


# --- the table ----------------------------------------------------------------------------

T, V = TypeError, ValueError
CASES = [
    # meshes
    ("mesh", "sizes that do not multiply to the device count",
     lambda _: px.make_mesh(data=3, fsdp=4), V,
     r"make_mesh: the axis sizes multiply to 12 \(data=3 x fsdp=4\) but there are 8 devices"),
    ("mesh", "two axes of -1", lambda _: px.make_mesh(data=-1, tensor=-1), V,
     r"make_mesh: at most one axis may be -1"),
    ("mesh", "-1 that cannot be filled", lambda _: px.make_mesh(data=-1, tensor=3), V,
     r"cannot fill data=-1: the other axes multiply to 3"),
    ("mesh", "an unknown axis name", lambda _: px.make_mesh(model=8), V,
     r"make_mesh: unknown mesh axis 'model'; the axes are stage, data, fsdp, expert, context, sequence, tensor"),
    ("mesh", "a float size", lambda _: px.make_mesh(data=2.0), T, r"axis data=2.0 must be an int"),
    ("mesh", "a zero size", lambda _: px.make_mesh(data=0), V,
     r"axis data=0 must be a positive size or -1"),
    ("mesh", "an unknown axis type", lambda _: px.make_mesh(data=8, axis_types="manual"), V,
     r"axis_types='manual' is not one of"),
    ("mesh", "slices that do not divide the devices",
     lambda _: px.make_hybrid_mesh(ici={"tensor": -1}, dcn={"data": 3}), V,
     r"8 devices do not split into 3 equal slices"),
    ("mesh", "a -1 across slices", lambda _: px.make_hybrid_mesh(ici={"tensor": 2},
                                                                 dcn={"data": -1}), V,
     r"dcn sizes must be explicit"),
    # strategies
    ("strategy", "a logical axis mapped two ways",
     lambda _: px.compose(px.TensorParallel("tensor"),
                          px.Strategy(name="Custom()", rules=(("mlp", "fsdp"),))), V,
     r"px.compose: conflicting rules for logical axis 'mlp'"),
    ("strategy", "a mesh axis that splits the batch twice",
     lambda _: px.compose(px.DataParallel("data"), px.ZeRO(1, "data")), V,
     r"mesh axis 'data' splits the batch in both DataParallel\('data'\) and ZeRO\(1, 'data'\)"),
    ("strategy", "one mesh axis for the batch and for a rule",
     lambda _: px.compose(px.DataParallel("tensor"), px.TensorParallel("tensor")), V,
     r"mesh axis 'tensor' splits the batch in DataParallel\('tensor'\) and shards logical"),
    ("strategy", "two ZeRO strategies", lambda _: px.compose(px.ZeRO(1, "data"), px.FSDP()), V,
     r"two ZeRO strategies"),
    ("strategy", "two gradient producers",
     lambda _: px.compose(px.GradientAccumulation(2), px.GradientAccumulation(4)), V,
     r"both decide how gradients are produced"),
    ("strategy", "two sync styles",
     lambda _: px.compose(px.DataParallel(style="gspmd"), px.ZeRO(2, style="explicit")), V,
     r"different sync styles \['explicit', 'gspmd'\]"),
    ("strategy", "composing a string", lambda _: px.compose(px.DataParallel(), "fsdp"), T,
     r"px.compose: expected Strategy values"),
    ("strategy", "ZeRO stage 4", lambda _: px.ZeRO(4), V, r"px.ZeRO: stage=4 must be 1"),
    ("strategy", "an unknown style", lambda _: px.DataParallel(style="auto"), V,
     r"px.DataParallel: style='auto' must be one of"),
    ("strategy", "zero micro-batches", lambda _: px.GradientAccumulation(0), V,
     r"px.GradientAccumulation: microbatches=0 must be a positive int"),
    ("strategy", "a sync that is not callable", lambda _: px.DataParallel(sync="buckets"), T,
     r"px.DataParallel: sync must be callable as sync\(grads, axes\) -> grads"),
    ("strategy", "a sync with the gspmd style",
     lambda _: px.DataParallel(style="gspmd", sync=px.BucketedSync()), V,
     r"sync= replaces the explicit style's all-reduce, but style='gspmd'"),
    ("strategy", "a negative bucket size", lambda _: px.BucketedSync(bucket_bytes=-1), V,
     r"px.BucketedSync: bucket_bytes=-1 must be an int >= 0"),
    ("strategy", "a strategy axis the mesh lacks", lambda _: px.train_step(MESH, px.FSDP()), V,
     r"px.train_step: the strategy ZeRO\(3, 'fsdp'\) uses mesh axis 'fsdp', but the mesh is "
     r"data=8 \(8 cpu devices\); add fsdp=N \(or fsdp=1\) to px.make_mesh"),
    ("strategy", "a pipeline's micro-batches as a bool",
     lambda _: px.Pipeline("stage", microbatches=True), T,
     r"px.Pipeline: microbatches must be an int, got True"),
    ("strategy", "an unknown pipeline schedule",
     lambda _: px.Pipeline("stage", microbatches=4, schedule="nope"), V,
     r"px.Pipeline: unknown schedule 'nope'"),
    # tensor-parallel plans
    ("plan", "a plan that is a list", lambda _: px.TensorParallel(plan=["colwise"]), T,
     r"px.TensorParallel: plan must be a non-empty dict of module-path patterns to styles"),
    ("plan", "an unknown preset", lambda _: px.TensorParallel(plan="megatron"), V,
     r"px.TensorParallel: plan='megatron' is not a preset \(\('transformer',\)\)"),
    ("plan", "an unknown style", lambda _: px.TensorParallel(plan={"mlp": "columnwise"}), V,
     r"plan entry 'mlp': 'columnwise' must map a string pattern to one of"),
    ("plan", "an entry that matches no module",
     lambda _: TensorPlan.of({"mlp.fc9": "colwise"}, "tensor")(abstract(stock_mlp)), V,
     r"the tensor-parallel plan for mesh axis 'tensor' has entries that match no module: "
     r"\['mlp.fc9'\]. The model's modules are \['layers', 'layers.0', 'layers.1'\]"),
    ("plan", "a style on a layer it does not fit",
     lambda _: TensorPlan.of({"layers.0": "attention"}, "tensor")(abstract(stock_mlp)), V,
     r"the plan gives layers.0 the style 'attention', but it is an nnx.Linear; 'attention' "
     r"applies to nnx.MultiHeadAttention"),
    ("plan", "TensorParallel that finds nothing to split",
     lambda _: px.shard(px.TrainState.create(nnx.Linear(4, 8, rngs=nnx.Rngs(0)),
                                             optax.sgd(0.1)), px.make_mesh(tensor=8),
                        px.TensorParallel()), V,
     r"px.shard: TensorParallel\('tensor'\) finds nothing to split over the mesh axis "
     r"tensor=8: .*\['bias'\].*Fix: annotate them .*or give a plan"),
    ("plan", "a plan for a plain parameter tree",
     lambda _: px.shard({"w": jnp.ones((8, 8))}, px.make_mesh(tensor=8),
                        px.TensorParallel(plan={"w": "colwise"})), T,
     r"a tensor-parallel plan reads the model's layers, so it needs an NNX model"),
    # steps: init, shard, train_step
    ("step", "a mesh that is a dict", lambda _: px.train_step({"data": 8}, DP), T,
     r"px.train_step: mesh must be a jax.sharding.Mesh"),
    ("step", "a strategy that is a string", lambda _: px.init(dict_state, MESH, "dp"), T,
     r"px.init: strategy must be a px.Strategy"),
    ("step", "decorating something that is not a function", lambda _: px.train_step(MESH, DP)(42),
     T, r"px.train_step: decorate a function step\(state, batch, \*args\) -> \(state, metrics\); "
     r"got int: 42"),
    ("step", "px.init given a state instead of a function",
     lambda _: px.init(dict_state(), MESH, DP), T,
     r"px.init: the first argument must be a function of no arguments .*got a dict. To place a "
     r"state that already exists, use px.shard"),
    ("step", "an init function with a required argument",
     lambda _: px.init(lambda seed: dict_state(), MESH, DP), T,
     r"px.init: the init function '<lambda>' takes the required arguments \['seed'\]"),
    ("step", "an init function that returns None", lambda _: px.init(lambda: None, MESH, DP), T,
     r"px.init: the init function returned None, which holds no arrays"),
    ("step", "an init function that returns a string",
     lambda _: px.init(lambda: {"w": "weights"}, MESH, DP), T,
     r"px.init: the init function returned a str at \['w'\]; the state must be a pytree of"),
    ("step", "a batch leaf that is a string",
     lambda _: sgd_step()(px.shard(dict_state(), MESH, DP), {"x": BATCH["x"], "y": "labels"}), T,
     r"px.train_step: the batch leaf \['y'\] is a str, not an array"),
    ("step", "a batch leaf that is None",
     lambda _: sgd_step()(px.shard(dict_state(), MESH, DP), {"x": BATCH["x"], "y": None}), T,
     r"px.train_step: the batch leaf \['y'\] is a NoneType, not an array"),
    ("step", "a scalar batch leaf",
     lambda _: sgd_step()(px.shard(dict_state(), MESH, DP), {"x": jnp.float32(0.1)}), V,
     r"the batch leaf \['x'\] is a scalar; every batch leaf needs a leading batch dimension"),
    ("step", "batch leaves of different batch sizes",
     lambda _: sgd_step()(px.shard(dict_state(), MESH, DP),
                          {"x": BATCH["x"], "y": np.zeros((16, 2), np.float32)}), V,
     r"px.train_step: the batch leaves disagree on the batch size: \['x'\] has shape \(8, 4\) "
     r"and \['y'\] has shape \(16, 2\)"),
    ("step", "a batch the batch shards do not divide",
     lambda _: sgd_step()(px.shard(dict_state(), MESH, DP),
                          {"x": np.ones((12, 4), np.float32), "y": np.ones((12, 2))}), V,
     r"the batch leaf \['x'\] has shape \(12, 4\): its leading \(batch\) dimension 12 is not "
     r"divisible by the 8 batch shards \(data=8\)"),
    ("step", "a bare array where the step reads batch['x']",
     lambda _: sgd_step()(px.shard(dict_state(), MESH, DP), BATCH["x"]), T,
     r"px.train_step: the batch is a bare array of shape \(8, 4\), and the step indexes it by "
     r"name \(batch\['x'\]\); pass a dict of arrays"),
    ("step", "a batch leaf whose rank changed since the last call", rank_changed, V,
     r"px.train_step: the batch leaf \['x'\] has shape \(8, 4, 1\), rank 3, but had shape "
     r"\(8, 4\) \(rank 2\) in the last call that worked; the step failed with: dot_general"),
    ("step", "a state placed on another mesh", on_another_mesh, V,
     r"px.train_step: the state leaf \['w'\] lives on the mesh data=4 \(4 cpu devices\), but "
     r"this step runs on data=8 \(8 cpu devices\). Place the state for this mesh: px.shard"),
    ("step", "a donated state passed again (was SIGSEGV)", donated_twice, V,
     r"px.train_step: this state was donated to an earlier call \(donate=True, the default\): "
     r"its buffers are deleted.*donate=False"),
    ("step", "a donated px.TrainState passed again", donated_train_state, V,
     r"px.train_step: this state was donated to an earlier call"),
    ("step", "a step that returns the state alone", step_returning(lambda s: s), T,
     r"px.train_step: step must return \(state, metrics\); it returned dict"),
    ("step", "a step that changes the state's structure",
     step_returning(lambda s: ({"w": s["w"], "extra": s["w"]}, {})), T,
     r"the state returned by the step has a different structure"),
    # px.value_and_grad
    ("grad", "a loss that is not callable", lambda _: px.value_and_grad("mse"), T,
     r"px.value_and_grad: loss_fn must be callable as loss_fn\(model, batch\); got str"),
    ("grad", "a loss that returns a vector",
     lambda _: px.value_and_grad(lambda w, b: b["x"] @ w)(jnp.ones((4, 2)), BATCH), V,
     r"px.value_and_grad: <lambda> must return a scalar loss \(the mean over the batch's "
     r"examples\); it returned shape \(8, 2\)"),
    ("grad", "an integer loss",
     lambda _: px.value_and_grad(lambda w, b: jnp.sum(b["x"] > 0))(jnp.ones(2), BATCH), T,
     r"<lambda> must return a floating loss; it returned dtype int32"),
    ("grad", "has_aux=True with a bare loss",
     lambda _: px.value_and_grad(dict_loss, has_aux=True)(dict_state(), BATCH), T,
     r"with has_aux=True, dict_loss must return \(loss, aux\); it returned an array of shape \(\)"),
    ("grad", "(loss, aux) without has_aux",
     lambda _: px.value_and_grad(lambda s, b: (dict_loss(s, b), 1.0))(dict_state(), BATCH), T,
     r"<lambda> returned a tuple of 2; return the loss alone, or pass has_aux=True"),
    ("grad", "zero micro-batches", lambda _: px.value_and_grad(dict_loss, microbatches=0), V,
     r"px.value_and_grad: microbatches=0 must be a positive int \(1: no accumulation\)"),
    ("grad", "negative micro-batches", lambda _: px.value_and_grad(dict_loss, microbatches=-2),
     V, r"microbatches=-2 must be a positive int"),
    ("grad", "micro-batches that do not divide the batch",
     lambda _: px.value_and_grad(dict_loss, microbatches=3)(dict_state(), BATCH), V,
     r"microbatches=3 does not divide the batch: leaf \['x'\] has 8 examples"),
    ("grad", "micro-batches twice",
     lambda _: sgd_step(strategy=px.compose(DP, px.GradientAccumulation(2)),
                        microbatches=2).lower(dict_state(), BATCH), V,
     r"microbatches=2 was given, but the strategy .* already decides"),
    ("grad", "an unknown batch-statistics mode",
     lambda _: px.value_and_grad(dict_loss, batch_stats="sync"), V,
     r"px.value_and_grad: batch_stats='sync' must be one of \('global', 'per_replica', "
     r"'per_microbatch'\)"),
    ("grad", "an unknown RNG mode", lambda _: px.value_and_grad(dict_loss, rng="independent"), V,
     r"px.value_and_grad: rng='independent' must be one of \('global', 'per_shard'\)"),
    ("grad", "per-replica statistics in the gspmd style",
     stateful_step(px.DataParallel(style="gspmd"), batch_stats="per_replica"), V,
     r"batch_stats='per_replica' computes statistics on each batch shard, which the gspmd "
     r"style does not see"),
    ("grad", "an integer aux value that differs between shards", varying_int_aux, V,
     r"the auxiliary value \['positive'\] \(int32\[\]\) differs between batch shards "
     r"\('data',\)"),
    ("grad", "an integer aux value that depends on the micro-batch",
     lambda _: px.value_and_grad(lambda w, b: (jnp.mean(b["x"] @ w), jnp.sum(b["x"] > 0)),
                                 has_aux=True, microbatches=2)(jnp.ones(4), BATCH), V,
     r"the auxiliary value \(the value itself\) is an integer, bool or key that depends on "
     r"the micro-batch"),
    ("grad", "a stateful model under a custom producer that rebuilds it from parameters",
     stateful_step(px.compose(DP, px.Strategy(name="Rebuilding()", grad_fn=rebuilding))), V,
     r"Rebuilding\(\) produces gradients by rebuilding the model from its parameters alone "
     r"\(GradRequest.rebuild\), which drops the module's non-parameter state: the model holds "
     r".*bn/mean.*return a parallax.grad.slice_loss.LocalResult as its aux, as px.Pipeline does"),
    ("grad", "whole-batch BatchNorm statistics under px.Pipeline", pipelined_batch_norm, V,
     r"px.Pipeline: batch_stats='global' asks for BatchNorm statistics over the whole batch "
     r"before the next layer runs.*pass batch_stats='per_microbatch' to px.value_and_grad"),
    ("grad", "an rbg key where one device's draws are wanted",
     stateful_step(rngs=nnx.Rngs(0, dropout=jax.random.key(1, impl="rbg"))), T,
     r"a rbg key cannot draw one device's values on a batch shard.*rng='per_shard'"),
    ("grad", "one device's draws without partitionable threefry",
     without_partitionable_threefry(stateful_step()), V,
     r"one device's random values on a batch shard need jax_threefry_partitionable"),
    ("finite", "NaN in the batch with check_finite",
     with_finite_check({"x": np.full((8, 4), np.nan, np.float32), "y": BATCH["y"]}), V,
     r"px.train_step\(check_finite=True\): batch \['x'\] is not finite"),
    ("finite", "a loss that is NaN with check_finite",
     with_finite_check(BATCH, lambda s, b: jnp.log(dict_loss(s, b) - 1e6)), V,
     r"px.train_step\(check_finite=True\): loss is not finite"),
    ("finite", "an infinite gradient with check_finite",
     with_finite_check(BATCH, lambda s, b: jnp.mean(jnp.sqrt(s["w"] * 0.0))), V,
     r"px.train_step\(check_finite=True\): gradient \['w'\] is not finite"),
    ("finite", "token ids outside the GPT's vocabulary with check_finite", gpt_with_ids, V,
     r"px.train_step\(check_finite=True\): GPT.embed: token ids within \[0, 32\) is not "
     r"finite \(or its check failed\)"),
    # analysis
    ("analysis", "ZeRO's formula over zero shards",
     lambda _: zero_memory.zero_state_bytes(10**6, 1, 0), V,
     r"zero_state_bytes: shards=0 must be a positive int"),
    ("analysis", "ZeRO stage 5", lambda _: zero_memory.zero_model_states_bytes(10**6, 5, 8), V,
     r"zero_model_states_bytes: stage=5 must be 0 \(no ZeRO\), 1, 2 or 3"),
    ("analysis", "a negative parameter count",
     lambda _: zero_memory.zero_gradient_bytes(-1, 2, 8), V,
     r"zero_gradient_bytes: num_params=-1 must be a non-negative number"),
    # models
    ("models", "a width the heads do not divide",
     lambda _: px.models.GPTConfig.tiny(embed_dim=100, num_heads=3), V,
     r"GPTConfig: embed_dim=100 is not divisible by num_heads=3"),
    ("models", "zero layers", lambda _: px.models.GPTConfig.tiny(num_layers=0), V,
     r"GPTConfig: num_layers must be a positive int, got 0"),
    ("models", "a config that is a dict",
     lambda _: px.models.GPT({"vocab_size": 8}, rngs=nnx.Rngs(0)), T,
     r"GPT: config must be a GPTConfig, got dict"),
    ("models", "float token ids",
     lambda _: abstract(lambda: px.models.GPT(GPT_CONFIG, rngs=nnx.Rngs(0))).embed(
         jnp.zeros((1, 4))), T, r"GPT.embed: tokens must be integer ids, got dtype float"),
    ("models", "a sequence longer than the positions",
     lambda _: abstract(lambda: px.models.GPT(GPT_CONFIG, rngs=nnx.Rngs(0))).embed(
         jnp.zeros((1, 65), jnp.int32)), V,
     r"GPT.embed: sequence length 65 exceeds max_seq_len=64"),
    ("models", "tokens without a next token",
     lambda _: px.models.next_token_loss(None, {"tokens": jnp.zeros((2, 1), jnp.int32)}), V,
     r"next_token_loss: batch\['tokens'\] must have shape \[batch, seq \+ 1\]"),
    ("models", "an MLP with no inputs", lambda _: px.models.MLP(0, [8], 2, rngs=nnx.Rngs(0)), V,
     r"MLP: in_features must be positive, got 0"),
    ("models", "targets of the wrong width",
     lambda _: px.models.mse_loss(tiny_mlp(), {"x": jnp.ones((4, 4)), "y": jnp.zeros((4, 3))}),
     V, r"mse_loss: the model's output has shape \(4, 2\)"),
    # comm
    ("comm", "a collective outside shard_map", lambda _: comm.all_gather(jnp.ones(3), "data"),
     V, r"all_gather: axis 'data' is not a mesh axis here; the mesh axes available are none "
     r"\(not inside jax.shard_map\)"),
    ("comm", "a misspelled axis", lambda _: in_shard_map(lambda v: comm.all_reduce(v, "dat")), V,
     r"all_reduce: axis 'dat' is not a mesh axis here; the mesh axes available are 'data' "
     r"\(size 2\), 'tensor' \(size 4\)"),
    ("comm", "an unknown reduction",
     lambda _: in_shard_map(lambda v: comm.all_reduce(v, "data", "avg")), V,
     r"all_reduce: op='avg' is not supported; use one of 'sum', 'mean', 'max', 'min', 'prod'"),
    ("comm", "a broadcast root out of range",
     lambda _: in_shard_map(lambda v: comm.broadcast(v, "tensor", root=4)), V,
     r"broadcast: root=4 is out of range for axis 'tensor' of size 4"),
    ("comm", "a send to a rank that does not exist",
     lambda _: in_shard_map(lambda v: comm.send(v, "tensor", [(0, 4)])), V,
     r"send: pair \(0, 4\) in perm is out of range for axis 'tensor' of size 4"),
    ("comm", "a negative bucket size",
     lambda _: in_shard_map(lambda v: comm.bucketed_all_reduce({"a": v}, "data",
                                                               bucket_bytes=-1)["a"]), V,
     r"pack_buckets: bucket_bytes=-1 must be an int >= 0"),
    ("comm", "a hierarchy over one axis twice",
     lambda _: in_shard_map(lambda v: comm.hierarchical_all_reduce(v, "data", "data")), V,
     r"hierarchical_all_reduce: inner_axis='data' and outer_axis='data' overlap"),
    # nn
    ("nn", "a dropout rate of 1", lambda _: px.nn.dropout(jnp.ones(3), 1.0, jax.random.key(0)),
     V, r"px.nn.dropout: rate=1.0 must be in \[0, 1\); use 0 for no dropout"),
    ("nn", "key/value heads that do not split",
     lambda _: px.nn.param_specs(nnx.state(abstract(lambda: px.nn.ParallelSelfAttention(
         48, 6, num_kv_heads=3, rngs=nnx.Rngs(0))), nnx.Param),
         px.make_mesh(tensor=4, devices=jax.devices()[:4])), V,
     r"px.nn.param_specs: \['key'\]\['kernel'\] has shape \(48, 3, 8\): its 'kv_heads' "
     r"dimension 1 has 3 entries"),
    # pipelines
    ("pipeline", "a float stage count", lambda _: px.pipeline.schedule("1f1b", 2.0, 8), T,
     r"schedule: stages must be an int, got 2.0"),
    ("pipeline", "interleaving with too few micro-batches",
     lambda _: px.pipeline.schedule("interleaved_1f1b", 4, 2, 2), V,
     r"interleaved with too few micro-batches: 2 for 4 stages"),
    ("pipeline", "zero stages for a partition", lambda _: px.pipeline.partition([1, 2], 0), V,
     r"partition: stages must be >= 1, got 0"),
    ("pipeline", "an unknown partition method",
     lambda _: px.pipeline.partition([1, 2], 2, "metis"), V, r"unknown method 'metis'"),
    ("pipeline", "a table cell that is not an action",
     lambda _: px.pipeline.Schedule.from_table(["F0 X3"]), V, r"cannot read 'X3' as an action"),
    ("pipeline", "stages that are not functions", lambda _: px.pipeline.Stages(1, 2, 3, 4), T,
     r"px.pipeline.Stages: first must be callable"),
    # px.distributed
    ("distributed", "a process count without a coordinator",
     lambda _: px.distributed.detect(num_processes=2, env={}), V,
     r"num_processes=2 needs coordinator='host:port' and process_id= as well"),
    ("distributed", "a coordinator without a port",
     lambda _: px.distributed.detect("nohost", 2, 0, env={}), V,
     r"coordinator 'nohost' is not 'host:port'"),
    ("distributed", "a process count that is a string",
     lambda _: px.distributed.detect("127.0.0.1:9", "2", 0, env={}), T,
     r"num_processes must be an int, got str"),
    ("distributed", "TF_CONFIG that is not JSON",
     lambda _: px.distributed.detect(env={"TF_CONFIG": "{not json"}), V,
     r"px\.distributed\.initialize: TF_CONFIG is not valid JSON"),
    ("distributed", "a barrier named by a number", lambda _: px.distributed.barrier(3), T,
     r"px\.distributed\.barrier: name must be a str"),
    # parallax.horovod
    ("horovod", "an optimizer given by name", lambda _: hvd.DistributedOptimizer("adam"), T,
     r"hvd\.DistributedOptimizer: tx must be an optax\.GradientTransformation"),
    ("horovod", "zero backward passes per step",
     lambda _: hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=0), V,
     r"backward_passes_per_step=0 must be an int >= 1"),
    ("horovod", "a max reduction of gradients",
     lambda _: hvd.DistributedOptimizer(optax.sgd(0.1), op=hvd.Max), V,
     r"op=ReduceOp\.Max reduces gradients with hvd\.Average, hvd\.Sum or hvd\.Adasum only"),
    # px.tf
    ("tf", "an unknown device", lambda _: px.tf.MirroredStrategy(devices=["gpu:0"]), V,
     r"px.tf.MirroredStrategy: unknown device 'gpu:0'"),
    ("tf", "a device twice", lambda _: px.tf.MirroredStrategy(devices=[0, 0]), V,
     r"must be distinct and not empty"),
    ("tf", "a replica function that is a string", lambda _: tf_strategy().run("train_step"), T,
     r"px.tf.MirroredStrategy.run: fn must be callable"),
    ("tf", "an unknown reduce op", lambda _: tf_strategy().reduce("MAX", np.ones(4)), V,
     r"px.tf.MirroredStrategy.reduce: unknown ReduceOp 'MAX'"),
    ("tf", "zero variable shards", lambda _: px.tf.FixedShardsPartitioner(0), V,
     r"FixedShardsPartitioner: num_shards must be positive"),
    ("tf", "a Keras-style optimizer given by name to the servers",
     lambda _: px.tf.ServerOptimizer("sgd"), T,
     r"px\.tf\.ServerOptimizer: tx must be an optax GradientTransformation \(e\.g\. "
     r"optax\.sgd\(0\.1\) for Keras's SGD\(learning_rate=0\.1\)\), got str"),
    ("tf", "a server optimizer outside a parameter-server scope",
     lambda _: px.tf.ServerOptimizer(optax.sgd(0.1)), V,
     r"px\.tf\.ServerOptimizer: create it inside `with strategy\.scope\(\):` of a "
     r"px\.tf\.ParameterServerStrategy \(or pass strategy=\)"),
    ("tf", "a variable created inside a scheduled function",
     lambda _: ps_worker_strategy().create_variable(np.ones(2)), V,
     r"px\.tf\.ParameterServerStrategy \(on a worker\): variables are created on the "
     r"coordinator, in strategy\.scope\(\) before scheduling"),
    ("tf", "a per-worker dataset that is a list, not a function",
     lambda _: ps_worker_strategy().distribute_datasets_from_function([1, 2]), T,
     r"distribute_datasets_from_function: dataset_fn must be callable as "
     r"dataset_fn\(input_context\); got list"),
    ("tf", "a parameter-server reduce over an axis the value lacks",
     lambda _: ps_worker_strategy().reduce("SUM", np.zeros(3), axis=1), V,
     r"reduce: axis=1 is out of range for a value of rank 1 \(shape \(3,\)\)"),
    ("horovod", "a step flag that is a number",
     lambda _: hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=2).update(
         {"w": jnp.ones(2)}, hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=2)
         .init({"w": jnp.zeros(2)}), step=1), T,
     r"hvd\.DistributedOptimizer: step must be None \(step every backward_passes_per_step "
     r"passes\), True or False, got int: 1"),
    ("horovod", "alltoall splits of NumPy's default int64",
     lambda _: hvd.alltoall(np.arange(4.0), splits=np.array([2, 2])), T,
     r"hvd\.alltoall: splits must hold 32-bit integers, as Horovod requires"),
    # px.ps
    ("ps", "keys out of order", lambda _: px.ps.keys.check_keys("KVWorker.push", [3, 1]), V,
     r"sorted and unique .*keys\[0\] = 3 is followed by 1"),
    ("ps", "negative keys", lambda _: px.ps.keys.check_keys("KVWorker.push", [-1, 2]), V,
     r"non-negative"),
    ("ps", "a negative staleness bound", lambda _: px.ps.BoundedDelay(-1), V,
     r"tau must be >= 0"),
    ("ps", "an unknown consistency model", lambda _: px.ps.as_consistency("strict"), V,
     r"'sequential', 'eventual' or px.ps.BoundedDelay"),
    # px.checkpoint
    ("checkpoint", "a string in the saved state",
     lambda tmp: px.checkpoint.save(tmp, {"w": "text"}, step=7), T,
     r"px.checkpoint.save: the state's leaf \['w'\] is a str, not an array"),
    ("checkpoint", "a negative step",
     lambda tmp: px.checkpoint.save(tmp, dict_state(), step=-1), V,
     r"px.checkpoint.save: step must be >= 0, got -1."),
    ("checkpoint", "restoring from nowhere",
     lambda tmp: px.checkpoint.restore(tmp / "nowhere", like=dict_state), V,
     r"px.checkpoint.restore: no checkpoint directory .*nowhere: it does not exist"),
    ("checkpoint", "a manager that keeps nothing",
     lambda tmp: px.checkpoint.Manager(tmp, max_to_keep=0), V,
     r"px.checkpoint.Manager: max_to_keep must be >= 1, got 0."),
]
IDS = [f"{i + 1:03d}/{len(CASES)} {area}: {what}" for i, (area, what, *_) in enumerate(CASES)]
SLOW = {gpt_with_ids}  # compiles a GPT step (over 5 s)
PARAMS = [pytest.param(*case, id=name, marks=[pytest.mark.slow] if case[2] in SLOW else [])
          for case, name in zip(CASES, IDS)]


def test_the_catalogue_is_large_and_distinct():
    assert len(CASES) >= 70
    assert len({(area, what) for area, what, *_ in CASES}) == len(CASES)
    assert len({pattern for *_, pattern in CASES}) == len(CASES)


@pytest.mark.parametrize("area,what,call,error,pattern", PARAMS)
def test_bad_input_gets_its_message(area, what, call, error, pattern, tmp_path):
    with pytest.raises(error, match=pattern) as raised:
        call(tmp_path)
    # The message is parallax's own, not JAX's or Python's internals.
    assert not re.search(r"jax\._src|Traceback|pjit", str(raised.value)), str(raised.value)
