"""A ``ContextVar`` set for the length of a ``with`` block: parallax's one way to scope state.

The step context, the finite-check records and TF's replica and scope contexts are each a
``contextvars.ContextVar`` that a ``with`` block sets and restores, so nested and concurrent
(thread, asyncio) uses never see each other's values and no global is mutated.

Example:
  >>> import contextvars
  >>> depth = contextvars.ContextVar("depth", default=0)
  >>> with binding(depth, 1):
  ...     depth.get()
  1
  >>> depth.get()
  0
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def binding(var: contextvars.ContextVar, value: T) -> Iterator[T]:
    """Sets ``var`` to ``value`` inside the block, restores it after (also on error)."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)
