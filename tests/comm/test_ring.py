"""Ring reduce-scatter and all-gather equal lax.psum_scatter / lax.all_gather (and numpy)."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from .comm_testing import line_mesh, per_device, stacked
from parallax import comm


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_reduce_scatter_and_all_gather_match_lax(n):
    # divisible along dim 0 and dim 1; bfloat16 on the dim-1 leaf only (each leaf is a
    # compile, and where the blocks lie does not depend on the dtype)
    x = {**stacked(n, shapes=[(2 * n, 3), (3, n)], dtypes=[jnp.float32, jnp.int32]),
         **stacked(n, shapes=[(3, n)], dtypes=[jnp.bfloat16])}

    def fn(x):
        even = {k: v for k, v in x.items() if v.shape[0] == 2 * n}
        odd = {k: v for k, v in x.items() if v.shape[0] != 2 * n}
        return {
            "rs0": comm.ring_reduce_scatter(even, "x", dim=0),
            "rs0_lax": jax_tree_psum_scatter(even, 0),
            "rs1": comm.ring_reduce_scatter(odd, "x", dim=1),
            "rs1_lax": jax_tree_psum_scatter(odd, 1),
            "ag1": comm.ring_all_gather(odd, "x", dim=1),
            "ag1_lax": {k: lax.all_gather(v, "x", axis=1, tiled=True) for k, v in odd.items()},
        }

    out = per_device(line_mesh(n), fn, x)
    for ring, ref in (("rs0", "rs0_lax"), ("rs1", "rs1_lax"), ("ag1", "ag1_lax")):
        for key in out[ring]:
            a, b = np.asarray(out[ring][key], np.float64), np.asarray(out[ref][key], np.float64)
            dtype = x[key].dtype
            if ring == "ag1" or dtype == jnp.int32:  # a gather moves bits; int sums are exact
                np.testing.assert_array_equal(a, b, err_msg=f"{ring} {key}")
            elif dtype == jnp.bfloat16:
                # both sides got the same bf16 inputs and round their partial sums to bf16
                # (the ring n - 1 times), so they differ by at most the documented
                # 2 n eps sum_j |x_j| (eps = 2^-8), per element of device i's column
                s = np.abs(np.asarray(x[key], np.float64)).sum(0)     # [3, n]
                s = np.moveaxis(s.reshape(3, n, 1), 1, 0)             # [n, 3, 1]
                assert np.all(np.abs(a - b) <= 2 * n * 2.0**-8 * s), (ring, key)
            else:
                np.testing.assert_allclose(a, b, atol=1e-5, err_msg=f"{ring} {key}")


def jax_tree_psum_scatter(tree, dim):
    return {k: lax.psum_scatter(v, "x", scatter_dimension=dim, tiled=True)
            for k, v in tree.items()}


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_non_divisible_lengths_pad_and_unpad(n):
    """13 rows over n devices: each gets ceil(13/n) rows, the padded tail is zero, and the
    all-gather with size=13 gives back exactly the sum."""
    x = stacked(n, shapes=[(13, 2)], dtypes=[jnp.float32, jnp.int32])

    def fn(x):
        part = comm.ring_reduce_scatter(x, "x")
        return {"part": part, "full": comm.ring_all_gather(part, "x", size=13)}

    out = per_device(line_mesh(n), fn, x)
    c = -(-13 // n)
    for key, v in x.items():
        total = np.asarray(v, np.float64).sum(0)
        padded = np.concatenate([total, np.zeros((n * c - 13, 2))]).reshape(n, c, 2)
        np.testing.assert_allclose(np.asarray(out["part"][key]), padded, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(out["full"][key]),
                                   np.broadcast_to(total, (n, 13, 2)), rtol=1e-5, atol=1e-5)


def test_ring_reduce_scatter_ops(mesh8):
    x = stacked(8, shapes=[(8,)], dtypes=[jnp.int32], small_ints=True)["int32_8"]
    out = per_device(mesh8, lambda v: {op: comm.ring_reduce_scatter(v, "x", op=op)
                                       for op in ("max", "min", "mean", "prod")}, x)
    ref = np.asarray(x, np.float64)
    for op, f in (("max", np.max), ("min", np.min), ("mean", np.mean), ("prod", np.prod)):
        np.testing.assert_allclose(np.asarray(out[op]).reshape(-1), f(ref, 0), err_msg=op)


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_ring_schedule(n):
    steps = comm.ring_schedule(n)
    assert len(steps) == 1 + 2 * (n - 1)
    everyone = tuple(range(n))
    after_rs = steps[n - 1]["holds"]
    # after the reduce-scatter, device d holds chunk d summed over all devices...
    assert all(after_rs[d][d] == everyone for d in range(n))
    # ...and only that one, when n > 2
    if n > 2:
        assert all(after_rs[d][k] != everyone for d in range(n) for k in range(n) if k != d)
    assert all(c == everyone for row in steps[-1]["holds"] for c in row)
    for step in steps[1:]:  # every device sends one chunk to its right neighbour per step
        assert sorted(s for s, _, _ in step["sends"]) == list(range(n))
        assert all(d == (s + 1) % n for s, d, _ in step["sends"])


def test_ring_matches_schedule_contributions(mesh8):
    """Device i contributes 2**i: after the ring reduce-scatter, the bits of chunk d say who
    contributed, and the schedule's prediction must match."""
    n = 8
    x = jnp.asarray(np.repeat(2 ** np.arange(n), n).reshape(n, n), jnp.int32)
    out = np.asarray(per_device(mesh8, lambda v: comm.ring_reduce_scatter(v, "x"), x))
    holds = comm.ring_schedule(n)[n - 1]["holds"]
    for d in range(n):
        assert out[d, 0] == sum(2 ** j for j in holds[d][d]) == 2 ** n - 1
