"""Gradient sync hooks in a train step: DDP's buckets (px.BucketedSync), one all-reduce per
gradient (px.AllReduceSync) and the backend's choice when the strategy names none.

With a sync, the explicit style sums gradients over the batch axes through the hook; it must
train to the one-device numbers, alone and composed with ZeRO and tensor parallelism, and
the compiled step must issue one all-reduce per bucket. The default is decided from the
mesh (tree exchanges across CPU processes, XLA's all-reduce elsewhere: the decision table is
checked here on described meshes, the 2-process program in
tests/distributed/test_default_sync.py).
"""

import math
import re

import types

import fixtures as fx
import jax
import numpy as np
import pytest

import parallax as px
from parallax.analysis import hlo
from parallax.grad.default_sync import default_sync, spans_processes

SYNC = px.BucketedSync(bucket_bytes=4096)
CASES = {
    "dp": ({"data": 8}, px.DataParallel("data", sync=SYNC)),
    "hsdp-zero2": ({"data": 2, "fsdp": 4},
                   px.compose(px.DataParallel("data", sync=SYNC), px.ZeRO(2, "fsdp"))),
    "dp-fsdp-tp": ({"data": 2, "fsdp": 2, "tensor": 2},
                   px.compose(px.DataParallel("data", sync=SYNC), px.FSDP("fsdp"),
                              px.TensorParallel("tensor"))),
    # one exchange-based sum per gradient (the default across CPU processes), with ZeRO 3's
    # gather and TP's automatic axes in the same step
    "tree": ({"data": 8}, px.DataParallel("data", sync="tree")),
    "tree-fsdp-tp": ({"data": 2, "fsdp": 2, "tensor": 2},
                     px.compose(px.DataParallel("data", sync="tree"), px.FSDP("fsdp"),
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
        px.DataParallel("data", sync=25 * 2**20)
    with pytest.raises(ValueError, match=re.escape(
            "px.DataParallel: sync='buckets' must be one of 'xla', 'tree', 'ring' (one "
            "all-reduce per gradient: XLA's, or parallax.comm's exchanges), None for the "
            "backend's choice, or a callable such as px.BucketedSync().")):
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


def fake_mesh(processes, platform="cpu", **axes):
    """A mesh as :mod:`parallax.grad.default_sync` reads it: devices with a process index
    and a platform, laid out over named axes."""
    shape = tuple(axes.values())
    devices = np.empty(shape, object)
    for i, owner in enumerate(np.asarray(processes).reshape(-1)):
        devices.flat[i] = types.SimpleNamespace(process_index=int(owner), platform=platform)
    return types.SimpleNamespace(devices=devices, axis_names=tuple(axes), shape=dict(axes))


def test_the_default_sum_is_the_exchange_only_across_cpu_processes():
    two = fake_mesh([0, 1], data=2)  # one device per process
    assert spans_processes(two, ("data",))
    assert default_sync(two, ("data",)) == px.AllReduceSync("tree")
    assert default_sync(fake_mesh([0, 0, 1, 1], data=4), ("data",)).algorithm == "tree"
    # the processes own the pipeline's stages; each data group is inside one process
    inside = fake_mesh([[0, 0], [1, 1]], stage=2, data=2)
    assert not spans_processes(inside, ("data",)) and spans_processes(inside, ("stage",))
    assert default_sync(inside, ("data",)).algorithm == "xla"
    # HSDP across processes: the remaining sum over data spans them
    assert spans_processes(fake_mesh([[0, 1], [0, 1]], data=2, fsdp=2), ("data",)) is False
    assert default_sync(fake_mesh([[0, 0], [1, 1]], data=2, fsdp=2), ("data",)).algorithm == (
        "tree")
    assert default_sync(fake_mesh([0, 1], "gpu", data=2), ("data",)).algorithm == "xla"
    assert default_sync(fake_mesh([0, 0], data=2), ("data",)).algorithm == "xla"
    abstract = jax.sharding.AbstractMesh((2,), ("data",))
    assert default_sync(abstract, ("data",)) == px.AllReduceSync("xla")


def _collectives(sync):
    mesh = px.make_mesh(data=8)
    strategy = px.DataParallel("data", sync=sync)
    state = px.init(fx.mlp_state, mesh, strategy)
    step = fx.mlp_step(mesh, strategy)
    found = hlo.collectives(step.lower(state, fx.mlp_batches(1)[0]).compile(), mesh)
    return found, 4 * sum(x.size for x in jax.tree.leaves(state.params)), step, state


def test_one_process_keeps_xla_and_the_named_sums_compile_to_their_collectives():
    default, grad_bytes, step, state = _collectives(None)
    xla, _, _, _ = _collectives("xla")
    summed = lambda found: sum(c.message_bytes for c in found  # noqa: E731
                               if c.kind == "all-reduce" and c.message_bytes > 4)
    # one process of simulated devices: XLA's all-reduce of every gradient (and the loss)
    assert summed(default) == summed(xla) == grad_bytes + 4
    assert not [c for c in default if c.kind == "collective-permute"]
    tree, _, _, _ = _collectives("tree")
    permuted = [c for c in tree if c.kind == "collective-permute"]
    assert sum(c.message_bytes for c in permuted) == 3 * grad_bytes  # log2(8) exchanges
    assert summed(tree) == 0  # only the loss's scalar is psum'd
    report = px.explain(step, state, fx.mlp_batches(1)[0])
    assert report.facts["gradient sync"].startswith(
        "AllReduceSync(algorithm='xla'): the default here (XLA's all-reduce)")


def test_bad_all_reduce_sync():
    with pytest.raises(ValueError, match=re.escape(
            "px.AllReduceSync: algorithm='nccl' must be one of 'xla', 'tree', 'ring', 'auto': "
            "'xla' for XLA's all-reduce, or a point-to-point algorithm of parallax.comm.")):
        px.AllReduceSync("nccl")
    assert px.DataParallel("data", sync="ring").grad_sync == px.AllReduceSync("ring")
