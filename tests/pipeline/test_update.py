"""PipeDream's weight versions (``px.Pipeline(weights=...)``) against their own update rules.

Each mode trains a small model for 10 steps inside ``px.train_step`` and is compared with a
plain one-device simulation of its rule (not with synchronous training, which it is not):

* ``"stashed"``: micro-batch ``j``'s forward on stage ``s`` uses the stage's weights after
  ``v_s(j)`` updates (PipeDream's ``max(0, j - p + s + 1)`` with 1F1B, checked against the
  schedule's table), its backward the same version; each stage applies each micro-batch's
  gradient to its latest weights, in order; the parameters outside the stack keep the
  step's version and take the micro-batch updates at the end.
* ``"2bw"``: ``W(t + 1) = W(t) - update(grad f(W(t - 1)))``, ``W(-1) = W(0)``.

The memory of the weight versions is read from the compiled programs.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax import pipeline as pp
from parallax.analysis import hlo
from parallax.pipeline.schedules.action import Action
from parallax.testing import relative_difference

from .runtime_testing import LOSS, Toy, layer, stage_mesh, toy_batch

STEPS, STAGES, MICRO, LAYERS = 10, 2, 4, 4  # Toy() has 4 layers
TX = optax.sgd(0.01, momentum=0.9)


def flat(model_params) -> dict:
    leaves = {jax.tree_util.keystr(k): v for k, v in
              jax.tree_util.tree_flatten_with_path(model_params)[0]}
    return {re.sub(r"\W+", "", k).replace("value", ""): np.asarray(v) for k, v in leaves.items()}


def data(steps=STEPS):
    return [toy_batch(16, seed=s) for s in range(steps)]


def make_step(mesh, strategy):
    @px.train_step(mesh, strategy, donate=False)
    def step(state, batch):
        state, loss = pp.update(LOSS, state, batch)
        return state, {"loss": loss}

    return step


@functools.cache
def train(weights, tx=TX, schedule="1f1b", stages=STAGES):
    """(losses, final parameters) under px.Pipeline(weights=...), 10 steps."""
    mesh = stage_mesh(stages)
    strategy = px.Pipeline("stage", microbatches=MICRO, schedule=schedule, remat="never",
                           weights=weights)
    wrap = pp.double_buffered if weights == "2bw" else (lambda t: t)
    state = px.init(lambda: px.TrainState.create(Toy(), wrap(tx)), mesh, strategy)
    step, losses = make_step(mesh, strategy), []
    for batch in data():
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, flat(jax.device_get(state.params)), state


def versions_from_table(sched):
    """v_s(j): how many W of stage s ran before F_j on stage s, read from the table."""
    tick = sched.tick_of
    return [[sum(tick[(Action("W", k), s)] < tick[(Action("F", j), s)]
                 for k in range(sched.microbatches)) for j in range(sched.microbatches)]
            for s in range(sched.stages)]


def plain(params: dict) -> dict:
    return {"w_in": params["w_in"], "layers": params["blocksw"], "w_out": params["w_out"]}


def toy_loss(p, batch):
    x = batch["x"] @ p["w_in"]
    x = jax.lax.scan(lambda x, w: (layer(w, x), None), x, p["layers"])[0]
    return jnp.mean((x @ p["w_out"] - batch["y"]) ** 2)


def stashed_reference(tx, schedule="1f1b", stages=STAGES):
    """PipeDream's weight stashing on one device, micro-batch by micro-batch."""
    version = versions_from_table(pp.schedule(schedule, stages, MICRO))
    per = LAYERS // stages
    start = plain(flat(nnx.state(Toy(), nnx.Param)))
    chunks = [start["layers"][s * per:(s + 1) * per] for s in range(stages)]
    others = {k: v for k, v in start.items() if k != "layers"}
    chunk_state, others_state = [tx.init(c) for c in chunks], tx.init(others)
    grad = jax.jit(jax.value_and_grad(toy_loss))
    losses = []
    for batch in data():
        history = [[c] for c in chunks]  # each stage's versions, oldest first
        size, step_losses, others_grads = batch["x"].shape[0] // MICRO, [], []
        for j in range(MICRO):
            mb = {k: v[j * size:(j + 1) * size] for k, v in batch.items()}
            used = [history[s][version[s][j]] for s in range(stages)]
            value, g = grad({**others, "layers": jnp.concatenate(used)}, mb)
            step_losses.append(float(value))
            others_grads.append({k: g[k] for k in others})
            for s in range(stages):  # stage s's W of micro-batch j: its latest weights move
                upd, chunk_state[s] = tx.update(g["layers"][s * per:(s + 1) * per],
                                                chunk_state[s], history[s][-1])
                history[s].append(optax.apply_updates(history[s][-1], upd))
        for g in others_grads:  # the parameters outside the stack, at the end, in order
            upd, others_state = tx.update(g, others_state, others)
            others = optax.apply_updates(others, upd)
        chunks = [h[-1] for h in history]
        losses.append(float(np.mean(step_losses)))
    return losses, {**others, "layers": np.concatenate(chunks)}


def two_versions_reference(tx):
    """PipeDream-2BW: the step's gradient at the previous version, applied to the current."""
    params = plain(flat(nnx.state(Toy(), nnx.Param)))
    previous, state = params, tx.init(params)
    grad = jax.jit(jax.value_and_grad(toy_loss))
    losses = []
    for batch in data():
        value, g = grad(previous, batch)
        losses.append(float(value))
        upd, state = tx.update(g, state, params)
        previous, params = params, optax.apply_updates(params, upd)
    return losses, params


def assert_close(run, ref, rtol=1e-5):
    losses, params, _ = run
    ref_losses, ref_params = ref
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses  # it trains
    assert relative_difference(np.array(losses), np.array(ref_losses)) <= rtol
    assert relative_difference(plain(params), {k: np.asarray(v) for k, v in
                                               ref_params.items()}) <= rtol


