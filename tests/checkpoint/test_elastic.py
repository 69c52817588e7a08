"""Elastic training in Horovod's manner under ``parallax launch --max-restarts K --min-np M``.

A launched run (ZeRO 3 across 2 processes x 2 devices: every process writes and reads its
own shards of each commit) is SIGKILLed (one process, by pid) mid-training, after its second
commit;
the launcher restarts the group, at full size or with one process fewer, the program
resumes from the commit kept in the node's memory, and the final parameters equal the
uninterrupted run's: the global batch is the same at every world size. Commits live in the
node's memory (the newest) and every few on disk; with the memory gone (a job started again
by hand), the newest commit on disk is restored.
"""

import argparse
import os
import pathlib
import re
import signal
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import parallax as px
import parallax.horovod as hvd
from parallax.checkpoint.elastic import Commits
from parallax.distributed import launch as launch_lib
from tests.distributed.launching import launcher

PROGRAM = str(pathlib.Path(__file__).parent / "programs" / "elastic_train.py")
STEPS, ROWS = 6, 16  # as in programs/elastic_train.py


@pytest.fixture(scope="module")
def uninterrupted():
    """The same 6 steps in this process, ZeRO 3 over 4 devices: final parameters."""
    make = lambda: px.TrainState.create(  # noqa: E731
        px.models.MLP(16, [64, 64], 16, rngs=nnx.Rngs(0)), optax.adam(1e-2))
    rng = np.random.default_rng(0)
    data = [{"x": rng.standard_normal((ROWS, 16), np.float32),
             "y": rng.standard_normal((ROWS, 16), np.float32)} for _ in range(STEPS)]
    run = px.testing.train(make, px.models.mse_loss, data,
                           mesh=px.make_mesh(fsdp=4, devices=jax.devices()[:4]),
                           strategy=px.ZeRO(3, "fsdp"))
    return jax.tree.leaves(run.final_params)


def launch(*args, kill_at=None, timeout=240):
    """Runs the program under the launcher; with ``kill_at``, SIGKILLs rank 1 once both ranks
    hold there (their commits written). Past ``timeout`` seconds the launcher and its ranks
    are killed and the test fails with their last output (launching.Started)."""
    with launcher(["--grace", "1", *map(str, args)], timeout=timeout) as started:
        holding = {}
        if kill_at is not None:
            for line in started.lines():
                match = re.match(rf"\[(\d)\] rank \d pid (\d+) holding at step {kill_at}", line)
                if match:
                    holding[match.group(1)] = int(match.group(2))
                if len(holding) == 2:
                    os.kill(holding["1"], signal.SIGKILL)
                    break
        done = started.finish()
    return done.returncode, done.stdout, done.stderr


