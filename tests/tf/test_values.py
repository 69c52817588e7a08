"""PerReplica, Mirrored and sync-on-read values: placement, reduce, gather, aggregation."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import parallax as px
from parallax.tf.values import aggregation_of

N = 8


@pytest.fixture(scope="module")
def strategy():
    return px.tf.MirroredStrategy()


def _components(strategy):  # replica r holds [[r, r + .5, r + 1], [10 r, ...]]
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: np.array([[0.0, 0.5, 1.0], [0.0, 5.0, 10.0]], np.float32)
        + ctx.replica_id_in_sync_group * np.array([[1.0], [10.0]], np.float32))


def test_per_replica_components_live_on_their_devices(strategy):
    value = _components(strategy)
    assert value.shape == (2, 3) and value.strategy == strategy
    for r, (component, device) in enumerate(zip(value.values, strategy.devices)):
        assert component.devices() == {device}
        assert component[0, 0] == r
    results = strategy.experimental_local_results({"v": value, "plain": 1.0})
    assert len(results) == N and results[3]["v"][1, 0] == 30 and results[3]["plain"] == 1.0


def test_reduce_over_replicas_and_over_the_global_batch(strategy):
    value = _components(strategy)
    stacked = np.stack([np.asarray(c) for c in value.values])  # [replica, row, col]
    np.testing.assert_allclose(strategy.reduce("SUM", value), stacked.sum(0))
    np.testing.assert_allclose(strategy.reduce("MEAN", value), stacked.mean(0))
    # axis=0: the rows of every replica form the global batch (16 rows)
    global_batch = stacked.reshape(N * 2, 3)
    np.testing.assert_allclose(strategy.reduce("SUM", value, axis=0), global_batch.sum(0))
    np.testing.assert_allclose(strategy.reduce(px.tf.ReduceOp.MEAN, value, axis=0),
                               global_batch.mean(0))
    np.testing.assert_allclose(strategy.reduce("MEAN", value, axis=-1), stacked.mean((0, 2)))
    np.testing.assert_allclose(strategy.gather(value, axis=0), global_batch)
    np.testing.assert_allclose(strategy.gather(value, axis=1),
                               np.concatenate(list(stacked), axis=1))


def test_mirrored_values(strategy):
    out = strategy.run(lambda v: (px.tf.Mirrored(px.tf.get_replica_context().all_reduce(
        "SUM", v)), v), args=(_components(strategy),))
    mirrored, per_replica = out
    assert isinstance(mirrored, px.tf.Mirrored) and isinstance(per_replica, px.tf.PerReplica)
    assert mirrored.value.sharding.is_fully_replicated and len(mirrored.values) == N
    total = strategy.reduce("SUM", per_replica)
    np.testing.assert_allclose(mirrored.value, total)
    np.testing.assert_allclose(strategy.reduce("MEAN", mirrored), total)  # TF: MEAN keeps it
    np.testing.assert_allclose(strategy.reduce("SUM", mirrored), N * total)
    # a Mirrored value passed back to run reaches every replica whole
    again = strategy.run(lambda m: m[1, 2], args=(mirrored,))
    assert [float(x) for x in again.values] == [float(total[1, 2])] * N


class Accumulators(nnx.Module):
    def __init__(self):
        self.total = nnx.Variable(jnp.zeros(()), aggregation="sum")
        self.average = nnx.BatchStat(jnp.ones(()))             # default: MEAN
        self.first = nnx.Variable(
            jnp.zeros(()), aggregation=px.tf.VariableAggregation.ONLY_FIRST_REPLICA)
        self.count = nnx.metrics.Average()                     # MetricState: SUM
        self.weight = nnx.Param(jnp.ones(()))                  # mirrored


def _update(acc):
    r = px.tf.get_replica_context().replica_id_in_sync_group.astype(jnp.float32)
    acc.total[...] = acc.total[...] + r + 1
    acc.average[...] = 0.5 * acc.average[...] + r
    acc.first[...] = r + 10
    acc.count.update(values=jnp.full((2,), r))
    return acc.total[...]  # the replica's own component while inside run


def test_sync_on_read_aggregation(strategy):
    with strategy.scope():
        acc = Accumulators()
    seen = strategy.run(_update, args=(acc,))
    ranks = np.arange(N, dtype=np.float32)
    assert [float(x) for x in seen.values] == list(ranks + 1)
    assert float(acc.total[...]) == (ranks + 1).sum()              # SUM
    assert float(acc.average[...]) == pytest.approx(0.5 + ranks.mean())  # MEAN
    assert float(acc.first[...]) == 10                              # ONLY_FIRST_REPLICA
    assert float(acc.count.compute()) == pytest.approx(ranks.mean())
    assert float(acc.weight[...]) == 1.0
    strategy.run(_update, args=(acc,))  # a SUM re-enters on the first replica only
    assert float(acc.total[...]) == 2 * (ranks + 1).sum()
    assert float(acc.average[...]) == pytest.approx(0.25 + 1.5 * ranks.mean())
    assert acc.total[...].sharding.is_fully_replicated


def test_aggregation_defaults_and_metadata():
    assert aggregation_of(nnx.BatchStat(jnp.zeros(2))) is px.tf.VariableAggregation.MEAN
    assert aggregation_of(nnx.Param(jnp.zeros(2))) is px.tf.VariableAggregation.NONE
    assert aggregation_of(nnx.Param(jnp.zeros(2), aggregation="mean")).name == "MEAN"
    with pytest.raises(ValueError, match=r"px.tf: a Variable has aggregation='max'; use one of "
                                         r"\['NONE', 'SUM', 'MEAN', 'ONLY_FIRST_REPLICA'\]"):
        aggregation_of(nnx.Variable(jnp.zeros(2), aggregation="max"))
