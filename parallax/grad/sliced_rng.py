"""Random draws in a step: one device's values, on every batch shard and micro-batch.

On one device, ``nnx.Dropout`` draws ``bernoulli(key, p, x.shape)`` over the whole batch
``[B, ...]``. Inside ``px.value_and_grad``'s ``shard_map`` each device sees only its rows
``[B / N, ...]``, and the same call would draw a different mask. JAX's threefry generator
(with ``jax_threefry_partitionable``, the default) gives element ``i`` of a draw the bits
``threefry(key, i)``, ``i`` the element's flat index in the whole array, and rows split
over the batch are contiguous blocks of that index. So a slice's bits are the threefry
bits of its own indices shifted by ``index * size``: this module wraps a key in a PRNG
implementation (:data:`SLICED`) whose key data carries the slice's ``index`` and its
``rows``, and whose ``random_bits`` adds that offset. Every ``jax.random`` function built
on the bits (``bernoulli``, ``uniform``, ``normal``...) then returns one device's values,
sliced, at the cost of a local draw: nothing of the global draw is computed or sent.

The rule for which draws are sliced: a draw whose leading dimension is the slice's number
of rows is a slice of one device's draw over the batch; any other draw (a mask broadcast
over the batch, a draw of shape ``[D]``) is the same on every shard, as on one device. A
draw of a non-batch shape whose leading dimension happens to equal the rows would be
sliced too: pass ``rng="per_shard"`` (independent streams, any shape, any PRNG
implementation) if a model draws such shapes.

Example:
  >>> import jax, jax.numpy as jnp
  >>> key = jax.random.key(0)
  >>> whole = jax.random.bernoulli(key, 0.5, (8, 3))
  >>> parts = [jax.random.bernoulli(sliced_key(key, i, 2), 0.5, (2, 3)) for i in range(4)]
  >>> bool((jnp.concatenate(parts) == whole).all())
  True

References:
  Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3", SC 2011 (counter-based
  generators: threefry). JAX's ``jax_threefry_partitionable`` design note (a draw's bits
  do not depend on how it is sharded).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.extend.random as jex_random
import jax.numpy as jnp
from jax import lax

_THREEFRY = jex_random.threefry_prng_impl
_U32 = jnp.uint32


class Position(NamedTuple):
    """Which slice of one device's batch a computation covers: block ``index`` of ``count``.

    ``index`` may be traced (``lax.axis_index`` inside ``shard_map``, a scan counter);
    ``count`` is static.
    """

    index: jax.Array | int
    count: int

    def refine(self, sub: jax.Array | int, parts: int) -> Position:
        """Block ``sub`` of ``parts`` inside this block (a micro-batch of a shard)."""
        return Position(self.index * parts + sub, self.count * parts)


WHOLE = Position(0, 1)


def _mul_64(index: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    """``index * size`` as (high, low) uint32 words, exactly (``size`` static)."""
    i0, i1 = index & 0xFFFF, index >> 16
    s_lo, s_hi = size & 0xFFFFFFFF, size >> 32
    s0, s1 = _U32(s_lo & 0xFFFF), _U32(s_lo >> 16)
    p00, p01, p10, p11 = i0 * s0, i0 * s1, i1 * s0, i1 * s1
    mid = p01 + p10
    mid_carry = (mid < p01).astype(_U32)
    lo = p00 + (mid << 16)
    carry = (lo < p00).astype(_U32)
    hi = p11 + (mid >> 16) + (mid_carry << 16) + carry + index * _U32(s_hi)
    return hi, lo


def _sliced_bits(key_data: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
    k1, k2, index, rows = key_data[0], key_data[1], key_data[2], key_data[3]
    size = math.prod(shape)
    if size >= 2**32:
        raise ValueError(
            f"px.value_and_grad(rng='global'): a random draw of shape {shape} has {size} "
            "elements on one batch slice; one device's draws are reproduced on a slice with "
            "32-bit counters, so fewer than 2**32 per draw. Pass rng='per_shard' to "
            "px.value_and_grad (independent streams per shard).")
    local = lax.iota(_U32, size).reshape(shape) if shape else jnp.zeros((), _U32)
    if shape:
        hit = rows == _U32(shape[0])
        hi, lo = _mul_64(jnp.where(hit, index, _U32(0)), size)
    else:
        hi, lo = _U32(0), _U32(0)
    counts_lo = local + lo
    counts_hi = jnp.broadcast_to(hi + (counts_lo < local).astype(_U32), shape)
    bits1, bits2 = jex_random.threefry2x32_p.bind(k1, k2, counts_hi, counts_lo)
    bits = bits1 ^ bits2
    if bit_width == 32:
        return bits
    if bit_width == 64:  # as threefry: the two words side by side (needs jax_enable_x64)
        wide = jnp.dtype(f"uint{bit_width}")
        return (lax.convert_element_type(bits1, wide) << 32) | lax.convert_element_type(
            bits2, wide)
    return lax.convert_element_type(bits, jnp.dtype(f"uint{bit_width}"))


def _with_fields(threefry_data: jax.Array, fields: jax.Array) -> jax.Array:
    fields = jnp.broadcast_to(fields, threefry_data.shape[:-1] + (2,))
    return jnp.concatenate([threefry_data, fields], axis=-1)


def _seed(seed: jax.Array) -> jax.Array:
    return _with_fields(_THREEFRY.seed(seed), jnp.zeros(2, _U32))


def _split(key_data: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return _with_fields(_THREEFRY.split(key_data[:2], shape), key_data[2:])


def _fold_in(key_data: jax.Array, data) -> jax.Array:
    return _with_fields(_THREEFRY.fold_in(key_data[:2], data), key_data[2:])


_SLICED_NAME = "parallax_sliced_threefry"
#: threefry keys that know their batch slice: ``(k1, k2, index, rows)``.
SLICED = jex_random.define_prng_impl(
    key_shape=(4,), seed=_seed, split=_split, random_bits=_sliced_bits, fold_in=_fold_in,
    name=_SLICED_NAME, tag="px_slice")


def is_key(x) -> bool:
    """Whether ``x`` is a typed PRNG key array (``jax.random.key``)."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _impl_name(key) -> str:
    return str(jax.random.key_impl(key))


