"""``px.train_step(..., check_finite=True)``: name the first non-finite value of a step.

A NaN loss says nothing about where it came from. With ``check_finite=True`` the step
records, while it is traced, one boolean per named value: every floating batch leaf, the
checks a model asks for (``require``: the reference GPT's token ids within the
vocabulary), the loss and every gradient leaf of each ``px.value_and_grad``. The step
returns them with its outputs, and the call raises naming the first one that failed, in
that order (a bad input explains a NaN loss, which explains NaN gradients). Off by
default: it reads the booleans back to the host after every call, which waits for the
step to finish.

Records are scoped like ``jax.set_mesh``: a ``ContextVar`` holds the list of the innermost
scope, and ``px.value_and_grad`` opens one inside the traced loss so that a model's
``require`` lands where its value can be returned (through the gradient's auxiliary
outputs, reduced over shards and micro-batches) rather than leaking out of a ``shard_map``.

A model calls it, so it sits with the other nouns a model uses (``activations``,
``attention``), below ``step/``, ``grad/`` and ``models/``, which all record into it.

Example:
  >>> import jax.numpy as jnp
  >>> with scope() as records:
  ...     record("loss", jnp.float32(jnp.nan))
  >>> first_failure({name: bool(ok) for name, ok in records})
  'loss'
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

import jax
import jax.numpy as jnp

from parallax.context import binding
from parallax.rules import readable_path

_records: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "parallax_finite_records", default=None)


def active() -> bool:
    """Whether a step with ``check_finite=True`` is being traced here."""
    return _records.get() is not None


@contextlib.contextmanager
def scope(enabled: bool = True):
    """Collects records made inside the block into a list of ``(name, ok)`` pairs.

    ``enabled=False`` suspends recording (inside a region whose values cannot leave it).
    """
    records: list = []
    with binding(_records, records if enabled else None):
        yield records


def all_finite(x) -> jax.Array:
    """True when every element of a floating array is finite (always for other dtypes)."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.isfinite(x).all()
    return jnp.bool_(True)


def record(name: str, tree) -> None:
    """Records whether every floating leaf of ``tree`` is finite, one record per leaf."""
    records = _records.get()
    if records is None:
        return
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    for path, leaf in leaves:
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.inexact):
            where = readable_path(path)
            records.append((f"{name}{where}", all_finite(leaf)))


def require(name: str, condition: Callable[[], jax.Array]) -> None:
    """Records ``condition()`` (a boolean scalar) under ``name`` when a step checks.

    ``condition`` is only called (and costs nothing otherwise) while a step with
    ``check_finite=True`` is traced.
    """
    records = _records.get()
    if records is not None:
        records.append((name, jnp.asarray(condition(), bool)))


def extend(records: list) -> None:
    """Adds already computed ``(name, ok)`` records to the current scope."""
    current = _records.get()
    if current is not None:
        current.extend(records)


def first_failure(report: dict) -> str | None:
    """The name of the first record that is False, in recording order."""
    for name, ok in report.items():
        if not ok:
            return name
    return None
