"""Environments of other launchers read into one cluster description, or refused naming what
was seen and the fix: horovodrun (horovod/runner/gloo_run.py, ``create_slot_env_vars``), Open
MPI's and MPICH's mpirun, SLURM's srun, a torchrun contract without its master."""

import re

import pytest

from parallax import distributed

# horovodrun --gloo -np 2 on one host, rank 1 (what gloo_run gives each slot)
HOROVODRUN = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1",
              "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1",
              "HOROVOD_HOSTNAME": "localhost", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
              "HOROVOD_GLOO_RENDEZVOUS_PORT": "41000", "HOROVOD_CONTROLLER": "gloo",
              "HOROVOD_CPU_OPERATIONS": "gloo"}
TWO_HOSTS = {**HOROVODRUN, "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_CROSS_RANK": "1",
             "HOROVOD_CROSS_SIZE": "2", "HOROVOD_HOSTNAME": "node2"}
OPEN_MPI = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
SRUN = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}


def numbers(spec):
    return (spec.coordinator, spec.num_processes, spec.process_id, spec.local_rank,
            spec.local_size, spec.source)


def test_horovodrun_on_one_host_is_two_processes():
    """Before: "single process", so N copies each trained alone with hvd.size() == 1."""
    spec = distributed.detect(env=HOROVODRUN)
    assert numbers(spec) == ("127.0.0.1:41001", 2, 1, 1, 2, "horovodrun")
    assert spec.is_multiprocess and not spec.auto


def test_horovodrun_on_several_hosts_needs_a_coordinator_address():
    message = ("px.distributed.initialize: horovodrun's environment (HOROVOD_RANK=3, "
               "HOROVOD_SIZE=4, HOROVOD_LOCAL_SIZE=2, HOROVOD_HOSTNAME=node2, "
               "HOROVOD_GLOO_RENDEZVOUS_ADDR=127.0.0.1) spans several hosts and names no "
               "address for JAX's coordinator, which rank 0 hosts (horovodrun's rendezvous "
               "server runs in the launcher, not in rank 0). Export "
               "JAX_COORDINATOR_ADDRESS=<rank 0's host>:<free port> before horovodrun (the "
               "same on every rank), pass px.distributed.initialize(coordinator=...), or start "
               "the job with `parallax launch`.")
    with pytest.raises(ValueError, match=re.escape(message)):
        distributed.detect(env=TWO_HOSTS)
    spec = distributed.detect(env={**TWO_HOSTS, "JAX_COORDINATOR_ADDRESS": "node1:5000"})
    assert numbers(spec) == ("node1:5000", 4, 3, 1, 2, "horovodrun")
    assert distributed.detect("node1:6000", env=TWO_HOSTS).coordinator == "node1:6000"


def test_open_mpi():
    with_uri = {**OPEN_MPI, "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.0.0.1:34911"}
    spec = distributed.detect(env=with_uri)  # JAX finds the coordinator from the HNP URI
    assert spec.auto and numbers(spec) == (None, 4, 2, 0, 2, "jax (Open MPI)")
    spec = distributed.detect(env={**OPEN_MPI, "JAX_COORDINATOR_ADDRESS": "10.0.0.1:5000"})
    assert numbers(spec) == ("10.0.0.1:5000", 4, 2, 0, 2, "mpirun (Open MPI)")
    with pytest.raises(ValueError, match=re.escape(
            "px.distributed.initialize: mpirun (Open MPI)'s environment "
            "(OMPI_COMM_WORLD_SIZE=4, OMPI_COMM_WORLD_RANK=2, OMPI_COMM_WORLD_LOCAL_RANK=0, "
            "OMPI_COMM_WORLD_LOCAL_SIZE=2) names no address for JAX's coordinator (no "
            "OMPI_MCA_orte_hnp_uri, which Open MPI 5 no longer sets). Export "
            "JAX_COORDINATOR_ADDRESS=<rank 0's host>:<free port>")):
        distributed.detect(env=OPEN_MPI)


def test_mpich_and_intel_mpi():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2",
           "JAX_COORDINATOR_ADDRESS": "127.0.0.1:5000"}
    assert numbers(distributed.detect(env=env)) == (
        "127.0.0.1:5000", 2, 1, 1, 2, "mpirun (MPICH / Intel MPI)")
    del env["JAX_COORDINATOR_ADDRESS"]
    with pytest.raises(ValueError, match=re.escape(
            "mpirun (MPICH / Intel MPI)'s environment (PMI_SIZE=2, PMI_RANK=1, "
            "MPI_LOCALRANKID=1, MPI_LOCALNRANKS=2) names no address for JAX's coordinator")):
        distributed.detect(env=env)


def test_slurm():
    spec = distributed.detect(env=SRUN)  # JAX derives the coordinator from the node list
    assert spec.auto and numbers(spec) == (None, 4, 3, 1, 2, "jax (SLURM)")
    assert distributed.detect(env={**SRUN, "SLURM_NTASKS": "1"}).source == "single process"
    batch_step = {"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4", "SLURM_NODEID": "0"}
    with pytest.raises(ValueError, match=re.escape(
            "px.distributed.initialize: SLURM's environment (SLURM_JOB_ID=77, SLURM_NTASKS=4) "
            "is a job of 4 tasks, but SLURM_PROCID, SLURM_LOCALID, SLURM_STEP_NODELIST are not "
            "set: this process was not started by srun (the batch script itself?). Start one "
            "process per task with `srun python train.py`")):
        distributed.detect(env=batch_step)


def test_a_torchrun_contract_without_its_master_is_refused():
    with pytest.raises(ValueError, match=re.escape(
            "px.distributed.initialize: RANK=1, WORLD_SIZE=2 are set (torchrun's contract) but "
            "MASTER_ADDR, MASTER_PORT are not, and no other launcher's variables are")):
        distributed.detect(env={"RANK": "1", "WORLD_SIZE": "2"})
    # a launcher that sets RANK/WORLD_SIZE beside its own variables is read as itself
    spec = distributed.detect(env={**HOROVODRUN, "RANK": "1", "WORLD_SIZE": "2"})
    assert spec.source == "horovodrun"


def test_the_innermost_launcher_wins():
    # parallax launch or torchrun inside a SLURM allocation, mpirun under horovodrun --mpi
    launched = {"PARALLAX_COORDINATOR": "127.0.0.1:4000", "PARALLAX_NUM_PROCESSES": "2",
                "PARALLAX_PROCESS_ID": "1"}
    assert distributed.detect(env={**SRUN, **launched}).source == "parallax launch"
    assert distributed.detect(env={**SRUN, **OPEN_MPI, "JAX_COORDINATOR_ADDRESS": "h:1"}
                              ).source == "mpirun (Open MPI)"
    assert distributed.detect(env={**OPEN_MPI, **HOROVODRUN}).source == "horovodrun"
