"""Megatron's MLP sharded by hand, in picotron's manner: what each rank holds and computes.

Rank ``r`` of ``n`` holds the columns ``r * k:(r + 1) * k`` of the column-parallel kernel
(and bias), and the same rows of the row-parallel kernel. It computes its slice of the
hidden layer with no communication, multiplies it by its rows, and one all-reduce (the sum
over ranks) gives the dense output. This test writes that out with plain slices and checks
the parallax.nn layers against it, value and gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import parallax.nn as pnn

from .nn_testing import P, tensor_mesh

N, D, H = 4, 16, 32
K = H // N  # hidden units per rank


def layers():
    return (pnn.ColumnParallelLinear(D, H, rngs=nnx.Rngs(0)),
            pnn.RowParallelLinear(H, D, rngs=nnx.Rngs(1)))


def weights():
    col, row = layers()
    rng = np.random.default_rng(0)  # non-zero biases, so their slicing is checked too
    return (np.asarray(col.kernel[...]), rng.standard_normal(H).astype(np.float32),
            np.asarray(row.kernel[...]), rng.standard_normal(D).astype(np.float32))


def by_hand(wc, bc, wr, br, x):
    """The sum over ranks of each rank's slice of the MLP, then the bias once."""
    partial = [jnp.tanh(x @ wc[:, r * K:(r + 1) * K] + bc[r * K:(r + 1) * K])
               @ wr[r * K:(r + 1) * K, :] for r in range(N)]
    return sum(partial) + br


def dense(wc, bc, wr, br, x):
    return jnp.tanh(x @ wc + bc) @ wr + br


def test_by_hand_equals_dense():
    x = np.random.default_rng(1).standard_normal((2, 8, D)).astype(np.float32)
    np.testing.assert_allclose(by_hand(*weights(), x), dense(*weights(), x), rtol=1e-5, atol=1e-6)


def test_layers_hold_and_compute_the_slices_by_hand():
    wc, bc, wr, br = weights()
    x = np.random.default_rng(1).standard_normal((2, 8, D)).astype(np.float32)
    mesh = tensor_mesh(N)
    graphdef, _ = nnx.split(layers())
    # Column-parallel: kernel and bias split by columns; row-parallel: kernel split by rows.
    specs = (P(None, "tensor"), P("tensor"), P("tensor", None), P())

    def mlp(wc, bc, wr, br):  # inside shard_map: each argument is this rank's shard
        col, row = nnx.merge(graphdef, {0: {"kernel": wc, "bias": bc},
                                        1: {"kernel": wr, "bias": br}})
        return row(jnp.tanh(col(x)))

    sharded = jax.jit(jax.shard_map(mlp, mesh=mesh, in_specs=specs, out_specs=P()))
    placed = jax.device_put(wc, jax.NamedSharding(mesh, specs[0]))
    for shard in placed.addressable_shards:
        r = shard.device.id  # the tensor mesh lists devices 0..N-1 in order
        np.testing.assert_array_equal(shard.data, wc[:, r * K:(r + 1) * K])

    hand = lambda *w: by_hand(*w, x)  # noqa: E731
    np.testing.assert_allclose(sharded(wc, bc, wr, br), hand(wc, bc, wr, br),
                               rtol=1e-5, atol=1e-6)
    loss = lambda f: lambda *w: jnp.sum(f(*w) ** 2)  # noqa: E731
    got = jax.grad(loss(sharded), argnums=(0, 1, 2, 3))(wc, bc, wr, br)
    want = jax.grad(loss(hand), argnums=(0, 1, 2, 3))(wc, bc, wr, br)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
