"""horovodrun's hosts under ``parallax launch``: ``-H``/``--hostfile`` start the ranks of other
hosts with ssh, and a discovery script sizes the group and grows it back.

Every host here is an alias of this machine (``localhost`` runs directly, ``127.0.0.1`` is
reached through ssh), and ssh is a stand-in put first on PATH: it drops ssh's options and
the host, records the host, and runs the remote command here in an emptied environment
(``env -i``), so the rank sees only what the launcher forwarded. All traffic stays on
loopback. The programs are plain Python (tests/distributed/programs/), so each launch takes
about a second.
"""

import json
import os
import re
import stat
import sys

import pytest

from parallax.distributed import launch
from tests.distributed import launching
from tests.distributed.launching import alive, assert_none_left, program, run_launcher

pytestmark = pytest.mark.multiprocess

SSH_STANDIN = """#!/bin/sh
# ssh's stand-in: drop the options and the host, run the remote command here
while [ $# -gt 0 ]; do
  case "$1" in
    -tt|-T) shift ;;
    -o|-p|-i) shift 2 ;;
    *) break ;;
  esac
done
echo "$1" >> "$STANDIN_LOG"
shift
exec env -i HOME="$HOME" PATH=/usr/bin:/bin sh -c "$*"
"""


def executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


