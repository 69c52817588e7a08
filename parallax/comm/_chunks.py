"""Array plumbing for the point-to-point algorithms: chunks, padding, reductions, typing.

A ring or tree all-reduce flattens the local array, pads it with zeros to ``n * c`` elements
(``c = ceil(S / n)``) and works on ``n`` chunks of ``c``. Padding with zeros is safe for every
reduction: the reduction is element-wise across devices, so padded positions only ever meet
other padded positions, and they are cut off at the end.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

COMBINE = {"sum": lax.add, "mean": lax.add, "max": lax.max, "min": lax.min, "prod": lax.mul}


def finish(y, op: str, n: int):
    """Applies the last step of a reduction: ``mean`` divides by ``n`` (ints become floats,
    as ``lax.pmean`` does)."""
    return y / n if op == "mean" else y


def chunk_size(size: int, n: int) -> int:
    """``ceil(size / n)``: the elements each device owns after a reduce-scatter."""
    return max(1, math.ceil(size / n))


def split_flat(x, n: int, multiple: int = 1):
    """Flattens ``x`` and zero-pads it into ``n`` chunks: returns an ``[n, c]`` array.

    ``c`` is ``ceil(size / n)`` rounded up to a multiple of ``multiple`` (block sizes).
    """
    flat = jnp.ravel(x)
    c = chunk_size(flat.size, n)
    c = -(-c // multiple) * multiple
    return jnp.pad(flat, (0, n * c - flat.size)).reshape(n, c)


def join_flat(chunks, shape):
    """Inverse of :func:`split_flat`: drops the padding and restores ``shape``."""
    size = int(np.prod(shape, dtype=np.int64))
    return jnp.ravel(chunks)[:size].reshape(shape)


def split_dim(x, n: int, dim: int):
    """Moves ``dim`` to the front and zero-pads it to ``n * c``: returns ``[n, c, ...rest]``."""
    x = jnp.moveaxis(x, dim, 0)
    length = x.shape[0]
    c = chunk_size(length, n)
    pad = [(0, n * c - length)] + [(0, 0)] * (x.ndim - 1)
    return jnp.pad(x, pad).reshape((n, c) + x.shape[1:])


def take(chunks, index):
    """``chunks[index]`` for a traced index (a rank computed from ``axis_index``)."""
    return lax.dynamic_index_in_dim(chunks, index, axis=0, keepdims=False)


def put(chunks, value, index):
    """``chunks.at[index].set(value)`` for a traced index."""
    return lax.dynamic_update_index_in_dim(chunks, value.astype(chunks.dtype), index, axis=0)


def ring_perm(n: int, offset: int = 1) -> list[tuple[int, int]]:
    """The (source, destination) pairs of a ring shift by ``offset``."""
    return [(i, (i + offset) % n) for i in range(n)]
