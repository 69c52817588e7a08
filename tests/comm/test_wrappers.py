"""The validated lax wrappers equal numpy on arrays and pytrees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from .comm_testing import line_mesh, per_device, stacked
from parallax import comm

P = jax.P


@pytest.mark.parametrize("n", [2, 4, 8])
def test_gather_scatter_all_to_all_reduce(n):
    x = stacked(n, shapes=[(n, 3)])
    out = per_device(line_mesh(n), lambda v: {
        "ag": comm.all_gather(v, "x"),
        "ag1": comm.all_gather(v, "x", dim=1),
        "stack": comm.all_gather(v, "x", tiled=False),
        "rs": comm.reduce_scatter(v, "x"),
        "rs_mean": comm.reduce_scatter(v, "x", op="mean"),
        "a2a": comm.all_to_all(v, "x", 0, 1),
        "red": comm.reduce(v, "x", root=n - 1),
        "red_max": comm.reduce(v, "x", root=0, op="max"),
    }, x)
    for key, v in x.items():
        a = np.asarray(v, np.float64)
        tol = 0.05 if "bfloat16" in key else 1e-5
        close = lambda got, want: np.testing.assert_allclose(  # noqa: E731
            np.asarray(got[key], np.float64), want, rtol=tol, atol=tol, err_msg=key)
        close(out["ag"], np.broadcast_to(a.reshape(n * n, 3), (n, n * n, 3)))
        close(out["ag1"], np.broadcast_to(np.concatenate(list(a), 1), (n, n, 3 * n)))
        close(out["stack"], np.broadcast_to(a, (n,) + a.shape))
        close(out["rs"], a.sum(0).reshape(n, 1, 3))
        close(out["rs_mean"], a.mean(0).reshape(n, 1, 3))
        # device i receives row i of every device, concatenated along dim 1
        close(out["a2a"], np.stack([np.concatenate([a[j, i:i + 1] for j in range(n)], 1)
                                    for i in range(n)]))
        red = np.zeros_like(a)
        red[n - 1] = a.sum(0)
        close(out["red"], red)
        red = np.zeros_like(a)
        red[0] = a.max(0)
        close(out["red_max"], red)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_broadcast_send_shift(n):
    # bfloat16 takes its own path (bit-cast to uint16 on the wire); every result is exact
    x = stacked(n, shapes=[(), (4,)])
    perm = [(0, n - 1), (n - 1, 0)] if n > 2 else [(1, 0)]
    out = per_device(line_mesh(n), lambda v: {
        "bc0": comm.broadcast(v, "x"),
        "bc_last": comm.broadcast(v, "x", root=n - 1),
        "send": comm.send(v, "x", perm),
        "right": comm.shift(v, "x"),
        "left": comm.shift(v, "x", -1),
        "three": comm.shift(v, "x", 3),
    }, x)
    for key, v in x.items():
        a = np.asarray(v)
        np.testing.assert_array_equal(out["bc0"][key], np.broadcast_to(a[0], a.shape))
        np.testing.assert_array_equal(out["bc_last"][key], np.broadcast_to(a[-1], a.shape))
        sent = np.zeros_like(a)
        for s, d in perm:
            sent[d] = a[s]
        np.testing.assert_array_equal(out["send"][key], sent)
        np.testing.assert_array_equal(out["right"][key], np.roll(a, 1, axis=0))
        np.testing.assert_array_equal(out["left"][key], np.roll(a, -1, axis=0))
        np.testing.assert_array_equal(out["three"][key], np.roll(a, 3, axis=0))


def test_invariant_results_can_be_returned_replicated(mesh8):
    """algorithm='xla' results are invariant: out_specs=P() works under check_vma=True."""
    f = jax.jit(jax.shard_map(
        lambda v: (comm.all_reduce(v, "x"), comm.broadcast(v, "x", 2),
                   comm.all_gather(v, "x", invariant=True)),
        mesh=mesh8, in_specs=P("x"), out_specs=P()))
    total, bc, gathered = f(jnp.arange(8.0))
    assert total.tolist() == [28.0] and bc.tolist() == [2.0]
    assert gathered.tolist() == list(range(8))


def test_bool_broadcast_and_vmap_axis_names():
    mesh = line_mesh(4)
    flags = jnp.array([True, False, False, True])
    out = per_device(mesh, lambda v: comm.broadcast(v, "x", 3), flags)
    assert out.tolist() == [True] * 4
    # names bound by jax.vmap(axis_name=) are accepted too
    y = jax.vmap(lambda v: comm.all_reduce(v, "i", "max"), axis_name="i")(jnp.arange(5.0))
    assert y.tolist() == [4.0] * 5
