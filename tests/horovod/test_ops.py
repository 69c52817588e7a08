"""Horovod's arithmetic on integer tensors: the Average of an integer tensor is the sum over
the ranks divided by their number, truncated toward zero, in the tensor's own dtype (Horovod
scales the sum by ``1 / size`` into the integer buffer: horovod/common/ops/gloo_operations.cc,
collective_operations.h); Horovod's own test (test_torch.py
``test_horovod_allreduce_average``) averages equal integer tensors back to themselves;
scaling factors truncate too. And alltoall's splits are Horovod's 32-bit integers."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

import parallax.horovod as hvd
from parallax.horovod.ops import integer_average

N = 8  # the ranks of @hvd.jit on the simulated devices


def test_integer_average_truncates_toward_zero():
    assert integer_average(jnp.array([3, 31, -3], jnp.int32), 2).tolist() == [1, 15, -1]
    assert integer_average(jnp.array([28, -28, 7], jnp.int32), 8).tolist() == [3, -3, 0]
    assert integer_average(jnp.array([3, -3], jnp.int32), 2, postscale=3.0).tolist() == [4, -4]


def test_integer_allreduce_average_inside_a_program_is_horovods():
    @hvd.jit(check_outputs="never")
    def step(batch):  # rank r holds [r, 10 r + 1, -r], then a value equal on every rank
        r = hvd.rank()
        mine = jnp.stack([r, 10 * r + 1, -r]).astype(jnp.int32)
        equal = jnp.arange(-3, 4, dtype=jnp.int32) * 7
        return (hvd.allreduce(mine), hvd.allreduce(equal),
                hvd.allreduce(mine, op=hvd.Sum, postscale_factor=0.5),
                hvd.allreduce(mine, postscale_factor=3.0, prescale_factor=1.5),
                hvd.grouped_allreduce([mine, equal]))

    mean, equal, half_sum, scaled, grouped = step(np.zeros((N, 1), np.float32))
    ranks = np.arange(N)
    every = np.stack([ranks, 10 * ranks + 1, -ranks], axis=1)  # [rank, 3]
    assert mean.dtype == jnp.int32
    np.testing.assert_array_equal(mean, np.trunc(every.sum(0) / N))  # [3, 36, -3]: not -4
    np.testing.assert_array_equal(equal, np.arange(-3, 4) * 7)  # Horovod's test: itself
    np.testing.assert_array_equal(half_sum, np.trunc(every.sum(0) * 0.5))
    prescaled = np.trunc(every * 1.5)  # each rank's buffer, truncated, then summed
    np.testing.assert_array_equal(scaled, np.trunc(prescaled.sum(0) * 3.0 / N))
    np.testing.assert_array_equal(grouped[0], mean)
    np.testing.assert_array_equal(grouped[1], equal)
    assert all(x.dtype == jnp.int32 for x in (equal, half_sum, scaled, *grouped))


def test_integer_allreduce_average_eagerly_and_what_stays_refused():
    x = np.array([3, -7, 40], np.int32)  # one process: its value counts once per rank
    out = hvd.allreduce(x)
    assert out.dtype == np.int32 and out.tolist() == x.tolist()
    with pytest.raises(TypeError, match=re.escape(
            "hvd.allreduce: op=hvd.Average of a bool tensor; Horovod scales the sum of numbers "
            "only")):
        hvd.allreduce(np.array([True, False]))


def test_alltoall_splits_are_horovods_32_bit_integers():
    message = ("hvd.alltoall: splits must hold 32-bit integers, as Horovod requires (its core "
               "refuses other element types); got int64. Pass a list of ints or an int32 "
               "array (np.asarray(splits, np.int32)).")
    with pytest.raises(TypeError, match=re.escape(message)):
        hvd.alltoall(np.arange(N), splits=np.ones(N, np.int64))  # NumPy's (and torch's) default
    with pytest.raises(TypeError, match="got float32"):
        hvd.alltoall(np.arange(N), splits=np.ones(N, np.float32))

    @hvd.jit(check_outputs="never")
    def step(batch):
        x = batch[0]
        received, counts = hvd.alltoall(x, splits=[1] * N)  # a list: int32, as Horovod's
        return hvd.PerRank((received, counts))

    received, counts = step(np.arange(N * 2, dtype=np.float32).reshape(N, 2)).value
    assert counts.dtype == np.int32 and counts.tolist() == [[1] * N] * N  # one row per rank

    @hvd.jit(check_outputs="never")
    def wide(batch):
        return hvd.alltoall(batch[0], splits=np.ones(N, np.int64))

    with pytest.raises(TypeError, match=re.escape(message)):
        wide(np.zeros((N, 2), np.float32))
