"""DDP's semantics on 8 simulated devices: buckets without the flat buffer's copy compile to
the plain sync's program, the flat buffer still gives one all-reduce per bucket, and bad
packings get pinned messages. (Broadcast from rank 0 at start runs across processes in
tests/horovod/programs/collectives.py; no_sync in tests/horovod/test_optimizer.py.)"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
from parallax.analysis import hlo


def compiled_step(sync):
    mesh = px.make_mesh(data=8)
    strategy = px.DataParallel("data", sync=sync)
    make = lambda: px.TrainState.create(  # noqa: E731
        px.models.MLP(16, [64, 64], 16, rngs=nnx.Rngs(0)), optax.adam(1e-2))
    state = px.init(make, mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    batch = {"x": np.ones((16, 16), np.float32), "y": np.zeros((16, 16), np.float32)}
    return step.lower(state, batch).compile(), mesh, state


def gradient_all_reduces(compiled, mesh):
    return sorted(c.message_bytes for c in hlo.collectives(compiled, mesh)
                  if c.kind == "all-reduce" and c.message_bytes > 4)


@pytest.mark.slow
def test_buckets_of_operands_compile_to_the_plain_sync():
    plain, mesh, state = compiled_step(None)
    bucketed, _, _ = compiled_step(px.BucketedSync())
    grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(state.params))
    # XLA's combiner makes one all-reduce of the gradients and the loss in both programs
    assert gradient_all_reduces(bucketed, mesh) == gradient_all_reduces(plain, mesh) == [
        grad_bytes + 4]
    text = bucketed.as_text()
    assert text.count(" concatenate(") == plain.as_text().count(" concatenate(")
    flat, _, _ = compiled_step(px.BucketedSync(packing="flat"))
    assert flat.as_text().count(" concatenate(") > text.count(" concatenate(")  # the copy


def test_a_leaf_split_between_buckets_comes_back_whole():
    mesh = px.make_mesh(data=8)
    grads = {"a": jnp.arange(8 * 10.0).reshape(8, 10), "b": jnp.ones((8, 3))}
    for packing in ("operands", "flat"):
        f = jax.jit(jax.shard_map(
            lambda g, p=packing: px.comm.bucketed_all_reduce(g, "data", bucket_bytes=16,
                                                             packing=p),
            mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P()))
        out = f(grads)
        np.testing.assert_array_equal(out["a"][0], np.asarray(grads["a"]).sum(0))
        np.testing.assert_array_equal(out["b"][0], np.full(3, 8.0))


def test_bad_packing():
    with pytest.raises(ValueError, match=re.escape(
            "px.BucketedSync: packing='tuple' must be 'operands' (one psum over each bucket's "
            "gradients) or 'flat' (a concatenated bucket buffer).")):
        px.BucketedSync(packing="tuple")
    mesh = px.make_mesh(data=8)
    f = jax.shard_map(lambda g: px.comm.bucketed_all_reduce(g, "data", algorithm="ring",
                                                           packing="operands"),
                      mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data"))
    with pytest.raises(ValueError, match=re.escape(
            "bucketed_all_reduce: packing='operands' with algorithm='xla' reduces with XLA's "
            "all-reduce, which has no product; use packing='flat' or a point-to-point "
            "algorithm ('ring', 'tree') for op='prod'.")):
        f = jax.shard_map(lambda g: px.comm.bucketed_all_reduce(g, "data", op="prod",
                                                               packing="operands"),
                          mesh=mesh, in_specs=jax.P("data"), out_specs=jax.P("data"))
        jax.jit(f)(jnp.ones(8))
    with pytest.raises(ValueError, match=re.escape(
            "px.BucketedSync: algorithm='hierarchical' must be one of 'xla', 'tree', 'ring', "
            "'auto': 'xla' for XLA's all-reduce, or a point-to-point algorithm of "
            "parallax.comm.")):
        px.BucketedSync(algorithm="hierarchical")


def stock_state():
    """A model nobody wrote for parallax: stock nnx layers."""

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(3, 4, kernel_size=(3, 3), rngs=rngs)
            self.norm = nnx.LayerNorm(4, rngs=rngs)
            self.out = nnx.Linear(4 * 6 * 6, 5, rngs=rngs)

        def __call__(self, x):
            h = nnx.relu(self.norm(self.conv(x)))
            return self.out(h.reshape(h.shape[0], -1))

    return px.TrainState.create(Net(nnx.Rngs(0)), optax.adam(1e-2))


def stock_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"]).mean()


def train(mesh, strategy, steps=3):
    state = px.init(stock_state, mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(stock_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        batch = {"x": rng.standard_normal((16, 6, 6, 3), np.float32),
                 "y": rng.integers(0, 5, 16).astype(np.int32)}
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.asarray(losses), state


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["tree", "ring", "auto"])
def test_point_to_point_sync_trains_like_one_device(algorithm):
    one_losses, one = train(px.make_mesh(data=1, devices=jax.devices()[:1]),
                            px.DataParallel("data"))
    strategy = px.DataParallel("data", sync=px.BucketedSync(algorithm=algorithm))
    losses, state = train(px.make_mesh(data=8), strategy)
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    assert px.testing.relative_difference(state.params, one.params) <= 1e-5
    for leaf in jax.tree.leaves(state):  # every replica holds the same bits
        first = np.asarray(leaf.addressable_shards[0].data)
        assert all(np.array_equal(np.asarray(s.data), first) for s in leaf.addressable_shards)


@pytest.mark.slow
def test_point_to_point_sync_composes_with_tensor_parallelism():
    one_losses, one = train(px.make_mesh(data=1, devices=jax.devices()[:1]),
                            px.DataParallel("data"))
    strategy = px.compose(px.DataParallel("data", sync=px.BucketedSync(algorithm="tree")),
                          px.TensorParallel("tensor", plan={"out": "rowwise"}))
    losses, state = train(px.make_mesh(data=4, tensor=2), strategy)
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    assert px.testing.relative_difference(state.params, one.params) <= 1e-5


def test_point_to_point_sync_sends_gradients_by_collective_permute():
    compiled, mesh, state = compiled_step(px.BucketedSync(algorithm="tree"))
    grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(state.params))
    permuted = [c for c in hlo.collectives(compiled, mesh) if c.kind == "collective-permute"]
    # recursive doubling on 8 devices: 3 rounds of every gradient, one per leaf and round
    assert len(permuted) == 3 * len(jax.tree.leaves(state.params))
    assert sum(c.message_bytes for c in permuted) == 3 * grad_bytes
    assert gradient_all_reduces(compiled, mesh) == []  # only the loss's scalar is psum'd


@pytest.mark.slow
def test_a_batch_axis_of_size_one_runs_no_collective():
    # XLA's CPU backend keeps an all-reduce over one device (a copy of every gradient)
    mesh = px.make_mesh(data=1, tensor=1, devices=jax.devices()[:1])
    strategy = px.DataParallel("data")
    state = px.init(stock_state, mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(stock_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    batch = {"x": np.ones((4, 6, 6, 3), np.float32), "y": np.zeros(4, np.int32)}
    assert hlo.collectives(step.lower(state, batch).compile(), mesh) == []
    losses, trained = train(mesh, strategy)
    plain = stock_state()  # the same steps by plain jax.jit

    @jax.jit
    def plain_step(state, batch):
        loss, grads = jax.value_and_grad(lambda p: stock_loss(
            nnx.merge(state.graphdef, p, state.rest), batch))(state.params)
        return state.apply_gradients(grads), loss

    rng, plain_losses = np.random.default_rng(0), []
    for _ in range(3):
        batch = {"x": rng.standard_normal((16, 6, 6, 3), np.float32),
                 "y": rng.integers(0, 5, 16).astype(np.int32)}
        plain, loss = plain_step(plain, batch)
        plain_losses.append(float(loss))
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    assert px.testing.relative_difference(trained.params, plain.params) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("stage, algorithm", [(3, "tree"), (2, "ring")])
def test_point_to_point_sync_sums_what_zero_leaves_across_replicas(stage, algorithm):
    # HSDP: ZeRO's reduce-scatter over fsdp, then the point-to-point sum over data
    one_losses, one = train(px.make_mesh(data=1, devices=jax.devices()[:1]),
                            px.DataParallel("data"))
    strategy = px.compose(px.DataParallel("data", sync=px.BucketedSync(algorithm=algorithm)),
                          px.ZeRO(stage, "fsdp"))
    losses, state = train(px.make_mesh(data=2, fsdp=4), strategy)
    np.testing.assert_allclose(losses, one_losses, rtol=1e-5)
    assert px.testing.relative_difference(state.params, one.params) <= 1e-5
