"""Shared meshes, inputs and runners for the parallax.comm tests (fixtures: conftest.py).

Inputs are stacked per device: a leaf of shape ``[n, *local]`` is device ``i``'s local array
at ``[i]``. :func:`per_device` runs a function on the local arrays inside ``shard_map`` and
returns each device's result stacked the same way, so varying results (ring, tree) and
invariant ones (``lax.psum``) are compared alike, against numpy on the stacked inputs.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

P = jax.P
SHAPES = [(), (13,), (3, 5, 2)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.int32]


@functools.lru_cache(maxsize=None)
def line_mesh(n: int, name: str = "x"):
    """A 1D mesh over the first ``n`` devices."""
    return jax.make_mesh((n,), (name,), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])


@functools.lru_cache(maxsize=None)
def grid_mesh(outer: int = 2, inner: int = 4):
    """A 2D ``data x tensor`` mesh."""
    return jax.make_mesh((outer, inner), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[: outer * inner])


def stacked(n: int, shapes=SHAPES, dtypes=DTYPES, seed: int = 0, small_ints: bool = False):
    """A dict pytree ``{"f32_13": [n, 13], ...}`` of random per-device inputs."""
    rng = np.random.default_rng(seed)
    tree = {}
    for dtype in dtypes:
        for shape in shapes:
            name = f"{jnp.dtype(dtype).name}_{'x'.join(map(str, shape)) or 'scalar'}"
            if jnp.issubdtype(dtype, jnp.integer):
                lo, hi = (-2, 3) if small_ints else (-50, 50)
                v = rng.integers(lo, hi, (n,) + shape)
            else:
                v = rng.standard_normal((n,) + shape)
            tree[name] = jnp.asarray(v, dtype)
    return tree


def per_device(mesh, fn, *trees, axis=None, check_vma=True):
    """Runs ``fn`` on each device's local arrays; returns the results stacked ``[n, ...]``."""
    axis = mesh.axis_names if axis is None else axis
    spec = P(tuple(axis)) if isinstance(axis, (tuple, list)) else P(axis)

    def body(*local):
        local = jax.tree.map(lambda v: v[0], local)
        return jax.tree.map(lambda y: jnp.asarray(y)[None], fn(*local))

    f = shard_map_jit(mesh, body, spec, check_vma)
    return f(*trees)


def shard_map_jit(mesh, body, spec, check_vma=True):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec,
                                 check_vma=check_vma))


NUMPY_OPS = {
    "sum": lambda a: a.sum(0),
    "mean": lambda a: a.mean(0),
    "max": lambda a: a.max(0),
    "min": lambda a: a.min(0),
    "prod": lambda a: a.prod(0),
}


def assert_reduced(out, inputs, op: str, n: int):
    """Checks every device's result against numpy's reduction of the stacked inputs."""
    for key, x in inputs.items():
        got = np.asarray(out[key], np.float64)
        want = NUMPY_OPS[op](np.asarray(x, np.float64))
        assert got.shape == (n,) + want.shape, key
        if jnp.issubdtype(x.dtype, jnp.integer) and op != "mean":
            np.testing.assert_array_equal(got, np.broadcast_to(want, got.shape), err_msg=key)
            continue
        scale = NUMPY_OPS["sum"](np.abs(np.asarray(x, np.float64))) if op in (
            "sum", "mean") else np.abs(want)
        if op == "mean":
            scale = scale / n
        eps = 2**-7 if x.dtype == jnp.bfloat16 else 1e-6
        if op == "prod":
            eps *= n
        tol = eps * (scale + 1e-30) + (1e-6 if x.dtype != jnp.bfloat16 else 0)
        assert np.all(np.abs(got - want) <= tol), (key, np.abs(got - want).max())
        # every device holds the same values
        assert np.all(got == got[:1]), key
