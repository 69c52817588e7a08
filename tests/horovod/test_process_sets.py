"""Process sets: every collective restricted to a set of ranks, inside @hvd.jit (XLA's
replica groups) and eagerly, against numpy over the members; registration rules and errors
as Horovod's (horovod/common/process_sets.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parallax.horovod as hvd
from parallax.analysis import hlo

MEMBERS = [1, 2, 5]


@pytest.fixture(scope="module")
def odd_set():
    ps = hvd.add_process_set(MEMBERS)
    yield ps
    hvd.remove_process_set(ps)


def per_rank_values():
    return np.arange(8, dtype=np.float32)[:, None] + 1.0  # rank r holds r + 1


@pytest.fixture(scope="module")
def in_program(odd_set):
    @hvd.jit(check_outputs="never")
    def step(x):
        v = x[0]
        parts = jnp.concatenate([v * 10 + j for j in range(3)])
        return hvd.PerRank(dict(
            sum=hvd.allreduce(v, op=hvd.Sum, process_set=odd_set),
            mean=hvd.allreduce(v, process_set=odd_set),
            min=hvd.allreduce(v, op=hvd.Min, process_set=odd_set),
            prod=hvd.allreduce(v, op=hvd.Product, process_set=odd_set),
            gather=hvd.allgather(v, process_set=odd_set),
            bcast=hvd.broadcast(v, 5, process_set=odd_set),
            a2a=hvd.alltoall(parts, process_set=odd_set),
            a2av=hvd.alltoall(parts, splits=jnp.arange(3, dtype=jnp.int32) % 2,
                              process_set=odd_set),
            rank=odd_set.rank()))

    x = per_rank_values()
    return jax.tree.map(np.asarray, step(x).value), step.lower(x)


def test_collectives_in_a_program_reduce_over_the_members_only(in_program):
    out, _ = in_program
    v = per_rank_values()[:, 0]
    members = v[MEMBERS]
    for r in range(8):
        inside = r in MEMBERS
        assert out["sum"][r] == (members.sum() if inside else v[r])
        assert out["mean"][r] == pytest.approx(members.mean() if inside else v[r], rel=1e-6)
        assert out["min"][r] == (members.min() if inside else v[r])
        assert out["prod"][r] == (members.prod() if inside else v[r])
        assert out["gather"][r].tolist() == members.tolist()  # every rank gets the set's
        assert out["bcast"][r] == (v[5] if inside else v[r])
        pos = MEMBERS.index(r) if inside else None
        expect = [m * 10 + pos for m in members] if inside else [v[r] * 10 + j for j in range(3)]
        assert out["a2a"][r].tolist() == pytest.approx(expect)
        assert out["rank"][r] == (pos if inside else -1)
        # splits [0, 1, 0]: each member sends its row 0 to the set's middle rank (2) only
        received, counts = out["a2av"][0][r], out["a2av"][1][r]
        assert counts.tolist() == ([1, 1, 1] if r == 2 else [0, 0, 0])
        want = [[m * 10, 0, 0] for m in members] if r == 2 else [[0, 0, 0]] * 3
        np.testing.assert_allclose(received.reshape(3, 3), want)


def test_the_compiled_all_reduce_names_the_sets_devices(in_program):
    """hvd.allreduce's all-reduces (named horovod/allreduce in the HLO metadata) run over
    the replica group {1, 2, 5}, every other device alone."""
    _, lowered = in_program
    reduces = [c for c in hlo.collectives(lowered.compile())
               if c.kind == "all-reduce" and "horovod/allreduce" in c.op_name]
    assert len(reduces) >= 2
    assert all(set(c.groups) == {(1, 2, 5), (0,), (3,), (4,), (6,), (7,)} for c in reduces)


def test_eager_collectives_count_the_members_this_process_holds(odd_set):
    assert float(hvd.allreduce(np.float32(2.0), op=hvd.Sum, process_set=odd_set)) == 6.0
    assert hvd.allgather(np.arange(2), process_set=odd_set).tolist() == [0, 1] * 3
    assert hvd.broadcast(np.ones(2), 2, process_set=odd_set).tolist() == [1.0, 1.0]
    assert odd_set.size() == 3 and odd_set.included() and odd_set.rank() == 0


def test_registration_follows_horovod():
    ps = hvd.add_process_set(hvd.ProcessSet([0, 3]))
    assert ps.process_set_id > 0 and hvd.global_process_set.process_set_id == 0
    with pytest.raises(ValueError, match=re.escape(
            "hvd.add_process_set: a process set with ranks [0, 3] is already registered")):
        hvd.add_process_set([3, 0])
    assert hvd.remove_process_set(ps) and not hvd.remove_process_set(ps)
    assert not hvd.remove_process_set(hvd.global_process_set)
    with pytest.raises(ValueError, match=re.escape(
            "hvd.allreduce: ProcessSet(process_set_id=None, ranks=[0, 3]) is not registered; "
            "pass it to hvd.add_process_set first (it may have been removed).")):
        hvd.allreduce(np.ones(1), process_set=ps)


def test_bad_process_sets_are_refused(odd_set):
    with pytest.raises(ValueError, match=re.escape(
            "hvd.add_process_set: ranks=[0, 9] must be distinct ranks of this job (0 .. 7: "
            "one rank per device), at least one.")):
        hvd.add_process_set([0, 9])
    with pytest.raises(TypeError, match=re.escape(
            "hvd.allgather: process_set=[1, 2] is not an hvd.ProcessSet")):
        hvd.allgather(np.ones(1), process_set=[1, 2])
    with pytest.raises(ValueError, match=re.escape(
            "hvd.broadcast: root_rank=0 is not in the process set [1, 2, 5]; the root must be "
            "one of its ranks.")):
        hvd.broadcast(np.ones(1), 0, process_set=odd_set)
    with pytest.raises(NotImplementedError, match=re.escape(
            "hvd.allreduce: op=hvd.Adasum on a process set is not supported")):
        hvd.allreduce(np.ones(1), op=hvd.Adasum, process_set=odd_set)

    @hvd.jit(check_outputs="never")
    def uneven(x):
        return hvd.alltoall(x, splits=jnp.ones(8, jnp.int32), process_set=odd_set)

    with pytest.raises(ValueError, match=re.escape(
            "hvd.alltoall: splits must hold one count per rank of the process set [1, 2, 5] "
            "(shape (3,)), got shape (8,), for a tensor with a first dimension.")):
        uneven(np.ones((64, 1), np.float32))
