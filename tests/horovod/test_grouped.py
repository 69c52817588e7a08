"""Grouped collectives and reducescatter: equal to the ungrouped ops (and numpy), one fused
collective in the compiled program where Horovod fuses, Horovod's default op (Average)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallax.horovod as hvd
from parallax.analysis import hlo

RANKS = 8


def rows(shape, seed):
    return np.random.default_rng(seed).normal(size=(RANKS,) + shape).astype(np.float32)


A, B = rows((16, 3), 0), rows((8,), 1)  # each rank's tensors


@pytest.fixture(scope="module")
def programs():
    @hvd.jit(batch_argnums=(0, 1), check_outputs="never")
    def grouped(a, b):
        a, b = a[0], b[0]
        return hvd.PerRank((hvd.grouped_allreduce([a, b]), hvd.grouped_allgather([a, b]),
                            hvd.grouped_reducescatter([a, b]),
                            hvd.reducescatter(a, op=hvd.Sum)))

    @hvd.jit(batch_argnums=(0, 1), check_outputs="never")
    def ungrouped(a, b):
        a, b = a[0], b[0]
        return hvd.PerRank(([hvd.allreduce(a), hvd.allreduce(b)],
                            [hvd.allgather(a), hvd.allgather(b)]))

    a, b = A, B
    return ((jax.tree.map(np.asarray, grouped(a, b).value), grouped.lower(a, b).compile()),
            (jax.tree.map(np.asarray, ungrouped(a, b).value), ungrouped.lower(a, b).compile()))


def test_grouped_ops_equal_the_ungrouped_ones_and_numpy(programs):
    (reduced, gathered, scattered, summed), _ = programs[0]
    (reduced1, gathered1), _ = programs[1]
    for r in range(RANKS):
        np.testing.assert_allclose(reduced[0][r], A.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(reduced[1][r], B.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(reduced[0][r], reduced1[0][r], rtol=1e-6)
        np.testing.assert_array_equal(gathered[0][r], A.reshape(-1, 3))
        np.testing.assert_array_equal(gathered[1][r], gathered1[1][r])
        # reducescatter: Horovod's default op is Average; rank r keeps part r
        np.testing.assert_allclose(scattered[0][r], A.mean(0)[2 * r:2 * r + 2], rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(scattered[1][r], B.mean(0)[r:r + 1], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(summed[r], A.sum(0)[2 * r:2 * r + 2], rtol=1e-5, atol=1e-5)


def test_the_grouped_program_fuses_each_group_into_one_collective(programs):
    found = hlo.collectives(programs[0][1])
    def by(name):  # the collectives named horovod/<name> (reducescatter calls the grouped op)
        return [c for c in found if f"horovod/{name}" in c.op_name
                and (name == "reducescatter" or "horovod/reducescatter" not in c.op_name)]

    assert [c.kind for c in by("grouped_allreduce")] == ["all-reduce"]
    assert len(by("grouped_allreduce")[0].shapes) == 2  # one all-reduce, both tensors
    assert [c.kind for c in by("grouped_allgather")] == ["all-gather"]
    assert [c.kind for c in by("grouped_reducescatter")] == ["reduce-scatter"]
    assert [c.kind for c in by("reducescatter")] == ["reduce-scatter"]


def test_eager_grouped_ops_and_reducescatter():
    a, b = hvd.grouped_allreduce([np.ones(2, np.float32), np.arange(3.0)], op=hvd.Sum)
    assert a.tolist() == [8.0, 8.0] and b.tolist() == [0.0, 8.0, 16.0]
    assert [t.shape for t in hvd.grouped_allgather([np.ones(1), np.ones((2, 3))])] == [
        (8,), (16, 3)]
    # one process holding the 8 ranks gets their 8 parts: the whole (averaged) tensor
    assert hvd.reducescatter(np.arange(8.0)).tolist() == list(np.arange(8.0))


def test_bad_grouped_input_is_refused():
    with pytest.raises(TypeError, match=re.escape(
            "hvd.grouped_allreduce: tensors must be a list of tensors, got ndarray; for one "
            "tensor call the ungrouped op.")):
        hvd.grouped_allreduce(np.ones(2))
    with pytest.raises(ValueError, match=re.escape(
            "hvd.grouped_reducescatter: the first dimension of shape (6,) does not split into "
            "8 equal parts (one per rank taking part); pad it to a multiple, or use "
            "hvd.allreduce.")):
        hvd.reducescatter(np.ones(6))
    with pytest.raises(ValueError, match=re.escape(
            "hvd.grouped_reducescatter: op=ReduceOp.Max must be hvd.Average (the default) or "
            "hvd.Sum.")):
        hvd.reducescatter(np.ones(8), op=hvd.Max)
