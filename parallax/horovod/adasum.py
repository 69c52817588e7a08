"""Adasum: adaptive summation of gradients (Maleki et al. 2020; Horovod's ``op=hvd.Adasum``).

Two gradients ``a`` and ``b`` combine as

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

which is ``a + b`` when they are orthogonal and their mean when they are parallel: each
keeps what the other does not already say. Many ranks combine recursively in pairs: rank
``r`` with rank ``r XOR 1``, then the pairs with their neighbours at distance 2, 4, ...
(recursive distance doubling), the lower ranks on the left, so ``2^k`` ranks need ``k``
rounds. A coefficient whose norm is below ``1e-8`` (a zero gradient) is 1, as in Horovod.
The dot products are per tensor (per leaf), never across a fused buffer, and accumulate in
float32 or wider.

Horovod exchanges halves of the vectors at each level (vector halving) and all-reduces the
partial dot products; here each round exchanges the whole vector with ``ppermute``, which
gives the same pairs and the same result with ``log2(n)`` full-size messages.

Example:
  >>> import jax.numpy as jnp
  >>> adasum_pair(jnp.array([1.0, 0.0]), jnp.array([0.0, 2.0])).tolist()   # orthogonal: sum
  [1.0, 2.0]
  >>> adasum_pair(jnp.array([2.0, 2.0]), jnp.array([2.0, 2.0])).tolist()   # parallel: mean
  [2.0, 2.0]

References:
  Maleki, Musuvathi, Mytkowicz, Saarikivi, Xu, Eksarevskiy, Ekanayake, Barsoum, "Scaling
  Distributed Training with Adaptive Summation", MLSys 2021 (arXiv:2006.02924, 2020);
  Horovod ``hvd.Adasum``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from parallax.comm import checks

NORM_FLOOR = 1e-8  # Horovod's threshold below which a squared norm counts as zero


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def adasum_pair(a: jax.Array, b: jax.Array) -> jax.Array:
    """Combines two gradients of one tensor by Adasum's rule (``a`` is the lower rank's).

    Args:
      a: the left operand.
      b: the right operand, same shape and dtype.

    Returns:
      ``(1 - a.b/(2|a|^2)) a + (1 - a.b/(2|b|^2)) b`` in ``a``'s dtype.
    """
    wide = jnp.promote_types(a.dtype, jnp.float32)
    a32, b32 = a.astype(wide), b.astype(wide)
    dot = jnp.sum(a32 * b32)
    a_norm, b_norm = jnp.sum(a32 * a32), jnp.sum(b32 * b32)
    a_coeff = jnp.where(a_norm >= NORM_FLOOR, 1 - dot / (2 * jnp.where(a_norm > 0, a_norm, 1)), 1)
    b_coeff = jnp.where(b_norm >= NORM_FLOOR, 1 - dot / (2 * jnp.where(b_norm > 0, b_norm, 1)), 1)
    return (a_coeff * a32 + b_coeff * b32).astype(a.dtype)


def adasum_stack(values: jax.Array) -> jax.Array:
    """Adasum of ``values[0], values[1], ...`` (a power of two of them), pairwise by levels.

    Example:
      >>> import jax.numpy as jnp
      >>> adasum_stack(jnp.eye(4)).tolist()          # four orthogonal vectors: their sum
      [1.0, 1.0, 1.0, 1.0]
    """
    count = values.shape[0]
    if not is_power_of_two(count):
        raise ValueError(f"hvd.Adasum: {count} ranks; Adasum combines a power of two of them "
                         "(as Horovod's); use 1, 2, 4, 8, ... processes.")
    while values.shape[0] > 1:
        values = jax.vmap(adasum_pair)(values[0::2], values[1::2])
    return values[0]


def adasum_all_reduce(x, axis):
    """Adasum over a mesh axis inside ``shard_map``: ``log2(n)`` rounds of ``ppermute``.

    Every device ends with the same value (both partners of a round compute the same pair in
    the same order). Works leaf by leaf on a pytree.

    Args:
      x: an array or pytree, the local value on each device.
      axis: the mesh axis (or tuple of axes) to reduce over; its size must be a power of two.

    Returns:
      The Adasum of the devices' values, on every device.

    Example:
      >>> import jax, jax.numpy as jnp, parallax as px
      >>> mesh = px.make_mesh(data=8)
      >>> f = jax.jit(jax.shard_map(lambda v: adasum_all_reduce(v[0], "data"), mesh=mesh,
      ...             in_specs=jax.P("data"), out_specs=jax.P(), check_vma=False))
      >>> f(jnp.eye(8)).tolist()                     # orthogonal: the sum
      [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    """
    axis, size = checks.check_axis("hvd.Adasum", axis)
    if not is_power_of_two(size):
        raise ValueError(f"hvd.Adasum: the axis {axis!r} has {size} devices; Adasum combines a "
                         "power of two of them (as Horovod's).")
    index = lax.axis_index(axis)

    def one(v):
        distance = 1
        while distance < size:
            other = lax.ppermute(v, axis, perm=[(i, i ^ distance) for i in range(size)])
            left = (index & distance) == 0
            v = adasum_pair(jnp.where(left, v, other), jnp.where(left, other, v))
            distance *= 2
        return v

    return jax.tree.map(one, x)
