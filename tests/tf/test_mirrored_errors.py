"""Pinned messages of the mirrored strategy's API boundary."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import parallax as px


@pytest.fixture(scope="module")
def strategy():
    return px.tf.MirroredStrategy()


def test_value_from_another_strategy(strategy):
    other = px.tf.MirroredStrategy(devices=[0, 1, 2, 3])
    foreign = next(iter(other.experimental_distribute_dataset([np.zeros((8, 2))])))
    with pytest.raises(ValueError, match=r"px.tf.MirroredStrategy.run: args\[0\] is a PerReplica "
                                         r"value of another strategy \(MirroredStrategy\(4 "
                                         r"replicas on cpu.*\); this strategy is "
                                         r"MirroredStrategy\(8 replicas"):
        strategy.run(lambda x: x, args=(foreign,))
    with pytest.raises(ValueError, match=r"px.tf.MirroredStrategy.reduce: value\['loss'\] is a "
                                         r"PerReplica value of another strategy"):
        strategy.reduce("SUM", {"loss": foreign})
    with other.scope():
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"px.tf.MirroredStrategy.run: the state of the NNX "
                                         r"objects in args is an array on 4 devices"):
        strategy.run(lambda m: m(jnp.ones(2)), args=(model,))


def test_reduce_errors(strategy):
    with pytest.raises(ValueError, match=r"px.tf.MirroredStrategy.reduce: axis=0 reduces over "
                                         r"the global batch of a per-replica value, but value is "
                                         r"a ndarray, not a PerReplica value; pass axis=None"):
        strategy.reduce("SUM", np.ones(4), axis=0)
    with pytest.raises(ValueError, match=r"px.tf.MirroredStrategy.reduce: unknown ReduceOp "
                                         r"'MAX'; use px.tf.ReduceOp.SUM or px.tf.ReduceOp.MEAN"):
        strategy.reduce("MAX", np.ones(4))
    with pytest.raises(TypeError, match=r"reduce_op must be px.tf.ReduceOp.SUM or "
                                        r"px.tf.ReduceOp.MEAN .*; got int: 3"):
        strategy.reduce(3, np.ones(4))
    with pytest.raises(ValueError, match=r"value is a ndarray, not a PerReplica or Mirrored "
                                         r"value, so SUM over 8 replicas is undefined"):
        strategy.reduce("SUM", np.ones(4))
    np.testing.assert_array_equal(strategy.reduce("MEAN", np.ones(4)), np.ones(4))
    value = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones(3))
    with pytest.raises(ValueError, match=r"axis=2 is out of range for value, whose per-replica "
                                         r"components have rank 1"):
        strategy.reduce("SUM", value, axis=2)
    with pytest.raises(ValueError, match=r"ReplicaContext.all_reduce: unknown ReduceOp 'min'"):
        strategy.run(lambda v: px.tf.get_replica_context().all_reduce("min", v), args=(value,))


def test_run_errors(strategy):
    with pytest.raises(TypeError, match=r"px.tf.MirroredStrategy.run: fn must be callable \(the "
                                        r"replica function, e.g. train_step\); got str"):
        strategy.run("train_step")
    with pytest.raises(TypeError, match=r"args must be a tuple or list of arguments; got "
                                        r"ndarray \(wrap a single argument: args=\(x,\)\)"):
        strategy.run(lambda x: x, args=np.ones(8))
    with pytest.raises(TypeError, match=r"args\[0\]\['bad'\] is a _Unhashable, which is "
                                        r"neither an array nor hashable"):
        strategy.run(lambda d: 0, args=({"bad": _Unhashable()},))
    with strategy.scope():
        model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))

    def closure(x):  # TensorFlow style: the model captured, not passed
        return model(x)

    with pytest.raises(ValueError, match=r"px.tf.MirroredStrategy.run: the replica function "
                                         r"reads 'model' \(an NNX Linear\) from its closure or "
                                         r"globals; jit would bake its current values"):
        strategy.run(closure, args=(jnp.ones(2),))
    with pytest.raises(ValueError, match=r"reads 'self' \(an NNX Linear\)"):
        strategy.run(model.__call__, args=(jnp.ones(2),))  # a bound method captures it too
    strategy.run(lambda m, x: m(x), args=(model, jnp.ones(2)))  # passed: fine

    def grow(m):
        m.extra = nnx.Param(jnp.zeros(2))

    with pytest.raises(ValueError, match=r"changed the structure of the NNX objects it received"):
        strategy.run(grow, args=(model,))
    with pytest.raises(TypeError, match=r"the replica function returned a str"):
        strategy.run(lambda: "done")


class _Unhashable:
    __hash__ = None


def test_scope_and_devices():
    a, b = px.tf.MirroredStrategy(), px.tf.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with a.scope():
        with pytest.raises(ValueError, match=r"px.tf.MirroredStrategy.scope: already inside the "
                                             r"scope of MirroredStrategy\(8 replicas"):
            with b.scope():
                pass
    with pytest.raises(ValueError, match=r"px.tf.MirroredStrategy: unknown device 'gpu:0'; this "
                                         r"process has \['cpu:0', 'cpu:1'"):
        px.tf.MirroredStrategy(devices=["gpu:0"])
    with pytest.raises(ValueError, match=r"must be distinct and not empty"):
        px.tf.MirroredStrategy(devices=[0, 0])
    assert px.tf.MirroredStrategy(devices=["/device:CPU:1", 0]).devices[0].id == 1
