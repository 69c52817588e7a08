"""A mirrored variable written differently on the replicas is refused, naming it and the fix.

TensorFlow 2 (``tensorflow/python/distribute/values.py``, ``_on_write_update_replica``) lets
each replica assign its own component of a variable with aggregation ``NONE``; its Keras
optimizers all-reduce the gradients first (``apply_gradients``'s
``experimental_aggregate_gradients=True`` / ``skip_gradients_aggregation=False``), and
TensorFlow 1 refused the write ("You must specify an aggregation method to update a
MirroredVariable in Replica Context"). parallax keeps one replicated array per mirrored
variable, so it refuses a divergent write (see ``parallax.tf.mirrored.divergence``).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px

FIX = (r"Aggregate the gradients before applying them, as Keras' optimizers do under "
       r"MirroredStrategy: grads = px.tf.get_replica_context\(\).all_reduce\('SUM', grads\)")


def _setup(strategy):
    with strategy.scope():
        model = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x = np.arange(8 * 2 * 4, dtype=np.float32).reshape(16, 4) / 10
    batch = next(iter(strategy.experimental_distribute_dataset([jnp.asarray(x)])))
    return model, optimizer, batch


def _step(aggregate):
    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(
            lambda m: px.tf.compute_average_loss(jnp.sum(m(x) ** 2, axis=-1)))(model)
        if aggregate:
            grads = px.tf.get_replica_context().all_reduce("SUM", grads)
        optimizer.update(model, grads)
        return loss
    return step


def test_unaggregated_gradients_are_refused_and_the_state_kept():
    strategy = px.tf.MirroredStrategy()
    model, optimizer, batch = _setup(strategy)
    before = jax.device_get(nnx.state(model))
    with pytest.raises(ValueError, match=(
            r"px.tf.MirroredStrategy.run: the replica function wrote a different value on "
            r"each replica into the mirrored variable\(s\) Linear \(NNX object 0 in args\)"
            r"\['bias'\].value, Linear \(NNX object 0 in args\)\['kernel'\].value; a "
            r"mirrored variable must be the same on every replica")) as error:
        strategy.run(_step(False), args=(model, optimizer, batch))
    assert re.search(FIX, str(error.value))
    # Nothing was written back: every device still holds the kernel from before.
    after = jax.device_get(nnx.state(model))
    assert jax.tree.all(jax.tree.map(np.array_equal, before, after))
    assert int(optimizer.step[...]) == 0


def test_aggregated_gradients_pass_and_stay_equal_on_every_device():
    strategy = px.tf.MirroredStrategy()
    model, optimizer, batch = _setup(strategy)
    for _ in range(3):
        strategy.run(_step(True), args=(model, optimizer, batch))
    kernel = model.kernel[...]
    shards = [np.asarray(s.data) for s in kernel.addressable_shards]
    assert all(np.array_equal(shards[0], s) for s in shards)
    assert int(optimizer.step[...]) == 3


def test_a_variable_with_an_aggregation_may_differ():
    strategy = px.tf.MirroredStrategy()
    with strategy.scope():
        holder = nnx.Dict(v=nnx.Variable(jnp.zeros(()), aggregation="mean"))

    def write_id(h):
        h["v"][...] = px.tf.get_replica_context().replica_id_in_sync_group.astype(jnp.float32)
        return h["v"][...]

    strategy.run(write_id, args=(holder,))
    assert float(holder["v"][...]) == pytest.approx(3.5)  # the mean of 0 .. 7
