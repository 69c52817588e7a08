"""The mesh and strategy in force while a parallax step is traced.

``px.train_step`` activates a :class:`StepContext` for the duration of tracing, so that code deep
inside a model (``px.constrain`` on an activation) and ``px.value_and_grad`` can see the mesh,
the strategy and which mesh axes are manual (inside ``shard_map``) without being passed them.
It is scoped like ``jax.set_mesh`` or ``nnx.logical_axis_rules``: a ``ContextVar`` set on entry
and restored on exit, never a module-level global that outlives the ``with`` block.

:func:`binding` is that scoping, parallax's one way to scope state: the step context, the
finite-check records and TF's replica and scope contexts are each a ``ContextVar`` that a
``with`` block sets and restores, so nested and concurrent (thread, asyncio) uses never see
each other's values.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import TypeVar

from jax.sharding import Mesh

from parallax.strategy import Strategy

T = TypeVar("T")


@contextlib.contextmanager
def binding(var: contextvars.ContextVar, value: T) -> Iterator[T]:
    """Sets ``var`` to ``value`` inside the block, restores it after (also on error).

    Example:
      >>> import contextvars
      >>> depth = contextvars.ContextVar("depth", default=0)
      >>> with binding(depth, 1):
      ...     depth.get()
      1
      >>> depth.get()
      0
    """
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a traced step runs under.

    Attributes:
      mesh: the device mesh.
      strategy: the (composed) strategy.
      manual_axes: mesh axes that are manual at this point of the trace (inside the
        ``shard_map`` that ``px.value_and_grad`` opens over the batch axes); sharding
        constraints must not name them.
      attention: the attention kernel the step asks for (``px.train_step(attention=...)``;
        ``"auto"``: per backend, :mod:`parallax.attention_kernel`).
    """

    mesh: Mesh
    strategy: Strategy
    manual_axes: frozenset[str] = frozenset()
    attention: str = "auto"


_current: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar(
    "parallax_step_context", default=None
)


def current() -> StepContext | None:
    """The active context, or None outside ``px.train_step`` (plain single-device code)."""
    return _current.get()


@contextlib.contextmanager
def activate(context: StepContext | None):
    """Makes ``context`` current inside the ``with`` block."""
    with binding(_current, context):
        yield context


@contextlib.contextmanager
def manual(axes):
    """Marks ``axes`` manual (inside a ``shard_map`` over them) for the ``with`` block."""
    outer = current()
    if outer is None:
        yield None
        return
    inner = dataclasses.replace(outer, manual_axes=outer.manual_axes | frozenset(axes))
    with activate(inner):
        yield inner
