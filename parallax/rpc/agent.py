"""A process's RPC agent: who it is, how to reach the other workers, and how a call travels.

A call to oneself runs on the agent's thread pool; a call to another worker is a Ray actor
call (``dispatch``, one argument) whose answer, a :class:`parallax.rpc.reply.Reply`, completes
a :class:`Future`: read by the caller's own thread when it waits at once (``rpc_sync``,
:meth:`Agent.call_and_wait`), by Ray's callback thread otherwise; there Ray's failures
become this package's (a dead actor is :class:`RemoteWorkerError` naming the worker).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid
from collections.abc import Callable
from typing import NamedTuple

import jax

from parallax.rpc.deadlines import Deadlines
from parallax.rpc.future import Future
from parallax.rpc.recording import (Tape, call_in_trace, current_anchor, current_context)
from parallax.rpc.reply import Reply
from parallax.rpc.wire import is_float_array, to_host

DEFAULT_TIMEOUT = 60.0  # seconds, PyTorch's default RPC timeout


class WorkerInfo(NamedTuple):
    """A worker's name and rank (PyTorch calls the rank ``id``).

    Example:
      >>> WorkerInfo("ps", 1).id
      1

    References:
      PyTorch, ``torch.distributed.rpc.WorkerInfo``.
    """

    name: str
    id: int


class Agent:
    """One process's view of its RPC group.

    Args:
      name: this worker's name.
      names: every worker's name, by rank.
      handles: the Ray actor of every other worker that takes calls (the driver takes none).
      state: this worker's :class:`parallax.rpc.worker_state.WorkerState`.
      actors: the actors this agent started (the driver's), stopped by ``shutdown``.
      in_actor: whether this agent lives in a worker actor (not in the driver).
    """

    def __init__(self, name: str, names: tuple, handles: dict, state, actors: dict,
                 in_actor: bool = False):
        self.name, self.names, self.handles, self.state = name, tuple(names), handles, state
        self.actors, self.in_actor = actors, in_actor
        self.executor = concurrent.futures.ThreadPoolExecutor(16, f"parallax-rpc-{name}")
        self.pending: set[Future] = set()
        self.lock = threading.Lock()
        self.deadlines = Deadlines()  # the calls' timeouts, one thread for all
        self.call_log = None  # a parallax.rpc.call_log.CallLog while recording is on

    def info(self, to, api: str) -> WorkerInfo:
        """The :class:`WorkerInfo` of ``to`` (a name, a rank or a WorkerInfo), validated."""
        name = to.name if isinstance(to, WorkerInfo) else to
        if isinstance(name, int) and not isinstance(name, bool) and 0 <= name < len(self.names):
            name = self.names[name]
        if not isinstance(name, str):
            raise TypeError(f"parallax.rpc.{api}: `to` must be a worker name (str), a rank (int) "
                            f"or a WorkerInfo, got {type(to).__name__} {to!r}")
        if name not in self.names:
            raise ValueError(f"parallax.rpc.{api}: no worker named {name!r} in this RPC group; "
                             f"its workers are {list(self.names)} (ranks 0..{len(self.names) - 1})"
                             "; pass one of those names, a rank, or get_worker_info(name)")
        return WorkerInfo(name, self.names.index(name))

    def describe(self, to: str, what: str) -> str:
        return f"{what} on worker {to!r} (rank {self.names.index(to)})"

    def call(self, to: str, method: str, args: tuple, *, timeout: float | None,
             describe: str) -> Future:
        """Runs ``WorkerState.<method>(*args)`` on worker ``to``; a future of the result.

        The answer of a remote call is read by Ray's callback thread (the future is the
        caller's to keep); a caller that waits at once uses :meth:`call_and_wait`."""
        return self._start(to, method, args, timeout, describe, wait=False)

    def call_and_wait(self, to: str, method: str, args: tuple, *, timeout: float | None,
                      describe: str):
        """``call(...).wait()``, but the answer is read in this thread, as a raw ``ray.get``
        would (no hand-over from Ray's callback thread; see :mod:`parallax.rpc.reply`)."""
        return self._start(to, method, args, timeout, describe, wait=True).wait()

    def _start(self, to: str, method: str, args: tuple, timeout, describe: str,
               wait: bool) -> Future:
        sent = time.time() if self.call_log is not None else None  # before it leaves
        reply = None
        if to != self.name:
            reply = Reply(self._submit(to, method, args, describe), to, self.names.index(to),
                          describe)
        # with wait, this thread's wait() (which comes next) reads the reply
        future = Future(timeout=timeout, describe=describe, deadlines=self.deadlines,
                        reply=reply if wait else None)
        if reply is None:
            done = self.executor.submit(getattr(self.state, method), *args)
            done.add_done_callback(lambda d: future.set_exception(d.exception())
                                   if d.exception() else future.set_result(d.result()))
        elif not wait:
            future.object_ref = reply.object_ref
            reply.read_later(future)
        if self.call_log is not None:
            self.call_log.start(self.name, to, method, describe, args, future, sent)
        with self.lock:
            self.pending.add(future)
        future._on_settled(self._forget)
        return future

    def _forget(self, future: Future) -> None:
        with self.lock:
            self.pending.discard(future)

    def _submit(self, to: str, method: str, args: tuple, describe: str):
        if to not in self.handles:
            raise RuntimeError(
                f"parallax.rpc: {describe}: worker {to!r} is the driver process (the one that "
                "called init_rpc), which takes no calls from other workers; run the code that "
                "must be called on one of the other workers")
        try:
            return self.handles[to].dispatch.remote((method, args))
        except Exception as error:  # Ray's serializer: a function or argument that won't pickle
            if "serializ" not in str(error).lower() and "pickl" not in str(error).lower():
                raise
            raise TypeError(
                f"parallax.rpc: cannot send {describe}: its function or arguments do not "
                f"pickle ({type(error).__name__}); pass a module-level function and arrays, "
                "pytrees or RRefs (no locks, sockets or open files in a closure)") from None

    def send_after(self, to: str, after, method: str, args: tuple) -> None:
        """A one-way message: ``WorkerState.<method>(*args)`` on ``to``, once Ray has the
        object ``after`` (None: at once); nothing waits for it or reads its answer."""
        self.handles[to].dispatch_after.remote(after, (method, args))

    def rpc_async(self, api: str, to, fn: Callable, args, kwargs, timeout: float | None,
                  rref_id: str | None = None) -> Future:
        """A call of ``fn`` on ``to``, recorded when a ``dist_autograd`` context is active."""
        return self._run(api, to, fn, args, kwargs, timeout, rref_id, wait=False)

    def rpc_sync(self, api: str, to, fn: Callable, args, kwargs, timeout: float | None):
        """``rpc_async(...).wait()``, the answer read in this thread (``call_and_wait``)."""
        return self._run(api, to, fn, args, kwargs, timeout, None, wait=True)

    def _run(self, api, to, fn, args, kwargs, timeout, rref_id, wait: bool):
        to = self.info(to, api).name
        if not callable(fn):
            raise TypeError(f"parallax.rpc.{api}: `func` must be callable, got "
                            f"{type(fn).__name__} {fn!r}")
        args, kwargs = tuple(args or ()), dict(kwargs or {})
        what = self.describe(to, f"{api}({getattr(fn, '__qualname__', fn)!s})")
        context = current_context()
        if current_anchor() is not None:
            done = self._in_trace(api, to, fn, args, kwargs, timeout, what, context, rref_id)
            return done.wait() if wait else done
        call_id = uuid.uuid4().hex if context is not None else None
        host_args, host_kwargs = to_host((args, kwargs))  # one tree walk for both
        call = (fn, host_args, host_kwargs, context, call_id, rref_id)
        if context is None:
            if wait:
                return self.call_and_wait(to, "run", call, timeout=timeout, describe=what)
            return self.call(to, "run", call, timeout=timeout, describe=what)
        tape = self.state.autograd.tapes.setdefault(context, Tape())
        floats = [leaf for leaf in jax.tree.leaves((args, kwargs)) if is_float_array(leaf)]
        entry = tape.record_call(call_id, to, floats, rref_id)
        if wait:
            value = self.call_and_wait(to, "run", call, timeout=timeout, describe=what)
            tape.record_outputs(entry, value)
            return value
        future = self.call(to, "run", call, timeout=timeout, describe=what)

        def keep_outputs(done: Future):
            value = done.wait()
            tape.record_outputs(entry, value)
            return value

        recorded = future.then(keep_outputs)
        recorded.object_ref = future.object_ref
        return recorded

    def _in_trace(self, api, to, fn, args, kwargs, timeout, what, context, rref_id) -> Future:
        if rref_id is not None:
            raise NotImplementedError(
                f"parallax.rpc.{api}: remote() inside a call recorded by dist_autograd is not "
                "differentiated; use rpc_sync there, or remote() from the context's owner")
        call_id = uuid.uuid4().hex

        def run(call_args, call_kwargs):
            host_args, host_kwargs = to_host((call_args, call_kwargs))
            return self.call_and_wait(to, "run", (fn, host_args, host_kwargs, context, call_id,
                                                  None), timeout=timeout, describe=what)

        def run_backward(cotangents):
            return self.call_and_wait(to, "backward", (context, call_id, cotangents),
                                      timeout=timeout, describe=f"backward of {what}")

        done = Future(describe=what)
        done.set_result(call_in_trace(args, kwargs, run, run_backward))
        return done


class _Current:
    """The process's agent: set by ``init_rpc`` (or a worker actor), cleared by ``shutdown``."""

    agent: Agent | None = None


_CURRENT = _Current()  # PyTorch's RPC API is per process: one agent per process


def current_agent(api: str) -> Agent:
    """This process's agent; a clear error if RPC is not running here."""
    if _CURRENT.agent is None:
        raise RuntimeError(f"parallax.rpc.{api}: RPC is not running in this process (never "
                           "initialised, or shut down); call parallax.rpc.init_rpc(name, rank, "
                           "world_size) first")
    return _CURRENT.agent


def set_agent(agent: Agent | None) -> None:
    _CURRENT.agent = agent


def agent_or_none() -> Agent | None:
    return _CURRENT.agent
