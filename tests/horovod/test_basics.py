"""One process of 8 ranks: join has nothing to wait for, allgather_object returns one object
per rank, the topology calls answer for one node (join across processes:
test_multiprocess.py); inside @hvd.jit join is refused, and the active-flag recipe its
message gives reproduces join's numbers."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

import parallax.horovod as hvd


def test_join_allgather_object_and_topology_in_one_process():
    assert hvd.join() == 0
    assert hvd.allgather_object({"r": 1}) == [{"r": 1}] * hvd.size()
    assert (hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()) == (0, 1, True)
    assert not hvd.mpi_threads_supported() and not hvd.mpi_enabled() and not hvd.mpi_built()
    assert hvd.gloo_enabled() and not hvd.nccl_built()
    # after join, eager allreduces still work (one process: no header exchange)
    assert float(hvd.allreduce(np.float32(1.0), op=hvd.Sum)) == hvd.size()


def test_cross_rank_reads_horovodruns_environment(monkeypatch):
    monkeypatch.setenv("HOROVOD_CROSS_RANK", "2")
    monkeypatch.setenv("HOROVOD_CROSS_SIZE", "4")
    assert (hvd.cross_rank(), hvd.cross_size()) == (2, 4)


def test_join_inside_a_program_is_refused():
    @hvd.jit
    def step(x):
        hvd.join()
        return hvd.allreduce(x.sum())

    with pytest.raises(ValueError, match=re.escape(
            "hvd.join: called inside a program over the Horovod axis; every rank runs every "
            "step of one SPMD program, so none can leave early. Eagerly: run the steps outside "
            "@hvd.jit (tx.update of hvd.DistributedOptimizer, hvd.allreduce or "
            "hvd.grouped_allreduce on this process's gradients) and call hvd.join() after its "
            "last batch. Inside @hvd.jit: pass each rank an active flag")):
        step(np.ones((8, 1), np.float32))


def test_the_active_flag_recipe_gives_joins_numbers():
    """Rank r has r % 3 + 1 batches of value 10 r + t: per step, join's sum counts the ranks
    still with data (the others' zeros), the mean divides by size(), and the last rank with
    data is the highest of those with the most batches (eager join's tie rule)."""
    counts = [r % 3 + 1 for r in range(8)]

    @hvd.jit
    def step(batch):  # this rank's [value, active]
        value, active = batch[0, 0], batch[0, 1]
        return (hvd.allreduce(value * active, op=hvd.Sum), hvd.allreduce(value * active),
                hvd.allreduce(jnp.where(active > 0, hvd.rank(), -1), op=hvd.Max))

    for t in range(max(counts)):
        rows = np.array([[10.0 * r + t, float(t < counts[r])] for r in range(8)], np.float32)
        total, mean, last = step(rows)
        expected = sum(10.0 * r + t for r in range(8) if t < counts[r])
        assert float(total) == expected and float(mean) == pytest.approx(expected / 8)
        assert int(last) == max(r for r in range(8) if t < counts[r])
    assert int(last) == max(r for r in range(8) if counts[r] == max(counts))  # join's answer
