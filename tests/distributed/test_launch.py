"""``parallax launch``: faults end the run within 10 s naming the rank, with no process left;
bad input gets a clear message; output is prefixed; restarts; Ctrl-C.

The launched program here is plain Python (tests/distributed/programs/faulty.py), so the
launcher runs in this process and each test takes about a second; a JAX program that loses a
peer is in test_multiprocess_faults.py.
"""

import re
import signal
import socket
import sys
import time

import pytest

from parallax.distributed import launch, supervisor
from tests.distributed.launching import assert_none_left, launcher, program

pytestmark = pytest.mark.multiprocess


def launch_here(capfd, *args):
    """Runs the launcher in this process; returns (exit code, stdout, stderr, end time)."""
    code = launch.main(["--grace", "1", *args])
    end = time.time()
    out, err = capfd.readouterr()
    return code, out, err, end


def fault_time(out: str) -> float:
    return float(re.search(r"fault at ([\d.]+)", out).group(1))


@pytest.mark.parametrize("mode, status, code", [
    ("raise", "exited with code 1", 1),
    ("exit3", "exited with code 3", 3),
    ("kill", r"was killed by signal SIGKILL \(9\)", 137),
])
def test_a_failing_rank_stops_the_group(capfd, mode, status, code):
    result, out, err, end = launch_here(capfd, "-np", "3", sys.executable,
                                        program("faulty.py"), mode, "1")
    assert result == code, err
    assert re.search(r"parallax launch: rank 1 \(pid \d+\) " + status + r" after [\d.]+ s; "
                     r"the other ranks were stopped", err), err
    assert end - fault_time(out) < 10
    assert "last lines of rank 1:\n    [1] pid " in err
    if mode == "raise":
        assert "    [1] RuntimeError: rank 1 broke" in err
    assert_none_left(out, expected=6)  # 3 ranks and their grandchildren


def test_output_lines_carry_the_rank_and_success_is_zero(capfd):
    result, out, err, _ = launch_here(capfd, "-np", "2", sys.executable, program("faulty.py"),
                                      "ok")
    assert result == 0, err
    assert sorted(re.findall(r"^\[(\d)\] pid \d+ child \d+ restart 0$", out, re.M)) == ["0", "1"]


def test_max_restarts_starts_the_whole_group_again(capfd):
    result, out, err, _ = launch_here(capfd, "-np", "2", "--max-restarts", "1", sys.executable,
                                      program("faulty.py"), "restart", "1")
    assert result == 0, err
    assert "parallax launch: restarting the group (1 of 1 restarts)" in err
    assert len(re.findall(r"restart 0$", out, re.M)) == 2
    assert len(re.findall(r"restart 1$", out, re.M)) == 2


@pytest.mark.parametrize("args, message", [
    (["-np", "0", "python"], r"-np 0: the number of processes must be >= 1\."),
    (["-np", "2", "no-such-program-xyz"], r"command not found: 'no-such-program-xyz' is not an "
                                          r"executable on PATH"),
    (["-np", "2"], r"no command given; e\.g\. `parallax launch -np 2 python train\.py` or "
                   r"`parallax launch --nproc-per-node 2 train\.py`\."),
    (["-np", "2", "--nnodes", "2", "python"], r"--nnodes 2 needs --coordinator HOST:PORT \(or "
                                              r"--master-addr HOST --master-port PORT\)"),
    (["-np", "2", "--nnodes", "2", "--node-rank", "2", "--coordinator", "h:1", "python"],
     r"--node-rank 2 must be in 0 \.\. 1 \(--nnodes 2\)\."),
    (["-np", "1", "--coordinator", "nohost", "python"], r"--coordinator 'nohost' is not "
                                                        r"HOST:PORT"),
])
def test_bad_input(capfd, args, message):
    code, _, err, _ = launch_here(capfd, *args)
    assert code == 2
    assert re.search(r"parallax launch: error: " + message, err), err


def test_port_in_use(capfd):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, _, err, _ = launch_here(capfd, "-np", "2", "--coordinator", f"127.0.0.1:{port}",
                                      sys.executable, "-c", "pass")
    assert code == 2
    assert re.search(rf"error: cannot use the coordinator address 127\.0\.0\.1:{port}: Address "
                     r"already in use \(port in use\? pick another", err), err


def test_unreachable_coordinator_is_an_error_not_a_hang(capfd):
    port = launch.free_port()
    start = time.monotonic()
    code, _, err, _ = launch_here(capfd, "--nproc-per-node", "1", "--nnodes", "2",
                                  "--node-rank", "1", "--coordinator", f"127.0.0.1:{port}",
                                  "--connect-timeout", "1",
                                  sys.executable, "-c", "pass")
    assert code == 2 and time.monotonic() - start < 5
    assert re.search(rf"error: cannot reach the coordinator 127\.0\.0\.1:{port} after 1 s "
                     r"\(Connection refused\); start node 0 with the same --coordinator", err)


@pytest.mark.slow
def test_ctrl_c_is_forwarded_and_stops_everything():
    with launcher(["-np", "2", "--grace", "1", sys.executable, program("faulty.py"), "wait"],
                  timeout=60) as proc:
        out = ""
        for line in proc.lines():
            out += line
            if len(re.findall(r"pid \d+", out)) == 2:  # both ranks started
                break
        assert len(re.findall(r"pid \d+", out)) == 2, out + "".join(proc.err)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        done = proc.finish()
    assert done.returncode == 130 and time.monotonic() - start < 10
    assert "parallax launch: SIGINT received: forwarding it to ranks 0, 1" in done.stderr
    assert "parallax launch: interrupted; stopped ranks" in done.stderr
    assert_none_left(done.stdout, expected=4)


def test_blame_prefers_the_cause_over_ranks_that_lost_a_peer():
    cause = supervisor.RankExit(1, 11, 3, 2.0, ("training step 7",))
    victim = supervisor.RankExit(0, 10, -6, 1.9, (
        "F1203 client.h:80] Terminating process because the JAX distributed service detected "
        "fatal errors.",))
    assert supervisor.blame([victim, cause]) is cause
    assert supervisor.blame([victim]) is victim
    assert victim.status() == "was killed by signal SIGABRT (6)" and victim.exit_code() == 134


def test_workers_get_torchruns_variables_with_torchruns_meanings(capfd):
    """A script written for torchrun reads RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT (and GROUP_*, ROLE_*, TORCHELASTIC_*) under ``parallax launch``
    with the meanings torchrun's agent gives them
    (torch/distributed/elastic/agent/server/local_elastic_agent.py, ``_start_workers``)."""
    result, out, err, _ = launch_here(capfd, "-np", "2", "--max-restarts", "1", sys.executable,
                                      program("torchrun_env.py"))
    assert result == 0, err
    import json
    seen = {int(e["RANK"]): e for e in (json.loads(line.partition("torchrun ")[2])
                                        for line in out.splitlines() if "torchrun {" in line)}
    assert sorted(seen) == [0, 1], out
    coordinator = seen[0]["PARALLAX_COORDINATOR"]
    host, _, port = coordinator.rpartition(":")
    for rank, env in seen.items():
        assert env == {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": "2", "ROLE_NAME": "default",
            "MASTER_ADDR": host, "MASTER_PORT": str(int(port) - 1),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "1",
            "TORCHELASTIC_RUN_ID": env["TORCHELASTIC_RUN_ID"],
            "TORCHELASTIC_USE_AGENT_STORE": "False", "PARALLAX_COORDINATOR": coordinator}
    assert seen[0]["TORCHELASTIC_RUN_ID"] == seen[1]["TORCHELASTIC_RUN_ID"]
