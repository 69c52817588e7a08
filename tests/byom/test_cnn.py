"""A ResNet-style CNN of stock Flax layers (Conv, BatchNorm, Dropout, Linear), not written for
parallax, trains under every data-parallel strategy exactly as a plain nnx loop on one
device: losses, gradients, parameters, BatchNorm running statistics and RNG counters (fp32,
1e-5), with the Dropout masks one device draws."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
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


CASES = {
    "dp": (dict(data=8), px.DataParallel()),
    "zero1": (dict(fsdp=4), px.ZeRO(1, "fsdp")),
    "zero2": (dict(fsdp=4), px.ZeRO(2, "fsdp")),
    "zero3": (dict(fsdp=8), px.ZeRO(3, "fsdp")),
    "dp-fsdp": (dict(data=2, fsdp=4), px.HSDP()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_cnn_trains_as_on_one_device(name):
    axes, strategy = CASES[name]
    run = parallax_run(lambda: CNN(rngs=nnx.Rngs(0)), cnn_loss, BATCHES, mesh(**axes), strategy)
    assert_same_training(run, reference())


def test_accumulation_keeps_the_full_batch_statistics():
    """Global statistics with micro-batches: one computation, the full batch's numbers."""
    strategy = px.compose(px.DataParallel(), px.GradientAccumulation(2))
    run = parallax_run(lambda: CNN(rngs=nnx.Rngs(0)), cnn_loss, BATCHES, mesh(data=2), strategy)
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
    return losses, first, nnx.merge(graphdef, params, rest)


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
