"""Other launchers' environments read as a :class:`ClusterSpec`: horovodrun, mpirun (Open MPI,
MPICH / Intel MPI), SLURM's srun; or refused with what was seen and the fix.

Each reader returns None when its launcher's variables are absent (or describe one process).
A launcher that gives every process its rank and size but no address for JAX's coordinator
(which process 0 hosts) is refused, naming the variables seen and how to supply the address
(``JAX_COORDINATOR_ADDRESS``, which ``jax.distributed`` reads too), unless JAX can derive it
itself (SLURM's node list, Open MPI's HNP URI), or every process is on one host.

Example:
  >>> env = {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1",
  ...        "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_GLOO_RENDEZVOUS_PORT": "41000"}
  >>> spec = from_horovod(env)
  >>> spec.coordinator, spec.num_processes, spec.process_id, spec.source
  ('127.0.0.1:41001', 2, 1, 'horovodrun')
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from parallax.distributed.cluster import API, ClusterSpec, check_address

COORDINATOR_VARIABLE = "JAX_COORDINATOR_ADDRESS"
_FIX = (f"Export {COORDINATOR_VARIABLE}=<rank 0's host>:<free port> before {{launcher}} (the "
        "same on every rank), pass px.distributed.initialize(coordinator=...), or start the "
        "job with `parallax launch`.")


def _seen(env: Mapping[str, str], names) -> str:
    return ", ".join(f"{n}={env[n]}" for n in names if n in env)


def _int(env: Mapping[str, str], name: str, launcher: str, default: int | None = None) -> int:
    if name not in env and default is not None:
        return default
    try:
        return int(env[name])
    except (KeyError, ValueError):
        raise ValueError(f"{API}: {launcher} set {_seen(env, [name]) or name + ' (missing)'}; "
                         "it must be an integer.") from None


def _given(env: Mapping[str, str]) -> str | None:
    address = env.get(COORDINATOR_VARIABLE)
    return check_address(address, COORDINATOR_VARIABLE) if address else None


def from_horovod(env: Mapping[str, str]) -> ClusterSpec | None:
    """horovodrun's ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK/SIZE``.

    horovodrun's gloo mode sets these per slot (horovod/runner/gloo_run.py,
    ``create_slot_env_vars``) and ``HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT``, the address of its
    own rendezvous server, which runs in the launcher, not in rank 0. On one host the JAX
    coordinator takes ``127.0.0.1:(HOROVOD_GLOO_RENDEZVOUS_PORT + 1)``, as torchrun's reading
    takes ``MASTER_PORT + 1``; across hosts it needs ``JAX_COORDINATOR_ADDRESS``.
    """
    names = ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE")
    if "HOROVOD_RANK" not in env and "HOROVOD_SIZE" not in env:
        return None
    launcher = "horovodrun"
    size, rank = _int(env, "HOROVOD_SIZE", launcher), _int(env, "HOROVOD_RANK", launcher)
    local_rank = _int(env, "HOROVOD_LOCAL_RANK", launcher, default=0)
    local_size = _int(env, "HOROVOD_LOCAL_SIZE", launcher, default=1)
    coordinator = _given(env)
    if coordinator is None and size > 1:
        port = env.get("HOROVOD_GLOO_RENDEZVOUS_PORT", "")
        if local_size == size and port.isdigit():
            coordinator = f"127.0.0.1:{int(port) + 1}"
        else:
            seen = _seen(env, names[:2] + ("HOROVOD_LOCAL_SIZE", "HOROVOD_HOSTNAME",
                                          "HOROVOD_GLOO_RENDEZVOUS_ADDR"))
            where = ("spans several hosts" if local_size != size
                     else "has no HOROVOD_GLOO_RENDEZVOUS_PORT (horovodrun --mpi?)")
            raise ValueError(
                f"{API}: horovodrun's environment ({seen}) {where} and names no address for "
                "JAX's coordinator, which rank 0 hosts (horovodrun's rendezvous server runs "
                "in the launcher, not in rank 0). " + _FIX.format(launcher="horovodrun"))
    return ClusterSpec(coordinator=coordinator, num_processes=size, process_id=rank,
                       local_rank=local_rank, local_size=local_size, source=launcher)


# (launcher, size, rank, local rank, local size): what each MPI's mpirun sets per process
MPI_VARIABLES = (
    ("mpirun (Open MPI)", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
     "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("mpirun (MPICH / Intel MPI)", "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)


def from_mpi(env: Mapping[str, str]) -> ClusterSpec | None:
    """mpirun's per-process ranks (Open MPI's ``OMPI_COMM_WORLD_*``, Hydra's ``PMI_*``).

    The coordinator: ``JAX_COORDINATOR_ADDRESS``; else, under Open MPI 4 and earlier, JAX
    derives it from ``OMPI_MCA_orte_hnp_uri`` (its own cluster detection); else refused.
    """
    for launcher, *names in MPI_VARIABLES:
        if names[0] not in env:
            continue
        size, rank = _int(env, names[0], launcher), _int(env, names[1], launcher)
        if size == 1:
            return None
        spec = ClusterSpec(num_processes=size, process_id=rank,
                           local_rank=_int(env, names[2], launcher, default=0),
                           local_size=_int(env, names[3], launcher, default=1), source=launcher)
        given = _given(env)
        if given is not None:
            return dataclasses.replace(spec, coordinator=given)
        if launcher.endswith("(Open MPI)") and "OMPI_MCA_orte_hnp_uri" in env:
            return dataclasses.replace(spec, source="jax (Open MPI)")
        why = (" (no OMPI_MCA_orte_hnp_uri, which Open MPI 5 no longer sets)"
               if launcher.endswith("(Open MPI)") else "")
        raise ValueError(f"{API}: {launcher}'s environment ({_seen(env, names)}) names no "
                         f"address for JAX's coordinator{why}. "
                         + _FIX.format(launcher="mpirun"))
    return None


def _tasks_on_node(text: str, node: int) -> int | None:
    """SLURM's ``2(x3),1`` (tasks per node, run-length coded) -> the count on ``node``."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None


