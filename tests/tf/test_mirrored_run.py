"""``run`` is one compiled program per input signature, with DataParallel's collectives."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.analysis import hlo

from .tf_testing import GLOBAL_BATCH, Net, dataset, objects, train_mirrored, train_one_device

# Each test takes 2.5 to 3 s of one core (docs/design.md, "Test suite time"): full suite only.
pytestmark = pytest.mark.slow


def _step(model, optimizer, inputs):
    features, labels = inputs

    def loss_fn(model):
        logits = model(features)
        per_example_loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return px.tf.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    grads = px.tf.get_replica_context().all_reduce(px.tf.ReduceOp.SUM, grads)
    optimizer.update(model, grads)
    return loss


def test_run_compiles_once_per_input_signature():
    traces = []

    def counted(model, optimizer, inputs):
        traces.append(inputs[0].shape)  # runs only while tracing
        return _step(model, optimizer, inputs)

    strategy = px.tf.MirroredStrategy()
    with strategy.scope():
        model, optimizer, _ = objects(batch_norm=False)
    for batch in strategy.experimental_distribute_dataset(dataset(steps=4)):
        strategy.run(counted, args=(model, optimizer, batch))
    assert traces == [(4, 8)]  # 4 steps, one trace of the per-replica batch
    small = next(iter(strategy.experimental_distribute_dataset(dataset(steps=1, batch=16))))
    strategy.run(counted, args=(model, optimizer, small))
    strategy.run(counted, args=(model, optimizer, small))
    assert traces == [(4, 8), (2, 8)]  # a new shape is a new signature, compiled once


def test_step_has_the_collectives_of_data_parallel():
    strategy = px.tf.MirroredStrategy()
    with strategy.scope():
        model, optimizer, _ = objects(batch_norm=False)
    graphdef, state = nnx.split((model, optimizer))

    @jax.jit  # TensorFlow's @tf.function around the distributed step
    def mirrored_step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        losses = strategy.run(_step, args=(model, optimizer, batch))
        return nnx.state((model, optimizer)), strategy.reduce("SUM", losses, axis=None)

    batch = next(iter(strategy.experimental_distribute_dataset(dataset(steps=1))))
    mirrored = hlo.collectives(mirrored_step.lower(state, batch).compile(), strategy.mesh)

    mesh, dp = px.make_mesh(data=8), px.DataParallel("data")
    train_state = px.init(lambda: px.TrainState.create(
        Net(rngs=nnx.Rngs(0)), optax.sgd(0.1, momentum=0.9)), mesh, dp)

    def mean_loss(model, batch):
        return optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1]).mean()

    @px.train_step(mesh, dp)
    def dp_step(state, batch):
        loss, grads = px.value_and_grad(mean_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    data_parallel = hlo.collectives(dp_step.lower(train_state, dataset(steps=1)[0]).compile(),
                                    mesh)

    def summary(found):
        return sorted((c.kind, c.dtypes, c.shapes, c.groups, c.message_bytes) for c in found)

    assert summary(mirrored) == summary(data_parallel)
    grad_bytes = 4 * sum(np.size(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert sum(c.message_bytes for c in mirrored) == grad_bytes + 4  # + the scalar loss


def test_loop_with_a_point_to_point_op_equals_one_device():
    # The ring's sums are typed varying; the mirrored parameters written from them must
    # still leave run as one replicated value.
    ops = px.tf.NcclAllReduce()
    ref_losses, ref_state, _ = train_one_device(False, dataset(steps=3))
    losses, state, _ = train_mirrored(px.tf.MirroredStrategy(cross_device_ops=ops), False,
                                      dataset(steps=3))
    assert px.testing.relative_difference(losses, ref_losses) <= 1e-5
    assert px.testing.relative_difference(state, ref_state) <= 1e-5
