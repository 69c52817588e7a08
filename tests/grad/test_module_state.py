"""Non-parameter state and auxiliary values flow through px.value_and_grad as through
nnx.value_and_grad: BatchNorm statistics, RNG counters, user variables, sown values; aux
values reduced by kind over shards and micro-batches; Dropout's one-device masks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.grad.sliced_rng import is_key

from byom.stock import key_data


class Stateful(nnx.Module):
    def __init__(self, *, rngs, rate=0.5):
        self.lin = nnx.Linear(4, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        self.calls[...] += 1
        hidden = self.drop(self.bn(self.lin(x)))
        self.sow(nnx.Intermediate, "hidden", hidden)
        return self.out(hidden)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def aux_loss(model, batch):
    """(loss, aux) with one value of every kind."""
    out = model(batch["x"])
    loss = jnp.mean((out - batch["y"]) ** 2)
    return loss, {"mse": loss, "out": out, "calls": model.calls[...], "name": "stateful"}


def data(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 4), np.float32),
            "y": rng.standard_normal((n, 2), np.float32)}


def state_of(model):
    return key_data(jax.device_get(nnx.state(model, nnx.Not(nnx.Param))))


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside")
@pytest.mark.parametrize("has_aux", [False, True])
def test_outside_a_step_it_updates_the_module_like_nnx(has_aux):
    """Outside a step, px.value_and_grad is nnx.value_and_grad: same values, same gradients,
    and the module's BatchStat, RngCount, variables and sown values written back."""
    fn = aux_loss if has_aux else loss_fn
    ours, theirs = Stateful(rngs=nnx.Rngs(0)), Stateful(rngs=nnx.Rngs(0))
    batch = data()

    @nnx.jit  # no parallax step: nnx.jit carries the module's updates out, as for nnx's own
    def parallax_grad(model, batch):
        value, grads = px.value_and_grad(fn, has_aux=has_aux)(model, batch)
        if has_aux:
            assert value[1].pop("name") == "stateful"  # a static aux value, passed through
        return value, grads

    @nnx.jit
    def nnx_grad(model, batch):
        value, grads = nnx.value_and_grad(fn, has_aux=has_aux)(model, batch)
        if has_aux:
            del value[1]["name"]
        return value, grads

    value, grads = parallax_grad(ours, batch)
    expected, expected_grads = nnx_grad(theirs, batch)
    if has_aux:
        assert int(value[1]["calls"]) == 1
        value, expected = value[0], expected[0]
    assert float(value) == pytest.approx(float(expected), rel=1e-6)
    assert px.testing.relative_difference(grads, expected_grads) <= 1e-6
    assert px.testing.relative_difference(state_of(ours), state_of(theirs)) <= 1e-6
    assert int(ours.calls[...]) == 1 and ours.hidden.get_value()[0].shape == (16, 8)


def mesh(**axes):
    return px.make_mesh(devices=jax.devices()[:int(np.prod(list(axes.values())))], **axes)


@functools.cache
def one_device(rate=0.5, steps=2):
    """What one device's jitted nnx loop returns: aux values and the state, per step."""
    model = Stateful(rngs=nnx.Rngs(0), rate=rate)

    @nnx.jit
    def step(model, batch):
        (_, aux), _ = nnx.value_and_grad(aux_loss, has_aux=True)(model, batch)
        hidden = nnx.pop(model, nnx.Intermediate)
        del aux["name"]
        return aux, hidden

    outs = [step(model, data(seed=s)) for s in range(steps)]
    return jax.device_get(outs), state_of(model)


