"""Module state under pipelines: BatchNorm statistics and Dropout streams held by the stages.

A model whose stacked layers hold ``nnx.BatchNorm`` and ``nnx.Dropout`` (and whose ``first``
holds a BatchNorm, whose ``last`` a Dropout) trains under ``px.Pipeline`` as a plain
one-device loop over the micro-batches in order does (``batch_stats="per_microbatch"``,
GPipe's statistics): same losses, parameters, running statistics and RNG counters, and the
same dropout masks (a different mask changes the loss by far more than the tolerance:
checked). Composed with ``px.DataParallel`` every batch shard runs that loop on its rows,
drawing its rows of one device's draw, and the shards' statistics are averaged. A model with
Dropout only trains with the default options exactly as one device on the whole batch.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.grad import sliced_rng
from parallax.grad.sliced_rng import Position, is_key

D, LAYERS, M, STEPS = 8, 4, 4, 3
TX = optax.sgd(0.1)


class Layer(nnx.Module):
    def __init__(self, rngs, norm=True):
        # no bias before a BatchNorm: its gradient is zero, its value rounding noise
        self.lin = nnx.Linear(D, D, use_bias=not norm, rngs=rngs)
        self.bn = nnx.BatchNorm(D, momentum=0.9, rngs=rngs) if norm else None
        self.drop = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, x):
        h = self.lin(x)
        return x + self.drop(jnp.tanh(self.bn(h) if self.bn is not None else h))


class Net(nnx.Module):
    def __init__(self, rngs, norm=True):
        self.inp = nnx.Linear(3, D, use_bias=not norm, rngs=rngs)
        self.bn_in = nnx.BatchNorm(D, momentum=0.8, rngs=rngs) if norm else None
        self.drop_out = nnx.Dropout(0.2, rngs=rngs)
        self.out = nnx.Linear(D, 2, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs):
            return Layer(rngs, norm)

        self.blocks = stack(rngs)


def first(model, batch):
    h = model.inp(batch["x"])
    return model.bn_in(h) if model.bn_in is not None else h


STAGES = px.pipeline.Stages(
    first=first,
    stage=lambda layer, x: layer(x),
    last=lambda model, x, batch: jnp.mean((model.out(model.drop_out(x)) - batch["y"]) ** 2),
    layers=lambda model: model.blocks,
)


def make(norm=True, dropout_seed=1):
    return Net(nnx.Rngs(0, dropout=dropout_seed), norm)


def batches(steps=STEPS, n=64, seed=0):
    r = np.random.default_rng(seed)
    return [{"x": r.standard_normal((n, 3), np.float32),
             "y": r.standard_normal((n, 2), np.float32)} for _ in range(steps)]


def numbers(tree):
    return jax.tree.map(lambda x: jax.random.key_data(x) if is_key(x) else x,
                        jax.device_get(tree))


# --- the references ---------------------------------------------------------------------

def loop_reference(shards=1, norm=True, dropout_seed=1):
    """Plain nnx: each of ``shards`` batch shards loops over its micro-batches in order from
    the step's state (its keys drawing its rows of one device's draw over the shards), the
    gradients averaged over shards and micro-batches, the statistics over shards."""
    graphdef, params, rest = nnx.split(make(norm, dropout_seed), nnx.Param, ...)
    opt_state = TX.init(params)

    @jax.jit
    def step(params, rest, opt_state, batch):
        loss, grads, after = 0.0, None, []
        for d in range(shards):
            rows = jax.tree.map(lambda x: np.split(x, shards)[d], batch)
            state = rest
            for m in range(M):
                micro = jax.tree.map(lambda x: np.split(x, M)[m], rows)
                state = sliced_rng.slice_keys(state, Position(d, shards), micro["x"].shape[0],
                                       "global")
                model = nnx.merge(graphdef, params, state)
                value, g = nnx.value_and_grad(STAGES)(model, micro)
                state = sliced_rng.unslice_keys(nnx.state(model, nnx.Not(nnx.Param)))
                loss += value / (shards * M)
                grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
            after.append(state)
        grads = jax.tree.map(lambda g: g / (shards * M), grads)
        updates, opt_state = TX.update(grads, opt_state, params)
        rest = jax.tree.map(lambda *xs: xs[0] if is_key(xs[0]) or not jnp.issubdtype(
            xs[0].dtype, jnp.floating) else sum(xs) / shards, *after)
        return loss, optax.apply_updates(params, updates), rest, opt_state

    losses = []
    for batch in batches():
        loss, params, rest, opt_state = step(params, rest, opt_state, batch)
        losses.append(float(loss))
    return losses, params, rest


def full_batch_reference(norm=False):
    """One device, the whole batch: ``nnx.value_and_grad`` and ``nnx.Optimizer``."""
    model = make(norm)
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(STAGES)(model, batch)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, b)) for b in batches()]
    return losses, nnx.state(model, nnx.Param), nnx.state(model, nnx.Not(nnx.Param))


def pipelined(schedule="1f1b", data=1, norm=True, dropout_seed=1, **options):
    devices = jax.devices()[:2 * data]
    mesh = (px.make_mesh(stage=2, data=data, devices=devices) if data > 1
            else px.make_mesh(stage=2, devices=devices))
    strategy = px.compose(*([px.DataParallel()] if data > 1 else []),
                          px.Pipeline("stage", microbatches=M, schedule=schedule))
    state = px.shard(px.TrainState.create(make(norm, dropout_seed), TX), mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(STAGES, **options)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    losses = []
    for batch in batches():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state.params, state.rest


def differences(run, reference) -> dict:
    (losses, params, rest), (ref_losses, ref_params, ref_rest) = run, reference
    d = px.testing.relative_difference
    return {"losses": d(np.asarray(losses), np.asarray(ref_losses)),
            "parameters": d(jax.device_get(params), jax.device_get(ref_params)),
            "state": d(numbers(rest), numbers(ref_rest))}


# --- the tests --------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_stages_with_batch_norm_and_dropout_train_as_the_loop(schedule):
    run = pipelined(schedule, batch_stats="per_microbatch")
    reference = loop_reference()
    diffs = differences(run, reference)
    assert max(diffs.values()) <= 1e-5, diffs
    # the running statistics moved, the counters once per micro-batch: not trivially equal
    rest = jax.device_get(run[2])
    assert np.abs(rest["bn_in"]["mean"][...]).max() > 1e-2
    assert np.abs(rest["blocks"]["bn"]["mean"][...]).max() > 1e-3
    assert (rest["blocks"]["drop"]["rngs"]["count"][...] == STEPS * M).all()
    assert int(rest["drop_out"]["rngs"]["count"][...]) == STEPS * M


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_with_data_parallel_each_shard_runs_the_loop(schedule):
    diffs = differences(pipelined(schedule, data=2, batch_stats="per_microbatch"),
                        loop_reference(shards=2))
    assert max(diffs.values()) <= 1e-5, diffs


@pytest.mark.slow
def test_dropout_masks_are_compared():
    """Another dropout seed changes the losses far beyond the tolerance: equal losses mean
    equal masks."""
    other = loop_reference(dropout_seed=2)
    assert px.testing.relative_difference(np.asarray(other[0]),
                                          np.asarray(loop_reference()[0])) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("data", [1, 4])
def test_dropout_only_trains_as_one_device_on_the_whole_batch(data):
    """Without batch statistics the default options hold: micro-batch m draws its rows of
    the whole batch's masks, and the counters advance once per step."""
    diffs = differences(pipelined("1f1b", data=data, norm=False), full_batch_reference())
    assert max(diffs.values()) <= 1e-5, diffs


