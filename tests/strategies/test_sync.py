"""Gradient sync hooks: DDP's buckets (px.BucketedSync) in a train step.

With a sync, the explicit style sums gradients over the batch axes through the hook; it must
train to the one-device numbers, alone and composed with ZeRO and tensor parallelism, and
the compiled step must issue one all-reduce per bucket.
"""

import math

import fixtures as fx
import jax
import pytest

import parallax as px
from parallax.analysis import hlo

SYNC = px.BucketedSync(bucket_bytes=4096)
CASES = {
    "dp": ({"data": 8}, px.DataParallel("data", sync=SYNC)),
    "hsdp-zero2": ({"data": 2, "fsdp": 4},
                   px.compose(px.DataParallel("data", sync=SYNC), px.ZeRO(2, "fsdp"))),
    "dp-fsdp-tp": ({"data": 2, "fsdp": 2, "tensor": 2},
                   px.compose(px.DataParallel("data", sync=SYNC), px.FSDP("fsdp"),
                              px.TensorParallel("tensor"))),
}


@pytest.mark.parametrize("name", CASES)
def test_bucketed_sync_trains_like_one_device(name):
    axes, strategy = CASES[name]
    make, loss, data, tx, ref = fx.reference("mlp")
    run = px.testing.train(make, loss, data, mesh=px.make_mesh(**axes), strategy=strategy)
    px.testing.assert_equivalent(run, ref, rtol=1e-5)


def _gradient_all_reduces(bucket_bytes):
    mesh = px.make_mesh(data=8)
    strategy = px.DataParallel(
        "data", sync=px.BucketedSync(bucket_bytes=bucket_bytes, packing="flat"))
    state = px.init(fx.mlp_state, mesh, strategy)

    @px.train_step(mesh, strategy)
    def step(state, batch):
        loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)
        return state.apply_gradients(grads), {"loss": loss}

    # Without XLA's combiner, which would merge the buckets' all-reduces into one tuple.
    compiled = step.lower(state, fx.mlp_batches(1)[0]).compile(
        compiler_options={"xla_disable_hlo_passes": "cpu-all-reduce-combiner"})
    found = [c for c in hlo.collectives(compiled, mesh)
             if c.kind == "all-reduce" and c.axes == ("data",) and c.message_bytes > 4]
    grad_bytes = 4 * sum(x.size for x in jax.tree.leaves(state.params))
    return found, grad_bytes, len(jax.tree.leaves(state.params))


@pytest.mark.slow
def test_one_all_reduce_per_bucket():
    found, grad_bytes, leaves = _gradient_all_reduces(8192)
    assert len(found) == math.ceil(grad_bytes / 8192) < leaves
    assert sum(c.message_bytes for c in found) == grad_bytes
    found, _, _ = _gradient_all_reduces(0)  # no fusion: one per leaf
    assert len(found) == leaves


def test_bad_syncs():
    with pytest.raises(TypeError, match=r"px.DataParallel: sync must be callable as "
                                        r"sync\(grads, axes\) -> grads, e.g. px.BucketedSync"):
        px.DataParallel("data", sync="buckets")
    with pytest.raises(ValueError, match=r"px.DataParallel: sync= replaces the explicit "
                                         r"style's all-reduce, but style='gspmd'"):
        px.DataParallel("data", style="gspmd", sync=SYNC)
    with pytest.raises(ValueError, match=r"px.compose: two different gradient syncs"):
        px.compose(px.DataParallel("data", sync=SYNC),
                   px.DataParallel("fsdp", sync=px.BucketedSync(0)))
    with pytest.raises(ValueError, match=r"has a gradient sync .* and style='gspmd', which "
                                         r"leaves the gradient sum to XLA"):
        px.compose(px.DataParallel("data", sync=SYNC), px.ZeRO(3, "fsdp", style="gspmd"))
    with pytest.raises(ValueError, match=r"px.BucketedSync: bucket_bytes=-1 must be an int >= 0"):
        px.BucketedSync(bucket_bytes=-1)
    with pytest.raises(ValueError, match=r"px.BucketedSync: compression='int8' must be None"):
        px.BucketedSync(compression="int8")
    # Equal settings are equal values: composing the same sync twice is no conflict.
    assert px.compose(px.DataParallel("data", sync=SYNC),
                      px.DataParallel("fsdp", sync=px.BucketedSync(4096))).grad_sync == SYNC
