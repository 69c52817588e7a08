"""Gradients through every algorithm (jax.grad inside shard_map) match lax and numpy.

Device i computes loss_i = sum(w_i * f(x)_i) with its own weights w_i. For an all-reduce,
d loss_total / d x_i = sum_j w_j on every device: the same whether f is lax.psum (invariant
output) or a ring/tree (varying output, whose transpose is the reverse ring/tree).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from .comm_testing import grid_mesh, line_mesh, per_device, stacked

from parallax import comm

SHAPES = [(), (13,), (3, 5)]


def grads(mesh, fns, x, w, axis="x"):
    """{name: d/dx sum(w * fns[name](x))} for every name, computed in one program."""
    def fn(x, w):
        def grad(f):
            def loss(x):
                y = f(x)
                return sum(jnp.sum(a * b) for a, b in zip(jax.tree.leaves(w),
                                                           jax.tree.leaves(y)))
            return jax.grad(loss)(x)
        return {name: grad(f) for name, f in fns.items()}

    return per_device(mesh, fn, x, w, axis=axis)


def assert_close(a, b, rtol=1e-5, what=""):
    for key in b:
        np.testing.assert_allclose(np.asarray(a[key]), np.asarray(b[key]), rtol=rtol,
                                   atol=rtol, err_msg=f"{what} {key}")


@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_reduce_gradients(n):
    x = stacked(n, SHAPES, [jnp.float32])
    w = stacked(n, SHAPES, [jnp.float32], seed=1)
    want = {k: np.broadcast_to(np.asarray(v).sum(0), v.shape) for k, v in w.items()}
    fns = {a: (lambda a: lambda v: comm.all_reduce(v, "x", algorithm=a))(a)
           for a in ("xla", "ring", "tree")}
    fns["ring_mean"] = lambda v: comm.ring_all_reduce(v, "x", op="mean")
    got = grads(line_mesh(n), fns, x, w)
    for a in ("xla", "ring", "tree"):
        assert_close(got[a], want, what=a)
    assert_close(got["ring_mean"], {k: v / n for k, v in want.items()}, what="mean")


@pytest.mark.parametrize("n", [4, 8])
def test_reduce_scatter_all_gather_broadcast_gradients(n):
    """Each ring/tree function has the gradient of its lax counterpart."""
    mesh = line_mesh(n)
    x = stacked(n, [(2 * n, 3)], [jnp.float32])
    out_shapes = {"rs": (2, 3), "ag": (2 * n * n, 3), "bc": (2 * n, 3)}
    ours = {
        "rs": lambda v: comm.ring_reduce_scatter(v, "x"),
        "ag": lambda v: comm.ring_all_gather(v, "x"),
        "bc": lambda v: comm.broadcast(v, "x", 1, algorithm="tree"),
    }
    ref = {
        "rs": lambda v: lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True),
        "ag": lambda v: lax.all_gather(v, "x", tiled=True),
        "bc": lambda v: comm.broadcast(v, "x", 1),
    }
    for name in ours:
        w = {k: v for k, v in zip(x, stacked(n, [out_shapes[name]], [jnp.float32],
                                             seed=2).values())}
        got = grads(mesh, {"ours": ours[name], "ref": ref[name]}, x, w)
        assert_close(got["ours"], got["ref"], what=name)


def test_hierarchical_bucketed_quantized_gradients():
    mesh = grid_mesh()
    axis = ("data", "tensor")
    x = stacked(8, SHAPES, [jnp.float32])
    w = stacked(8, SHAPES, [jnp.float32], seed=1)
    want = {k: np.broadcast_to(np.asarray(v).sum(0), v.shape) for k, v in w.items()}
    fns = {
        "hier": lambda v: comm.hierarchical_all_reduce(v, "tensor", "data"),
        "hier_ring": lambda v: comm.hierarchical_all_reduce(v, "tensor", "data",
                                                            algorithm="ring"),
        "bucket": lambda v: comm.bucketed_all_reduce(v, axis, bucket_bytes=32),
        "quant": lambda v: comm.quantized_all_reduce(v, axis, block_size=4),
    }
    got = grads(mesh, fns, x, w, axis=axis)
    for name in fns:
        assert_close(got[name], want, what=name)
