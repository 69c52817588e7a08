"""Which cluster this process belongs to, read from explicit arguments or the environment.

A multi-process JAX job needs three numbers on every process: the coordinator's address
(process 0 runs JAX's coordination service there), how many processes there are, and this
process's id. :func:`detect` reads them, first source first:

1. explicit arguments (each one overrides the same field of the environment below);
2. the variables ``parallax launch`` sets (:data:`LAUNCH_VARIABLES`);
3. torchrun's ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
   ``LOCAL_WORLD_SIZE``; the JAX coordinator listens on ``MASTER_PORT + 1``, because
   torchrun's own rendezvous store holds ``MASTER_PORT``;
4. horovodrun's ``HOROVOD_RANK``, ``HOROVOD_SIZE``, ``HOROVOD_LOCAL_RANK/SIZE``
   (:mod:`parallax.distributed.launchers`);
5. ``TF_CONFIG`` (TensorFlow's cluster spec and task): the chief and the workers are the
   processes, in that order, and the first of them hosts the coordinator at its address;
6. mpirun's ``OMPI_COMM_WORLD_*`` (Open MPI) or ``PMI_*`` (MPICH, Intel MPI), then srun's
   ``SLURM_*``: the numbers are read here, the coordinator is ``JAX_COORDINATOR_ADDRESS`` or
   what JAX's own detection derives (SLURM's node list, Open MPI's HNP URI);
7. JAX's own detection (Cloud TPU, Kubernetes, ``JAX_COORDINATOR_ADDRESS``) when one of
   those environments is visible;
8. otherwise one process, unless torchrun's ``RANK``/``WORLD_SIZE`` are set without a master
   (refused).

The innermost launcher comes first (``parallax launch`` or torchrun inside a SLURM
allocation, mpirun under ``horovodrun --mpi``). A launcher whose environment lacks what
``jax.distributed`` needs is refused with the variables seen and the fix.

The result is a :class:`ClusterSpec`, a small immutable value; nothing here starts anything.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

from parallax.distributed import launchers, tf_config
from parallax.distributed.cluster import API, ClusterSpec, check_address

#: The variables ``parallax launch`` sets for each process it starts.
LAUNCH_VARIABLES = {
    "PARALLAX_COORDINATOR": "host:port of the coordination service (process 0 hosts it)",
    "PARALLAX_COORDINATOR_BIND": "host:port process 0 binds the service to (loopback by default)",
    "PARALLAX_NUM_PROCESSES": "processes in the whole job (all nodes)",
    "PARALLAX_PROCESS_ID": "this process's id, 0 .. PARALLAX_NUM_PROCESSES - 1",
    "PARALLAX_LOCAL_RANK": "this process's index on its node",
    "PARALLAX_LOCAL_SIZE": "processes on this node",
    "PARALLAX_NODE_RANK": "this node's index",
    "PARALLAX_NUM_NODES": "nodes in the job",
    "PARALLAX_DEVICES_PER_PROCESS": "devices each process uses (simulated CPU devices on CPU)",
    "PARALLAX_RESTART": "how many times the launcher restarted the group (0 on the first run)",
    "PARALLAX_EXIT_GATE_FD": "rank 0 only: a pipe the launcher closes when the other ranks exited",
    "PARALLAX_EXIT_GRACE": "seconds rank 0 keeps the coordination service up for the others",
}

TORCHRUN_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")

# How messages name where a process id and a process count came from.
ORIGINS = {
    "parallax launch": "parallax launch's PARALLAX_PROCESS_ID/PARALLAX_NUM_PROCESSES",
    "torchrun": "torchrun's RANK/WORLD_SIZE",
    "TF_CONFIG": "TF_CONFIG",
    "horovodrun": "horovodrun's HOROVOD_RANK/HOROVOD_SIZE",
}

# Environments that jax.distributed.initialize() detects by itself (its ClusterEnv list).
JAX_DETECTED_MARKERS = {
    "JAX_COORDINATOR_ADDRESS": "JAX_COORDINATOR_ADDRESS",
    "TPU_WORKER_HOSTNAMES": "Cloud TPU",
    "CLOUD_TPU_TASK_ID": "Cloud TPU",
    "JOBSET_NAME": "Kubernetes (JobSet)",
}


def _int(env: Mapping[str, str], name: str, origin: str) -> int:
    text = env[name]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{API}: {name}={text!r} (from {origin}) must be an integer.") from None


def check_ids(num_processes, process_id, origin: str) -> None:
    """``0 <= process_id < num_processes``, with the message naming where they came from."""
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"{API}: num_processes={num_processes} (from {origin}) must be >= 1.")
    if process_id is not None and process_id < 0:
        raise ValueError(f"{API}: process_id={process_id} (from {origin}) must be >= 0.")
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise ValueError(
            f"{API}: process_id {process_id} is not below num_processes {num_processes} (from "
            f"{origin}); process ids run 0 .. {num_processes - 1}."
        )


def from_launcher(env: Mapping[str, str]) -> ClusterSpec | None:
    """The spec ``parallax launch`` wrote into the environment, if it did."""
    if "PARALLAX_NUM_PROCESSES" not in env:
        return None
    origin = "parallax launch's PARALLAX_* variables"
    missing = [n for n in ("PARALLAX_COORDINATOR", "PARALLAX_PROCESS_ID") if n not in env]
    if missing:
        raise ValueError(f"{API}: PARALLAX_NUM_PROCESSES is set but {', '.join(missing)} "
                         "is not; start the processes with `parallax launch`.")
    devices = env.get("PARALLAX_DEVICES_PER_PROCESS")
    return ClusterSpec(
        coordinator=check_address(env["PARALLAX_COORDINATOR"], "PARALLAX_COORDINATOR"),
        num_processes=_int(env, "PARALLAX_NUM_PROCESSES", origin),
        process_id=_int(env, "PARALLAX_PROCESS_ID", origin),
        local_rank=_int(env, "PARALLAX_LOCAL_RANK", origin) if "PARALLAX_LOCAL_RANK" in env else 0,
        local_size=_int(env, "PARALLAX_LOCAL_SIZE", origin) if "PARALLAX_LOCAL_SIZE" in env else 1,
        local_devices=_int(env, "PARALLAX_DEVICES_PER_PROCESS", origin) if devices else None,
        coordinator_bind=env.get("PARALLAX_COORDINATOR_BIND"),
        source="parallax launch",
        launched=True,
    )


def from_torchrun(env: Mapping[str, str]) -> ClusterSpec | None:
    """torchrun's variables (``MASTER_ADDR`` ... ``LOCAL_WORLD_SIZE``), if all are set."""
    present = [n for n in TORCHRUN_VARIABLES if n in env]
    if "MASTER_ADDR" not in env and "MASTER_PORT" not in env:
        return None  # RANK/WORLD_SIZE alone: maybe another launcher's (launchers.stray_torchrun)
    if len(present) < len(TORCHRUN_VARIABLES):
        missing = [n for n in TORCHRUN_VARIABLES if n not in env]
        raise ValueError(f"{API}: torchrun's {', '.join(present)} are set but "
                         f"{', '.join(missing)} are not; torchrun sets all of them.")
    origin = "torchrun's RANK/WORLD_SIZE"
    port = _int(env, "MASTER_PORT", origin)
    local_size = _int(env, "LOCAL_WORLD_SIZE", origin) if "LOCAL_WORLD_SIZE" in env else 1
    return ClusterSpec(
        coordinator=check_address(f"{env['MASTER_ADDR']}:{port + 1}", "MASTER_ADDR:MASTER_PORT+1"),
        num_processes=_int(env, "WORLD_SIZE", origin),
        process_id=_int(env, "RANK", origin),
        local_rank=_int(env, "LOCAL_RANK", origin) if "LOCAL_RANK" in env else 0,
        local_size=local_size,
        source="torchrun",
    )


