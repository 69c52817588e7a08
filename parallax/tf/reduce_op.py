"""``ReduceOp``: how ``tf.distribute`` combines the values of several replicas.

TensorFlow has two: ``SUM`` and ``MEAN``. Every ``parallax.tf`` API that reduces
(``strategy.reduce``, ``ReplicaContext.all_reduce``, the cross-device ops) accepts the enum
member or its name (``"SUM"``, ``"mean"``), as TensorFlow does, and refuses anything else
with the list of valid values.
"""

from __future__ import annotations

import enum


class ReduceOp(enum.Enum):
    """How values from the replicas are combined.

    Members:
      SUM: add the values.
      MEAN: the arithmetic mean of the values.

    Example:
      >>> ReduceOp.SUM.value
      'SUM'
      >>> as_reduce_op("demo", "mean")
      <ReduceOp.MEAN: 'MEAN'>

    References:
      TensorFlow, ``tf.distribute.ReduceOp``.
    """

    SUM = "SUM"
    MEAN = "MEAN"


def as_reduce_op(api: str, op) -> ReduceOp:
    """``op`` as a :class:`ReduceOp`, or a clear error naming ``api``.

    Args:
      api: the public API that received ``op`` (for the message).
      op: a :class:`ReduceOp` or its name, any case.

    Returns:
      The :class:`ReduceOp`.

    Raises:
      TypeError: ``op`` is neither a ``ReduceOp`` nor a string.
      ValueError: an unknown name (``"MAX"``).

    Example:
      >>> as_reduce_op("demo", ReduceOp.SUM)
      <ReduceOp.SUM: 'SUM'>
    """
    if isinstance(op, ReduceOp):
        return op
    valid = "px.tf.ReduceOp.SUM or px.tf.ReduceOp.MEAN (or the strings 'SUM', 'MEAN')"
    if not isinstance(op, str):
        raise TypeError(f"{api}: reduce_op must be {valid}; got {type(op).__name__}: {op!r}.")
    try:
        return ReduceOp[op.upper()]
    except KeyError:
        raise ValueError(
            f"{api}: unknown ReduceOp {op!r}; use {valid}. tf.distribute has no MAX or MIN "
            "reduction: reduce inside strategy.run with jax.lax.pmax over "
            "strategy.replica_axes if you need one.") from None
