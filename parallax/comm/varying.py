"""Varying manual axes: which ``shard_map`` axes a value varies over, and casting to varying.

Under ``check_vma=True`` every value inside ``shard_map`` carries the set of manual mesh axes
it varies over. A constant (``jnp.zeros``) or a replicated input is *invariant*; a
``ppermute`` result or a batch slice is *varying*. Loop carries and ``switch`` branches must
agree, and autodiff of an invariant input inserts a ``psum`` of its gradient, so parallax
casts values to varying explicitly where it matters (``lax.pcast(..., to="varying")``).
"""

from __future__ import annotations

from collections.abc import Iterable

import jax
from jax import lax


def varying_axes(x) -> frozenset:
    """The manual mesh axes ``x`` varies over (empty outside ``shard_map``)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:  # jax 0.10 keeps it in manual_axis_type (mat)
        mat = getattr(aval, "manual_axis_type", None) or getattr(aval, "mat", None)
        vma = getattr(mat, "varying", None)
    return frozenset(vma or ())


def to_varying(x, axes: str | Iterable[str]):
    """``x`` cast to vary over ``axes``; a no-op for the axes it already varies over.

    Example:
      >>> import jax, jax.numpy as jnp, parallax as px
      >>> mesh = px.make_mesh(data=-1)
      >>> f = jax.shard_map(lambda x: to_varying(jnp.zeros(2), "data") + x, mesh=mesh,
      ...                   in_specs=jax.P("data"), out_specs=jax.P("data"))
      >>> f(jnp.ones(2 * jax.device_count())).shape[0] == 2 * jax.device_count()
      True
    """
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    have = varying_axes(x)
    missing = tuple(a for a in axes if a not in have)
    return lax.pcast(x, missing, to="varying") if missing else x
