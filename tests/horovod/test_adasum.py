"""Adasum (Maleki et al. 2020) equals a direct numpy transcription of the paper's rule."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallax as px
import parallax.horovod as hvd
from parallax.horovod.adasum import adasum_all_reduce, adasum_pair, adasum_stack
from tests.horovod import adasum_reference as ref

RTOL = 1e-5  # float32 arithmetic against the float64 transcription


def grads(count, size=37, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(size)
    # correlated gradients (a shared direction plus noise), as real ones are
    return [(base + 0.7 * rng.standard_normal(size)).astype(np.float32) for _ in range(count)]


@pytest.mark.parametrize("case", ["random", "parallel", "orthogonal", "zero"])
def test_pair_rule(case):
    a, b = grads(2)
    if case == "parallel":
        b = 3 * a
    elif case == "orthogonal":
        a, b = np.array([1.0, 0.0, 0.0], np.float32), np.array([0.0, 2.0, 0.0], np.float32)
    elif case == "zero":
        b = np.zeros_like(a)
    np.testing.assert_allclose(adasum_pair(jnp.asarray(a), jnp.asarray(b)), ref.pair(a, b),
                               rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("count", [2, 4, 8])
def test_stack_of_ranks(count):
    values = grads(count, seed=count)
    got = jax.jit(adasum_stack)(jnp.stack(values))
    np.testing.assert_allclose(got, ref.adasum(values), rtol=RTOL, atol=1e-6)


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_all_reduce_over_a_mesh_axis(devices):
    values = grads(devices, size=24, seed=devices)
    mesh = px.make_mesh(data=devices, devices=jax.devices()[:devices])
    f = jax.jit(jax.shard_map(lambda v: adasum_all_reduce(v[0], "data"), mesh=mesh,
                              in_specs=jax.P("data"), out_specs=jax.P("data"), check_vma=False))
    out = np.asarray(f(jnp.stack(values))).reshape(devices, -1)
    np.testing.assert_allclose(out[0], ref.adasum(values), rtol=RTOL, atol=1e-6)
    assert (out == out[0]).all()  # every device holds the same bits


def test_allreduce_op_adasum_in_a_program():
    values = np.stack(grads(8, size=12, seed=3))

    @hvd.jit
    def step(batch):
        return hvd.allreduce(batch[0], op=hvd.Adasum)

    np.testing.assert_allclose(np.asarray(step(values)), ref.adasum(list(values)),
                               rtol=RTOL, atol=1e-6)


def test_adasum_needs_a_power_of_two():
    with pytest.raises(ValueError, match=re.escape(
            "hvd.Adasum: 3 ranks; Adasum combines a power of two of them (as Horovod's); use "
            "1, 2, 4, 8, ... processes.")):
        adasum_stack(jnp.ones((3, 2)))
    mesh = px.make_mesh(data=6, devices=jax.devices()[:6])
    f = jax.shard_map(lambda v: adasum_all_reduce(v, "data"), mesh=mesh, in_specs=jax.P("data"),
                      out_specs=jax.P("data"), check_vma=False)
    with pytest.raises(ValueError, match=re.escape(
            "hvd.Adasum: the axis 'data' has 6 devices; Adasum combines a power of two of them")):
        jax.jit(f)(jnp.ones(6))
