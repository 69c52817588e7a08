"""``parallax launch`` reads torchrun's and horovodrun's command lines, one meaning per flag,
and refuses combinations that disagree or mean nothing (messages pinned). No process starts
here: these tests parse, validate and plan (torch/distributed/run.py and
horovod/runner/launch.py are the references for the spellings)."""

import argparse
import re
import sys

import pytest

from parallax.distributed import hosts, launch
from tests.distributed.launching import program

SCRIPT = program("rank_env.py")


def config(*args):
    parser = argparse.ArgumentParser(allow_abbrev=False)
    launch.add_arguments(parser)
    return launch.config_from_args(parser.parse_args(list(args)))


def test_torchruns_spellings():
    c = config("--nproc_per_node", "2", "--nnodes", "2:2", "--node_rank", "1", "--master_addr",
               "10.0.0.1", "--master_port", "29500", SCRIPT, "--lr", "1")
    assert c.command == (sys.executable, SCRIPT, "--lr", "1")  # a bare .py: this Python
    assert (c.nproc, c.nnodes, c.node_rank, c.world_size) == (2, 2, 1, 4)
    assert c.coordinator == "10.0.0.1:29501"
    env = launch.environment(c, launch.group_start(c, 0), 3, base={})
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["RANK"], env["LOCAL_RANK"]) == (
        "10.0.0.1", "29500", "3", "1")  # torchrun's store port comes back as MASTER_PORT
    assert config("--nproc-per-node", "2", "--master-port", "1234", SCRIPT
                  ).coordinator == "127.0.0.1:1235"
    assert config("--standalone", "--nproc-per-node", "2", SCRIPT).coordinator is None
    c = config("--nnodes", "2", "--node-rank", "0", "--rdzv-backend", "static",
               "--rdzv-endpoint", "h:29400", "--rdzv-id", "job7", SCRIPT)
    assert (c.coordinator, c.nproc, c.world_size) == ("h:29401", 1, 2)  # torchrun's default: 1
    assert launch.environment(c, launch.group_start(c, 0), 0, base={})[
        "TORCHELASTIC_RUN_ID"] == "job7"
    assert config("-m", "json.tool", "--indent", "2").command == (
        sys.executable, "-m", "json.tool", "--indent", "2")
    assert config("--no-python", sys.executable, "-c", "1").command == (sys.executable, "-c", "1")
    with pytest.raises(launch.LaunchError, match=re.escape(
            f"command not found: {SCRIPT!r} is not an executable")):  # no x bit: not run
        config("--no_python", SCRIPT)


def test_np_is_the_total_and_nproc_per_node_the_count_per_node():
    both = config("-np", "4", "--nproc-per-node", "2", "--nnodes", "2", "--coordinator", "h:1",
                  sys.executable)
    assert (both.nproc, both.world_size) == (2, 4)
    assert config("-np", "4", "--nnodes", "2", "--coordinator", "h:1", sys.executable).nproc == 2
    assert config("-np", "3", sys.executable).world_size == 3


def test_horovodruns_hosts():
    c = config("-np", "3", "-H", "localhost:2,127.0.0.1:2", sys.executable)
    group = launch.group_start(c, 0)
    assert [(p.rank, p.host, p.local_rank, p.local_size, p.node_rank, p.nnodes)
            for p in group.placements] == [(0, "localhost", 0, 2, 0, 2),
                                           (1, "localhost", 1, 2, 0, 2),
                                           (2, "127.0.0.1", 0, 1, 1, 2)]
    assert re.fullmatch(r"localhost:\d+", group.coordinator) and group.world_size == 3
    env = launch.environment(c, group, 2, base={})
    assert (env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"],
            env["GROUP_WORLD_SIZE"], env["PARALLAX_NODE_RANK"]) == ("2", "0", "1", "1", "2", "1")
    assert config("-H", "localhost:2,127.0.0.1:2", sys.executable).nproc == 4  # all the slots
    assert launch.elastic_memory(config("-H", "localhost:2,127.0.0.1:2", "--max-restarts", "1",
                                        sys.executable)) is None  # 127.0.0.1 is reached by ssh
    assert hosts.without_slot(c.hosts, "127.0.0.1") == (hosts.Host("localhost", 2),
                                                       hosts.Host("127.0.0.1", 1))


