"""Tensor fusion: the bucket plan, and bucketed_all_reduce == per-leaf all_reduce."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .comm_testing import assert_reduced, line_mesh, per_device, stacked
from parallax import comm


def test_plan_reverse_order_and_straddling():
    tree = {"a": jnp.zeros(300), "b": jnp.zeros(200), "c": jnp.zeros(100)}
    plan = comm.pack_buckets(tree, bucket_bytes=1600)           # 400 float32 per bucket
    assert [b.nbytes for b in plan] == [1600, 800]
    assert plan[0].pieces == ((2, 0, 100), (1, 0, 200), (0, 0, 100))
    forward = comm.pack_buckets(tree, bucket_bytes=1600, reverse=False)
    assert forward[0].pieces == ((0, 0, 300), (1, 0, 100))
    assert len(comm.pack_buckets(tree, bucket_bytes=0)) == 3   # fusion off: one per leaf
    assert len(comm.pack_buckets(tree, bucket_bytes=None)) == 1
    assert len(comm.pack_buckets(tree, bucket_bytes=4)) == 600  # one element per bucket


def test_plan_groups_dtypes_and_covers_every_element():
    tree = [jnp.zeros((3, 4)), jnp.zeros(5, jnp.int32), jnp.zeros(7), jnp.zeros((2,), jnp.bfloat16),
            jnp.zeros((0,))]
    plan = comm.pack_buckets(tree, bucket_bytes=24)
    assert all(len({np.dtype(tree[i].dtype) for i, _, _ in b.pieces}) == 1 for b in plan)
    covered = {i: 0 for i in range(len(tree))}
    for b in plan:
        assert b.nbytes <= 24
        for i, start, stop in b.pieces:
            covered[i] += stop - start
    assert covered == {i: v.size for i, v in enumerate(tree)}
    f32 = [b for b in plan if b.dtype == np.float32]
    assert len(f32) == -(-(12 + 7) * 4 // 24)                  # ceil(total / bucket)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_bucketed_equals_all_reduce(n):
    """Fusion off, straddling 40-byte buckets and one bucket per dtype. The packing does not
    depend on n, only the collective does, so n = 2, 4 run the straddling case alone (each
    bucket is one more collective to compile)."""
    x = stacked(n, shapes=[(), (13,), (3, 5)])
    sizes = (0, 40, None) if n == 8 else (40,)
    out = per_device(line_mesh(n), lambda v: {
        **{f"sum/{b}": comm.bucketed_all_reduce(v, "x", bucket_bytes=b) for b in sizes},
        **{f"mean/{b}": comm.bucketed_all_reduce(v, "x", bucket_bytes=b, op="mean",
                                                 reverse=False) for b in sizes},
    }, x)
    for name, tree in out.items():
        assert_reduced(tree, x, name.split("/")[0], n)


def test_bucketed_with_ring_and_compression(mesh8):
    n = 8
    x = stacked(n, shapes=[(13,), (3, 5)], dtypes=[jnp.float32, jnp.int32])
    out = per_device(mesh8, lambda v: comm.bucketed_all_reduce(
        v, "x", bucket_bytes=48, algorithm="ring", compression="bf16"), x)
    assert jax.tree.structure(out) == jax.tree.structure(x)
    for key, v in x.items():
        got, ref = np.asarray(out[key], np.float64), np.asarray(v, np.float64)
        assert out[key].dtype == v.dtype and np.all(got == got[:1]), key
        if v.dtype == jnp.int32:                                # integers are never cast
            np.testing.assert_array_equal(got[0], ref.sum(0), err_msg=key)
        else:                                                   # docs/comm.md's bound
            assert np.all(np.abs(got[0] - ref.sum(0)) <= 2 * n * 2.0**-8 * np.abs(ref).sum(0))