@pytest.fixture
def ssh_standin(tmp_path, monkeypatch):
    """The stand-in first on PATH; returns the file that lists the hosts it was asked for."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "ssh", SSH_STANDIN)
    log = tmp_path / "ssh.log"
    log.write_text("")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("STANDIN_LOG", str(log))
    monkeypatch.setenv("PARALLAX_TEST_MARK", "forwarded")
    return log


def launch_here(capfd, *args):
    code = launch.main(["--grace", "1", *args])
    out, err = capfd.readouterr()
    return code, out, err


def reports(out):
    return [json.loads(line.partition("env ")[2]) for line in out.splitlines()
            if re.match(r"\[\d+\] env \{", line)]


def test_hosts_reached_by_ssh_get_the_same_contract(capfd, ssh_standin):
    code, out, err = launch_here(capfd, "-np", "3", "-H", "localhost:2,127.0.0.1:1",
                                 sys.executable, program("rank_env.py"), "--lr", "1")
    assert code == 0, err
    assert ssh_standin.read_text().split() == ["127.0.0.1"]  # localhost ran directly
    seen = {int(r["RANK"]): r for r in reports(out)}
    assert sorted(seen) == [0, 1, 2], out
    coordinator = seen[0]["PARALLAX_COORDINATOR"]
    assert re.fullmatch(r"localhost:\d+", coordinator)  # rank 0's host
    remote = seen[2]
    assert (remote["LOCAL_RANK"], remote["LOCAL_WORLD_SIZE"], remote["WORLD_SIZE"],
            remote["GROUP_RANK"], remote["GROUP_WORLD_SIZE"], remote["PARALLAX_COORDINATOR"],
            remote["PARALLAX_TEST_MARK"], remote["cwd"], remote["argv"]) == (
        "0", "1", "3", "1", "2", coordinator, "forwarded", os.getcwd(), ["--lr", "1"])
    assert (seen[1]["LOCAL_RANK"], seen[1]["LOCAL_WORLD_SIZE"], seen[1]["GROUP_RANK"]) == (
        "1", "2", "0")


@pytest.mark.slow
def test_a_jax_job_spans_a_host_reached_by_ssh(ssh_standin):
    """Two processes, one through ssh, join one jax.distributed job (coordinator on
    localhost, rank 0's host) and sum over both processes' devices."""
    env = launching.test_env(PATH=os.environ["PATH"], STANDIN_LOG=str(ssh_standin))
    out = run_launcher(["-np", "2", "-H", "localhost:1,127.0.0.1:1", sys.executable,
                        program("global_sum.py")], env=env, timeout=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert sorted(re.findall(r"^\[\d\] (rank \d of 2: sum 1)$", out.stdout, re.M)) == [
        "rank 0 of 2: sum 1", "rank 1 of 2: sum 1"], out.stdout[-3000:]
    assert ssh_standin.read_text().split() == ["127.0.0.1"]
    assert_none_left(out.stdout, expected=4)


def test_a_failing_rank_on_a_host_reached_by_ssh_stops_the_group(capfd, ssh_standin,
                                                                   tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    code, out, err = launch_here(capfd, "--hostfile", str(hostfile), sys.executable,
                                 program("faulty.py"), "exit3", "1")
    assert code == 3, err
    assert re.search(r"parallax launch: rank 1 \(pid \d+\) exited with code 3 after [\d.]+ s; "
                     r"the other ranks were stopped", err), err
    assert ssh_standin.read_text().split() == ["127.0.0.1"]
    assert_none_left(out, expected=4)


def test_discovered_hosts_grow_the_group_back(capfd, tmp_path):
    hostfile = tmp_path / "available"
    hostfile.write_text("localhost:1\n")
    script = executable(tmp_path / "discover.sh", f"#!/bin/sh\ncat {hostfile}\n")
    code, out, err = launch_here(capfd, "--host-discovery-script", script, "--min-np", "1",
                                 "--max-np", "2", sys.executable, program("rank_env.py"),
                                 "--grow", str(hostfile))
    assert code == 0, err
    assert "parallax launch: starting 1 process on localhost" in err
    assert ("parallax launch: the discovery script reports 2 slots (localhost:2); stopping the "
            "group of 1 to start it again with 2") in err
    assert "parallax launch: starting 2 processes on localhost" in err
    runs = [(r["PARALLAX_RESTART"], r["WORLD_SIZE"]) for r in reports(out)]
    assert sorted(runs) == [("0", "1"), ("1", "2"), ("1", "2")], out
    assert not [r["pid"] for r in reports(out) if alive(r["pid"])]


def test_too_few_discovered_slots_end_after_the_start_timeout(capfd, tmp_path):
    script = executable(tmp_path / "discover.sh", "#!/bin/sh\necho localhost:1\n")
    code, _, err = launch_here(capfd, "--host-discovery-script", script, "--min-np", "2",
                               "--start-timeout", "0.5", sys.executable, "-c", "pass")
    assert code == 2
    assert (f"parallax launch: error: --host-discovery-script {script} reported localhost:1 (1 "
            "slots) for 0.5 s, fewer than --min-np 2. Lower --min-np, or raise "
            "--start-timeout.") in err, err


def test_min_np_drops_the_failed_slot_from_its_host(capfd, ssh_standin):
    code, out, err = launch_here(capfd, "-H", "localhost:1,127.0.0.1:1", "--max-restarts", "1",
                                 "--min-np", "1", sys.executable, program("faulty.py"),
                                 "restart", "1")
    assert code == 0, err
    assert ("parallax launch: rank 1's slot is dropped (a failed slot counts as a lost host); 1 "
            "remain (--min-np 1)") in err
    assert ssh_standin.read_text().split() == ["127.0.0.1"]  # the restart ran on localhost only
    assert len(re.findall(r"restart 1$", out, re.M)) == 1


def test_a_failure_under_discovery_restarts_on_the_hosts_reported_then(capfd, tmp_path):
    script = executable(tmp_path / "discover.sh", "#!/bin/sh\necho localhost:2\n")
    code, out, err = launch_here(capfd, "--host-discovery-script", script, "--min-np", "1",
                                 "--max-restarts", "1", sys.executable, program("faulty.py"),
                                 "restart", "1")
    assert code == 0, err
    assert ("parallax launch: restarting the group (1 of 1 restarts) on the hosts the "
            "discovery script reports") in err
    assert err.count("parallax launch: starting 2 processes on localhost") == 2
    assert len(re.findall(r"restart 1$", out, re.M)) == 2
    assert_none_left(out, expected=8)
