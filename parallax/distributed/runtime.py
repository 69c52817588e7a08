"""Joining a multi-process job: ``initialize()``, who am I, ``barrier()``, ``shutdown()``.

Every process of a job runs the same program and calls :func:`initialize` before JAX uses a
device. It finds the cluster (:mod:`parallax.distributed.environment`) and starts JAX's own
runtime, ``jax.distributed``: process 0 hosts the coordination service, every process
connects to it, and XLA's collectives run between the processes' devices (NCCL on GPU,
ICI/DCN on TPU, gloo over TCP on CPU, which :func:`initialize` selects). Nothing here moves
data itself.

Failure handling. JAX's processes share fate through the coordination service: a process
that exits waits in a shutdown barrier for the others, and one that loses a peer aborts when
the heartbeat times out (100 s by default). :func:`initialize` shortens both timeouts. Under
``parallax launch`` the launcher owns the group's fate instead: JAX's recoverable mode lets a
process exit at once with its own status (the launcher then stops the others), JAX's
preemption handler is off (so SIGTERM stops a process), and rank 0, which hosts the
coordination service, keeps it up at exit until the launcher reports the other ranks gone, or
for ``PARALLAX_EXIT_GRACE`` seconds (5), so that ranks finishing a little later are not cut
off. :func:`shutdown` at the end of a program is the exact, synchronised exit.

On CPU a multi-process job runs with JAX's persistent compilation cache off: a program one
process loads from the cache and its peer compiles hang at their first collective with
jax 0.12 (:mod:`parallax.distributed.compilation_cache`).

The process joins one cluster at a time; like ``jax.distributed``'s own state, the spec it
joined is remembered for :func:`local_rank` and :func:`local_size`.

(A little over 300 lines: jax.distributed's lifecycle and the queries on it.)
"""

from __future__ import annotations

import dataclasses
import ipaddress
import zlib
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from parallax.distributed import compilation_cache, exit_gate
from parallax.distributed.environment import API, ClusterSpec, detect

# The cluster this process joined (one per process, as in jax.distributed).
_joined: list[ClusterSpec] = []


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bind_address(spec: ClusterSpec) -> str | None:
    """Where process 0 binds the service: as told, else the coordinator itself if it is a
    loopback address (JAX's default binds every interface)."""
    if spec.coordinator_bind:
        return spec.coordinator_bind
    if spec.coordinator and _is_loopback(spec.coordinator.rpartition(":")[0]):
        return spec.coordinator
    return None


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{API}: {name}={value!r} must be a positive number of seconds.")
    return max(1, int(round(value)))


