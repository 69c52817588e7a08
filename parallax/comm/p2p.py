"""Point-to-point messages: ``send`` (any permutation) and ``shift`` (a ring step).

Both are ``lax.ppermute`` with validated ranks: the one primitive every ring and tree
algorithm of :mod:`parallax.comm` is built from. A device that receives nothing gets zeros.
bfloat16 goes as its 16-bit pattern (:func:`parallax.comm.compress.ppermute_wire`) so no
backend widens it on the wire.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parallax.comm import checks
from parallax.comm._chunks import ring_perm
from parallax.comm.compress import ppermute_wire


def send(x, axis, perm):
    """Point-to-point: device ``src`` sends ``x`` to ``dst`` for each pair in ``perm``.

    Args:
      x: an array or pytree of arrays.
      axis: a mesh axis name or a tuple of them.
      perm: ``(source, destination)`` rank pairs; each rank sends at most once and receives
        at most once.

    Returns:
      On each destination, what its source sent; zeros on devices that receive nothing.

    Example:
      >>> mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.jit(jax.shard_map(lambda v: send(v, "x", [(0, 3), (3, 0)]), mesh=mesh,
      ...                   in_specs=jax.P("x"), out_specs=jax.P("x")))
      >>> f(jnp.arange(4.0)).tolist()
      [3.0, 0.0, 0.0, 0.0]

    References:
      MPI-3.1, ``MPI_Sendrecv``; XLA ``CollectivePermute``.
    """
    api = "send"
    axis, n = checks.check_axis(api, axis)
    pairs = checks.check_perm(api, perm, axis, n)
    return jax.tree.map(lambda v: ppermute_wire(jnp.asarray(v), axis, pairs), x)


def shift(x, axis, offset: int = 1):
    """Ring shift: device ``i``'s ``x`` moves to device ``(i + offset) mod n``.

    Args:
      x: an array or pytree of arrays.
      axis: a mesh axis name or a tuple of them.
      offset: how far along the ring (negative: the other way).

    Returns:
      What device ``(i - offset) mod n`` had, on every device ``i``.

    Example:
      >>> mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.jit(jax.shard_map(lambda v: shift(v, "x"), mesh=mesh,
      ...                   in_specs=jax.P("x"), out_specs=jax.P("x")))
      >>> f(jnp.arange(4.0)).tolist()
      [3.0, 0.0, 1.0, 2.0]

    References:
      The step of every ring algorithm (Patarasuk & Yuan 2009).
    """
    api = "shift"
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"{api}: offset={offset!r} must be a Python int.")
    axis, n = checks.check_axis(api, axis)
    if offset % n == 0:
        return jax.tree.map(jnp.asarray, x)
    return jax.tree.map(lambda v: ppermute_wire(jnp.asarray(v), axis, ring_perm(n, offset)), x)
