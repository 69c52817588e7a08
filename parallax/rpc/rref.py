"""``RRef``: a reference to a value owned by one worker, usable from any worker.

The owner keeps the value and a count of the RRefs that point at it. An RRef made by
``remote()`` or ``RRef(value)`` counts once; every copy sent to another worker (pickled)
counts once more before it leaves; each copy, when Python frees it, tells the owner, which
frees the value at zero. The creator's release waits for the creating call (Ray runs it
after that call's result exists), so a value is never freed before it is made.

References:
  PyTorch, ``torch.distributed.rpc.RRef`` (owner, ``to_here``, ``local_value``,
  ``rpc_sync()/rpc_async()/remote()`` proxies) and its reference-counting protocol
  (``rref_context.cpp``: forks counted by the owner, deletes sent when a user RRef dies).
"""

from __future__ import annotations

import uuid

from parallax.rpc.agent import Agent, WorkerInfo, agent_or_none, current_agent
from parallax.rpc.backward_pass import backward_pass
from parallax.rpc.future import Future
from parallax.rpc.options import UNSET_RPC_TIMEOUT, resolve_timeout
from parallax.rpc.recording import current_context, tie


def _call_method(rref: RRef, method: str, args: tuple, kwargs: dict):
    """Runs on the owner: ``rref.local_value().<method>(*args, **kwargs)``."""
    return getattr(rref.local_value(), method)(*args, **kwargs)