def _configure_devices(spec: ClusterSpec) -> None:
    """Gloo for CPU collectives; a device count becomes the number of simulated CPU devices."""
    try:
        if spec.is_multiprocess and jax.config.jax_cpu_collectives_implementation in (None, "none"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if isinstance(spec.local_devices, int):
            jax.config.update("jax_num_cpu_devices", spec.local_devices)
        if spec.launched:
            # The launcher, not JAX's shutdown barrier, stops the group (see module docstring).
            jax.config.update("jax_enable_recoverability", True)
            jax.config.update("jax_enable_preemption_service", False)
    except RuntimeError as error:
        raise RuntimeError(
            f"{API}: JAX already uses its devices ({error}); call initialize() at the top of "
            "the program, before anything creates an array or asks for jax.devices()."
        ) from None


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *,
               local_devices: int | Sequence[int] | None = None,
               heartbeat_timeout_s: float = 10, shutdown_timeout_s: float = 60,
               init_timeout_s: float = 120,
               coordinator_bind: str | None = None) -> ClusterSpec:
    """Joins this process to its multi-process job (a no-op for one process).

    Reads the cluster from the explicit arguments, then ``parallax launch``'s variables,
    torchrun's, ``TF_CONFIG``, then JAX's own detection (SLURM, Open MPI, Cloud TPU,
    Kubernetes); see :mod:`parallax.distributed.environment`. On CPU it selects gloo
    collectives. Calling it again returns the same spec.

    Args:
      coordinator: ``host:port`` where process 0 runs JAX's coordination service.
      num_processes: the number of processes in the job.
      process_id: this process's id, ``0 .. num_processes - 1``.
      local_devices: devices this process uses: a count (on CPU, that many simulated
        devices; on accelerators, the ``local_rank``-th group of that many) or device ids.
      heartbeat_timeout_s: a process silent this long is dead and the job aborts (JAX's
        default is 100 s).
      shutdown_timeout_s: how long an exiting process waits for the others at JAX's shutdown
        barrier (not used under ``parallax launch``, whose processes exit at once).
      init_timeout_s: how long to keep trying to reach the coordinator.
      coordinator_bind: the address process 0 binds the service to; by default the
        coordinator itself when it is a loopback address, else every interface.

    Returns:
      The :class:`~parallax.distributed.environment.ClusterSpec` joined.

    Raises:
      ValueError: inconsistent numbers (a process id not below the number of processes, a
        malformed ``TF_CONFIG``), or a second call that names another cluster.
      RuntimeError: JAX already uses its devices, or the coordinator cannot be reached.

    Example:
      >>> import parallax as px
      >>> px.distributed.initialize().source       # no cluster in sight: one process
      'single process'
      >>> px.distributed.rank(), px.distributed.size(), px.distributed.is_chief()
      (0, 1, True)

    References:
      ``jax.distributed.initialize``; Horovod ``hvd.init()``; PyTorch
      ``torch.distributed.init_process_group``.
    """
    spec = detect(coordinator, num_processes, process_id, local_devices=local_devices)
    if coordinator_bind is not None:
        spec = dataclasses.replace(spec, coordinator_bind=coordinator_bind)
    if _joined:
        return _same_cluster(_joined[0], spec)
    if jax.distributed.is_initialized():  # someone called jax.distributed.initialize()
        spec = ClusterSpec(num_processes=jax.process_count(), process_id=jax.process_index(),
                           source="jax.distributed (initialized elsewhere)")
        if spec.is_multiprocess:
            compilation_cache.off_on_cpu()  # in time if nothing was compiled yet
        _joined.append(spec)
        return spec
    timeouts = {name: _positive(name, value) for name, value in (
        ("heartbeat_timeout_s", heartbeat_timeout_s), ("shutdown_timeout_s", shutdown_timeout_s),
        ("init_timeout_s", init_timeout_s))}
    _configure_devices(spec)
    if spec.is_multiprocess:
        _start(spec, timeouts)
    _joined.append(spec)
    return spec


def _same_cluster(joined: ClusterSpec, asked: ClusterSpec) -> ClusterSpec:
    fields = ("coordinator", "num_processes", "process_id")
    if asked.source.startswith("explicit") and any(
            getattr(asked, f) != getattr(joined, f) for f in fields):
        raise ValueError(
            f"{API}: this process already joined a job as process {joined.process_id} of "
            f"{joined.num_processes} (coordinator {joined.coordinator}, from {joined.source}); "
            f"it cannot join another (asked: process {asked.process_id} of "
            f"{asked.num_processes} at {asked.coordinator}). Call px.distributed.shutdown() "
            "first.")
    return joined


def _start(spec: ClusterSpec, timeouts: dict) -> None:
    kwargs = dict(
        local_device_ids=spec.device_ids(),
        initialization_timeout=timeouts["init_timeout_s"],
        heartbeat_timeout_seconds=timeouts["heartbeat_timeout_s"],
        shutdown_timeout_seconds=timeouts["shutdown_timeout_s"],
    )
    if not spec.auto:
        kwargs.update(coordinator_address=spec.coordinator, num_processes=spec.num_processes,
                      process_id=spec.process_id, coordinator_bind_address=bind_address(spec))
    try:
        jax.distributed.initialize(**kwargs)
    except RuntimeError as error:
        where = spec.coordinator or "the detected coordinator"
        raise RuntimeError(
            f"{API}: process {spec.process_id} of {spec.num_processes} could not join the job "
            f"at {where} (from {spec.source}): {str(error).strip().splitlines()[0]}. Check that "
            "process 0 runs with the same coordinator address and that the port is free."
        ) from None
    compilation_cache.off_on_cpu()  # a cached and a fresh program hang (its docstring)
    if spec.launched:
        exit_gate.install(hosts_service=spec.process_id == 0)


