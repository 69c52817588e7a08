"""Runs a parallax.nn layer on one device and inside shard_map, and compares the two.

:func:`compare` applies the layer to the same input on one device (the dense layer) and in
``shard_map`` over a ``tensor`` axis of 2 or 4 devices with the parameters sharded by
``px.nn.param_specs``; it pulls the same random cotangent back through both (``jax.vjp``)
and checks outputs, parameter gradients and input gradients to fp32 relative 1e-5.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import parallax as px

P = jax.P
RTOL = 1e-5


@functools.lru_cache(maxsize=None)
def tensor_mesh(n: int):
    """A mesh with one ``tensor`` axis over the first ``n`` devices."""
    return px.make_mesh(tensor=n, devices=jax.devices()[:n])


def _cotangent(shape, dtype):
    # Drawn outside the compiled program: random bits inside it cost seconds of compile.
    return np.random.default_rng(7).standard_normal(shape).astype(dtype)


def _vjp(fn, leaves, x, wrt_input):
    out = jax.eval_shape(fn, leaves, x)
    ct = _cotangent(out.shape, out.dtype)

    def pulled(leaves, x, ct):
        if wrt_input:
            y, pull = jax.vjp(fn, leaves, x)
        else:
            y, pull = jax.vjp(lambda p: fn(p, x), leaves)
        return y, pull(ct)

    return jax.jit(pulled)(leaves, x, ct)


def run(module, x, *, mesh=None, in_spec=P(), out_spec=P(), call=None, wrt_input=True):
    """(output, gradients) of ``call(module, x)``, dense (``mesh=None``) or in shard_map."""
    call = call or (lambda m, v: m(v))
    graphdef, params = nnx.split(module, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)

    def apply(leaves, v):
        return call(nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), v)

    fn = apply
    if mesh is not None:
        specs = px.nn.param_specs(params, mesh)
        fn = jax.shard_map(apply, mesh=mesh, in_specs=(specs, in_spec), out_specs=out_spec)
    return _vjp(fn, leaves, x, wrt_input)


def compare(module, x, sizes=(2, 4), *, in_spec=P(), out_spec=P(), call=None,
            wrt_input=True):
    """Asserts the runs over ``tensor=n`` devices (each n in ``sizes``) equal the dense one."""
    dense = run(module, x, call=call, wrt_input=wrt_input)
    for n in sizes:
        parallel = run(module, x, mesh=tensor_mesh(n), in_spec=in_spec, out_spec=out_spec,
                       call=call, wrt_input=wrt_input)
        diff = px.testing.relative_difference(parallel, dense, floor=0.0)
        assert diff <= RTOL, f"tensor={n}: relative difference {diff:.2e} > {RTOL:g}"
    return dense


def inputs(shape, seed=0, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def ints(shape, high, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, high, shape), jnp.int32)