def test_hostfile(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# two hosts\nlocalhost slots=2\n\n127.0.0.1   slots = 1  # the other\n")
    assert config("--hostfile", str(path), sys.executable).hosts == (
        hosts.Host("localhost", 2), hosts.Host("127.0.0.1", 1))
    assert config("-hostfile", str(path), "-np", "2", sys.executable).nproc == 2


@pytest.mark.parametrize("args, message", [
    (["-np", "4", "--nproc-per-node", "3"],
     "-np 4 and --nproc-per-node 3 disagree: -np is the TOTAL number of processes "
     "(horovodrun's meaning), --nproc-per-node the number per node (torchrun's); 3 per node x "
     "1 node(s) = 3. Give one of them."),
    (["-np", "3", "--nnodes", "2", "--coordinator", "h:1"],
     "-np 3 with --nnodes 2: -np is the TOTAL number of processes (horovodrun's meaning; it "
     "counted processes per node before), so it must be a multiple of --nnodes. For 3 per "
     "node use --nproc-per-node 3."),
    (["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h"],
     "--node-rank 2 must be in 0 .. 1 (--nnodes 2)."),
    (["--nnodes", "1:4"], "--nnodes 1:4: an elastic node count (torchrun's MIN:MAX, where the "
                          "c10d rendezvous admits MIN to MAX nodes as they come) is not "
                          "supported: the coordinator and node ranks are fixed at start."),
    (["--rdzv-backend", "c10d", "--rdzv-endpoint", "h:29400"],
     "--rdzv-backend c10d: only 'static' is supported (fixed nodes, each with its --node-rank)"),
    (["--rdzv-endpoint", "nohost"], "--rdzv-endpoint 'nohost' is not HOST:PORT"),
    (["--standalone", "--nnodes", "2"], "--standalone is one node with a free local port "
                                        "(torchrun's meaning): it excludes --nnodes > 1"),
    (["--coordinator", "h:1", "--master-addr", "h"],
     "--coordinator and --master-addr/--master-port both name the coordinator: give one "
     "(--coordinator HOST:PORT is --master-addr HOST --master-port PORT-1)."),
    (["--nproc-per-node", "gpu"], "--nproc-per-node 'gpu' must be an integer or 'cpu'"),
    (["--nproc-per-node", "0"], "--nproc-per-node 0 must be >= 1."),
    (["-m", "--no-python", "json.tool"], "-m/--module and --no-python exclude each other "
                                         "(torchrun's rule)"),
    (["--nproc", "2"], "--nproc 2: --nproc is gone (it counted the processes of one node); use "
                       "--nproc-per-node N for N per node (torchrun's) or -np N for N in all "
                       "(horovodrun's)."),
    (["nosuch_script.py"], "script not found: 'nosuch_script.py' (in "),
    (["-H", "a:2", "--nnodes", "2"], "--nnodes with -H: --nnodes is torchrun's (the same "
                                     "command on every node), while with -H this launcher "
                                     "starts every rank on every host itself"),
    (["-H", "a:2", "--nproc-per-node", "2"], "--nproc-per-node with -H"),
    (["-H", "a:2,a:1"], "-H a:2,a:1: host 'a' is listed twice; give each host once"),
    (["-H", "a:0"], "-H a:0: host 'a' has 0 slots; a host runs at least one process"),
    (["-H", "a"], "-H a: 'a' is not HOST:SLOTS (e.g. node1:2)."),
    (["-np", "5", "-H", "a:2,b:2"], "-np 5 is more than the 4 slots of the hosts (a:2, b:2); "
                                    "horovodrun runs one process per slot"),
    (["-H", "a:1", "--hostfile", "f"], "-H, --hostfile and --host-discovery-script each list "
                                       "the hosts: give one of them"),
    (["-np", "2", "--max-np", "4"], "--max-np needs -H, --hostfile or --host-discovery-script"),
    (["-H", "a:2", "--max-np", "4"], "--max-np needs --host-discovery-script"),
    (["-np", "2", "-p", "2222"], "-p/--ssh-port needs -H, --hostfile or "
                                 "--host-discovery-script (horovodrun's hosts)"),
    (["--host-discovery-script", sys.executable], "--host-discovery-script needs --min-np M "
                                                  "(or -np N)"),
    (["--host-discovery-script", "no-such-script-xyz", "--min-np", "1"],
     "--host-discovery-script 'no-such-script-xyz' is not an executable"),
    (["--host-discovery-script", sys.executable, "--min-np", "3", "--max-np", "2"],
     "--min-np 3 and --max-np 2: need 1 <= --min-np <= --max-np."),
])
def test_conflicting_or_meaningless_combinations(args, message):
    with pytest.raises(launch.LaunchError, match=re.escape(message)):
        config(*args, sys.executable)


def test_hostfile_errors(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("node1\n")
    with pytest.raises(launch.LaunchError, match=re.escape(
            f"--hostfile {path}, line 1: 'node1' is not `HOST slots=N` (horovodrun's hostfile: "
            "every line names its slots, e.g. `node1 slots=4`).")):
        config("--hostfile", str(path), sys.executable)
    path.write_text("# nothing\n")
    with pytest.raises(launch.LaunchError, match=re.escape(
            f"--hostfile {path}: no hosts in it (lines `HOST slots=N`).")):
        config("--hostfile", str(path), sys.executable)
    with pytest.raises(launch.LaunchError, match=re.escape("--hostfile /nonexistent/h: cannot "
                                                           "read it")):
        config("--hostfile", "/nonexistent/h", sys.executable)
