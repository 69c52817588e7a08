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
            "bucketed_all_reduce: packing='operands' reduces with XLA's all-reduce "
            "(algorithm='xla', op sum/mean/max/min); got algorithm='ring', op='sum'. Use "
            "packing='flat' for point-to-point algorithms and products.")):
        jax.jit(f)(jnp.ones(8))
