"""How a call reaches a worker other than through its Unix socket: this worker itself (a thread
of its pool), or a worker on another machine (a Ray actor call).

Every kind of peer (these and :class:`parallax.rpc.direct.DirectPeer`) offers the same three
things: ``call_and_wait`` (the value, read in the calling thread), ``call`` (completes a
future) and ``send_one_way``.

References:
  PyTorch's RPC agent sends a call to itself through its own thread pool; across machines
  TensorPipe uses TCP (here, Ray's actor calls).
"""

from __future__ import annotations

import concurrent.futures
import traceback

from parallax.rpc.errors import raised_on, unpicklable_error
from parallax.rpc.future import Future
from parallax.rpc.reply import Reply


class LocalPeer:
    """Calls to this worker: run on its thread pool, nothing pickled.

    Args:
      name: this worker's name.
      rank: its rank.
      handle: runs a call (``Agent.serve``).
      threads: the pool's size (``num_worker_threads``).
      deadlines: this agent's :class:`parallax.rpc.deadlines.Deadlines`.
    """

    def __init__(self, name: str, rank: int, handle, threads: int, deadlines):
        self.name, self.rank, self._handle, self._deadlines = name, rank, handle, deadlines
        self.executor = concurrent.futures.ThreadPoolExecutor(threads, f"parallax-rpc-{name}")

    def _run(self, method: str, args: tuple):
        try:
            return self._handle(method, args)
        except BaseException as error:
            raise raised_on(error, self.name, self.rank,
                            "".join(traceback.format_exception(error)))

    def call(self, method: str, args: tuple, future: Future, describe: str) -> None:
        del describe
        done = self.executor.submit(self._run, method, args)
        done.add_done_callback(lambda d: future.set_exception(d.exception())
                               if d.exception() else future.set_result(d.result()))

    def call_and_wait(self, method: str, args: tuple, timeout: float | None, describe: str):
        future = Future(timeout=timeout, describe=describe, deadlines=self._deadlines)
        self.call(method, args, future, describe)
        return future.wait()

    def send_one_way(self, method: str, args: tuple) -> None:
        self._handle(method, args)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class RayPeer:
    """A worker reached through its Ray actor (``RpcWorker.dispatch``): one on another machine,
    or any worker when the group's ``_transports`` is ``["ray"]``.

    Args:
      name: the worker's name.
      rank: its rank.
      actor: its Ray actor handle.
      deadlines: this agent's :class:`parallax.rpc.deadlines.Deadlines`.
    """

    def __init__(self, name: str, rank: int, actor, deadlines):
        self.name, self.rank, self.actor, self._deadlines = name, rank, actor, deadlines

    def _reply(self, method: str, args: tuple, describe: str) -> Reply:
        try:
            ref = self.actor.dispatch.remote((method, args))
        except Exception as error:  # Ray's serializer: a function or argument that won't pickle
            if "serializ" not in str(error).lower() and "pickl" not in str(error).lower():
                raise
            raise unpicklable_error(describe, error) from None
        return Reply(ref, self.name, self.rank, describe)

    def call(self, method: str, args: tuple, future: Future, describe: str) -> None:
        self._reply(method, args, describe).read_later(future)

    def call_and_wait(self, method: str, args: tuple, timeout: float | None, describe: str):
        reply = self._reply(method, args, describe)
        return Future(timeout=timeout, describe=describe, deadlines=self._deadlines,
                      reply=reply).wait()

    def send_one_way(self, method: str, args: tuple) -> None:
        self.actor.dispatch_after.remote(None, (method, args))

    def close(self) -> None:
        pass
