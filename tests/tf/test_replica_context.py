"""Replica and cross-replica contexts, loss scaling, the default strategy."""

import jax.numpy as jnp
import numpy as np
import pytest

import parallax as px


def test_contexts():
    strategy = px.tf.MirroredStrategy()
    default = px.tf.get_replica_context()
    assert default.num_replicas_in_sync == 1 and not px.tf.in_cross_replica_context()
    assert float(default.all_reduce("MEAN", jnp.float32(3))) == 3.0
    assert px.tf.get_strategy().num_replicas_in_sync == 1
    with strategy.scope():
        assert px.tf.get_replica_context() is None and px.tf.in_cross_replica_context()
        assert px.tf.get_strategy() is strategy
        created = jnp.zeros(3)  # arrays made in scope are mirrored (replicated)
    assert created.sharding.is_fully_replicated and len(created.devices()) == 8

    def replica_fn(x):
        ctx = px.tf.get_replica_context()
        assert ctx.num_replicas_in_sync == 8 and ctx.strategy == strategy
        gathered = ctx.all_gather(x, axis=0)
        return ctx.replica_id_in_sync_group, gathered

    ids, gathered = strategy.run(replica_fn, args=(
        strategy.experimental_distribute_values_from_function(
            lambda ctx: np.full((1,), ctx.replica_id_in_sync_group, np.float32)),))
    assert [int(i) for i in ids.values] == list(range(8))
    assert gathered.values[5].tolist() == list(range(8))


def test_compute_average_loss_divides_by_the_global_batch():
    strategy = px.tf.MirroredStrategy()
    per_example = np.arange(32.0, dtype=np.float32)
    batch = next(iter(strategy.experimental_distribute_dataset([per_example])))

    def replica_fn(losses):  # default global batch: 4 local examples x 8 replicas
        return (px.tf.compute_average_loss(losses),
                px.tf.compute_average_loss(losses, sample_weight=2.0, global_batch_size=64),
                px.tf.scale_regularization_loss(jnp.float32(8.0)))

    mean, weighted, regularization = strategy.run(replica_fn, args=(batch,))
    assert float(strategy.reduce("SUM", mean)) == pytest.approx(per_example.mean())
    assert float(strategy.reduce("SUM", weighted)) == pytest.approx(per_example.mean())
    assert float(strategy.reduce("SUM", regularization)) == pytest.approx(8.0)
    with pytest.raises(ValueError, match=r"px.tf.compute_average_loss: per_example_loss has "
                                         r"shape \(\); pass one loss per example"):
        px.tf.compute_average_loss(jnp.float32(1.0))
    # TensorFlow (nn_impl_distribute.py): a zero global batch gives 0 (div_no_nan).
    assert float(px.tf.compute_average_loss(jnp.ones(3), global_batch_size=0)) == 0.0
    with pytest.raises(ValueError, match=r"global_batch_size=-1 must be a non-negative int"):
        px.tf.compute_average_loss(jnp.ones(3), global_batch_size=-1)
