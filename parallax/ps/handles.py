"""Server handles: what a server does with the values pushed to it.

A handle sees, for one request, the stored values of the pushed keys and the pushed values
(both flat, in key order) and returns the new stored values. Per-element state (an
optimizer's moments) lives beside the values: every leaf of the handle's state with the
values' shape is gathered and scattered with them, and the other leaves (a step count) are
shared by the whole server.

- :class:`SumHandle` is PS-Lite's ``KVServerDefaultHandle``: stored += pushed.
- :class:`parallax.ps.OptaxHandle` applies an optax optimizer to the pushed gradients: the
  classic parameter-server SGD, with the optimizer running where the parameters live.

PS-Lite's general form, a request handle called as ``handle(meta, data, server)`` for every
push and pull with any ``cmd``, is in :mod:`parallax.ps.request`.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

UPDATE = 0  # push cmd: hand the pushed values to the server's handle
ASSIGN = 1  # push cmd: set the stored values (and reset their per-element state)
ADD = 2  # push cmd: add the pushed values to the stored ones, whatever the handle (state kept)


class Handle(Protocol):
    """What a server calls on each push (``cmd=UPDATE``)."""

    def init(self, values: np.ndarray) -> Any:
        """The state for freshly stored ``values`` (a pytree; None for stateless handles)."""

    def push(self, stored: np.ndarray, pushed: np.ndarray, state: Any) -> tuple[np.ndarray, Any]:
        """(new stored values, new state) for the pushed keys' elements."""


class SumHandle:
    """Adds pushed values to the stored ones: PS-Lite's ``KVServerDefaultHandle``.

    A key pushed for the first time starts at zero, so after ``n`` pushes of ``v`` it holds
    ``n * v`` (PS-Lite's own test).

    Example:
      >>> stored = np.ones(3, np.float32)
      >>> SumHandle().push(stored, np.full(3, 2, np.float32), None)[0].tolist()
      [3.0, 3.0, 3.0]

    References:
      PS-Lite, ``KVServerDefaultHandle`` (``include/ps/kv_app.h``).
    """

    def init(self, values: np.ndarray) -> None:
        del values

    def push(self, stored: np.ndarray, pushed: np.ndarray, state: None) -> tuple[np.ndarray, None]:
        if stored.flags.writeable:  # a view of the store (or a gathered copy): add in place
            return np.add(stored, pushed, out=stored), state
        return stored + pushed, state

    def __eq__(self, other) -> bool:
        return type(other) is SumHandle

    def __hash__(self) -> int:
        return hash(SumHandle)

    def __repr__(self) -> str:
        return "SumHandle()"