@pytest.mark.slow
def test_other_schedules_carry_the_state_too():
    run = pipelined("zbv", batch_stats="per_microbatch")  # first and last on one stage
    diffs = differences(run, loop_reference())
    assert max(diffs.values()) <= 1e-5, diffs


@pytest.mark.slow
def test_value_and_grad_writes_the_state_back():
    model, batch = make(), batches(1)[0]
    fn = px.pipeline.value_and_grad(STAGES, "1f1b", microbatches=M, batch_stats="per_microbatch")
    with jax.set_mesh(px.make_mesh(stage=2, devices=jax.devices()[:2])):
        loss, grads = nnx.jit(fn)(model, batch)
    reference = make()
    losses, g = [], None
    for m in range(M):
        micro = jax.tree.map(lambda x: np.split(x, M)[m], batch)
        value, gm = nnx.value_and_grad(STAGES)(reference, micro)
        losses.append(value)
        g = gm if g is None else jax.tree.map(jnp.add, g, gm)
    d = px.testing.relative_difference
    assert d(loss, np.mean(losses)) <= 1e-5
    assert d(jax.device_get(grads), jax.tree.map(lambda x: x / M, g)) <= 1e-5
    assert d(numbers(nnx.state(model, nnx.Not(nnx.Param))),
             numbers(nnx.state(reference, nnx.Not(nnx.Param)))) <= 1e-5


