"""A partial last batch is split over the replicas as TensorFlow splits it (issue 24, case 8).

TensorFlow (``tensorflow/python/distribute/input_lib.py``, ``_make_rebatch_fn``, and
``tensorflow/python/data/experimental/ops/distribute.py``, ``batch_sizes_for_worker``)
rebatches a global batch ``G`` into per-replica sizes ``G // n`` (+1 for the first ``G % n``)
and fills the replicas in order from a partial last batch, the last replicas getting fewer
rows or an empty batch. ``tf.nn.compute_average_loss``
(``tensorflow/python/ops/nn_impl_distribute.py``) divides each replica's sum by the
``global_batch_size`` passed, or by default by *its own* rows times the replica count
(``div_no_nan``). The training tests compare 8 replicas with one device computing exactly
those numbers on the same examples: losses, parameters and optimizer state after every step,
the partial one included.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.tf.input import partial_batches

from .tf_testing import Net

N = 8
GLOBAL = 16


def test_tf_batch_sizes_and_split():
    # batch_sizes_for_worker's docstring example: G = 7 over W = 2 workers x R = 2 replicas.
    assert partial_batches.replica_batch_sizes(7, 4) == (2, 2, 2, 1)
    assert partial_batches.split_rows(16, 16, 8) == (2,) * 8
    assert partial_batches.split_rows(5, 16, 8) == (2, 2, 1, 0, 0, 0, 0, 0)
    assert partial_batches.split_rows(12, 12, 8) == (2, 2, 2, 2, 1, 1, 1, 1)


def test_last_batch_as_in_tensorflows_input_lib_test():
    # input_lib_test: range(9).batch(4) over 2 replicas gives [[0,1],[2,3]], [[4,5],[6,7]],
    # [[8],[]].
    strategy = px.tf.MirroredStrategy(jax.devices()[:2])
    data = [np.arange(9)[i:i + 4] for i in range(0, 9, 4)]
    got = [[v.tolist() for v in b.values] for b in strategy.experimental_distribute_dataset(data)]
    assert got == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]


def test_reduce_gather_and_local_results_read_the_real_rows():
    strategy = px.tf.MirroredStrategy()
    data = [np.arange(16.0), np.arange(5.0) + 100]
    last = list(strategy.experimental_distribute_dataset(data))[1]
    assert last.rows == (2, 2, 1, 0, 0, 0, 0, 0) and last.shape == (2,)
    assert [len(v) for v in strategy.experimental_local_results(last)] == [2, 2, 1, 0, 0, 0, 0, 0]
    assert float(strategy.reduce("MEAN", last, axis=0)) == pytest.approx(102.0)
    assert float(strategy.reduce("SUM", last, axis=0)) == pytest.approx(510.0)
    assert strategy.gather(last, axis=0).tolist() == [100.0, 101.0, 102.0, 103.0, 104.0]
    with pytest.raises(ValueError, match=r"px.tf.MirroredStrategy.reduce: value is a partial "
                                         r"batch whose replicas hold \[2, 2, 1, 0, 0, 0, 0, 0\] "
                                         r"rows .* so axis=None is undefined; use axis=0"):
        strategy.reduce("SUM", last, axis=None)


def _data(total, features=8, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((total, features), np.float32)
    y = rng.integers(0, 4, total).astype(np.int32)
    return [(x[i:i + GLOBAL], y[i:i + GLOBAL]) for i in range(0, total, GLOBAL)]


def _objects():
    model = Net(rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)


def _train_step(model, optimizer, metric, inputs, global_batch_size):
    features, labels = inputs

    def loss_fn(model):
        per_example = optax.softmax_cross_entropy_with_integer_labels(model(features), labels)
        return px.tf.compute_average_loss(per_example, global_batch_size=global_batch_size)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    grads = px.tf.get_replica_context().all_reduce("SUM", grads)
    optimizer.update(model, grads)
    mask = px.tf.get_replica_context().example_mask(labels.shape[0])
    metric.update(logits=model(features), labels=labels, mask=mask)
    return loss


def _reference_weights(rows, global_batch_size):
    """Per example, the factor TF's compute_average_loss gives it on its replica."""
    split = partial_batches.split_rows(rows, GLOBAL, N)
    if global_batch_size is not None:
        return np.full(rows, 1.0 / global_batch_size, np.float32)
    return np.concatenate([np.full(r, 1.0 / (r * N), np.float32) for r in split if r])


@pytest.mark.slow
@pytest.mark.parametrize("global_batch_size", [GLOBAL, None, 5],
                         ids=["tutorial-GLOBAL_BATCH", "tf-default", "true-size"])