def parallax_steps(mesh, strategy, steps=2, **options):
    state = px.shard(px.TrainState.create(Stateful(rngs=nnx.Rngs(0)), optax.sgd(0.0)),
                     mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        model = state.model
        (_, aux), grads = px.value_and_grad(aux_loss, has_aux=True, **options)(model, batch)
        hidden = nnx.pop(model, nnx.Intermediate)
        assert aux.pop("name") == "stateful"  # a static value, passed through (at trace time)
        return state.apply_gradients(grads), (aux, hidden)

    outs = []
    for s in range(steps):
        state, out = step(state, data(seed=s))
        outs.append(jax.device_get(out))
    return outs, key_data(jax.device_get(state.rest)), step, state


LAYOUTS = {
    "dp": (dict(data=8), px.DataParallel(), {}),
    # the gradients summed by exchanges (the default across CPU processes): aux values and
    # module state are still reduced in the step's checked map
    "dp-tree": (dict(data=8), px.DataParallel(sync="tree"), {}),
    "hsdp-accumulate": (dict(data=2, fsdp=2), px.HSDP(), {"microbatches": 2}),
    "dp-gspmd": (dict(data=4), px.DataParallel(style="gspmd"), {}),
}


@pytest.mark.filterwarnings("ignore:Using 'Module.sow\\(\\)' outside")
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_aux_state_and_masks_equal_one_device(name):
    """Per-example aux (the outputs, the sown hidden layer with its Dropout mask)
    concatenated, float aux averaged, an integer that every shard agrees on and a string
    passed through; the module state after two steps equal."""
    axes, strategy, options = LAYOUTS[name]
    outs, rest, _, _ = parallax_steps(mesh(**axes), strategy, **options)
    ref_outs, ref_rest = one_device()
    for (aux, hidden), (ref_aux, ref_hidden) in zip(outs, ref_outs):
        assert int(aux["calls"]) == int(ref_aux["calls"])
        assert aux["out"].shape == (16, 2)
        assert px.testing.relative_difference(aux["out"], ref_aux["out"]) <= 1e-5
        assert abs(float(aux["mse"]) - float(ref_aux["mse"])) <= 1e-5 * float(ref_aux["mse"])
        mask, ref_mask = jax.tree.leaves(hidden)[0] != 0, jax.tree.leaves(ref_hidden)[0] != 0
        assert mask.shape == (16, 8) and 0.2 < mask.mean() < 0.8
        np.testing.assert_array_equal(mask, ref_mask)  # one device's Dropout mask
    assert px.testing.relative_difference(rest, ref_rest) <= 1e-5


@pytest.mark.slow
def test_run_to_run_masks_are_deterministic_and_per_shard_streams_differ():
    m = mesh(data=4)
    first, _, _, _ = parallax_steps(m, px.DataParallel(), steps=1)
    again, _, _, _ = parallax_steps(m, px.DataParallel(), steps=1)
    np.testing.assert_array_equal(jax.tree.leaves(first[0][1])[0], jax.tree.leaves(again[0][1])[0])
    own, _, _, _ = parallax_steps(m, px.DataParallel(), steps=1, rng="per_shard")
    ref_mask = jax.tree.leaves(one_device()[0][0][1])[0] != 0
    mask = jax.tree.leaves(own[0][1])[0] != 0
    assert (mask != ref_mask).any()  # independent streams: not one device's mask
    quarters = mask.reshape(4, 4, 8)
    assert all((quarters[i] != quarters[0]).any() for i in range(1, 4))


@pytest.mark.parametrize("sync", [None, "tree"])
def test_an_integer_that_differs_between_shards_is_refused(sync):
    def counts(model, batch):
        out = model(batch["x"])
        return jnp.mean(out ** 2), {"positive": jnp.sum(out > 0)}

    m = mesh(data=4)

    @px.train_step(m, px.DataParallel(sync=sync), donate=False)
    def step(state, batch):
        (_, aux), grads = px.value_and_grad(counts, has_aux=True)(state.model, batch)
        return state.apply_gradients(grads), aux

    state = px.shard(px.TrainState.create(Stateful(rngs=nnx.Rngs(0)), optax.sgd(0.0)), m,
                     px.DataParallel())
    with pytest.raises(ValueError, match=r"px.value_and_grad: the auxiliary value \['positive'\] "
                       r"\(int32\[\]\) differs between batch shards \('data',\), and a value of "
                       r"this kind has no one-device reduction: return a float mean"):
        step(state, data())


def test_an_integer_that_differs_between_microbatches_is_refused():
    def counts(w, batch):
        return jnp.mean(batch["x"] @ w), {"positive": jnp.sum(batch["x"] > 0)}

    with pytest.raises(ValueError, match=r"the auxiliary value \['positive'\] is an integer, bool "
                       r"or key that depends on the micro-batch"):
        px.value_and_grad(counts, has_aux=True, microbatches=2)(jnp.ones(4), data())


def test_counters_and_rng_counts_advance_once_per_step():
    outs, rest, _, _ = parallax_steps(mesh(data=2, fsdp=2), px.HSDP(), steps=3,
                                      microbatches=2)
    assert int(outs[-1][0]["calls"]) == 3
    counts = [v for k, v in jax.tree_util.tree_flatten_with_path(rest)[0]
              if "count" in jax.tree_util.keystr(k)]
    assert counts and all(int(c) == 3 for c in counts)


def test_keys_stay_plain_threefry_keys():
    _, _, _, state = parallax_steps(mesh(data=2), px.DataParallel(), steps=1)
    keys = [x for x in jax.tree.leaves(state.rest) if is_key(x)]
    assert keys and all(str(jax.random.key_impl(k)) == "threefry2x32" for k in keys)


def test_a_producer_that_carries_no_state_refuses_a_stateful_model():
    """A custom producer that rebuilds the model from its parameters alone would drop its
    BatchNorm statistics or RNG streams; it is refused, with how px.Pipeline carries them."""
    def rebuilding(request, params, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(request.rebuild(p), batch))(params)
        return (loss, None), grads

    m = mesh(data=2)
    strategy = px.compose(px.DataParallel(), px.Strategy(name="Rebuilding()", grad_fn=rebuilding))

    @px.train_step(m, strategy, donate=False)
    def step(state, batch):
        loss, grads = px.value_and_grad(loss_fn)(state.model, batch)
        return state.apply_gradients(grads), loss

    state = px.shard(px.TrainState.create(Stateful(rngs=nnx.Rngs(0)), optax.sgd(0.0)), m,
                     strategy)
    with pytest.raises(ValueError, match=r"px.value_and_grad: DataParallel\('data'\) \+ "
                       r"Rebuilding\(\) produces gradients by rebuilding the model from its "
                       r"parameters alone .*the model holds bn/mean"):
        step(state, data())


class Sowing(nnx.Module):
    def __init__(self, rngs):
        self.inp = nnx.Linear(4, 8, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        hidden = jnp.tanh(self.inp(x))
        self.sow(nnx.Intermediate, "hidden", hidden)
        return self.out(hidden)


def test_values_captured_with_nnx_capture_come_back_as_on_one_device():
    """flax's newer way to read sown values, ``nnx.capture`` inside the loss, returned as
    aux: under DataParallel over 4 shards the captured per-example hidden values come back
    whole and equal one device's, and so do the loss and its gradients."""
    def captured_loss(model, batch):
        out, captured = nnx.capture(model, nnx.Intermediate)(batch["x"])
        return jnp.mean((out - batch["y"]) ** 2), captured

    batch = data()
    (loss, captured), grads = nnx.value_and_grad(captured_loss, has_aux=True)(
        Sowing(nnx.Rngs(0)), batch)
    m = mesh(data=4)
    strategy = px.DataParallel()
    state = px.shard(px.TrainState.create(Sowing(nnx.Rngs(0)), optax.sgd(0.0)), m, strategy)

    @px.train_step(m, strategy, donate=False)
    def step(state, batch):
        (loss, captured), grads = px.value_and_grad(captured_loss, has_aux=True)(
            state.model, batch)
        return state.apply_gradients(grads), (loss, captured, grads)

    _, (px_loss, px_captured, px_grads) = step(state, batch)
    assert float(px_loss) == pytest.approx(float(loss), rel=1e-5)
    hidden = np.asarray(captured["hidden"][0])  # a sown tuple: one entry per call
    px_hidden = np.asarray(px_captured["hidden"][0])
    assert px_hidden.shape == hidden.shape == (16, 8)
    np.testing.assert_allclose(px_hidden, hidden, rtol=1e-5, atol=1e-6)
    assert px.testing.relative_difference(jax.device_get(px_grads), grads) < 1e-5