def _step(strategy, mesh, model, **options):
    state = px.shard(px.TrainState.create(model, TX), mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(STAGES, **options)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    return lambda: step.lower(state, batches(1)[0])


MESH2 = dict(stage=2)


@pytest.mark.parametrize("options, weights, pattern", [
    ({}, "flush", r"px.Pipeline: batch_stats='global' asks for BatchNorm statistics over "
     r"the whole batch.*batch_stats='per_microbatch'"),
    ({"batch_stats": "per_replica"}, "flush",
     r"batch_stats='per_replica' asks for BatchNorm statistics over the whole batch shard"),
    ({"batch_stats": "per_microbatch"}, "2bw",
     r"px.Pipeline\(weights='2bw'\): the model holds non-parameter state .*"
     r"weights='flush' only"),
    ({"batch_stats": "per_microbatch"}, "stashed",
     r"px.Pipeline\(weights='stashed'\): the model holds non-parameter state "
     r"\(blocks/bn/mean.*weights='flush' only"),
])
def test_what_a_pipeline_cannot_carry_is_refused(options, weights, pattern):
    mesh = px.make_mesh(stage=2, devices=jax.devices()[:2])
    strategy = px.Pipeline("stage", microbatches=M, weights=weights)
    if weights != "flush":
        tx = px.pipeline.double_buffered(TX) if weights == "2bw" else TX
        state = px.shard(px.TrainState.create(make(), tx), mesh, strategy)

        @px.train_step(mesh, strategy)
        def step(state, batch):
            return px.pipeline.update(STAGES, state, batch)

        with pytest.raises(ValueError, match=pattern):
            step.lower(state, batches(1)[0])
        return
    with pytest.raises(ValueError, match=pattern):
        _step(strategy, mesh, make(), **options)()


def test_first_and_last_sharing_a_stream_is_refused():
    shared = px.pipeline.Stages(
        first=lambda m, b: m.drop_out(m.inp(b["x"])),
        stage=STAGES.stage, last=STAGES.last, layers=STAGES.layers)
    mesh = px.make_mesh(stage=2, devices=jax.devices()[:2])
    strategy = px.Pipeline("stage", microbatches=M)
    state = px.shard(px.TrainState.create(make(norm=False), TX), mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(shared)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    with pytest.raises(ValueError, match=re.escape(
            "Stages.first and Stages.last both write the same module variable")):
        step.lower(state, batches(1)[0])


@pytest.mark.slow
def test_gpipe_by_autodiff_refuses_state():
    fn = px.pipeline.gpipe_value_and_grad(STAGES, microbatches=M)
    with jax.set_mesh(px.make_mesh(stage=2, devices=jax.devices()[:2])):
        with pytest.raises(ValueError, match=re.escape(
                "px.pipeline.gpipe_value_and_grad: the model holds non-parameter state")):
            fn(make(), batches(1)[0])
