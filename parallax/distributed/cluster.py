"""The cluster one process belongs to, as a value: :class:`ClusterSpec`.

Example:
  >>> check_address("10.0.0.1:1234", "coordinator")
  '10.0.0.1:1234'
"""

from __future__ import annotations

import dataclasses

API = "px.distributed.initialize"


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """The cluster one process belongs to.

    Attributes:
      coordinator: ``host:port`` of the coordination service; None for one process or when
        JAX detects the cluster itself.
      num_processes: processes in the job (None: JAX detects it).
      process_id: this process's id (None: JAX detects it).
      local_rank: this process's index among the processes of its host.
      local_size: the processes on its host.
      local_devices: devices this process uses: a count (CPU: simulated devices; accelerators:
        the ``local_rank``-th group of that many), explicit device ids, or None (all).
      coordinator_bind: the address process 0 binds the service to (None: JAX's default,
        every interface).
      source: where the numbers came from (``"explicit"``, ``"parallax launch"``,
        ``"torchrun"``, ``"TF_CONFIG"``, ``"jax"`` + the environment, ``"single process"``).
      launched: started by ``parallax launch``, which supervises the processes' exits.

    Example:
      >>> spec = ClusterSpec("127.0.0.1:1234", 2, 1, source="explicit")
      >>> spec.is_multiprocess, spec.local_rank
      (True, 0)
    """

    coordinator: str | None = None
    num_processes: int | None = 1
    process_id: int | None = 0
    local_rank: int = 0
    local_size: int = 1
    local_devices: int | tuple[int, ...] | None = None
    coordinator_bind: str | None = None
    source: str = "single process"
    launched: bool = False

    @property
    def is_multiprocess(self) -> bool:
        """More than one process, or a cluster JAX will size itself."""
        return self.num_processes is None or self.num_processes > 1

    @property
    def auto(self) -> bool:
        """JAX's own cluster detection fills in the numbers."""
        return self.source.startswith("jax")

    def device_ids(self) -> list[int] | None:
        """The local device ids to pass to JAX (a count becomes this rank's group)."""
        if self.local_devices is None:
            return None
        if isinstance(self.local_devices, int):
            first = self.local_rank * self.local_devices
            return list(range(first, first + self.local_devices))
        return list(self.local_devices)


def check_address(text: str, what: str) -> str:
    """``text`` when it is ``host:port``, else a ValueError naming ``what``."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(
            f"{API}: {what} {text!r} is not 'host:port' (e.g. '10.0.0.1:1234')."
        )
    return text