def test_the_stashed_versions_are_pipedreams():
    sched = pp.schedule("1f1b", 4, 8)
    assert versions_from_table(sched) == [[max(0, j - 4 + s + 1) for j in range(8)]
                                          for s in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("tx", [TX, optax.adam(1e-2)], ids=["momentum", "adam"])
def test_weight_stashing_follows_its_update_rule(tx):
    run = train("stashed", tx)
    assert int(run[2].step) == STEPS * MICRO  # one update per micro-batch
    assert_close(run, stashed_reference(tx))
    assert abs(run[0][-1] - train("flush")[0][-1]) > 1e-4  # and it is not synchronous


@pytest.mark.slow
def test_2bw_applies_the_previous_versions_gradient():
    run = train("2bw")
    assert int(run[2].step) == STEPS
    assert_close(run, two_versions_reference(TX))
    np.testing.assert_allclose(run[0][:2], two_versions_reference(TX)[0][:2], rtol=1e-6)


@pytest.mark.slow
def test_the_versions_memory_is_read_from_the_compiled_programs():
    """2BW's state holds the parameters twice; stashing keeps one version per micro-batch
    in flight (the versions ring, ``peak_in_flight`` slots + a spare) in the step's
    temporaries."""
    mesh, width = stage_mesh(STAGES), 128  # wide layers: weights dominate the temporaries
    batch = data(1)[0]

    def program(weights, tx=TX, schedule="1f1b"):
        strategy = px.Pipeline("stage", microbatches=MICRO, remat="never", weights=weights,
                               schedule=schedule)
        state = jax.eval_shape(lambda: px.TrainState.create(Toy(width=width), tx))
        return hlo.memory(make_step(mesh, strategy).lower(state, batch).compile())

    flush, two = program("flush"), program("2bw", pp.double_buffered(TX))
    params = sum(x.size * x.dtype.itemsize
                 for x in jax.tree.leaves(nnx.state(Toy(width=width), nnx.Param)))
    chunk = LAYERS // STAGES * width * width * 4  # one stage's layers
    per_device = params - (STAGES - 1) * chunk  # the stack is split over the stages
    assert two.argument_bytes - flush.argument_bytes == per_device  # 2BW: W(t - 1) too

    # Stashing: one version per micro-batch in flight (+ the spare row). GPipe keeps all M
    # in flight, 1F1B p - s: the difference between the two schedules' growth over their
    # flushed programs is exactly that many more chunks of weights.
    grown, slots = {}, {}
    for name in ("1f1b", "gpipe"):
        sched = pp.schedule(name, STAGES, MICRO)
        slots[name] = max(sched.peak_in_flight(s) for s in range(STAGES)) + 1
        grown[name] = (program("stashed", schedule=name).temp_bytes
                       - program("flush", schedule=name).temp_bytes)
    assert grown["gpipe"] - grown["1f1b"] == (slots["gpipe"] - slots["1f1b"]) * chunk
    # beyond the ring: the latest weights and their momentum, carried by the tick loop,
    # and the update computed for them
    assert grown["1f1b"] <= (slots["1f1b"] + 4) * chunk, grown["1f1b"] / chunk


def test_asynchronous_weights_need_px_pipeline_update():
    mesh = stage_mesh(STAGES)
    strategy = px.Pipeline("stage", microbatches=MICRO, weights="stashed")

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(LOSS)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    state = jax.eval_shape(lambda: px.TrainState.create(Toy(), TX))
    with pytest.raises(ValueError, match=re.escape(
            "px.Pipeline(weights='stashed'): the weights are not one version per step, so "
            "px.value_and_grad + state.apply_gradients cannot express the step; write it as "
            "`state, loss = px.pipeline.update(loss_fn, state, batch)`")):
        step.lower(state, data(1)[0])


def test_2bw_needs_the_double_buffered_optimizer():
    mesh = stage_mesh(STAGES)
    strategy = px.Pipeline("stage", microbatches=MICRO, weights="2bw")
    state = jax.eval_shape(lambda: px.TrainState.create(Toy(), TX))
    with pytest.raises(ValueError, match=re.escape(
            "px.pipeline.update: px.Pipeline(weights='2bw') computes the step's gradient at "
            "the previous weight version, which the optimizer keeps: create the state with "
            "px.TrainState.create(model, px.pipeline.double_buffered(tx))")):
        make_step(mesh, strategy).lower(state, data(1)[0])


def test_stashing_runs_on_the_stage_axis_alone():
    mesh = px.make_mesh(stage=2, data=2, devices=jax.devices()[:4])
    strategy = px.compose(px.DataParallel("data"),
                          px.Pipeline("stage", microbatches=2, weights="stashed"))
    state = jax.eval_shape(lambda: px.TrainState.create(Toy(), TX))
    with pytest.raises(ValueError, match=re.escape(
            "px.pipeline.update: px.Pipeline(weights='stashed') updates the weights inside "
            "the pipeline after every micro-batch, on the stage axis alone; DataParallel")):
        make_step(mesh, strategy).lower(state, data(1)[0])


def test_bad_weights_and_calls_outside_a_pipeline():
    with pytest.raises(ValueError, match=re.escape(
            "px.Pipeline: weights='async' is not a weight-version mode; use 'flush'")):
        px.Pipeline("stage", microbatches=2, weights="async")
    with pytest.raises(ValueError, match=re.escape(
            "px.pipeline.update: called outside px.train_step; it runs inside a step "
            "decorated with px.train_step(mesh, strategy) whose strategy holds px.Pipeline")):
        pp.update(LOSS, px.TrainState.create(Toy(), TX), data(1)[0])
