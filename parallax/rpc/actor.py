"""The Ray actor of one worker: its :class:`WorkerState`, and an agent to call the others."""

from __future__ import annotations

import ray

from parallax.rpc.agent import Agent, set_agent
from parallax.rpc.worker_state import WorkerState


@ray.remote(num_cpus=0, max_concurrency=32)  # threads: a call may call back into this worker
class RpcWorker:
    """A worker of an RPC group, in its own process (a named Ray actor of the group's namespace).

    Example:
      >>> callable(RpcWorker.remote)
      True

    References:
      PyTorch, ``torch.distributed.rpc``: one RPC agent per worker process, with a thread
      pool serving incoming calls.
    """

    def __init__(self, name: str, names: tuple):
        self.name, self.names = name, names
        self.state = WorkerState(name)

    def connect(self, handles: dict) -> int:
        """Learns the group's actors; from here on, code running here may call the others."""
        others = {n: h for n, h in handles.items() if n != self.name}
        set_agent(Agent(self.name, self.names, others, self.state, actors={}, in_actor=True))
        return self.state.pid()

    def dispatch(self, call: tuple):
        """Runs ``WorkerState.<method>(*args)`` for ``call = (method, args)``.

        A call is one argument: Ray serializes an actor call's arguments one by one (about
        10-25 us each on this project's machine, ``benchmarks/rpc.py``'s notes), and a
        call needs only the one."""
        method, args = call
        return getattr(self.state, method)(*args)

    def dispatch_after(self, after, call: tuple):
        """``dispatch(call)`` once Ray has the object ``after`` (a top-level ObjectRef argument,
        which Ray resolves before running the method; its value is unused)."""
        del after
        return self.dispatch(call)
