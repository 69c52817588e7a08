"""Horovod's reduction ops and compression, as values.

``hvd.Average`` and ``hvd.Sum`` are the usual all-reduces, ``hvd.Adasum`` is adaptive
summation (:mod:`parallax.horovod.adasum`), ``hvd.Min``/``hvd.Max``/``hvd.Product`` the
element-wise ones. ``hvd.Compression.none|fp16|bf16`` says how floats travel (parallax.comm's
:class:`~parallax.comm.Compression`: cast on the wire, summed in float32).

Example:
  >>> import parallax.horovod as hvd
  >>> hvd.Average, hvd.Compression.fp16
  (<ReduceOp.Average: 'average'>, <Compression.fp16: 'fp16'>)
"""

from __future__ import annotations

import enum

from parallax.comm import Compression as _WireCompression


class ReduceOp(enum.Enum):
    """How an all-reduce combines the ranks' values (Horovod's ``hvd.Average`` & co.)."""

    Average = "average"
    Sum = "sum"
    Adasum = "adasum"
    Min = "min"
    Max = "max"
    Product = "product"


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product


class Compression:
    """Horovod's ``hvd.Compression``: ``none``, ``fp16`` (and ``bf16``) on the wire."""

    none = _WireCompression.none
    fp16 = _WireCompression.fp16
    bf16 = _WireCompression.bf16


def check_op(api: str, op) -> ReduceOp:
    """``op`` as a :class:`ReduceOp` (its name is accepted too), or a clear error."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        for member in ReduceOp:
            if op.lower() == member.value:
                return member
    raise ValueError(f"{api}: op={op!r} is not one of hvd.Average, hvd.Sum, hvd.Adasum, "
                     "hvd.Min, hvd.Max, hvd.Product.")


def check_compression(api: str, compression) -> _WireCompression:
    """``compression`` as parallax.comm's :class:`~parallax.comm.Compression`."""
    if compression is None:
        return _WireCompression.none
    if isinstance(compression, _WireCompression):
        return compression
    raise TypeError(f"{api}: compression={compression!r} is not hvd.Compression.none, "
                    "hvd.Compression.fp16 or hvd.Compression.bf16.")
