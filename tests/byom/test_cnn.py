"""A ResNet-style CNN of stock Flax layers (Conv, BatchNorm, Dropout, Linear), not written for
parallax, trains under every data-parallel strategy exactly as a plain nnx loop on one
device: losses, gradients, parameters, BatchNorm running statistics and RNG counters (fp32,
1e-5), with the Dropout masks one device draws."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px

from .stock import (
    CNN,
    TX,
    assert_same_training,
    cnn_batches,
    cnn_loss,
    parallax_run,
    plain_nnx,
)

pytestmark = pytest.mark.slow  # each test compiles a CNN step and its reference (5-15 s)

BATCHES = cnn_batches()


@functools.cache
def reference():
    return plain_nnx(lambda: CNN(rngs=nnx.Rngs(0)), cnn_loss, BATCHES)


def mesh(**axes):
    count = int(np.prod(list(axes.values())))
    return px.make_mesh(devices=jax.devices()[:count], **axes)


TP_HEAD = {"head": "colwise"}  # the classes over "tensor": a plan for a stock model

CASES = {  # every path a module's state takes, in both styles where a strategy has two
    "dp": (dict(data=8), px.DataParallel(), {}),
    "dp-gspmd": (dict(data=8), px.DataParallel(style="gspmd"), {}),
    "zero1": (dict(fsdp=4), px.ZeRO(1, "fsdp"), {}),
    "zero2": (dict(fsdp=4), px.ZeRO(2, "fsdp"), {}),
    "zero2-gspmd": (dict(fsdp=4), px.ZeRO(2, "fsdp", style="gspmd"), {}),
    "zero3": (dict(fsdp=8), px.ZeRO(3, "fsdp"), {}),
    "dp-fsdp": (dict(data=2, fsdp=4), px.HSDP(), {}),
    "dp-fsdp-gspmd": (dict(data=2, fsdp=4), px.HSDP(style="gspmd"), {}),
    "dp-tp": (dict(data=4, tensor=2),
              px.compose(px.DataParallel(), px.TensorParallel(plan=TP_HEAD)), {}),
    "dp-tp-gspmd": (dict(data=4, tensor=2),
                    px.compose(px.DataParallel(style="gspmd"), px.TensorParallel(plan=TP_HEAD)),
                    {}),
    # global statistics with micro-batches: one computation, the full batch's numbers
    "accumulate": (dict(data=2), px.compose(px.DataParallel(), px.GradientAccumulation(2)), {}),
    "accumulate-gspmd": (dict(data=2), px.compose(px.DataParallel(style="gspmd"),
                                                  px.GradientAccumulation(2)), {}),
    "microbatches": (dict(data=4), px.DataParallel(), {"microbatches": 2}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cnn_trains_as_on_one_device(name):
    """Losses, gradients, parameters, the BatchNorm running statistics, the Dropout RNG
    counters and keys, and the optimizer state after 5 steps: the plain nnx loop's."""
    axes, strategy, options = CASES[name]
    run = parallax_run(lambda: CNN(rngs=nnx.Rngs(0)), cnn_loss, BATCHES, mesh(**axes), strategy,
                       **options)
    assert_same_training(run, reference())


def plain_slices(make_model, batches, shards, microbatches):
    """One device computing what each shard and micro-batch computes in parallax's
    per-replica / per-micro-batch modes: statistics of its own slice, the state threaded
    through each shard's micro-batches, running averages averaged over shards."""
    graphdef, params, rest = nnx.split(make_model(), nnx.Param, ...)
    opt_state = TX.init(params)

    def forward(p, state, chunk):
        def f(p):
            model = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, state))
            return cnn_loss(model, chunk), nnx.state(model, nnx.Not(nnx.Param))
        (loss, state), grads = jax.value_and_grad(f, has_aux=True)(p)
        return loss, grads, state

    @jax.jit
    def step(params, rest, opt_state, batch):
        rows = batch["label"].shape[0] // (shards * microbatches)
        losses, grads, states = [], [], []
        for shard in range(shards):
            state = rest
            for m in range(microbatches):
                start = (shard * microbatches + m) * rows
                chunk = jax.tree.map(lambda x: x[start:start + rows], batch)
                loss, g, state = forward(params, state, chunk)
                losses.append(loss)
                grads.append(g)
            states.append(state)
        mean = lambda *xs: sum(xs) / len(xs)
        grads = jax.tree.map(mean, *grads)
        rest = jax.tree.map(lambda *xs: mean(*xs) if jnp.issubdtype(xs[0].dtype, jnp.floating)
                            else xs[0], *states)
        updates, opt_state = TX.update(grads, opt_state, params)
        return mean(*losses), grads, jax.tree.map(lambda p, u: p + u, params, updates), \
            rest, opt_state

    losses, first = [], None
    for batch in batches:
        loss, grads, params, rest, opt_state = step(params, rest, opt_state, batch)
        losses.append(float(loss))
        first = jax.device_get(grads) if first is None else first
    return losses, first, nnx.merge(graphdef, params, rest), jax.device_get(opt_state)