def joined() -> ClusterSpec | None:
    """The cluster this process joined with :func:`initialize`, or None."""
    return _joined[0] if _joined else None


def rank() -> int:
    """This process's id in the job (``jax.process_index()``; 0 for one process).

    Example:
      >>> import parallax as px
      >>> px.distributed.rank()
      0
    """
    return jax.process_index()


def size() -> int:
    """The number of processes in the job (``jax.process_count()``).

    Example:
      >>> import parallax as px
      >>> px.distributed.size()
      1
    """
    return jax.process_count()


def local_rank() -> int:
    """This process's index among the processes on its host (0 when unknown).

    Example:
      >>> import parallax as px
      >>> px.distributed.local_rank()
      0
    """
    spec = joined()
    return spec.local_rank if spec is not None and spec.num_processes is not None else 0


def local_size() -> int:
    """The number of processes on this host (1 when unknown).

    Example:
      >>> import parallax as px
      >>> px.distributed.local_size()
      1
    """
    spec = joined()
    return spec.local_size if spec is not None and spec.num_processes is not None else 1


def is_chief() -> bool:
    """True on process 0, the one that logs, evaluates and saves (TF's chief, Horovod's rank 0).

    Example:
      >>> import parallax as px
      >>> px.distributed.is_chief()
      True
    """
    return rank() == 0


def barrier(name: str = "barrier") -> None:
    """Waits until every process reaches ``barrier(name)`` (a no-op for one process).

    It is a collective over all devices, so every process must call it in the same order; a
    process that reaches a barrier of another name is an error, not a hang.

    Args:
      name: the barrier's name, the same on every process.

    Raises:
      ValueError: processes reached barriers of different names.

    Example:
      >>> import parallax as px
      >>> px.distributed.barrier("after setup")

    References:
      ``MPI_Barrier``; ``jax.experimental.multihost_utils.sync_global_devices``.
    """
    if not isinstance(name, str):
        raise TypeError(f"px.distributed.barrier: name must be a str, got {type(name).__name__}.")
    if jax.process_count() == 1:
        return
    mine = np.uint32(zlib.crc32(name.encode()))
    names = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1)
    others = [i for i, h in enumerate(names) if h != mine]
    if others:
        raise ValueError(
            f"px.distributed.barrier: process {jax.process_index()} reached barrier {name!r} "
            f"but process(es) {others} reached a barrier of another name; every process must "
            "call the same barriers in the same order.")


def shutdown() -> None:
    """Leaves the job in step with the others: a barrier, then ``jax.distributed.shutdown()``.

    Optional: processes also leave when the program ends. Calling it at the end of a program
    makes the exit exact: under ``parallax launch`` (JAX's recoverable mode, where leaving
    does not wait for the others) the other processes disconnect first and process 0, which
    hosts the coordination service, waits for them (``multihost_utils.live_devices``) before
    stopping it. A no-op for one process.

    Example:
      >>> import parallax as px
      >>> px.distributed.shutdown()
    """
    spec = joined()
    if jax.process_count() > 1 and jax.distributed.is_initialized():
        barrier("px.distributed.shutdown")
        if spec is not None and spec.launched and jax.process_index() == 0:
            with multihost_utils.live_devices(jax.devices()):
                pass  # returns once every other process has disconnected
        jax.distributed.shutdown()
    _joined.clear()
