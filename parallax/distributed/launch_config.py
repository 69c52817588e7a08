"""What ``parallax launch`` starts, validated: :class:`LaunchConfig`
(built by :func:`parallax.distributed.launch_options.config_from_args`)."""

from __future__ import annotations

import dataclasses

from parallax.distributed.hosts import Host
from parallax.distributed.remote import SshOptions


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """What to launch, validated (see ``config_from_args``).

    Attributes:
      command: the program and its arguments.
      nproc: processes on this node; with ``hosts`` or ``discovery``, processes in the job
        (0 with ``discovery``: as many as the hosts have slots, up to ``max_np``).
      devices_per_process: devices each process uses (None: JAX's default).
      nnodes, node_rank: nodes in the job and this node's index (torchrun's way).
      coordinator: ``host:port`` of the coordination service (None: a free port on
        127.0.0.1, or on the first host with ``hosts``).
      max_restarts: how many times the whole group may be started again after a failure.
      grace_s: seconds between SIGTERM and SIGKILL when stopping the group.
      exit_grace_s: at most how long rank 0 keeps the coordination service up at exit for
        ranks still finishing (on other nodes, or that did not exit yet).
      connect_timeout_s: how long the job may take to start (``--start-timeout``): nodes
        other than 0 wait this long for the coordinator, a discovery script for
        ``min_np`` slots.
      prefix: prefix output lines with the rank.
      min_np: elastic runs: after a failure, restart with one process fewer (the failed
        slot counts as a lost host), down to this many (None: always the full group); with
        ``discovery``, the fewest processes to start with.
      hosts: horovodrun's ``-H``/``--hostfile``: this launcher starts every rank, filling
        the hosts' slots in order, through ssh on hosts other than this one.
      discovery: horovodrun's ``--host-discovery-script``: the hosts, asked at each start.
      max_np, slots_per_host: the most processes with ``discovery``; the slots of a
        discovered host printed without them.
      ssh: ssh's port and identity file.
      run_id: torchrun's ``--rdzv-id`` (``TORCHELASTIC_RUN_ID``).

    Example:
      >>> config = LaunchConfig(("python", "train.py"), nproc=2, nnodes=2, node_rank=1,
      ...                       coordinator="10.0.0.1:29400")
      >>> config.world_size, config.starts_every_rank
      (4, False)
    """

    command: tuple[str, ...]
    nproc: int
    devices_per_process: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    coordinator: str | None = None
    max_restarts: int = 0
    grace_s: float = 3.0
    exit_grace_s: float = 5.0
    connect_timeout_s: float = 60.0
    prefix: bool = True
    min_np: int | None = None
    hosts: tuple[Host, ...] | None = None
    discovery: str | None = None
    max_np: int | None = None
    slots_per_host: int | None = None
    ssh: SshOptions = SshOptions()
    run_id: str | None = None

    @property
    def starts_every_rank(self) -> bool:
        """horovodrun's way: this launcher starts the ranks of every host."""
        return self.hosts is not None or self.discovery is not None

    @property
    def world_size(self) -> int:
        return self.nproc if self.starts_every_rank else self.nproc * self.nnodes
