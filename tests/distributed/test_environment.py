"""initialize() reads every environment right: explicit, parallax launch, torchrun, TF_CONFIG,
JAX's detection; bad values get pinned messages. No processes are started."""

import json

import pytest

from parallax import distributed
from parallax.distributed import environment, launch, runtime

LAUNCHED = {"PARALLAX_COORDINATOR": "127.0.0.1:4000", "PARALLAX_NUM_PROCESSES": "4",
            "PARALLAX_PROCESS_ID": "3", "PARALLAX_LOCAL_RANK": "1", "PARALLAX_LOCAL_SIZE": "2",
            "PARALLAX_DEVICES_PER_PROCESS": "2", "PARALLAX_COORDINATOR_BIND": "127.0.0.1:4000"}
TORCHRUN = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500", "RANK": "5", "WORLD_SIZE": "8",
            "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}


def tf_config(task_type="worker", index=1, **cluster):
    cluster = cluster or {"chief": ["host0:2222"], "worker": ["host1:2222", "host1:2223"]}
    return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type,
                                                                  "index": index}})}


def test_nothing_in_sight_is_one_process():
    spec = distributed.detect(env={})
    assert spec == distributed.ClusterSpec()
    assert not spec.is_multiprocess and spec.source == "single process"


def test_parallax_launch_variables():
    spec = distributed.detect(env=LAUNCHED)
    assert (spec.coordinator, spec.num_processes, spec.process_id) == ("127.0.0.1:4000", 4, 3)
    assert (spec.local_rank, spec.local_size, spec.local_devices) == (1, 2, 2)
    assert spec.launched and spec.source == "parallax launch"
    assert spec.device_ids() == [2, 3]  # the second group of 2 on this host
    assert runtime.bind_address(spec) == "127.0.0.1:4000"


def test_launcher_writes_what_initialize_reads():
    config = launch.LaunchConfig(("python",), nproc=2, devices_per_process=2, nnodes=2,
                                 node_rank=1, coordinator="10.0.0.1:1234")
    group = launch.group_start(config, attempt=1)
    assert group.ranks == (2, 3) and group.world_size == 4
    env = launch.environment(config, group, 3, base={})
    spec = distributed.detect(env=env)
    assert (spec.coordinator, spec.num_processes, spec.process_id) == ("10.0.0.1:1234", 4, 3)
    assert (spec.local_rank, spec.local_size, spec.local_devices) == (1, 2, 2)
    assert env["PARALLAX_RESTART"] == "1" and env["PYTHONUNBUFFERED"] == "1"
    assert set(environment.LAUNCH_VARIABLES) >= {k for k in env if k.startswith("PARALLAX_")}


def test_torchrun_variables():
    spec = distributed.detect(env=TORCHRUN)
    # torchrun's own store holds MASTER_PORT; JAX's coordinator takes the next port
    assert (spec.coordinator, spec.num_processes, spec.process_id) == ("10.1.2.3:29501", 8, 5)
    assert (spec.local_rank, spec.local_size, spec.source) == (1, 4, "torchrun")
    assert not spec.launched and runtime.bind_address(spec) is None


def test_tf_config_chief_and_workers():
    spec = distributed.detect(env=tf_config("worker", 1))
    assert (spec.coordinator, spec.num_processes, spec.process_id) == ("host0:2222", 3, 2)
    assert (spec.local_rank, spec.local_size, spec.source) == (1, 2, "TF_CONFIG")
    chief = distributed.detect(env=tf_config("chief", 0))
    assert chief.process_id == 0 and chief.local_size == 1
    no_chief = distributed.detect(env=tf_config("worker", 0, worker=["a:1", "b:1"]))
    assert (no_chief.coordinator, no_chief.process_id) == ("a:1", 0)


def test_order_explicit_then_launcher_then_torchrun_then_tf_config():
    both = {**LAUNCHED, **TORCHRUN, **tf_config()}
    assert distributed.detect(env=both).source == "parallax launch"
    assert distributed.detect(env={**TORCHRUN, **tf_config()}).source == "torchrun"
    spec = distributed.detect(process_id=1, env=both)  # explicit beats everything, per field
    assert (spec.process_id, spec.num_processes, spec.source) == (
        1, 4, "explicit + parallax launch")
    spec = distributed.detect("127.0.0.1:9", 2, 1, env={})
    assert (spec.coordinator, spec.num_processes, spec.process_id, spec.source) == (
        "127.0.0.1:9", 2, 1, "explicit")


def test_jax_detects_slurm_and_mpi_coordinators_itself():
    """(SLURM, MPI and horovodrun in detail: test_launcher_environments.py.)"""
    spec = distributed.detect(env={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "1",
                                   "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "n1"})
    assert spec.auto and spec.source == "jax (SLURM)" and spec.num_processes == 4
    assert distributed.detect(env={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}).source == (
        "single process")
    spec = distributed.detect(env={"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1",
                                   "OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1"})
    assert spec.source == "jax (Open MPI)" and spec.process_id == 1


@pytest.mark.parametrize("text, message", [
    ("{not json", r"TF_CONFIG is not valid JSON \(Expecting property name enclosed in double "
                  r"quotes at position 1\)\. Expected JSON like"),
    ('{"task": {"type": "worker", "index": 0}}', r"TF_CONFIG has no 'cluster' mapping"),
    ('{"cluster": {"worker": ["a:1"]}}', r"TF_CONFIG has no 'task' with a 'type' and an 'index'"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "master", "index": 0}}',
     r"TF_CONFIG task type 'master' is not 'chief' or 'worker'"),
    ('{"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}}',
     r"TF_CONFIG worker address 'a' is not 'host:port'"),
])
def test_malformed_tf_config(text, message):
    with pytest.raises(ValueError, match=r"px\.distributed\.initialize: " + message):
        distributed.detect(env={"TF_CONFIG": text})


