"""Real multi-process runs through ``parallax launch`` on localhost (gloo).

- Two "nodes" (two launchers, one process each, 2 devices per process) form one job and
  train DataParallel (with XLA's all-reduce and with point-to-point exchanges), ZeRO 3, DP x TP and a 1F1B pipeline whose stage axis spans the two
  processes to the one-device losses and parameters (1e-6); the same launch then runs
  parallax.horovod's checks for 2 processes x 2 devices and the Horovod-style example.
- ``parallax demo`` under the launcher agrees with one device.
- A JAX process that calls ``sys.exit(3)`` mid-training, while its peer is blocked in a
  collective with it, ends the run within 10 s with its own code, and no process is left.
"""

import re
import shutil
import sys
import time

import pytest

from parallax.distributed import launch
from tests.distributed.launching import alive, launcher, program, run_launcher
from tests.horovod.test_multiprocess import assert_horovod_agrees

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def test_two_nodes_on_localhost_train_five_strategies_like_one_device():
    coordinator = f"127.0.0.1:{launch.free_port()}"
    common = ["--nnodes", "2", "--coordinator", coordinator, "--devices-per-process", "2"]
    command = [sys.executable, program("strategies.py"), "--horovod"]
    with launcher(["--nproc-per-node", "1", "--node-rank", "1", *common, *command]) as node1:
        node0 = run_launcher(["-np", "2", "--node-rank", "0", *common, *command])  # the total
        done1 = node1.finish()
    out1, err1 = done1.stdout, done1.stderr
    assert node0.returncode == 0 and done1.returncode == 0, (
        node0.stdout[-3000:] + node0.stderr[-3000:] + out1[-3000:] + err1[-3000:])
    for rank, text in ((0, node0.stdout), (1, out1)):
        results = re.findall(rf"^\[{rank}\] agree (.*)$", text, re.M)
        assert len(results) == 5, text
        for strategy in ("DataParallel", "DDP point-to-point", "ZeRO 3", "DP x TP",
                         "1F1B over processes"):
            assert any(f'"strategy": "{strategy}"' in r for r in results)
    # the pipeline's stage axis spans the processes: both load the whole batch
    assert re.search(r'"1F1B over processes", "mesh": \{"data": 2, "stage": 2\}, "rows": \[0, 8\]',
                     out1)
    assert_horovod_agrees(node0.stdout + out1, 2, train=True, devices=2)


def test_a_jax_rank_that_exits_mid_training_ends_the_run_with_its_code():
    done = run_launcher(["-np", "2", "--grace", "2", sys.executable, program("stuck_peer.py")])
    out, err = done.stdout, done.stderr
    end = time.time()
    assert done.returncode == 3, out[-3000:] + err[-3000:]
    assert re.search(r"parallax launch: rank 1 \(pid \d+\) exited with code 3 after", err), err
    fault = float(re.search(r"fault at ([\d.]+)", out).group(1))
    assert end - fault < 10
    pids = [int(p) for p in re.findall(r"^\[\d\] pid (\d+)$", out, re.M)]
    assert len(pids) == 2 and not any(alive(p) for p in pids)


def test_parallax_demo_under_the_launcher_agrees_with_one_device():
    # the installed command, or the module where the console script is not on PATH
    command = [shutil.which("parallax")] if shutil.which("parallax") else [
        sys.executable, "-m", "parallax.cli"]
    out = run_launcher(["-np", "2", *command, "demo", "--strategy", "dp+fsdp", "--steps", "2",
                        "--quiet"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for rank in (0, 1):
        assert f"[{rank}] parallax demo: process {rank} of 2, 2 devices in all" in out.stdout
        match = re.search(rf"^\[{rank}\] largest relative loss difference vs one device: "
                          r"([\d.e+-]+)", out.stdout, re.M)
        assert match and float(match.group(1)) <= 1e-4, out.stdout[-3000:]


def test_a_pretrained_checkpoint_loads_across_two_processes_reading_only_their_slices(
        tmp_path):
    import json

    import jax
    from flax import nnx

    import parallax as px

    model = px.models.GPT(px.models.GPTConfig.tiny(), rngs=nnx.Rngs(0))
    px.models.save_pretrained(tmp_path / "in", model)
    out = run_launcher(["-np", "2", "--devices-per-process", "2", sys.executable,
                        program("pretrained_load.py"), str(tmp_path / "in"),
                        str(tmp_path / "out")])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [json.loads(x) for x in re.findall(r"loaded (\{.*\})", out.stdout)]
    assert sorted(line["process"] for line in lines) == [0, 1]
    for line in lines:
        assert line["shards_match"]
        # fsdp splits every large leaf across the processes: each reads about half the
        # model (its two devices' tensor halves of its fsdp half), never all of it
        assert line["bytes_read"] < 0.75 * line["model_bytes"], line
    saved = px.models.from_pretrained(tmp_path / "out")  # gathered and written by process 0
    for a, b in zip(jax.tree.leaves(nnx.state(saved)), jax.tree.leaves(nnx.state(model))):
        assert (a == b).all()
