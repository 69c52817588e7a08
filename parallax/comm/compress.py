"""Compression on the wire: send floats in 16 bits, accumulate in 32.

Gradients tolerate rounding far better than they tolerate waiting. Horovod's
``hvd.Compression.fp16`` casts each tensor to half precision before the all-reduce and back
after; the bytes on the wire halve. parallax does the same, with one rule that keeps results
replicated: every device rounds its *own* contribution exactly as it rounds what it sends, so
all devices compute bit-identical sums (otherwise partners in a tree would each add one exact
and one rounded value, and the copies of a parameter would drift apart).

Where the reduction happens matters:

* ``algorithm="ring"`` / ``"tree"`` (point-to-point): each step sends the wire dtype and
  adds in float32 (or the input dtype when wider). The bytes on the wire halve on every
  backend; ``tests/comm/test_hlo.py`` checks it in the compiled program.
* ``algorithm="xla"``: the array is cast to the wire dtype and ``lax.psum`` reduces it in that
  dtype on GPU/TPU. The CPU backend promotes a bf16/fp16 all-reduce to float32 on the wire
  (a convert before and after the ``all-reduce``), so there it saves nothing.

Integer and boolean leaves are never cast.

bfloat16 travels as its 16-bit pattern (``uint16``), see :func:`ppermute_wire`: the CPU
backend's float normalisation otherwise widens every bf16 ``collective-permute`` to f32
(measured with jax 0.10.2; fp16 is left alone there).

For 4x fewer bytes, see :func:`parallax.comm.quantized_all_reduce` (blockwise int8).
"""

from __future__ import annotations

import enum
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax


class Compression(enum.Enum):
    """How floating-point values travel: ``none``, ``bf16`` or ``fp16``.

    Example:
      >>> from parallax.comm import Compression
      >>> Compression.bf16.wire_dtype(jnp.float32)
      dtype(bfloat16)
      >>> Compression.none.wire_dtype(jnp.float32)
      dtype('float32')

    References:
      Horovod ``hvd.Compression.fp16`` (Sergeev & Del Balso 2018); Micikevicius et al. 2018,
      "Mixed Precision Training" (why float32 accumulation matters).
    """

    none = "none"
    bf16 = "bf16"
    fp16 = "fp16"

    def wire_dtype(self, dtype) -> jnp.dtype:
        """The dtype on the wire for an array of ``dtype`` (unchanged for non-floats)."""
        dtype = jnp.dtype(dtype)
        if self is Compression.none or not jnp.issubdtype(dtype, jnp.floating):
            return dtype
        wire = jnp.dtype(jnp.bfloat16 if self is Compression.bf16 else jnp.float16)
        return wire if wire.itemsize < dtype.itemsize else dtype

    def accumulate_dtype(self, dtype) -> jnp.dtype:
        """The dtype sums are kept in: float32 (or wider) when compressing floats."""
        dtype = jnp.dtype(dtype)
        if self is Compression.none or not jnp.issubdtype(dtype, jnp.floating):
            return dtype
        return jnp.promote_types(dtype, jnp.float32)


def as_compression(api: str, compression) -> Compression:
    """Accepts a :class:`Compression`, its name (``"bf16"``) or ``None`` (no compression)."""
    if compression is None:
        return Compression.none
    if isinstance(compression, Compression):
        return compression
    try:
        return Compression(compression)
    except ValueError:
        raise ValueError(
            f"{api}: compression={compression!r} is not one of Compression.none, "
            "Compression.bf16, Compression.fp16 (or the strings 'none', 'bf16', 'fp16')."
        ) from None


class Wire:
    """The two casts of one leaf: to the wire dtype before a send, to the sum dtype after."""

    def __init__(self, compression: Compression, dtype):
        self.wire = compression.wire_dtype(dtype)
        self.acc = compression.accumulate_dtype(dtype)

    def send(self, x):
        return x.astype(self.wire)

    def recv(self, x):
        return x.astype(self.acc)

    def round(self, x):
        """What ``x`` becomes after one trip over the wire (applied to own contributions)."""
        return self.recv(self.send(x))


def ppermute_wire(x, axis, perm):
    """``lax.ppermute`` that keeps bfloat16 16 bits wide on the wire on every backend.

    A bf16 array is bit-cast to ``uint16``, permuted and bit-cast back: the same bytes, but
    no backend can promote them (XLA's CPU ``float-normalization-bf16`` pass turns a bf16
    ``collective-permute`` into an f32 one, doubling its bytes). Other dtypes go straight to
    ``lax.ppermute``. The gradient is the inverse permutation, sent the same way.

    Example:
      >>> mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.jit(jax.shard_map(lambda v: ppermute_wire(v, "x", [(0, 1), (1, 0)]),
      ...             mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x")))
      >>> f(jnp.array([1.0, 2.0], jnp.bfloat16)).tolist()
      [2.0, 1.0]
    """
    if x.dtype != jnp.bfloat16:
        return lax.ppermute(x, axis, list(perm))
    return _bf16_permute(x, axis, tuple(tuple(p) for p in perm))


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _bf16_permute(x, axis, perm):
    bits = lax.ppermute(lax.bitcast_convert_type(x, jnp.uint16), axis, list(perm))
    return lax.bitcast_convert_type(bits, jnp.bfloat16)


def _bf16_permute_fwd(x, axis, perm):
    return _bf16_permute(x, axis, perm), None


def _bf16_permute_bwd(axis, perm, _, ct):
    return (_bf16_permute(ct, axis, tuple((d, s) for s, d in perm)),)


_bf16_permute.defvjp(_bf16_permute_fwd, _bf16_permute_bwd)
