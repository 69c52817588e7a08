"""A process's RPC agent: who it is, how it reaches the other workers, and how a call travels.

A call to oneself runs on the agent's thread pool; a call to another worker of this machine
goes over that worker's Unix socket (:class:`parallax.rpc.direct.DirectPeer`), one on another
machine through its Ray actor (:class:`parallax.rpc.peers.RayPeer`). Each worker, the driver
included, serves calls on its own socket (:class:`parallax.rpc.server.Server`). Under a
``dist_autograd`` context a user's call is recorded (:mod:`parallax.rpc.recording`).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from typing import NamedTuple

import jax

from parallax.rpc.activity import Activity
from parallax.rpc.answers import AnswerReader, Outbox
from parallax.rpc.deadlines import Deadlines
from parallax.rpc.direct import DirectPeer
from parallax.rpc.errors import UnknownWorkerError
from parallax.rpc.future import Future
from parallax.rpc.options import TensorPipeRpcBackendOptions
from parallax.rpc.peers import LocalPeer, RayPeer
from parallax.rpc.recording import Tape, call_in_trace, current_anchor, current_context
from parallax.rpc.server import Server
from parallax.rpc.wire import is_float_array, to_host


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
      state: this worker's :class:`parallax.rpc.worker_state.WorkerState`.
      options: the group's :class:`parallax.rpc.options.TensorPipeRpcBackendOptions`.
      in_actor: whether this agent lives in a worker actor (not in the driver).
    """

    def __init__(self, name: str, names: tuple, state, options: TensorPipeRpcBackendOptions,
                 in_actor: bool = False):
        self.name, self.names, self.state = name, tuple(names), state
        self.rank, self.options, self.in_actor = self.names.index(name), options, in_actor
        self.default_timeout = float(options.rpc_timeout) or None
        self.deadlines = Deadlines()  # the calls' timeouts, one thread for all
        self.answers, self.outbox = AnswerReader(), Outbox()
        self.activity = Activity()  # calls in flight, for a graceful shutdown
        self.local = LocalPeer(name, self.rank, self.serve, options.num_worker_threads,
                               self.deadlines)
        self.peers: dict[str, object] = {name: self.local}
        self.unreachable: dict[str, str] = {}  # why a worker has no peer here
        self.server: Server | None = None
        self.group: tuple[dict, str | None] = ({}, None)  # the driver's: actors, socket dir
        self.call_log = None  # a parallax.rpc.call_log.CallLog while recording is on

    # -- joining the group ----------------------------------------------------------------

    def listen(self, directory: str) -> str:
        """Serves calls on ``directory/<rank>.sock``; returns the path."""
        os.makedirs(directory, mode=0o700, exist_ok=True)
        path = os.path.join(directory, f"{self.rank}.sock")
        self.server = Server(path, self.serve_incoming, self.describe(self.name, "worker"))
        return path

    def connect(self, table: dict, node: str) -> None:
        """Learns how to reach every other worker: ``table[name] = {"node", "path", "actor"}``
        (``node``: its machine; ``path``: its socket or None; ``actor``: its Ray actor or None).
        Workers of this machine (``node``) are called on their sockets, others through Ray."""
        transports = self.options.transports()
        for name, where in table.items():
            if name == self.name:
                continue
            rank = self.names.index(name)
            if "unix" in transports and where["path"] and where["node"] == node:
                self.peers[name] = DirectPeer(name, rank, where["path"], self.answers)
            elif "ray" in transports and where["actor"] is not None:
                self.peers[name] = RayPeer(name, rank, where["actor"], self.deadlines)
            elif where["actor"] is None:
                self.unreachable[name] = (
                    "it is the driver (the process that called init_rpc), a Ray driver that "
                    f"hosts no actor, and this group's transports are {list(transports)}: "
                    "only its Unix socket takes calls, from workers of its machine")
            else:
                self.unreachable[name] = (
                    f"it is on another machine and this group's transports are "
                    f"{list(transports)}; allow 'ray' in TensorPipeRpcBackendOptions("
                    "_transports=...) to call across machines")

    def close(self) -> None:
        """Stops serving and calling (the process stays)."""
        if self.server is not None:
            self.server.close()
        self.outbox.close()
        self.answers.close()
        for peer in self.peers.values():
            peer.close()
        self.deadlines.close()

    # -- serving ----------------------------------------------------------------------------

    def serve(self, method: str, args: tuple):
        """Runs ``WorkerState.<method>(*args)``: what every call to this worker does."""
        return getattr(self.state, method)(*args)

    def serve_incoming(self, method: str, args: tuple):
        """``serve`` for a call from another worker, counted while it runs."""
        self.activity.begin()
        try:
            return self.serve(method, args)
        finally:
            self.activity.end()

    # -- calling ----------------------------------------------------------------------------

    def info(self, to, api: str) -> WorkerInfo:
        """The :class:`WorkerInfo` of ``to`` (a name, a rank or a WorkerInfo), validated."""
        name = to.name if isinstance(to, WorkerInfo) else to
        if isinstance(name, int) and not isinstance(name, bool) and 0 <= name < len(self.names):
            name = self.names[name]
        if not isinstance(name, str):
            raise TypeError(f"parallax.rpc.{api}: `to` must be a worker name (str), a rank (int) "
                            f"or a WorkerInfo, got {type(to).__name__} {to!r}")
        if name not in self.names:
            raise UnknownWorkerError(
                f"parallax.rpc.{api}: no worker named {name!r} in this RPC group; its workers "
                f"are {list(self.names)} (ranks 0..{len(self.names) - 1}); pass one of those "
                "names, a rank, or get_worker_info(name)")
        return WorkerInfo(name, self.names.index(name))

    def describe(self, to: str, what: str) -> str:
        return f"{what} on worker {to!r} (rank {self.names.index(to)})"

    def _peer(self, to: str, describe: str):
        if to not in self.peers:
            raise RuntimeError(f"parallax.rpc: {describe}: worker {to!r} cannot be reached from "
                               f"{self.name!r}: {self.unreachable.get(to, 'unknown route')}")
        return self.peers[to]

    def call(self, to: str, method: str, args: tuple, *, timeout: float | None,
             describe: str) -> Future:
        """Runs ``WorkerState.<method>(*args)`` on worker ``to``; a future of the result.

        Raises at once (nothing sent) if the call does not pickle; any other failure
        completes the future."""
        future = Future(timeout=timeout, describe=describe, deadlines=self.deadlines)
        sent = time.time() if self.call_log is not None else None
        self.activity.begin()
        try:
            self._peer(to, describe).call(method, args, future, describe)
        except TypeError:  # it does not pickle: nothing was sent
            self.activity.end()
            raise
        except Exception as error:
            future.set_exception(error)
        future._on_settled(lambda _: self.activity.end())
        if self.call_log is not None:
            self.call_log.start(self.name, to, method, describe, args, future, sent)
        return future

    def call_and_wait(self, to: str, method: str, args: tuple, *, timeout: float | None,
                      describe: str):
        """``call(...).wait()``, the answer read in this thread (no other thread involved)."""
        sent = time.time() if self.call_log is not None else None
        self.activity.begin()
        try:
            return self._peer(to, describe).call_and_wait(method, args, timeout, describe)
        finally:
            self.activity.end()
            if self.call_log is not None:
                self.call_log.add(self.name, to, method, describe, args, sent)

    def send_one_way(self, to: str, method: str, args: tuple, after: Future | None = None):
        """``WorkerState.<method>(*args)`` on ``to``, answered by nobody, once ``after`` (a
        call's future, if any) has settled: queued, safe to call from ``__del__``."""
        peer = self.peers.get(to)
        if peer is None:
            return
        if after is not None:  # at once if it has settled already
            after._on_settled(lambda _: self.outbox.put(peer.send_one_way, method, args))
        else:
            self.outbox.put(peer.send_one_way, method, args)

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

        return future.then(keep_outputs)

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
            return self.call_and_wait(to, "backward", (context, call_id, cotangents, False),
                                      timeout=timeout, describe=f"backward of {what}")

        done = Future(describe=what)
        done.set_result(call_in_trace(args, kwargs, run, run_backward))
        return done


class _Current:
    """The process's agent (set by ``init_rpc`` or a worker actor, cleared by ``shutdown``)
    and the worker actors a driver keeps between groups (``parallax/rpc/group.py``)."""

    agent: Agent | None = None
    idle_workers: tuple = ((), None)  # (actors, the Ray job they belong to)


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
