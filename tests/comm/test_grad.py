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
    """{name: d/dx sum(w * fns[name](x))} for every name, computed in one program.

    ``w`` is one weights tree for every function, or ``{name: tree}`` when the functions'
    outputs differ in shape."""
    ws = w if set(w) == set(fns) else dict.fromkeys(fns, w)

    def fn(x, ws):
        def grad(f, w):
            def loss(x):
                y = f(x)
                return sum(jnp.sum(a * b) for a, b in zip(jax.tree.leaves(w),
                                                           jax.tree.leaves(y)))
            return jax.grad(loss)(x)
        return {name: grad(f, ws[name]) for name, f in fns.items()}

    return per_device(mesh, fn, x, ws, axis=axis)


def assert_close(a, b, rtol=1e-5, what=""):
    for key in b:
        np.testing.assert_allclose(np.asarray(a[key]), np.asarray(b[key]), rtol=rtol,
                                   atol=rtol, err_msg=f"{what} {key}")


def assert_within_bf16_bound(got, want, scale, n, what=""):
    """docs/comm.md's bound for sums whose terms or partial sums are rounded to bfloat16:
    |error| <= 2 n eps sum_j |w_j|, eps = 2^-8."""
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= 2 * n * 2.0**-8 * scale), (what, err.max())


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_reduce_gradients(n):
    """float32 and bfloat16 leaves through every algorithm; float32 with bf16 on the wire,
    whose backward pass sends the cotangents in bf16 too (one leaf: each is a compile)."""
    x = {**stacked(n, SHAPES, [jnp.float32]), **stacked(n, [(13,)], [jnp.bfloat16])}
    w = {**stacked(n, SHAPES, [jnp.float32], seed=1),
         **stacked(n, [(13,)], [jnp.bfloat16], seed=1)}
    want = {k: np.broadcast_to(np.asarray(v, np.float64).sum(0), v.shape) for k, v in w.items()}
    scale = {k: np.abs(np.asarray(v, np.float64)).sum(0) for k, v in w.items()}
    algorithms = ("xla", "ring", "tree")
    fns = {a: (lambda a: lambda v: comm.all_reduce(v, "x", algorithm=a))(a) for a in algorithms}
    f32 = {k: v for k, v in want.items() if "float32" in k}
    fns["ring_mean"] = lambda v: comm.ring_all_reduce({k: v[k] for k in f32}, "x", op="mean")
    wire = "float32_13"
    fns.update({f"{a}/bf16": (lambda a: lambda v: comm.all_reduce(
        {wire: v[wire]}, "x", algorithm=a, compression="bf16"))(a) for a in algorithms})
    ws = {name: {wire: w[wire]} if "/" in name else w for name in fns}
    ws["ring_mean"] = {k: w[k] for k in f32}
    got = grads(line_mesh(n), fns, x, ws)
    for a in algorithms:
        assert_close(got[a], f32, what=a)
        assert_within_bf16_bound(got[a]["bfloat16_13"], want["bfloat16_13"],
                                 scale["bfloat16_13"], n, a)
        assert_within_bf16_bound(got[f"{a}/bf16"][wire], want[wire], scale[wire], n, a)
        # leaves the function does not use get zero gradient
        assert not np.any(np.asarray(got[f"{a}/bf16"]["float32_3x5"]))
    assert_close(got["ring_mean"], {k: v / n for k, v in f32.items()}, what="mean")


@pytest.mark.parametrize("n", [2, 4, 8])
def test_collective_gradients_match_lax(n):
    """Each ring/tree function and each wrapper has the gradient of its lax counterpart.
    send and shift also run in bfloat16, which they permute as uint16 under a custom_vjp
    (the rings' bf16 backward pass is checked in test_all_reduce_gradients)."""
    mesh = line_mesh(n)
    x = stacked(n, [(2 * n, 3)], [jnp.float32, jnp.bfloat16])
    f32, bf16 = x
    perm = [(0, n - 1), (n - 1, 0)] if n > 2 else [(1, 0)]
    left = [(i, (i - 1) % n) for i in range(n)]

    def on(keys, f):
        return lambda v: {k: f(v[k]) for k in keys}

    pairs = {  # name: (ours, lax's, the leaves it runs on, output shape)
        "rs": (lambda v: comm.ring_reduce_scatter(v, "x"),
               lambda v: lax.psum_scatter(v, "x", scatter_dimension=0, tiled=True),
               [f32], (2, 3)),
        "ag": (lambda v: comm.ring_all_gather(v, "x"),
               lambda v: lax.all_gather(v, "x", tiled=True), [f32], (2 * n * n, 3)),
        "bc": (lambda v: comm.broadcast(v, "x", 1, algorithm="tree"),
               lambda v: comm.broadcast(v, "x", 1), [f32], (2 * n, 3)),
        "gather": (lambda v: comm.all_gather(v, "x", dim=1),
                   lambda v: lax.all_gather(v, "x", axis=1, tiled=True), [f32], (2 * n, 3 * n)),
        "a2a": (lambda v: comm.all_to_all(v, "x", 0, 1),
                lambda v: lax.all_to_all(v, "x", 0, 1, tiled=True), [f32], (2, 3 * n)),
        "send": (lambda v: comm.send(v, "x", perm),
                 lambda v: lax.ppermute(v, "x", perm), [f32, bf16], (2 * n, 3)),
        "shift": (lambda v: comm.shift(v, "x", -1),
                  lambda v: lax.ppermute(v, "x", left), [f32, bf16], (2 * n, 3)),
    }
    fns, ws = {}, {}
    for i, (name, (ours, ref, keys, shape)) in enumerate(pairs.items()):
        w = stacked(n, [shape], [jnp.float32, jnp.bfloat16], seed=2 + i)
        fns[name], fns[f"{name}_ref"] = on(keys, ours), on(keys, ref)
        ws[name] = ws[f"{name}_ref"] = {k: v for k, v in zip(x, w.values()) if k in keys}
    got = grads(mesh, fns, x, ws)
    for name, (_, _, keys, _) in pairs.items():
        assert_close(got[name], {f32: got[f"{name}_ref"][f32]}, what=name)
        if bf16 in keys:  # bf16 cotangents are only moved, so the bits are the same
            np.testing.assert_array_equal(np.asarray(got[name][bf16], np.float64),
                                          np.asarray(got[f"{name}_ref"][bf16], np.float64),
                                          err_msg=name)


@pytest.mark.parametrize("outer,inner", [(1, 2), (2, 2), (2, 4)])
def test_hierarchical_bucketed_quantized_gradients(outer, inner):
    n = outer * inner
    mesh = grid_mesh(outer, inner)
    axis = ("data", "tensor")
    shapes = SHAPES if n == 8 else [(13,)]  # one leaf that n does not divide: a compile less
    x = stacked(n, shapes, [jnp.float32])
    w = stacked(n, shapes, [jnp.float32], seed=1)
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
