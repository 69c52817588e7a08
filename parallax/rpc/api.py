"""``init_rpc``, ``shutdown``, ``rpc_sync``, ``rpc_async``, ``remote``, ``get_worker_info``.

The process that calls ``init_rpc`` is worker ``name`` (rank ``rank``); it starts one Ray
actor for every other worker, named after it in a namespace of its own group, on the Ray
cluster of ``parallax.ps.init_cluster`` (127.0.0.1 unless told otherwise).

References:
  PyTorch, ``torch.distributed.rpc.api`` (``rpc_sync``, ``rpc_async``, ``remote``,
  ``shutdown(graceful=True)``, ``get_worker_info``) and ``init_rpc``.
"""

from __future__ import annotations

import concurrent.futures
import uuid
from collections.abc import Callable, Sequence

import ray

from parallax.ray_cluster.connect import init_cluster
from parallax.rpc.actor import RpcWorker
from parallax.rpc.agent import (DEFAULT_TIMEOUT, Agent, WorkerInfo, agent_or_none, current_agent,
                                set_agent)
from parallax.rpc.future import Future
from parallax.rpc.rref import RRef, make_remote
from parallax.rpc.worker_state import WorkerState


def init_rpc(name: str, rank: int = 0, world_size: int = 1, *,
             worker_names: Sequence[str] | None = None,
             timeout: float = DEFAULT_TIMEOUT) -> None:
    """Makes this process worker ``name`` of a group of ``world_size``, starting the others.

    Args:
      name: this worker's name.
      rank: this worker's rank.
      world_size: the number of workers.
      worker_names: every worker's name by rank (``worker_names[rank] == name``); by default
        ``"worker<r>"`` for the other ranks.
      timeout: seconds to wait for the workers to start.

    Example:
      >>> import parallax.rpc as rpc
      >>> rpc.init_rpc("main", rank=0, world_size=1)
      >>> rpc.get_worker_info()
      WorkerInfo(name='main', id=0)
      >>> rpc.shutdown()

    References:
      PyTorch, ``torch.distributed.rpc.init_rpc``.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"parallax.rpc.init_rpc: `name` must be a non-empty str, got {name!r}")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"parallax.rpc.init_rpc: world_size must be an int >= 1, got "
                         f"{world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"parallax.rpc.init_rpc: rank must be in 0..{world_size - 1} "
                         f"(world_size={world_size}), got {rank!r}")
    names = (tuple(worker_names) if worker_names is not None else
             tuple(name if r == rank else f"worker{r}" for r in range(world_size)))
    if len(names) != world_size or names[rank] != name or len(set(names)) != world_size:
        raise ValueError(f"parallax.rpc.init_rpc: worker_names must be {world_size} distinct "
                         f"names with worker_names[{rank}] == {name!r}, got {list(names)}")
    if agent_or_none() is not None:
        raise RuntimeError("parallax.rpc.init_rpc: RPC is already running in this process "
                           f"as worker {agent_or_none().name!r}; call rpc.shutdown() first")
    init_cluster()
    namespace = f"parallax.rpc.{uuid.uuid4().hex[:12]}"
    actors = {n: RpcWorker.options(name=n, namespace=namespace).remote(n, names)
              for n in names if n != name}
    try:
        ray.get([actor.connect.remote(actors) for actor in actors.values()], timeout=timeout)
    except Exception:
        for actor in actors.values():
            ray.kill(actor)
        raise
    set_agent(Agent(name, names, actors, WorkerState(name), actors))


def shutdown(graceful: bool = True, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Stops the group: waits for this process's outstanding calls (if ``graceful``), then
    stops the workers it started. Values owned by them are gone after this.

    Args:
      graceful: wait for the calls this process made that have not answered yet.
      timeout: seconds to wait for them.

    Example:
      >>> import parallax.rpc as rpc
      >>> rpc.init_rpc("main")
      >>> rpc.shutdown()
    """
    agent = current_agent("shutdown")
    if agent.in_actor:
        raise RuntimeError(f"parallax.rpc.shutdown: worker {agent.name!r} is a worker actor; "
                           "only the process that called init_rpc shuts the group down")
    if graceful:
        with agent.lock:
            pending = list(agent.pending)
        concurrent.futures.wait([f._inner for f in pending], timeout=timeout)
    set_agent(None)
    for actor in agent.actors.values():
        ray.kill(actor)
    agent.executor.shutdown(wait=False, cancel_futures=True)
    agent.deadlines.close()


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


def rpc_async(to, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
              timeout: float | None = DEFAULT_TIMEOUT) -> Future:
    """Runs ``func(*args, **kwargs)`` on worker ``to``; returns a :class:`Future` of the result.

    Args:
      to: the worker's name, rank or :class:`WorkerInfo`.
      func: a picklable callable.
      args: its positional arguments (arrays travel as NumPy arrays).
      kwargs: its keyword arguments.
      timeout: seconds after which the future fails with ``RPCTimeoutError`` (None or 0:
        never).

    Returns:
      A future of the result; a worker that died fails it with ``RemoteWorkerError``, an
      exception raised by ``func`` fails it with that exception.

    Example:
      >>> import parallax.rpc as rpc
      >>> rpc.init_rpc("main")
      >>> rpc.rpc_async("main", max, args=(3, 4)).wait()
      4
      >>> rpc.shutdown()

    References:
      PyTorch, ``torch.distributed.rpc.rpc_async``.
    """
    return current_agent("rpc_async").rpc_async("rpc_async", to, func, args, kwargs, timeout)


def rpc_sync(to, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
             timeout: float | None = DEFAULT_TIMEOUT):
    """Runs ``func(*args, **kwargs)`` on worker ``to`` and returns its result (blocking).

    Example:
      >>> import parallax.rpc as rpc
      >>> rpc.init_rpc("main")
      >>> rpc.rpc_sync("main", sum, args=([1, 2, 3],))
      6
      >>> rpc.shutdown()

    References:
      PyTorch, ``torch.distributed.rpc.rpc_sync``.
    """
    return current_agent("rpc_sync").rpc_sync("rpc_sync", to, func, args, kwargs, timeout)


def remote(to, func: Callable, args: tuple | None = None, kwargs: dict | None = None,
           timeout: float | None = DEFAULT_TIMEOUT) -> RRef:
    """Runs ``func`` on worker ``to``, which keeps the result; returns an :class:`RRef` to it.

    Returns at once; ``to_here()`` waits for the value.

    Example:
      >>> import parallax.rpc as rpc
      >>> rpc.init_rpc("main")
      >>> rpc.remote("main", sorted, args=([3, 1, 2],)).to_here()
      [1, 2, 3]
      >>> rpc.shutdown()

    References:
      PyTorch, ``torch.distributed.rpc.remote``.
    """
    return make_remote(current_agent("remote"), to, func, args, kwargs, timeout)
