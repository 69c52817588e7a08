"""The Ray actor of one worker: a process that joins a group, serves it, and may serve the next.

The driver's ``init_rpc`` asks each actor to ``join`` (a fresh :class:`WorkerState` and an
agent serving its Unix socket), then to ``connect`` (how to reach the others). ``drain``
waits for its calls in flight (a graceful shutdown); ``retire`` leaves the group, and the
process waits, alive, for the driver's next ``init_rpc`` (``parallax/rpc/group.py``).
"""

from __future__ import annotations

import os

import ray

from parallax.rpc.agent import Agent, set_agent
from parallax.rpc.worker_state import WorkerState


@ray.remote(num_cpus=0, max_concurrency=32)  # threads: a call may call back into this worker
class RpcWorker:
    """A worker of an RPC group, in its own process.

    Example:
      >>> callable(RpcWorker.remote)
      True

    References:
      PyTorch, ``torch.distributed.rpc``: one RPC agent per worker process, with a thread
      pool serving incoming calls; a process may ``init_rpc`` again after ``shutdown``.
    """

    def __init__(self):
        self.agent: Agent | None = None

    def join(self, name: str, names: tuple, directory: str, options) -> dict:
        """Becomes worker ``name``: a fresh state and agent, serving ``directory/<rank>.sock``
        when the group talks over Unix sockets. Returns its pid, machine and socket."""
        self.agent = Agent(name, names, WorkerState(name), options, in_actor=True)
        path = self.agent.listen(directory) if "unix" in options.transports() else None
        set_agent(self.agent)
        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "path": path}

    def connect(self, table: dict) -> None:
        """Learns how to reach every other worker (see ``Agent.connect``)."""
        self.agent.connect(table, ray.get_runtime_context().get_node_id())

    def drain(self, seconds: float | None) -> tuple[int, int]:
        """Waits (``seconds`` at most) until this worker has no call in flight; returns how
        many calls it has started so far and how many are still in flight."""
        import time

        activity = self.agent.activity
        activity.wait_idle(None if seconds is None else time.monotonic() + seconds)
        return activity.started, activity.in_flight

    def retire(self) -> bool:
        """Leaves the group (its values are dropped); whether no call was still running."""
        agent, self.agent = self.agent, None
        set_agent(None)
        if agent is None:
            return True
        idle = agent.activity.in_flight == 0
        agent.close()
        return idle

    def dispatch(self, call: tuple):
        """Runs ``WorkerState.<method>(*args)`` for ``call = (method, args)`` (a call through
        Ray: from another machine, or when the group's ``_transports`` is ``["ray"]``).

        A call is one argument: Ray serializes an actor call's arguments one by one, and a
        call needs only the one."""
        method, args = call
        return self.agent.serve_incoming(method, args)

    def dispatch_after(self, after, call: tuple):
        """``dispatch(call)`` once Ray has the object ``after`` (a top-level ObjectRef argument,
        which Ray resolves before running the method; its value is unused)."""
        del after
        return self.dispatch(call)