@pytest.mark.parametrize("mode,shards,microbatches,dropout", [
    ("per_replica", 2, 1, 0.0),       # DDP's statistics (dropout: see the global tests)
    ("per_microbatch", 1, 2, 0.5),    # GPipe's: a plain loop over micro-batches, RNGs included
    ("per_microbatch", 2, 2, 0.0),
])
def test_opt_in_statistics_equal_their_per_slice_computation(mode, shards, microbatches,
                                                             dropout):
    make = lambda: CNN(rngs=nnx.Rngs(0), dropout=dropout)
    options = dict(batch_stats=mode)
    if microbatches > 1:
        options["microbatches"] = microbatches
    run = parallax_run(make, cnn_loss, BATCHES[:3], mesh(data=shards), px.DataParallel(),
                       **options)
    assert_same_training(run, plain_slices(make, BATCHES[:3], shards, microbatches))


# --- a bias right before a BatchNorm: what "the same statistics" can mean -----------------

class BiasedCNN(nnx.Module):
    """The stock CNN of issue 24, case 1: ``Conv`` *with* its bias, then ``BatchNorm``."""

    def __init__(self, *, rngs):
        self.conv = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)  # momentum 0.99
        self.head = nnx.Linear(8, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(nnx.relu(self.bn(self.conv(x))).mean(axis=(1, 2)))


def biased_trajectory(step, carry, batches):
    """``(loss, batch mean of the conv output, bias used, running mean, running var)`` of
    each step, read from the model the step starts from and the state it leaves."""
    rows = []
    for batch in batches:
        model = carry[1]()
        mean = np.asarray(model.conv(batch["image"])).mean(axis=(0, 1, 2))
        bias = np.asarray(model.conv.bias[...]).copy()
        carry, loss = step(carry, batch)
        after = carry[1]()
        rows.append((float(loss), mean, bias, np.asarray(after.bn.mean[...]).copy(),
                     np.asarray(after.bn.var[...]).copy()))
    return rows


def biased_plain(batches):
    model = BiasedCNN(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def update(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(cnn_loss)(model, batch)
        optimizer.update(model, grads)
        return loss

    def step(carry, batch):
        return carry, update(model, optimizer, batch)

    return biased_trajectory(step, (None, lambda: nnx.clone(model)), batches)


def biased_parallax(batches):
    m, strategy = mesh(data=8), px.DataParallel("data")
    state = px.shard(px.TrainState.create(BiasedCNN(rngs=nnx.Rngs(0)), optax.adam(1e-2)), m,
                     strategy)

    @px.train_step(m, strategy)
    def update(state, batch):
        loss, grads = px.value_and_grad(cnn_loss)(state.model, batch)
        return state.apply_gradients(grads), loss

    def model_of(state):
        return lambda: nnx.merge(state.graphdef, jax.device_get(state.params),
                                 jax.device_get(state.rest))

    def step(carry, batch):
        state, loss = update(carry[0], batch)
        return (state, model_of(state)), loss

    return biased_trajectory(step, (state, model_of(state)), batches)


def test_a_bias_before_batch_norm_is_rounding_noise_and_the_statistics_say_so():
    """Issue 24, case 1, measured: the running mean of a BatchNorm that follows a biased
    convolution is not a number two programs can agree on, and parallax keeps what is.

    A bias right before a BatchNorm has a gradient that is zero in exact arithmetic (the
    mean subtraction removes it), so it holds rounding noise (~1e-9 here); Adam divides
    each entry by its own magnitude and moves the bias by about ``lr`` in the noise's
    direction. The running mean averages the conv output, bias included, so it follows
    that noise; the running variance, the losses and the other parameters do not. The
    plain nnx loop fed the same rows in another order (the same mathematics) drifts
    exactly as parallax does. What must hold, and is asserted against the plain loop
    (BatchNorm's definition, Ioffe & Szegedy 2015; flax ``nnx.BatchNorm``'s
    ``ra = momentum * ra + (1 - momentum) * batch_mean``):

    - every step updates the running mean from the batch mean of the model it ran
      (``0.99 * previous + 0.01 * mean``), in each program;
    - the running mean less its bias part (the same average of the biases used) and the
      running variance equal the plain loop's; so do the losses.
    """
    rng = np.random.default_rng(0)
    batches = [{"image": rng.standard_normal((16, 16, 16, 3), np.float32),
                "label": rng.integers(0, 10, 16).astype(np.int32)} for _ in range(3)]
    shuffled = np.random.default_rng(1).permutation(16)
    runs = {"plain": biased_plain(batches), "parallax": biased_parallax(batches),
            "plain, rows shuffled": biased_plain(
                [jax.tree.map(lambda x: x[shuffled], b) for b in batches])}
    d = px.testing.relative_difference
    without_bias = {}
    for name, rows in runs.items():
        running, bias_part = np.zeros(8), np.zeros(8)
        for _, mean, bias, after, _ in rows:
            running = 0.99 * running + 0.01 * mean
            bias_part = 0.99 * bias_part + 0.01 * bias
            assert d(after, running) <= 1e-5, name  # the definition, in every program
        without_bias[name] = running - bias_part
    plain, ours = runs["plain"], runs["parallax"]
    assert d(np.array([r[0] for r in ours]), np.array([r[0] for r in plain])) <= 1e-5
    assert d(np.array([r[4] for r in ours]), np.array([r[4] for r in plain])) <= 1e-5
    assert d(without_bias["parallax"], without_bias["plain"]) <= 1e-5
    # the bias part is the program's rounding: one device disagrees with itself as much
    raw = lambda name: np.array([r[3] for r in runs[name]])
    assert d(raw("plain, rows shuffled"), raw("plain")) > 1e-2
