"""Recursive doubling: rounds for any N, and the binomial-tree broadcast."""

import jax.numpy as jnp
import numpy as np
import pytest

from .comm_testing import line_mesh, per_device, stacked
from parallax import comm
from parallax.comm import cost


@pytest.mark.parametrize("n", range(1, 17))
def test_tree_rounds_reduce_everything(n):
    """Simulating the rounds on sets of contributors gives everyone everything."""
    rounds = comm.tree_rounds(n)
    assert len(rounds) == cost.tree_rounds_count(n)
    if n & (n - 1) == 0:
        assert len(rounds) == int(np.log2(n)) and all(k == "exchange" for k, _ in rounds)
    have = [{i} for i in range(n)]
    for kind, pairs in rounds:
        sent = {s: set(have[s]) for s, _ in pairs}
        for s, d in pairs:
            have[d] = sent[s] if kind == "unfold" else have[d] | sent[s]
    assert all(h == set(range(n)) for h in have)


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8])
def test_tree_broadcast_every_root(n):
    x = stacked(n, shapes=[(5,)], dtypes=[jnp.float32, jnp.bfloat16, jnp.int32])
    out = per_device(line_mesh(n), lambda v: {
        r: comm.broadcast(v, "x", r, algorithm="tree") for r in sorted({0, n // 2, n - 1})}, x)
    for r, tree in out.items():
        for key, v in tree.items():
            np.testing.assert_array_equal(np.asarray(v), np.broadcast_to(x[key][r], v.shape))


def test_broadcast_rounds_are_logarithmic():
    for n in range(1, 17):
        rounds = comm.tree.broadcast_rounds(n, root=n // 2)
        assert len(rounds) == (int(np.ceil(np.log2(n))) if n > 1 else 0)
        have = {n // 2}
        for pairs in rounds:
            assert all(s in have for s, _ in pairs)
            have |= {d for _, d in pairs}
        assert have == set(range(n))
