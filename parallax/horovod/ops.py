"""Horovod's reduction ops and compression, as values.

``hvd.Average`` and ``hvd.Sum`` are the usual all-reduces, ``hvd.Adasum`` is adaptive
summation (:mod:`parallax.horovod.adasum`), ``hvd.Min``/``hvd.Max``/``hvd.Product`` the
element-wise ones. ``hvd.Compression.none|fp16|bf16`` says how floats travel (parallax.comm's
:class:`~parallax.comm.Compression`: cast on the wire, summed in float32). Scaling and the
Average of integer tensors follow Horovod's arithmetic (:func:`scale`,
:func:`integer_average`).

Example:
  >>> import parallax.horovod as hvd
  >>> hvd.Average, hvd.Compression.fp16
  (<ReduceOp.Average: 'average'>, <Compression.fp16: 'fp16'>)
"""

from __future__ import annotations

import enum

import jax.numpy as jnp
import numpy as np
from jax import lax

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


def is_integer(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer)


def scale(x, factor: float):
    """``x * factor``; an integer tensor keeps its dtype, truncated toward zero, as Horovod's
    ``ScaleBuffer`` writes ``scale * x`` back into the integer buffer
    (horovod/common/ops/collective_operations.h, ``ScaleBufferCPUImpl``)."""
    if factor == 1.0:
        return x
    return (x * factor).astype(x.dtype) if is_integer(x.dtype) else x * factor


def integer_average(total, count: int, postscale: float = 1.0):
    """Horovod's Average of integers: ``sum * postscale / count`` truncated toward zero.

    Horovod's Average is a Sum whose postscale factor is divided by the set's size
    (horovod/common/ops/gloo_operations.cc and nccl_operations.cc), and the scaled sum is
    written back into the integer buffer, so the mean truncates toward zero
    (``[3, 31] / 2 -> [1, 15]``, ``-3 / 2 -> -1``; ROCm builds divide in the framework
    with ``floor_divide`` instead, horovod/torch/mpi_ops_v2.cc ``DivideInPlace``). With
    ``postscale == 1`` this is integer division, exact: Horovod's own test averages equal
    integer tensors back to themselves (test_torch.py ``test_horovod_allreduce_average``).

    Example:
      >>> import jax.numpy as jnp
      >>> integer_average(jnp.array([3, 31, -3], jnp.int32), 2).tolist()
      [1, 15, -1]
    """
    if postscale == 1.0:
        return lax.div(total, jnp.asarray(count, total.dtype))
    return (total * (postscale / count)).astype(total.dtype)


def check_average_dtype(api: str, op: ReduceOp, dtype) -> None:
    if op is ReduceOp.Average and not (jnp.issubdtype(dtype, jnp.inexact) or is_integer(dtype)):
        raise TypeError(f"{api}: op=hvd.Average of a {np.dtype(dtype).name} tensor; Horovod "
                        "scales the sum of numbers only (its ScaleBuffer has no case for it). "
                        "Use op=hvd.Sum, or cast to an integer or float dtype.")