def from_slurm(env: Mapping[str, str]) -> ClusterSpec | None:
    """srun's tasks (``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``); JAX derives the
    coordinator from ``SLURM_STEP_NODELIST`` and the job id (its own cluster detection)."""
    if "SLURM_JOB_ID" not in env:
        return None
    launcher = "SLURM"
    size = _int(env, "SLURM_NTASKS", launcher, default=1)
    if size == 1:
        return None
    needed = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST")
    missing = [n for n in needed if n not in env]
    if missing:
        raise ValueError(
            f"{API}: SLURM's environment ({_seen(env, ('SLURM_JOB_ID', 'SLURM_NTASKS'))}) is a "
            f"job of {size} tasks, but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'}"
            " not set: this process was not started by srun (the batch script itself?). Start "
            "one process per task with `srun python train.py`, or run one process with "
            "SLURM_NTASKS=1.")
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    local_size = _tasks_on_node(per_node, _int(env, "SLURM_NODEID", launcher, default=0))
    spec = ClusterSpec(num_processes=size, process_id=_int(env, "SLURM_PROCID", launcher),
                       local_rank=_int(env, "SLURM_LOCALID", launcher),
                       local_size=local_size or 1, source="jax (SLURM)")
    given = _given(env)
    return spec if given is None else dataclasses.replace(spec, coordinator=given,
                                                          source="srun (SLURM)")


def stray_torchrun(env: Mapping[str, str]) -> None:
    """Refuses torchrun's ``RANK``/``WORLD_SIZE`` without its ``MASTER_ADDR``/``MASTER_PORT``
    when no launcher claimed the process (a job of several processes read as one)."""
    if "WORLD_SIZE" in env and env["WORLD_SIZE"] not in ("1", ""):
        seen = _seen(env, ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
        missing = [n for n in ("MASTER_ADDR", "MASTER_PORT") if n not in env]
        raise ValueError(
            f"{API}: {seen} are set (torchrun's contract) but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not, and no other launcher's variables "
            "are. Set MASTER_ADDR=<rank 0's host> and MASTER_PORT=<free port> on every process "
            "(the JAX coordinator takes MASTER_PORT + 1), or start the job with `parallax "
            "launch` or torchrun.")
