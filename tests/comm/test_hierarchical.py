"""hierarchical_all_reduce equals a flat all-reduce over both axes, for every inner/outer
algorithm, on 2x4, 2x2 and 1x2 meshes (N = 8, 4, 2; 4x2 is in test_hlo), with shapes that do
not divide by the inner size."""

import jax.numpy as jnp
import pytest

from .comm_testing import assert_reduced, grid_mesh, per_device, stacked
from parallax import comm

AXES = ("data", "tensor")


@pytest.mark.slow
@pytest.mark.parametrize("outer,inner", [(2, 4), (2, 2), (1, 2)])
def test_hierarchical_matches_numpy(outer, inner):
    n = outer * inner
    x = stacked(n, shapes=[(), (13,), (3, 5, 2)])
    one = stacked(n, shapes=[(13,)])
    small = stacked(n, shapes=[(7,)], dtypes=[jnp.float32, jnp.int32], small_ints=True)

    def fn(x, one, small):
        h = comm.hierarchical_all_reduce
        return {
            "xla": h(x, "tensor", "data"),
            "ring": h(one, "tensor", "data", algorithm="ring"),
            "tree_outer": h(one, "tensor", "data", outer_algorithm="tree"),
            "mean": h(small, "tensor", "data", op="mean"),
            "max": h(small, "tensor", "data", op="max", algorithm="ring", outer_algorithm="xla"),
            "prod": h(small, "tensor", "data", op="prod", algorithm="ring"),
        }

    out = per_device(grid_mesh(outer, inner), fn, x, one, small, axis=AXES)
    assert_reduced(out["xla"], x, "sum", n)
    for key in ("ring", "tree_outer"):
        assert_reduced(out[key], one, "sum", n)
    for op in ("mean", "max", "prod"):
        assert_reduced(out[op], small, op, n)


def test_inner_and_outer_may_be_swapped():
    """Nothing forces the mesh's inner axis to be the fast one: both orders give the sum."""
    x = stacked(8, shapes=[(9,)], dtypes=[jnp.float32])
    out = per_device(grid_mesh(), lambda v: comm.hierarchical_all_reduce(v, "data", "tensor"),
                     x, axis=AXES)
    assert_reduced(out, x, "sum", 8)