def test_partial_last_batch_trains_as_tensorflow(global_batch_size):
    data = _data(2 * GLOBAL + 5)  # batches of 16, 16 and a partial 5: rows [2, 2, 1, 0 ...]
    model, optimizer = _objects()
    ref_metric = nnx.metrics.Accuracy()

    @nnx.jit
    def ref_step(model, optimizer, metric, x, y, weights):
        def loss_fn(model):
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
            return jnp.sum(per_example * weights)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        metric.update(logits=model(x), labels=y)
        return loss

    ref_losses, ref_states = [], []
    for x, y in data:
        size = global_batch_size if x.shape[0] < GLOBAL else GLOBAL
        weights = jnp.asarray(_reference_weights(x.shape[0], size))
        ref_losses.append(float(ref_step(model, optimizer, ref_metric, x, y, weights)))
        ref_states.append(nnx.state((model, optimizer)))

    strategy = px.tf.MirroredStrategy()
    with strategy.scope():
        model, optimizer = _objects()
        metric = nnx.metrics.Accuracy()
    losses, states = [], []
    for step, batch in enumerate(strategy.experimental_distribute_dataset(data)):
        size = global_batch_size if step == 2 else GLOBAL
        per_replica = strategy.run(_train_step, args=(model, optimizer, metric, batch, size))
        losses.append(float(strategy.reduce("SUM", per_replica, axis=None)))
        states.append(nnx.state((model, optimizer)))
    assert len(losses) == 3 and batch[0].rows == (2, 2, 1, 0, 0, 0, 0, 0)
    assert px.testing.relative_difference(losses, ref_losses) <= 1e-5
    for got, want in zip(states, ref_states):
        assert px.testing.relative_difference(got, want) <= 1e-5
    assert float(metric.compute()) == pytest.approx(float(ref_metric.compute()), abs=1e-7)


def test_global_batch_that_does_not_divide_trains_as_tensorflow():
    data = _data(24)[:1]  # one batch of 16 -> re-cut below to 12 rows over 8 replicas
    data = [(x[:12], y[:12]) for x, y in data]
    model, optimizer = _objects()

    @nnx.jit
    def ref_step(model, optimizer, x, y):
        def loss_fn(model):
            per_example = optax.softmax_cross_entropy_with_integer_labels(model(x), y)
            return jnp.sum(per_example) / 12

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    ref_loss = float(ref_step(model, optimizer, *data[0]))
    strategy = px.tf.MirroredStrategy()
    with strategy.scope():
        pmodel, poptimizer = _objects()
        metric = nnx.metrics.Accuracy()
    (batch,) = strategy.experimental_distribute_dataset(data)
    assert batch[0].rows == (2, 2, 2, 2, 1, 1, 1, 1)
    loss = strategy.run(_train_step, args=(pmodel, poptimizer, metric, batch, 12))
    assert float(strategy.reduce("SUM", loss, axis=None)) == pytest.approx(ref_loss, rel=1e-5)
    assert px.testing.relative_difference(nnx.state(pmodel), nnx.state(model)) <= 1e-5


def test_a_padded_batch_nobody_masks_is_refused():
    strategy = px.tf.MirroredStrategy()
    with strategy.scope():
        model, optimizer = _objects()
    before = jax.tree.map(np.asarray, nnx.state(model))
    last = list(strategy.experimental_distribute_dataset(_data(GLOBAL + 5)))[1]

    def unmasked_step(model, optimizer, inputs):
        features, labels = inputs

        def loss_fn(m):  # a plain mean: the zero padding rows would enter it
            return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(m(features), labels))

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, px.tf.get_replica_context().all_reduce("MEAN", grads))
        return loss

    with pytest.raises(ValueError, match=r"px.tf.MirroredStrategy.run: this step's batch is a "
                                         r"partial last batch split over the replicas as "
                                         r"TensorFlow splits it \(real rows per replica: "
                                         r"\[2, 2, 1, 0, 0, 0, 0, 0\]\); in one compiled program "
                                         r"every replica holds 2 rows.*drop_remainder=True"):
        strategy.run(unmasked_step, args=(model, optimizer, last))
    assert px.testing.relative_difference(nnx.state(model), before) == 0.0
    with pytest.raises(ValueError, match=r"px.tf.compute_average_loss: px.tf.ReplicaContext: a "
                                         r"value with 6 rows, but this step's per-replica batch "
                                         r"is padded to 2 rows"):
        strategy.run(lambda x: px.tf.compute_average_loss(jnp.zeros(6) + x[0][0, 0]),
                     args=(last,))