def assert_equal_to_uninterrupted(out_file, uninterrupted, processes):
    result = np.load(out_file)
    assert int(result["processes"]) == processes
    for i, want in enumerate(uninterrupted):
        np.testing.assert_allclose(result[f"p{i}"], want, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_killed_process_restarts_the_group_from_the_commit_in_memory(tmp_path, uninterrupted):
    code, out, err = launch("-np", "2", "--devices-per-process", "2", "--max-restarts", "1",
                            sys.executable, PROGRAM, tmp_path / "out.npz", "--hold-at", "5",
                            kill_at=5)
    assert code == 0, out[-2000:] + err[-3000:]
    assert re.search(r"parallax launch: rank 1 \(pid \d+\) was killed by signal SIGKILL \(9\)",
                     err), err
    assert "parallax launch: restarting the group (1 of 1 restarts) with 2 processes" in err
    assert ("[0] parallax elastic: restart 1 on 2 processes: resumed from commit 2 (memory, "
            "made by 2 processes) at {'step': 4}") in out, out
    assert "[0] rank 0 done at step 6 on 2 processes" in out
    memory = re.search(r"\[0\] commit 2 in (\S+) holds \['ocdbt.process_0', "
                       r"'ocdbt.process_1'\]", out)  # each process wrote its own shards
    assert memory, out
    assert len(np.load(tmp_path / "out.npz")["losses"]) == 2  # steps 5 and 6 after the restart
    assert_equal_to_uninterrupted(tmp_path / "out.npz", uninterrupted, processes=2)
    assert not pathlib.Path(memory.group(1)).exists()  # the launcher removed the job's memory


@pytest.mark.slow
@pytest.mark.multiprocess
def test_with_min_np_the_group_restarts_smaller_with_the_same_global_batch(tmp_path,
                                                                           uninterrupted):
    code, out, err = launch("-np", "2", "--devices-per-process", "2", "--max-restarts", "1",
                            "--min-np", "1", sys.executable, PROGRAM, tmp_path / "out.npz",
                            "--hold-at", "5", kill_at=5)
    assert code == 0, out[-2000:] + err[-3000:]
    assert ("parallax launch: rank 1's slot is dropped (a failed slot counts as a lost host); "
            "1 remain (--min-np 1)") in err, err
    assert "parallax launch: restarting the group (1 of 1 restarts) with 1 process\n" in err
    assert ("[0] parallax elastic: restart 1 on 1 process: resumed from commit 2 (memory, made "
            "by 2 processes) at {'step': 4}") in out, out
    assert_equal_to_uninterrupted(tmp_path / "out.npz", uninterrupted, processes=1)


def test_commits_go_to_memory_and_every_few_to_disk_and_the_newest_wins(tmp_path):
    like = {"w": jax.ShapeDtypeStruct((2,), np.float32)}
    commits = Commits(directory=tmp_path / "disk", memory=str(tmp_path / "memory"),
                      checkpoint_every=2)
    for index in (1, 2, 3):
        commits.save(index, {"w": np.full(2, index, np.float32)}, {"step": 2 * index})
    commits.wait()
    assert sorted(p.name for p in (tmp_path / "memory").iterdir()) == ["3"]  # newest only
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["2"]  # every 2nd
    assert commits.latest() == (3, "memory")
    restored = commits.restore(like=like, mesh=None, strategy=None)
    assert restored.extra == {"step": 6} and restored.state["w"].tolist() == [3, 3]
    commits.close()
    # The launcher's memory is gone (a job started again by hand): the disk has the newest.
    again = Commits(directory=tmp_path / "disk", memory=None)
    assert again.latest() == (2, "disk")
    assert again.restore(like=like, mesh=None, strategy=None).extra == {"step": 4}
    again.close()


def test_outside_the_launcher_a_state_needs_a_directory(monkeypatch):
    monkeypatch.delenv("PARALLAX_ELASTIC_MEMORY", raising=False)
    with pytest.raises(ValueError, match=re.escape(
            "hvd.elastic.State: commits need somewhere to live: pass directory= (a checkpoint "
            "directory every process can reach), or run under parallax launch on one node, "
            "which keeps commits in the node's memory.")):
        hvd.elastic.State({"w": np.zeros(2)}, like={"w": np.zeros(2)}, mesh=None)


def test_min_np_is_checked_and_shrinks_the_plan():
    parser = argparse.ArgumentParser()
    launch_lib.add_arguments(parser)
    config = launch_lib.config_from_args(parser.parse_args(
        ["-np", "3", "--max-restarts", "2", "--min-np", "2", sys.executable]))
    assert config.min_np == 2
    group = launch_lib.group_start(config, 1, nproc=2, memory="/dev/shm/x")
    assert group.ranks == (0, 1) and group.world_size == 2
    env = launch_lib.environment(config, group, 1)
    assert env["PARALLAX_NUM_PROCESSES"] == "2" and env["PARALLAX_ELASTIC_MEMORY"] == "/dev/shm/x"
    for bad in (["-np", "2", "--min-np", "3"], ["-np", "2", "--min-np", "0"],
                ["-np", "2", "--nnodes", "2", "--coordinator", "h:1", "--min-np", "1"]):
        with pytest.raises(launch_lib.LaunchError, match=re.escape("--min-np")):
            launch_lib.config_from_args(parser.parse_args(bad + [sys.executable]))
