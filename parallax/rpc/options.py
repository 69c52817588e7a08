"""PyTorch's RPC settings: ``BackendType``, ``TensorPipeRpcBackendOptions``, the timeouts.

A ported script passes ``backend=BackendType.TENSORPIPE`` and a
``TensorPipeRpcBackendOptions(num_worker_threads=..., rpc_timeout=...)`` to ``init_rpc``;
both are taken here with PyTorch's defaults and meanings. parallax has one agent (calls
between processes of one machine go over Unix sockets, other calls over Ray), which plays
TensorPipe's part: ``TENSORPIPE`` is the name a script uses for it.

Timeouts, as PyTorch has them: a call's ``timeout=-1`` (``UNSET_RPC_TIMEOUT``, the default)
means the group's default (``rpc_timeout``, 60 s), ``0`` means no timeout; ``None`` also
means none (parallax's spelling).

References:
  PyTorch, ``torch/distributed/rpc/options.py`` (``TensorPipeRpcBackendOptions``),
  ``backend_registry.py`` (``BackendType``), ``constants.py`` (``DEFAULT_RPC_TIMEOUT_SEC``,
  ``UNSET_RPC_TIMEOUT``, ``DEFAULT_NUM_WORKER_THREADS``, ``DEFAULT_SHUTDOWN_TIMEOUT``).
"""

from __future__ import annotations

import dataclasses
import enum
import numbers

DEFAULT_RPC_TIMEOUT_SEC = 60.0
UNSET_RPC_TIMEOUT = -1.0
DEFAULT_NUM_WORKER_THREADS = 16
DEFAULT_INIT_METHOD = "env://"
DEFAULT_SHUTDOWN_TIMEOUT = 0  # shutdown(graceful=True) waits as long as it takes
TRANSPORTS = ("unix", "ray")  # same-machine sockets, then Ray's actor calls


class BackendType(enum.Enum):
    """The RPC backends ``init_rpc(backend=...)`` takes: PyTorch's one, ``TENSORPIPE``.

    Example:
      >>> BackendType.TENSORPIPE.name
      'TENSORPIPE'

    References:
      PyTorch, ``torch.distributed.rpc.BackendType`` (``backend_registry.py``).
    """

    TENSORPIPE = "TENSORPIPE"


@dataclasses.dataclass(kw_only=True)
class TensorPipeRpcBackendOptions:
    """The group's settings, with PyTorch's names and defaults.

    Args:
      num_worker_threads: threads that run a worker's calls to itself (PyTorch: the thread
        pool that runs every incoming call; here each connection of another worker has a
        thread of its own, so a call that calls back never waits for a free thread).
      rpc_timeout: the default timeout of calls, seconds (0: none).
      init_method: PyTorch's rendezvous URL; accepted and unused (the process calling
        ``init_rpc`` starts the others, so there is nothing to meet at).
      device_maps, devices: accelerator tensors sent device to device; not supported
        (arrays travel as host NumPy arrays): must stay empty.
      _transports: parallax's choice of transports, a subset of ``("unix", "ray")``: by
        default workers on one machine talk over Unix sockets and others through Ray's
        actor calls; ``["ray"]`` sends every call through Ray.
      _channels: PyTorch's TensorPipe channels; must be None.

    Example:
      >>> options = TensorPipeRpcBackendOptions(rpc_timeout=20)
      >>> options.rpc_timeout, options.num_worker_threads
      (20, 16)

    References:
      PyTorch, ``torch.distributed.rpc.TensorPipeRpcBackendOptions``.
    """

    num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS
    rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC
    init_method: str = DEFAULT_INIT_METHOD
    device_maps: dict | None = None
    devices: list | None = None
    _transports: list | None = None
    _channels: list | None = None

    def __post_init__(self):
        api = "parallax.rpc.TensorPipeRpcBackendOptions"
        if (isinstance(self.num_worker_threads, bool)
                or not isinstance(self.num_worker_threads, int) or self.num_worker_threads < 1):
            raise ValueError(f"{api}: num_worker_threads must be an int >= 1, got "
                             f"{self.num_worker_threads!r}")
        if not isinstance(self.rpc_timeout, numbers.Real) or self.rpc_timeout < 0:
            raise ValueError(f"{api}: rpc_timeout must be seconds >= 0 (0: no timeout), got "
                             f"{self.rpc_timeout!r}")
        if self.device_maps or self.devices:
            self._no_devices("device_maps/devices")
        if self._channels is not None:
            raise ValueError(f"{api}: _channels selects TensorPipe channels, which parallax "
                             "does not have; leave it None")
        if self._transports is not None:
            unknown = [t for t in self._transports if t not in TRANSPORTS]
            if unknown or not self._transports:
                raise ValueError(f"{api}: _transports must be a non-empty subset of "
                                 f"{list(TRANSPORTS)}, got {self._transports!r}")

    def set_device_map(self, to: str, device_map: dict) -> None:
        """PyTorch's device-to-device map for calls to ``to``; not supported here."""
        self._no_devices(f"set_device_map({to!r}, ...)")

    def set_devices(self, devices: list) -> None:
        """PyTorch's devices of this worker's agent; not supported here."""
        self._no_devices("set_devices(...)")

    @staticmethod
    def _no_devices(what: str):
        raise NotImplementedError(
            f"parallax.rpc.TensorPipeRpcBackendOptions: {what} maps accelerator tensors between "
            "workers; parallax.rpc sends arrays as host NumPy arrays (jax.device_put them where "
            "they are used), so it has no device maps: leave device_maps and devices empty")

    def transports(self) -> tuple[str, ...]:
        return tuple(self._transports) if self._transports is not None else TRANSPORTS


def resolve_timeout(timeout, default: float | None, api: str) -> float | None:
    """Seconds a call may take (None: no limit), from a call's ``timeout=`` as PyTorch reads
    it: -1 the default, 0 (or None) none.

    Example:
      >>> resolve_timeout(-1, 60.0, "rpc_sync"), resolve_timeout(0, 60.0, "rpc_sync")
      (60.0, None)
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"parallax.rpc.{api}: timeout must be seconds (a number; -1: the "
                        f"default of {default} s, 0: none), got {type(timeout).__name__} "
                        f"{timeout!r}")
    if timeout == UNSET_RPC_TIMEOUT:
        return default
    if timeout < 0:
        raise ValueError(f"parallax.rpc.{api}: timeout must be >= 0 seconds, or -1 for the "
                         f"default ({default} s), got {timeout!r}")
    return float(timeout) if timeout else None
