"""parallax.horovod across real processes, through ``parallax launch`` (gloo on localhost):
every collective equals numpy on the gathered inputs, broadcasts make differently seeded
processes identical, and the optimizer trains to the full-batch numbers. Here 4 processes of
one device; the 2 x 2 run, with the Horovod-style example against one process, shares the
launch of tests/distributed/test_multiprocess.py (fewer process starts)."""

import re
import sys

import pytest

from tests.distributed.launching import Started, run_launcher
from tests.distributed.launching import test_env as launch_env

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

PROGRAM = "tests/horovod/programs/collectives.py"
CHECKS = 38  # "ok ..." lines each rank prints with one device per process
CHECKS_SEVERAL_DEVICES = 33  # eager alltoall refused: 1 check instead of 6


def assert_horovod_agrees(text: str, ranks: int, train: bool, devices: int = 1) -> None:
    """Every process printed every ``ok`` check, ``all agree``, and (train) the example's
    match; with ``devices`` per process, process p holds Horovod ranks p * devices ..."""
    checks = CHECKS if devices == 1 else CHECKS_SEVERAL_DEVICES
    for rank in range(ranks):
        assert len(re.findall(rf"^\[{rank}\] ok ", text, re.M)) == checks, text[-3000:]
        assert f"[{rank}] all agree" in text
        if train:
            match = re.search(rf"^\[{rank}\] rank {rank * devices}: matches the one-process "
                              r"run: losses "
                              r"([\d.e+-]+), parameters ([\d.e+-]+)", text, re.M)
            assert match and max(float(match.group(1)), float(match.group(2))) <= 1e-5


def test_collectives_across_four_processes():
    out = run_launcher(["-np", "4", sys.executable, PROGRAM])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert_horovod_agrees(out.stdout, 4, train=False)


def test_horovodruns_environment_is_one_job_not_n_single_processes():
    """Two processes started as ``horovodrun --gloo -np 2`` starts them (horovod/runner/
    gloo_run.py: HOROVOD_RANK, HOROVOD_SIZE, HOROVOD_LOCAL_*, HOROVOD_CROSS_*,
    HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT): one job of 2 ranks. Before, each trained alone with
    hvd.size() == 1."""
    from parallax.distributed.coordinator_address import free_port_pair

    rendezvous = free_port_pair() - 1  # horovodrun's server (absent here); JAX takes + 1
    procs = [Started(
        [sys.executable, "tests/horovod/programs/horovodrun_env.py"], timeout=120,
        merge_stderr=True, env=launch_env(
            HOROVOD_RANK=str(r), HOROVOD_SIZE="2", HOROVOD_LOCAL_RANK=str(r),
            HOROVOD_LOCAL_SIZE="2", HOROVOD_CROSS_RANK="0", HOROVOD_CROSS_SIZE="1",
            HOROVOD_HOSTNAME="localhost", HOROVOD_GLOO_RENDEZVOUS_ADDR="127.0.0.1",
            HOROVOD_GLOO_RENDEZVOUS_PORT=str(rendezvous), HOROVOD_CONTROLLER="gloo",
            HOROVOD_CPU_OPERATIONS="gloo")) for r in range(2)]
    try:
        dones = [p.finish() for p in procs]
    finally:
        for p in procs:
            p.kill()
    outs = [d.stdout for d in dones]
    for r, (done, out) in enumerate(zip(dones, outs)):
        assert done.returncode == 0, out[-3000:]
        assert f"source horovodrun processes 2 size 2 rank {r} sum 3" in out, out[-3000:]


def test_join_lets_a_process_run_out_of_data_while_the_other_reduces():
    """Process 1 joins after one batch; process 0's next allreduces (and eager
    DistributedOptimizer updates) count it as zero (averages still divide by size(), as
    Horovod's), and join returns the last to join."""
    out = run_launcher(["-np", "2", sys.executable, "tests/horovod/programs/join.py"])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "[0] sums [11.0, 20.0, 30.0] means [5.5, 10.0, 15.0] last 0" in out.stdout
    assert "[1] sums [11.0] means [5.5] last 0" in out.stdout
    # the eager optimizer's fused reduction is followed with zeros too (sgd(1): -mean)
    assert ("[0] optimizer [[-5.5, 5.5], [-10.0, 10.0], [-15.0, 15.0]] last 0"
            in out.stdout), out.stdout[-3000:]
    assert "[1] optimizer [[-5.5, 5.5]] last 0" in out.stdout
    for rank in range(2):
        assert f"[{rank}] objects [{{'rank': 0}}, {{'rank': 1}}]" in out.stdout
    # rank 0 alone sums its own 5; rank 1, outside the set, takes part and keeps its 6
    assert "[0] set 5.0 cross 0 1" in out.stdout and "[1] set 6.0 cross 0 1" in out.stdout
    # eager: the set {0}'s gather; reducescatter averages 1x and 2x arange(4): rank r keeps
    # part r; a grouped allreduce sums each tensor
    assert "[0] more [0] [0.0, 1.5] [1.0, [2.0, 2.0]]" in out.stdout
    assert "[1] more [0] [3.0, 4.5] [1.0, [2.0, 2.0]]" in out.stdout
