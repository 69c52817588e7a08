"""Checks shared by every ``parallax.comm`` function: axes, ops, roots, dims, algorithms.

Each check raises at trace time, before any collective is emitted, with a message that names
the API, the offending value, what is available (the mesh axes here and their sizes) and a fix.
``lax`` itself answers a wrong axis name with a bare ``AssertionError`` or ``NameError``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax import lax

Axis = str | tuple[str, ...]

OPS = ("sum", "mean", "max", "min", "prod")


def available_axes() -> dict[str, int]:
    """The manual mesh axes of the enclosing ``shard_map`` and their sizes ({} outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = getattr(mesh, "manual_axes", ()) or ()
    shape = dict(mesh.shape) if mesh.axis_names else {}
    return {name: shape[name] for name in mesh.axis_names if name in manual}


def _describe(axes: dict[str, int]) -> str:
    if not axes:
        return "none (not inside jax.shard_map)"
    return ", ".join(f"{name!r} (size {size})" for name, size in axes.items())


def check_axis(api: str, axis) -> tuple[Axis, int]:
    """Validates a mesh axis name (or tuple of names); returns it normalised and its size.

    Names bound by ``jax.vmap(..., axis_name=)`` are accepted too (``lax.axis_size`` knows them).
    """
    if isinstance(axis, list):
        axis = tuple(axis)
    names = axis if isinstance(axis, tuple) else (axis,)
    if not names or not all(isinstance(a, str) for a in names):
        raise TypeError(
            f"{api}: axis={axis!r} must be a mesh axis name (str) or a tuple of names, "
            f"e.g. axis='data'; the mesh axes here are {_describe(available_axes())}."
        )
    if len(set(names)) != len(names):
        raise ValueError(f"{api}: axis={axis!r} names an axis twice; name each axis once.")
    here = available_axes()
    sizes = []
    for name in names:
        if name in here:
            sizes.append(here[name])
            continue
        try:
            sizes.append(int(lax.axis_size(name)))
        except (NameError, KeyError, AssertionError, ValueError):
            fix = (
                f"pass one of {tuple(here)}" if here else
                f"call {api} inside jax.shard_map(f, mesh=mesh, in_specs=..., out_specs=...) "
                f"over a mesh that has an axis {name!r}"
            )
            raise ValueError(
                f"{api}: axis {name!r} is not a mesh axis here; the mesh axes available are "
                f"{_describe(here)}. Fix: {fix}."
            ) from None
    return (axis if isinstance(axis, tuple) else names[0]), math.prod(sizes)


def check_op(api: str, op: str, allowed: Sequence[str] = OPS) -> str:
    """Checks a reduction name against ``allowed``."""
    if op not in allowed:
        raise ValueError(
            f"{api}: op={op!r} is not supported; use one of {', '.join(map(repr, allowed))}."
        )
    return op


def check_choice(api: str, name: str, value, allowed: Sequence) -> None:
    """Checks a keyword that takes one of a few values (``algorithm=`` and the like)."""
    if value not in allowed:
        raise ValueError(
            f"{api}: {name}={value!r} is not one of {', '.join(map(repr, allowed))}."
        )


def check_root(api: str, root, axis: Axis, size: int) -> int:
    """Checks that ``root`` is a static rank on ``axis``."""
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TypeError(
            f"{api}: root={root!r} must be a Python int (a static rank on axis {axis!r}); "
            "a traced root is not supported."
        )
    if not 0 <= root < size:
        raise ValueError(
            f"{api}: root={root} is out of range for axis {axis!r} of size {size}; "
            f"use 0 <= root < {size}."
        )
    return int(root)


def check_dim(api: str, x, dim: int, what: str = "dim") -> int:
    """Normalises an array dimension (negative counts from the end)."""
    ndim = np.ndim(x)
    if not -ndim <= dim < ndim:
        raise ValueError(
            f"{api}: {what}={dim} is out of range for an array of shape {np.shape(x)} "
            f"(rank {ndim}); use -{ndim} <= {what} < {ndim}."
        )
    return dim % ndim


def check_divisible(api: str, x, dim: int, axis: Axis, size: int, fix: str) -> None:
    """Checks that dimension ``dim`` of ``x`` splits evenly over ``size`` devices."""
    length = np.shape(x)[dim]
    if length % size:
        raise ValueError(
            f"{api}: dimension {dim} of the array of shape {np.shape(x)} has length {length}, "
            f"which does not divide by the {size} devices of axis {axis!r}. Fix: {fix}."
        )


def check_perm(api: str, perm, axis: Axis, size: int) -> tuple[tuple[int, int], ...]:
    """Checks a point-to-point permutation: (source, destination) pairs, each rank once."""
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
    except (TypeError, ValueError):
        raise TypeError(
            f"{api}: perm={perm!r} must be a sequence of (source, destination) int pairs."
        ) from None
    for s, d in pairs:
        if not (0 <= s < size and 0 <= d < size):
            raise ValueError(
                f"{api}: pair ({s}, {d}) in perm is out of range for axis {axis!r} of size "
                f"{size}; ranks are 0..{size - 1}."
            )
    for role, ranks in (("source", [s for s, _ in pairs]), ("destination", [d for _, d in pairs])):
        if len(set(ranks)) != len(ranks):
            raise ValueError(
                f"{api}: a {role} appears twice in perm={list(pairs)}; each device may send "
                "once and receive once per call (split it into several calls)."
            )
    return pairs