class RRef:
    """A remote reference; ``RRef(value)`` owns ``value`` on this worker.

    Args:
      value: the value this worker will own.

    Example:
      >>> import parallax.rpc as rpc
      >>> rpc.init_rpc("solo", rank=0, world_size=1)
      >>> r = rpc.RRef([1, 2])
      >>> r.to_here(), r.is_owner(), r.owner().name
      ([1, 2], True, 'solo')
      >>> rpc.shutdown()

    References:
      PyTorch, ``torch.distributed.rpc.RRef``.
    """

    def __init__(self, value):
        agent = current_agent("RRef")
        self._owner, self._id, self._created = agent.name, uuid.uuid4().hex, None
        agent.state.store(self._id, value)

    @classmethod
    def _user(cls, owner: str, rref_id: str, created: Future | None) -> RRef:
        rref = cls.__new__(cls)
        rref._owner, rref._id, rref._created = owner, rref_id, created
        return rref

    @classmethod
    def _user_local(cls, agent: Agent, rref_id: str) -> RRef:
        agent.state.fork(rref_id)
        return cls._user(agent.name, rref_id, None)

    def owner(self) -> WorkerInfo:
        """The owner's :class:`WorkerInfo`."""
        return current_agent("RRef.owner").info(self._owner, "RRef.owner")

    def owner_name(self) -> str:
        return self._owner

    def is_owner(self) -> bool:
        agent = agent_or_none()
        return agent is not None and agent.name == self._owner

    def confirmed_by_owner(self) -> bool:
        """Whether the owner knows of this RRef: always on the owner; for an RRef made by
        ``remote()``, once the owner has stored the value (the creating call answered);
        for a copy received from another worker, at once (the owner counted it before it
        was sent).

        References:
          PyTorch, ``RRef.confirmed_by_owner`` (``OwnerRRef``: true; ``UserRRef``: once the
          owner acknowledged it).
        """
        if self.is_owner() or self._created is None:
            return True
        return self._created._inner.done() and self._created._inner.exception() is None

    def backward(self, dist_autograd_ctx_id: str | int = -1, retain_graph: bool = False):
        """Runs distributed autograd's backward pass from this RRef's value (a root seeded
        with ones) in context ``dist_autograd_ctx_id``, on the worker that opened it.

        The value must be the result of a ``remote()`` (or the RRef of a value read in a
        call) made in that context. PyTorch's default, -1, runs a local autograd on the owner;
        JAX keeps no tape of local work, so a context is required here.

        References:
          PyTorch, ``RRef.backward(dist_autograd_ctx_id=-1, retain_graph=False)``.
        """
        if dist_autograd_ctx_id == -1:
            raise NotImplementedError(
                "parallax.rpc.RRef.backward: dist_autograd_ctx_id=-1 asks PyTorch for a local "
                "autograd pass on the owner; JAX records no local tape, so pass the context: "
                "rref.backward(ctx) inside `with dist_autograd.context() as ctx:`")
        backward_pass(dist_autograd_ctx_id, [], retain_graph, [self], UNSET_RPC_TIMEOUT)

    def _wait_created(self, api: str, timeout: float | None) -> None:
        if self._created is not None:
            self._created.wait(timeout)  # raises the creating call's error

    def local_value(self):
        """The value, on its owner (inside a recorded call, its gradient is kept here)."""
        agent = current_agent("RRef.local_value")
        if agent.name != self._owner:
            raise RuntimeError(f"parallax.rpc.RRef.local_value: called on worker {agent.name!r}, "
                               f"but the value is owned by {self._owner!r}; use to_here() to "
                               "copy it here, or rpc_sync() to run code where it lives")
        self._wait_created("local_value", None)
        context, state, rref_id = current_context(), agent.state, self._id
        return tie(state.fetch(rref_id),
                   lambda cotangent: state.accumulate(context, rref_id, cotangent))

    def to_here(self, timeout: float | None = UNSET_RPC_TIMEOUT):
        """A copy of the value on this worker (the value itself on the owner).

        Args:
          timeout: seconds; -1 the group's default, 0 none (PyTorch's meanings)."""
        agent = agent_or_none()
        if agent is None:
            raise RuntimeError("parallax.rpc.RRef.to_here: RPC was shut down in this process "
                               f"(or never started): the value of this RRef, owned by "
                               f"{self._owner!r}, is out of reach; call to_here() before "
                               "rpc.shutdown()")
        if agent.name == self._owner:
            return self.local_value()
        timeout = resolve_timeout(timeout, agent.default_timeout, "RRef.to_here")
        self._wait_created("to_here", timeout)
        context, owner, rref_id = current_context(), self._owner, self._id
        value = agent.call_and_wait(owner, "fetch", (rref_id,), timeout=timeout,
                                    describe=agent.describe(owner, "RRef.to_here()"))
        return tie(value, lambda cotangent: agent.call_and_wait(
            owner, "accumulate", (context, rref_id, cotangent), timeout=timeout,
            describe=agent.describe(owner, "a gradient of RRef.to_here()")))

    def rpc_sync(self, timeout: float | None = UNSET_RPC_TIMEOUT) -> _Proxy:
        """``rref.rpc_sync().f(x)`` runs ``value.f(x)`` on the owner and returns the result."""
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float | None = UNSET_RPC_TIMEOUT) -> _Proxy:
        """``rref.rpc_async().f(x)``: a Future of ``value.f(x)`` run on the owner."""
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float | None = UNSET_RPC_TIMEOUT) -> _Proxy:
        """``rref.remote().f(x)``: an RRef, owned by the owner, of ``value.f(x)``."""
        return _Proxy(self, "remote", timeout)

    def __reduce__(self):
        agent = agent_or_none()
        if agent is not None:  # this copy counts as a user before it leaves
            if agent.name == self._owner:
                agent.state.fork(self._id)
            else:
                self._wait_created("pickle", agent.default_timeout)
                agent.call_and_wait(self._owner, "fork", (self._id,),
                                    timeout=agent.default_timeout,
                                    describe=agent.describe(self._owner, "an RRef fork"))
        return (RRef._user, (self._owner, self._id, None))

    def __del__(self):
        try:
            agent = agent_or_none()
            if agent is None or "_id" not in self.__dict__:
                return
            if agent.name == self._owner:
                agent.state.release(self._id)
            else:  # once the creating call has answered: never before the value exists
                agent.send_one_way(self._owner, "release", (self._id,), after=self._created)
        except Exception:  # interpreter or Ray shutting down: nothing left to free
            pass

    def __eq__(self, other) -> bool:
        return isinstance(other, RRef) and (self._owner, self._id) == (other._owner, other._id)

    def __hash__(self) -> int:
        return hash((self._owner, self._id))

    def __repr__(self) -> str:
        return f"RRef(owner={self._owner!r}, id={self._id[:8]})"


class _Proxy:
    """``rref.rpc_sync()`` and friends: attribute calls become calls on the RRef's owner."""

    def __init__(self, rref: RRef, mode: str, timeout: float | None):
        self._rref, self._mode, self._timeout = rref, mode, timeout

    def __getattr__(self, method: str):
        def call(*args, **kwargs):
            agent = current_agent(f"RRef.{self._mode}")
            call_args = (self._rref, method, args, kwargs)
            timeout = resolve_timeout(self._timeout, agent.default_timeout, f"RRef.{self._mode}")
            if self._mode == "remote":
                return make_remote(agent, self._rref._owner, _call_method, call_args, {},
                                   timeout)
            run = agent.rpc_sync if self._mode == "rpc_sync" else agent.rpc_async
            return run(f"RRef.{self._mode}", self._rref._owner, _call_method, call_args, {},
                       timeout)

        return call


def make_remote(agent: Agent, to, fn, args, kwargs, timeout: float | None) -> RRef:
    """Runs ``fn`` on ``to``, which keeps the result; returns the RRef to it at once."""
    rref_id = uuid.uuid4().hex
    created = agent.rpc_async("remote", to, fn, args, kwargs, timeout, rref_id=rref_id)
    return RRef._user(agent.info(to, "remote").name, rref_id, created)