def is_sliced(key) -> bool:
    """Whether ``key`` is a :data:`SLICED` key."""
    return is_key(key) and jax.random.key_impl(key) == SLICED


def sliced_key(key: jax.Array, index, rows: int) -> jax.Array:
    """``key`` as a :data:`SLICED` key for block ``index`` of ``rows`` rows.

    Raises:
      TypeError: ``key`` is not a threefry key (rbg keys cannot be sliced).
    """
    if is_sliced(key):
        key = unsliced_key(key)
    if _impl_name(key) != _THREEFRY.name:
        raise TypeError(
            f"px.value_and_grad: a {_impl_name(key)} key cannot draw one device's values on "
            "a batch shard (only threefry keys can); create the model's nnx.Rngs with "
            "threefry keys (the default), or pass rng='per_shard' to px.value_and_grad.")
    data = jax.random.key_data(key)
    fields = jnp.stack([jnp.asarray(index, _U32), jnp.asarray(rows, _U32)])
    return jax.random.wrap_key_data(_with_fields(data, fields), impl=SLICED)


def unsliced_key(key: jax.Array) -> jax.Array:
    """The plain threefry key under a sliced one."""
    return jax.random.wrap_key_data(jax.random.key_data(key)[..., :2], impl=_THREEFRY)


def slice_keys(tree, position: Position, rows: int, mode: str):
    """Every key leaf of ``tree`` prepared for a slice of the batch.

    ``mode="global"``: sliced keys, so draws are one device's (see the module docstring);
    ``"per_shard"``: each key folded with the slice's index, an independent stream per
    slice. The whole batch (``position.count == 1``) needs neither.
    """
    if position.count == 1:
        return tree
    if mode == "per_shard":
        fold = lambda k: jax.random.fold_in(k, jnp.asarray(position.index, _U32))
        return jax.tree.map(lambda x: fold(x) if is_key(x) else x, tree)
    if not jax.config.jax_threefry_partitionable and any(map(is_key, jax.tree.leaves(tree))):
        raise ValueError(
            "px.value_and_grad: one device's random values on a batch shard need "
            "jax_threefry_partitionable (JAX's default), which is off; turn it on "
            "(jax.config.update('jax_threefry_partitionable', True)) or pass "
            "rng='per_shard' for independent streams per shard.")
    return jax.tree.map(
        lambda x: sliced_key(x, position.index, rows) if is_key(x) else x, tree)


def unslice_keys(tree):
    """Every sliced key leaf of ``tree`` back to a plain threefry key."""
    return jax.tree.map(lambda x: unsliced_key(x) if is_sliced(x) else x, tree)
