"""One process of 8 ranks: join has nothing to wait for, allgather_object returns one object
per rank, the topology calls answer for one node (join across processes:
test_multiprocess.py)."""

import re

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
            "step of one SPMD program, so none can leave early.")):
        step(np.ones((8, 1), np.float32))
