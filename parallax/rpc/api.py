"""``init_rpc``, ``shutdown``, ``rpc_sync``, ``rpc_async``, ``remote``, ``get_worker_info``,
``get_rpc_timeout``, with PyTorch's signatures and defaults.

The process that calls ``init_rpc`` is worker ``name`` (rank ``rank``); it starts one Ray
actor for every other worker (all at once, reusing the processes of a group it shut down
before: ``parallax/rpc/group.py``), on the Ray cluster of ``parallax.ps.init_cluster``
(127.0.0.1 unless told otherwise). Workers of one machine then call each other over Unix
sockets (``parallax/rpc/direct.py``), so calls do not go through Ray.

References:
  PyTorch, ``torch/distributed/rpc/__init__.py`` (``init_rpc``) and
  ``torch/distributed/rpc/api.py`` (``rpc_sync``, ``rpc_async``, ``remote``,
  ``shutdown(graceful=True, timeout=0)``, ``get_worker_info``); ``get_rpc_timeout``.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Callable, Sequence

import ray

from parallax.ray_cluster.connect import init_cluster
from parallax.rpc import group
from parallax.rpc.agent import Agent, WorkerInfo, agent_or_none, current_agent, set_agent
from parallax.rpc.future import Future
from parallax.rpc.options import (DEFAULT_SHUTDOWN_TIMEOUT, UNSET_RPC_TIMEOUT, BackendType,
                                  TensorPipeRpcBackendOptions, resolve_timeout)
from parallax.rpc.rref import RRef, make_remote
from parallax.rpc.worker_state import WorkerState

NAME = re.compile(r"[A-Za-z0-9_:\-]{1,127}")  # PyTorch's rule for worker names


def init_rpc(name: str, backend: BackendType | None = None, rank: int = -1,
             world_size: int | None = None,
             rpc_backend_options: TensorPipeRpcBackendOptions | None = None, *,
             worker_names: Sequence[str] | None = None) -> None:
    """Makes this process worker ``name`` of a group of ``world_size``, starting the others.

    Args:
      name: this worker's name (letters, digits, ``_``, ``:``, ``-``; under 128 characters).
      backend: ``BackendType.TENSORPIPE`` or None (the same: parallax's one agent).
      rank: this worker's rank; -1 (PyTorch's "from the rendezvous") means 0.
      world_size: the number of workers; None means ``len(worker_names)``, or 1.
      rpc_backend_options: a :class:`TensorPipeRpcBackendOptions` (default timeout of calls,
        threads); its ``rpc_timeout`` also bounds the workers' start.
      worker_names: every worker's name by rank (``worker_names[rank] == name``); by default
        ``"worker<r>"`` for the other ranks.

    Example:
      >>> import parallax.rpc as rpc
      >>> rpc.init_rpc("main", rank=0, world_size=1)
      >>> rpc.get_worker_info()
      WorkerInfo(name='main', id=0)
      >>> rpc.shutdown()

    References:
      PyTorch, ``torch.distributed.rpc.init_rpc``.
    """
    if backend is not None and not isinstance(backend, BackendType):
        raise TypeError(f"parallax.rpc.init_rpc: backend must be a member of BackendType "
                        f"(BackendType.TENSORPIPE), got {type(backend).__name__} {backend!r}")
    options = rpc_backend_options or TensorPipeRpcBackendOptions()
    if not isinstance(options, TensorPipeRpcBackendOptions):
        raise TypeError("parallax.rpc.init_rpc: rpc_backend_options must be a "
                        f"TensorPipeRpcBackendOptions, got {type(options).__name__}")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"parallax.rpc.init_rpc: `name` must be 1 to 127 letters, digits, "
                         f"'_', ':' or '-' (PyTorch's rule), got {name!r}")
    if world_size is None:
        world_size = len(worker_names) if worker_names is not None else 1
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"parallax.rpc.init_rpc: world_size must be an int >= 1, got "
                         f"{world_size!r}")
    rank = 0 if rank == -1 else rank
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"parallax.rpc.init_rpc: rank must be in 0..{world_size - 1} "
                         f"(world_size={world_size}), got {rank!r}")
    names = (tuple(worker_names) if worker_names is not None else
             tuple(name if r == rank else f"worker{r}" for r in range(world_size)))
    if len(names) != world_size or names[rank] != name or len(set(names)) != world_size:
        raise ValueError(f"parallax.rpc.init_rpc: worker_names must be {world_size} distinct "
                         f"names with worker_names[{rank}] == {name!r}, got {list(names)}")
    bad = [n for n in names if not isinstance(n, str) or not NAME.fullmatch(n)]
    if bad:
        raise ValueError(f"parallax.rpc.init_rpc: worker names must be 1 to 127 letters, "
                         f"digits, '_', ':' or '-' (PyTorch's rule), got {bad}")
    if agent_or_none() is not None:
        raise RuntimeError("parallax.rpc.init_rpc: RPC is already running in this process "
                           f"as worker {agent_or_none().name!r}; call rpc.shutdown() first")
    init_cluster()
    directory = tempfile.mkdtemp(prefix="parallax-rpc-")  # mode 0700: this user's sockets
    agent = Agent(name, names, WorkerState(name), options)
    try:
        path = agent.listen(directory) if "unix" in options.transports() else None
        actors, where = group.start_workers([n for n in names if n != name], names, directory,
                                            options, float(options.rpc_timeout) or None)
        node = ray.get_runtime_context().get_node_id()
        table = {n: {"node": where[n]["node"], "path": where[n]["path"], "actor": actors[n]}
                 for n in actors}
        table[name] = {"node": node, "path": path, "actor": None}
        ray.get([actor.connect.remote(table) for actor in actors.values()])
    except BaseException:
        agent.close()
        shutil.rmtree(directory, ignore_errors=True)
        raise
    agent.connect(table, node)
    agent.group = (actors, directory)
    set_agent(agent)


def shutdown(graceful: bool = True, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
    """Stops the group. With ``graceful``, first waits until no worker has a call in flight
    (every worker's calls, not only this process's: a call between two workers completes).

    Args:
      graceful: wait for every worker's outstanding calls first; else stop at once (calls in
        flight fail).
      timeout: seconds to wait for them; 0 (PyTorch's default) waits as long as it takes.
        Past it the group is stopped anyway and this raises, naming the busy workers.

    Example:
      >>> import parallax.rpc as rpc
      >>> rpc.init_rpc("main")
      >>> rpc.shutdown()

    References:
      PyTorch, ``torch.distributed.rpc.shutdown``.
    """
    agent = current_agent("shutdown")
    if agent.in_actor:
        raise RuntimeError(f"parallax.rpc.shutdown: worker {agent.name!r} is a worker actor; "
                           "only the process that called init_rpc shuts the group down")
    actors, directory = agent.group
    busy = group.drain(agent, actors, timeout or None) if graceful else []
    set_agent(None)
    try:
        group.stop_workers(actors, keep=graceful and not busy)
    finally:
        agent.close()
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
    if busy:
        raise RuntimeError(f"parallax.rpc.shutdown: workers {busy} still had calls in flight "
                           f"after timeout={timeout} s; the group was stopped anyway (those calls "
                           "failed). Pass timeout=0 to wait as long as they take")


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The :class:`WorkerInfo` of ``worker_name`` (this worker's when None).

    Example:
      >>> import parallax.rpc as rpc
      >>> rpc.init_rpc("main", worker_names=["main"])
      >>> rpc.get_worker_info("main").id
      0
      >>> rpc.shutdown()
    """
    agent = current_agent("get_worker_info")
    return agent.info(agent.name if worker_name is None else worker_name, "get_worker_info")


def get_rpc_timeout() -> float:
    """The group's default timeout of calls, in seconds (``rpc_backend_options.rpc_timeout``,
    60 by default; 0: none).

    Example:
      >>> import parallax.rpc as rpc
      >>> rpc.init_rpc("main", rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
      ...     rpc_timeout=20))
      >>> rpc.get_rpc_timeout()
      20.0
      >>> rpc.shutdown()

    References:
      PyTorch, ``torch.distributed.rpc.get_rpc_timeout``.
    """
    return float(current_agent("get_rpc_timeout").options.rpc_timeout)


def rpc_async(to, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
              timeout: float | None = UNSET_RPC_TIMEOUT) -> Future:
    """Runs ``func(*args, **kwargs)`` on worker ``to``; returns a :class:`Future` of the result.

    Args:
      to: the worker's name, rank or :class:`WorkerInfo`.
      func: a picklable callable.
      args: its positional arguments (arrays travel as NumPy arrays).
      kwargs: its keyword arguments.
      timeout: seconds after which the future fails with ``RPCTimeoutError`` (a
        ``RuntimeError``); -1: the group's default (``get_rpc_timeout()``); 0 or None: never.

    Returns:
      A future of the result; a worker that died fails it with ``RemoteWorkerError``, an
      exception raised by ``func`` fails it with that exception (chained from the remote
      traceback, which names the worker).

    Example:
      >>> import parallax.rpc as rpc
      >>> rpc.init_rpc("main")
      >>> rpc.rpc_async("main", max, args=(3, 4)).wait()
      4
      >>> rpc.shutdown()

    References:
      PyTorch, ``torch.distributed.rpc.rpc_async``.
    """
    agent = current_agent("rpc_async")
    return agent.rpc_async("rpc_async", to, func, args, kwargs,
                           resolve_timeout(timeout, agent.default_timeout, "rpc_async"))


def rpc_sync(to, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
             timeout: float | None = UNSET_RPC_TIMEOUT):
    """Runs ``func(*args, **kwargs)`` on worker ``to`` and returns its result (blocking).

    Same arguments and errors as :func:`rpc_async`.

    Example:
      >>> import parallax.rpc as rpc
      >>> rpc.init_rpc("main")
      >>> rpc.rpc_sync("main", sum, args=([1, 2, 3],))
      6
      >>> rpc.shutdown()

    References:
      PyTorch, ``torch.distributed.rpc.rpc_sync``.
    """
    agent = current_agent("rpc_sync")
    return agent.rpc_sync("rpc_sync", to, func, args, kwargs,
                          resolve_timeout(timeout, agent.default_timeout, "rpc_sync"))


def remote(to, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
           timeout: float | None = UNSET_RPC_TIMEOUT) -> RRef:
    """Runs ``func`` on worker ``to``, which keeps the result; returns an :class:`RRef` to it.

    Returns at once; ``to_here()`` waits for the value (and raises the call's error).

    Example:
      >>> import parallax.rpc as rpc
      >>> rpc.init_rpc("main")
      >>> rpc.remote("main", sorted, args=([3, 1, 2],)).to_here()
      [1, 2, 3]
      >>> rpc.shutdown()

    References:
      PyTorch, ``torch.distributed.rpc.remote``.
    """
    agent = current_agent("remote")
    return make_remote(agent, to, func, args, kwargs,
                       resolve_timeout(timeout, agent.default_timeout, "remote"))
