"""``ReplicaContext.merge_call`` and ``strategy.extended``: TF's Keras-optimizer pattern."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px


def replica_ids(strategy):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: np.full((2,), ctx.replica_id_in_sync_group, np.float32))


def test_merge_fn_runs_in_cross_replica_context_and_results_unwrap():
    strategy = px.tf.MirroredStrategy()
    seen = {}

    def merge_fn(s, v, scale):
        seen["context"] = (px.tf.get_replica_context(), px.tf.in_cross_replica_context(), s)
        total = s.reduce("SUM", v, axis=None)
        mean_rows = s.reduce("MEAN", v, axis=0)
        gathered = s.gather(v, axis=0)
        parts = s.experimental_local_results(v)
        return v, total * scale, mean_rows, gathered, parts[7]

    def replica_fn(x):
        return px.tf.get_replica_context().merge_call(merge_fn, args=(x,),
                                                      kwargs={"scale": 2.0})

    own, total, mean, gathered, last = strategy.run(replica_fn, args=(replica_ids(strategy),))
    assert seen["context"] == (None, True, strategy)
    assert [v.tolist() for v in own.values] == [[i, i] for i in range(8)]  # its component
    assert all(v.tolist() == [56.0, 56.0] for v in total.values)   # 2 x (0 + ... + 7)
    assert all(float(v) == 3.5 for v in mean.values)               # mean over replicas, rows
    assert gathered.values[3].tolist() == [i for i in range(8) for _ in range(2)]
    assert all(v.tolist() == [7.0, 7.0] for v in last.values)


def test_merge_call_needs_a_strategy():
    with pytest.raises(ValueError, match=r"px\.tf\.ReplicaContext\.merge_call: called outside "
                       r"any strategy \(the default replica context\), where TensorFlow passes "
                       r"its default strategy; parallax has none to pass"):
        px.tf.get_replica_context().merge_call(lambda s: None)
    one = px.tf.OneDeviceStrategy("cpu:0")
    total = one.run(lambda: px.tf.get_replica_context().merge_call(
        lambda s, x: s.reduce("SUM", x, axis=None), args=(jnp.float32(3),)))
    assert float(total) == 3.0


def keras_style_step(model, batch, aggregate):
    """Loss, gradients per replica; merge_call reduces them and updates each variable once."""
    ctx = px.tf.get_replica_context()

    def loss_fn(m):
        return px.tf.compute_average_loss((m(batch["x"]) - batch["y"])[:, 0] ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    params = nnx.state(model, nnx.Param)
    leaves = jax.tree.leaves(grads)
    variables = [v for _, v in nnx.to_flat_state(params)]

    def apply(s, variables, leaves):
        if aggregate == "batch":
            reduced = s.extended.batch_reduce_to(
                "SUM", [(g, v) for g, v in zip(leaves, variables)])
        else:
            reduced = [s.extended.reduce_to("SUM", g, destinations=v)
                       for g, v in zip(leaves, variables)]
        for variable, grad in zip(variables, reduced):
            s.extended.update(variable, lambda var, g: var.__setitem__(..., var[...] - 0.1 * g),
                              args=(grad,), group=False)

    ctx.merge_call(apply, args=(variables, leaves))
    return loss


@pytest.mark.parametrize("aggregate", ["each", "batch"])
def test_keras_style_updates_match_one_device(aggregate):
    strategy = px.tf.MirroredStrategy()
    rng = np.random.default_rng(0)
    data = [{"x": rng.normal(size=(16, 3)).astype(np.float32),
             "y": rng.normal(size=(16, 1)).astype(np.float32)} for _ in range(3)]
    with strategy.scope():
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    reference = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    tx = optax.sgd(0.1)
    ref_params = nnx.state(reference, nnx.Param)
    opt_state = tx.init(ref_params)
    for batch, dist in zip(data, strategy.experimental_distribute_dataset(data)):
        strategy.run(keras_style_step, args=(model, dist, aggregate))

        def loss_fn(p):
            m = nnx.merge(nnx.graphdef(reference), p)
            return jnp.mean((m(batch["x"]) - batch["y"])[:, 0] ** 2)

        grads = jax.grad(loss_fn)(ref_params)
        updates, opt_state = tx.update(grads, opt_state)
        ref_params = optax.apply_updates(ref_params, updates)
        for got, want in zip(jax.tree.leaves(nnx.state(model, nnx.Param)),
                             jax.tree.leaves(ref_params)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_update_refuses_a_per_replica_argument():
    strategy = px.tf.MirroredStrategy()
    with strategy.scope():
        model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))

    def replica_fn(model, x):
        px.tf.get_replica_context().merge_call(
            lambda s, b, g: s.extended.update(b, lambda v, d: v, args=(g,)),
            args=(model.bias, x[:1]))

    with pytest.raises(ValueError, match=r"px\.tf\.MirroredStrategy\.extended\.update: "
                       r"\[0\]\[0\] is a per-replica value; update takes mirrored arguments "
                       r"only \(TensorFlow refuses them too\): reduce it first"):
        strategy.run(replica_fn, args=(model, replica_ids(strategy)))


def test_extended_devices_and_bad_destinations():
    strategy = px.tf.MirroredStrategy()
    ext = strategy.extended
    assert len(ext.worker_devices) == 8 == len(ext.parameter_devices)
    assert ext.should_checkpoint and ext.experimental_require_static_shapes
    with pytest.raises(TypeError, match=r"px\.tf\.MirroredStrategy\.extended\.reduce_to: "
                       r"destinations must be a variable, an array, a device name"):
        ext.reduce_to("SUM", replica_ids(strategy), destinations=None)
    reduced = ext.reduce_to("MEAN", replica_ids(strategy), destinations="cpu:0")
    assert isinstance(reduced, px.tf.Mirrored) and reduced.value.tolist() == [3.5, 3.5]


def test_one_device_strategy_runs_a_mirrored_script_unchanged():
    strategy = px.tf.OneDeviceStrategy("/cpu:0")
    assert strategy.num_replicas_in_sync == 1 and "cpu:0" in repr(strategy).lower()
    with strategy.scope():
        model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    reference = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    ref_opt = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)
    x = np.arange(12.0, dtype=np.float32).reshape(4, 3) / 10

    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        grads = px.tf.get_replica_context().all_reduce("SUM", grads)
        optimizer.update(model, grads)
        return loss

    for batch in strategy.experimental_distribute_dataset([x, x]):
        assert isinstance(batch, jax.Array) and batch.shape == (4, 3)
        loss = strategy.run(step, args=(model, optimizer, batch))
        assert isinstance(loss, jax.Array)  # plain, as TF's OneDeviceStrategy returns
        want = step(reference, ref_opt, x)
        np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(model.kernel[...]), np.asarray(reference.kernel[...]),
                               rtol=1e-6)
    assert float(strategy.reduce("SUM", jnp.arange(4.0), axis=0)) == 6.0
    assert strategy.experimental_local_results(loss) == (loss,)
    with pytest.raises(TypeError, match=r"px\.tf\.OneDeviceStrategy: device must be one "
                       r"device \(e\.g\. 'gpu:0'\); got a list of 2"):
        px.tf.OneDeviceStrategy(["cpu:0", "cpu:1"])