def test_tf_config_rank_beyond_the_world():
    with pytest.raises(ValueError, match=(
            r"px\.distributed\.initialize: TF_CONFIG task worker:2 is not in the cluster spec, "
            r"which lists 2 worker task\(s\) \(indices 0 \.\. 1\); rank 2 is not below world "
            r"size 2\.")):
        distributed.detect(env=tf_config("worker", 2))
    with pytest.raises(ValueError, match=r"TF_CONFIG task type 'ps' is not a process of an "
                                         r"SPMD job \(only chief and worker tasks are\)"):
        distributed.detect(env=tf_config("ps", 0, ps=["p:1"], worker=["a:1"]))


@pytest.mark.parametrize("env, origin", [
    ({**TORCHRUN, "RANK": "8"}, "torchrun's RANK/WORLD_SIZE"),
    ({**LAUNCHED, "PARALLAX_PROCESS_ID": "4"},
     "parallax launch's PARALLAX_PROCESS_ID/PARALLAX_NUM_PROCESSES"),
])
def test_rank_beyond_the_world(env, origin):
    with pytest.raises(ValueError, match=(
            r"px\.distributed\.initialize: process_id \d is not below num_processes \d \(from "
            + origin + r"\); process ids run 0 \.\. \d\.")):
        distributed.detect(env=env)


def test_explicit_arguments_are_checked():
    with pytest.raises(ValueError, match=r"process_id 2 is not below num_processes 2 \(from "
                                         r"explicit\)"):
        distributed.detect("127.0.0.1:9", 2, 2, env={})
    with pytest.raises(ValueError, match=r"num_processes=2 needs coordinator='host:port' and "
                                         r"process_id= as well"):
        distributed.detect(num_processes=2, env={})
    with pytest.raises(ValueError, match=r"coordinator 'nohost' is not 'host:port'"):
        distributed.detect("nohost", 2, 0, env={})
    with pytest.raises(TypeError, match=r"num_processes must be an int, got str"):
        distributed.detect("127.0.0.1:9", "2", 0, env={})
    with pytest.raises(ValueError, match=r"torchrun's MASTER_ADDR are set but MASTER_PORT, "
                                         r"RANK, WORLD_SIZE are not"):
        distributed.detect(env={"MASTER_ADDR": "x"})
    with pytest.raises(ValueError, match=r"RANK='one' \(from torchrun's RANK/WORLD_SIZE\) "
                                         r"must be an integer"):
        distributed.detect(env={**TORCHRUN, "RANK": "one"})


def test_initialize_is_a_no_op_for_one_process_and_idempotent(monkeypatch):
    for name in list(LAUNCHED) + list(TORCHRUN) + ["TF_CONFIG"]:
        monkeypatch.delenv(name, raising=False)
    first = distributed.initialize()
    assert distributed.initialize() is first
    assert (distributed.rank(), distributed.size(), distributed.local_rank(),
            distributed.local_size(), distributed.is_chief()) == (0, 1, 0, 1, True)
    distributed.barrier("one process")
    with pytest.raises(ValueError, match=r"already joined a job as process 0 of 1 .* cannot "
                                         r"join another \(asked: process 1 of 2 at "
                                         r"127\.0\.0\.1:9\)"):
        distributed.initialize("127.0.0.1:9", 2, 1)
    with pytest.raises(TypeError, match=r"px\.distributed\.barrier: name must be a str"):
        distributed.barrier(3)


def test_launcher_exports_torchruns_contract_read_back_as_the_same_cluster():
    """Two nodes of two: torchrun's numbers for global rank 3 (torch/distributed/elastic/
    agent/server/local_elastic_agent.py): GROUP_RANK is the node, ROLE_* the one role's; the
    torchrun reading of them (MASTER_PORT + 1) names the launcher's own coordinator."""
    config = launch.LaunchConfig(("python",), nproc=2, nnodes=2, node_rank=1,
                                 coordinator="10.0.0.1:1234", max_restarts=2)
    env = launch.environment(config, launch.group_start(config, attempt=1), 3, base={})
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                                "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")} == {
        "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1233", "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_MAX_RESTARTS": "2"}
    as_launched = distributed.detect(env=env)
    as_torchrun = distributed.detect(env={k: v for k, v in env.items()
                                          if not k.startswith("PARALLAX_")})
    assert (as_torchrun.coordinator, as_torchrun.num_processes, as_torchrun.process_id,
            as_torchrun.local_rank, as_torchrun.local_size) == (
        as_launched.coordinator, as_launched.num_processes, as_launched.process_id,
        as_launched.local_rank, as_launched.local_size)