def from_jax_detection(env: Mapping[str, str]) -> ClusterSpec | None:
    """A cluster JAX's own ``jax.distributed.initialize()`` detects, if one is visible."""
    for marker, name in JAX_DETECTED_MARKERS.items():
        if marker in env:
            return ClusterSpec(num_processes=None, process_id=None, source=f"jax ({name})")
    return None


def detect(coordinator: str | None = None, num_processes: int | None = None,
           process_id: int | None = None, *,
           local_devices: int | Sequence[int] | None = None,
           env: Mapping[str, str] | None = None) -> ClusterSpec:
    """The cluster this process belongs to (see the module docstring for the order).

    Args:
      coordinator: ``host:port`` of process 0's coordination service.
      num_processes: the number of processes.
      process_id: this process's id.
      local_devices: devices for this process (a count, or device ids).
      env: the environment to read (``os.environ`` by default).

    Returns:
      A :class:`ClusterSpec`.

    Example:
      >>> env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RANK": "1",
      ...        "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
      >>> spec = detect(env=env)
      >>> spec.coordinator, spec.num_processes, spec.process_id, spec.source
      ('10.0.0.1:29501', 4, 1, 'torchrun')

    References:
      PyTorch ``torchrun`` environment variables; TensorFlow ``TF_CONFIG``
      (``tf.distribute.cluster_resolver.TFConfigClusterResolver``);
      ``jax.distributed.initialize``.
    """
    env = os.environ if env is None else env
    _check_explicit(coordinator, num_processes, process_id, local_devices)
    found = None
    # an explicit coordinator supplies what other launchers' environments may lack
    told = env if coordinator is None else {**env, launchers.COORDINATOR_VARIABLE: coordinator}
    for reader in (from_launcher, from_torchrun, launchers.from_horovod,
                   tf_config.from_tf_config, launchers.from_mpi, launchers.from_slurm):
        found = reader(told if reader.__module__ == launchers.__name__ else env)
        if found is not None:
            break
    explicit = any(v is not None for v in (coordinator, num_processes, process_id))
    if found is None:
        if explicit:
            found = ClusterSpec(num_processes=None, process_id=None, source="explicit")
        else:
            found = from_jax_detection(env)
            if found is None:
                launchers.stray_torchrun(env)
                found = ClusterSpec()
    updates = {k: v for k, v in (("coordinator", coordinator), ("num_processes", num_processes),
                                 ("process_id", process_id)) if v is not None}
    if local_devices is not None:
        updates["local_devices"] = (local_devices if isinstance(local_devices, int)
                                    else tuple(local_devices))
    if updates.keys() & {"coordinator", "num_processes", "process_id"}:
        source = ("explicit" if found.source in ("single process", "explicit")
                  else f"explicit + {found.source}")
        updates["source"] = source
    spec = dataclasses.replace(found, **updates)
    if spec.source.startswith("explicit") and not spec.auto:
        if spec.num_processes is not None and spec.num_processes > 1 and (
                spec.coordinator is None or spec.process_id is None):
            raise ValueError(
                f"{API}: num_processes={spec.num_processes} needs coordinator='host:port' and "
                f"process_id= as well (got coordinator={spec.coordinator!r}, "
                f"process_id={spec.process_id!r}).")
        if spec.num_processes is None:
            raise ValueError(f"{API}: coordinator= or process_id= was given without "
                             "num_processes=.")
        if spec.process_id is None:
            spec = dataclasses.replace(spec, process_id=0)
    check_ids(spec.num_processes, spec.process_id, ORIGINS.get(spec.source, spec.source))
    return spec


def _check_explicit(coordinator, num_processes, process_id, local_devices) -> None:
    if coordinator is not None:
        if not isinstance(coordinator, str):
            raise TypeError(f"{API}: coordinator must be a 'host:port' string, got "
                            f"{type(coordinator).__name__}.")
        check_address(coordinator, "coordinator")
    for name, value in (("num_processes", num_processes), ("process_id", process_id)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{API}: {name} must be an int, got {type(value).__name__}.")
    if local_devices is not None:
        if isinstance(local_devices, bool):
            raise TypeError(f"{API}: local_devices must be an int or a sequence of ints.")
        if isinstance(local_devices, int):
            if local_devices < 1:
                raise ValueError(f"{API}: local_devices={local_devices} must be >= 1.")
        elif not all(isinstance(i, int) and i >= 0 for i in local_devices):
            raise TypeError(f"{API}: local_devices must be an int (a count) or device ids "
                            f"(ints >= 0), got {local_devices!r}.")
