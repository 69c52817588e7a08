"""all_reduce with every algorithm equals numpy (and so lax.psum) for N = 2, 4, 8.

One compiled program per (algorithm, N): sum over a pytree of three shapes (a scalar, 13 and
3x5x2 elements, which do not divide by N) in float32, bfloat16 and int32; mean, max, min and
prod over float32 and int32 leaves.
"""

import jax
import numpy as np
import pytest

from .comm_testing import assert_reduced, line_mesh, per_device, stacked
from parallax import comm

OTHER = ("mean", "max", "min", "prod")


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("algorithm", ["xla", "ring", "tree"])
def test_all_reduce_matches_numpy(algorithm, n):
    full = stacked(n)
    small = stacked(n, shapes=[(13,)], dtypes=["float32", "int32"], small_ints=True, seed=1)

    def fn(full, small):
        out = {"sum": comm.all_reduce(full, "x", algorithm=algorithm)}
        out.update({op: comm.all_reduce(small, "x", op, algorithm=algorithm) for op in OTHER})
        return out

    out = per_device(line_mesh(n), fn, full, small)
    assert_reduced(out["sum"], full, "sum", n)
    for op in OTHER:
        assert_reduced(out[op], small, op, n)


@pytest.mark.parametrize("n", [3, 6])
def test_ring_and_tree_for_n_not_a_power_of_two(n):
    x = stacked(n, shapes=[(7,), (2, 5)])

    def fn(x):
        return {a: comm.all_reduce(x, "x", algorithm=a) for a in ("ring", "tree")}

    out = per_device(line_mesh(n), fn, x)
    for a in ("ring", "tree"):
        assert_reduced(out[a], x, "sum", n)


def test_auto_and_axis_tuples(mesh8):
    """'auto' picks per leaf; the xla path takes a tuple of axes; the results are the sums."""
    from .comm_testing import grid_mesh

    x = stacked(8, shapes=[(5,), (300, 40)], dtypes=["float32"])
    mesh = grid_mesh()
    out = per_device(mesh, lambda v: {
        "auto": comm.all_reduce(v, ("data", "tensor"), algorithm="auto", link="nvlink-h100"),
        "xla": comm.all_reduce(v, ("data", "tensor")),
        "hier": comm.all_reduce(v, ("data", "tensor"), algorithm="hierarchical"),
    }, x)
    for key in out:
        assert_reduced(out[key], x, "sum", 8)


def test_nested_pytrees_without_vma_checks(mesh8):
    """check_vma=False shard_maps work too; nested containers keep their structure."""
    x = stacked(8, shapes=[(5,)], dtypes=["float32"])["float32_5"]
    tree = {"a": [x, (x * 2,)], "b": x * 3}
    out = per_device(mesh8, lambda t: {
        a: comm.all_reduce(t, "x", algorithm=a) for a in ("xla", "ring", "tree")},
        tree, check_vma=False)
    for a in ("xla", "ring", "tree"):
        got = out[a]
        assert jax.tree.structure(got) == jax.tree.structure(tree)
        for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(tree)):
            np.testing.assert_allclose(g, np.broadcast_to(np.asarray(v).sum(0), v.shape),
                                       rtol=1e-5, atol=1e-5)
