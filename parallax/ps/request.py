"""PS-Lite's request handles: ``(meta, data, server)`` for every push and pull.

PS-Lite's ``KVServer`` hands each request to one function,
``ReqHandle(const KVMeta& req_meta, const KVPairs<Val>& req_data, KVServer* server)``, which
owns the store, sees the request's command (any integer the worker sent) and answers with
``server->Response(req_meta, res)``. :class:`parallax.ps.KVStore` accepts such a handle
beside its simple ones; the two kinds are told apart by shape:

- a *simple handle* has ``init(values)`` and ``push(stored, pushed, state)``
  (:class:`parallax.ps.SumHandle`, :class:`parallax.ps.OptaxHandle`): the server keeps the
  table, pulls read it, and ``cmd`` is ``UPDATE`` or ``ASSIGN``;
- a *request handle* is any other callable, called as ``handle(meta, data, server)`` for
  every request; it keeps its own store (it lives inside the server's process) and answers
  a pull by returning a :class:`KVPairs` (or calling ``server.response(meta, pairs)``).

A request handle that raises fails that request only: the worker's ``wait`` raises
:class:`parallax.ps.HandleError` naming the server, its key range and the exception.
Checkpoints (``KVStore.save``) hold the server table only, so a request handle's own store
is not saved.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class KVMeta:
    """What a request handle learns about a request (PS-Lite's ``KVMeta``).

    Attributes:
      cmd: the integer the worker passed to ``push``/``pull`` (user commands included).
      push: the request carries values (a push, or the push half of ``push_pull``).
      pull: the request wants values back (a pull, or ``push_pull``).
      sender: the worker's rank; -1 for a ``KVStore.client()`` (PS-Lite: the node id).
      timestamp: the worker's timestamp of the request (what ``push``/``pull`` returned).
      customer_id: always 0: each ``KVWorker`` is one PS-Lite customer of one app.

    Example:
      >>> KVMeta(cmd=7, push=True, pull=False, sender=0, timestamp=3).cmd
      7

    References:
      PS-Lite, ``struct KVMeta`` (``include/ps/kv_app.h``).
    """

    cmd: int
    push: bool
    pull: bool
    sender: int
    timestamp: int
    customer_id: int = 0


@dataclasses.dataclass
class KVPairs:
    """Sorted keys, their values (flat, in key order) and optional lengths (PS-Lite's ``KVPairs``).

    Example:
      >>> pairs = KVPairs(np.array([1, 4], np.uint64), np.ones(4, np.float32))
      >>> pairs.key_lens().tolist()
      [2, 2]

    References:
      PS-Lite, ``struct KVPairs`` (``include/ps/kv_app.h``).
    """

    keys: np.ndarray
    vals: np.ndarray
    lens: np.ndarray | None = None

    def key_lens(self) -> np.ndarray:
        """Values per key: ``lens``, or the values split evenly over the keys."""
        if self.lens is not None:
            return np.asarray(self.lens, np.int64)
        if self.keys.size == 0:
            return np.zeros(0, np.int64)
        return np.full(self.keys.size, np.asarray(self.vals).size // self.keys.size, np.int64)


def is_request_handle(handle) -> bool:
    """True for a PS-Lite request handle: callable, without a simple handle's ``push``."""
    return callable(handle) and not callable(getattr(handle, "push", None))


@dataclasses.dataclass
class HandleFailure:
    """A handle's exception, returned (not raised) so the other servers' replies still land."""

    server: int
    begin: int
    end: int
    api: str
    error: BaseException
    trace: str
