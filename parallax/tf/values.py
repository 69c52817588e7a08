"""Distributed values: per-replica, mirrored, and how sync-on-read variables aggregate.

TensorFlow keeps one component per device: a ``PerReplica`` value holds different data on
each replica (a slice of the batch, a per-replica loss), a ``Mirrored`` value holds the same
data on every replica (a variable created under ``strategy.scope()``), and a sync-on-read
variable keeps its own component on each replica and aggregates them when read (metrics,
BatchNorm moving statistics).

In JAX these are global arrays on the strategy's mesh, so nothing here copies data:

* :class:`PerReplica` is one array whose leading dimension indexes the replicas
  (``[num_replicas, *local_shape]``), sharded over the replica axes: each device holds exactly
  its own component.
* :class:`Mirrored` is a replicated array (every device holds the whole value). Arrays and
  NNX variables created under ``strategy.scope()`` are mirrored without being wrapped; the
  class marks a value the replica function returns as equal on every replica.
* Sync-on-read is a property of an NNX variable, read by :func:`aggregation_of`: its
  ``aggregation`` metadata (``nnx.BatchStat(x, aggregation="sum")``), else a default by type
  (``BatchStat``: MEAN, like TF's BatchNorm moving statistics; ``MetricState``: SUM, like
  TF's metrics' totals and counts; ``Intermediate``: ONLY_FIRST_REPLICA; everything else,
  parameters and optimizer state included: NONE, i.e. mirrored).

References:
  TensorFlow ``tf.distribute``: ``values.PerReplica``, ``values.Mirrored``,
  ``SyncOnReadVariable``, ``tf.VariableAggregation``.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
from flax import nnx
from flax.nnx.training.metrics import MetricState


class VariableAggregation(enum.Enum):
    """How the replicas' components of a variable combine when it leaves ``strategy.run``.

    Members:
      NONE: mirrored: every replica must write the same value (parameters, optimizer state).
      SUM: the components add up (metric totals and counts).
      MEAN: their mean (BatchNorm moving statistics).
      ONLY_FIRST_REPLICA: the first replica's component.

    Example:
      >>> VariableAggregation["SUM"]
      <VariableAggregation.SUM: 'SUM'>

    References:
      TensorFlow, ``tf.VariableAggregation``.
    """

    NONE = "NONE"
    SUM = "SUM"
    MEAN = "MEAN"
    ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"


_DEFAULTS = (
    (nnx.BatchStat, VariableAggregation.MEAN),
    (MetricState, VariableAggregation.SUM),
    (nnx.Intermediate, VariableAggregation.ONLY_FIRST_REPLICA),
)


def aggregation_of(variable: nnx.Variable) -> VariableAggregation:
    """How ``strategy.run`` aggregates ``variable``'s per-replica components.

    Args:
      variable: an NNX variable.

    Returns:
      Its ``aggregation`` metadata (a :class:`VariableAggregation` or its name, any case)
      when set, else the default of its type (see the module docstring).

    Raises:
      ValueError: unknown ``aggregation`` metadata.

    Example:
      >>> import jax.numpy as jnp
      >>> aggregation_of(nnx.BatchStat(jnp.zeros(3)))
      <VariableAggregation.MEAN: 'MEAN'>
      >>> aggregation_of(nnx.Param(jnp.zeros(3)))
      <VariableAggregation.NONE: 'NONE'>
      >>> aggregation_of(nnx.Variable(jnp.zeros(3), aggregation="sum"))
      <VariableAggregation.SUM: 'SUM'>

    References:
      TensorFlow, ``tf.Variable(synchronization=ON_READ, aggregation=...)``.
    """
    declared = variable.get_metadata().get("aggregation")
    if declared is not None:
        if isinstance(declared, VariableAggregation):
            return declared
        try:
            return VariableAggregation[str(declared).upper()]
        except KeyError:
            raise ValueError(
                f"px.tf: a {type(variable).__name__} has aggregation={declared!r}; use one of "
                f"{[a.name for a in VariableAggregation]} (px.tf.VariableAggregation)."
            ) from None
    for kind, aggregation in _DEFAULTS:
        if isinstance(variable, kind):
            return aggregation
    return VariableAggregation.NONE


def _local_components(array, rows=None) -> tuple:
    """The components of ``array`` this process holds, one per device, in replica order.

    With ``rows`` (a padded partial batch), component ``i`` is cut to its ``rows[i]`` real rows.
    """
    if isinstance(array, jax.core.Tracer) or not hasattr(array, "addressable_shards"):
        parts = [(i, array[i]) for i in range(array.shape[0])]
    else:
        shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
        parts = [(s.index[0].start or 0, s.data[0]) for s in shards]
    return tuple(x if rows is None else x[:rows[i]] for i, x in parts)


@dataclasses.dataclass(frozen=True)
class PerReplica:
    """A value with one component per replica (TF's ``PerReplica``).

    Attributes:
      stacked: ``[num_replicas, *local_shape]``; component ``i`` is ``stacked[i]``, held by
        replica ``i``'s device (sharded over the strategy's replica axes).
      strategy: the strategy whose replicas hold it (static: part of a jit signature).
      rows: ``None``, or for a batch split unevenly (a partial last batch, TensorFlow's
        split: :mod:`parallax.tf.input.partial_batches`) the real rows of each replica's component;
        ``stacked`` holds them padded with zero rows to the largest count (static).

    Made by ``strategy.run`` (what the replica function returns), by the distributed
    datasets and by ``strategy.experimental_distribute_values_from_function``; inside
    ``run`` each replica sees its own component.

    Example:
      >>> import parallax as px
      >>> strategy = px.tf.MirroredStrategy()
      >>> v = strategy.experimental_distribute_values_from_function(
      ...     lambda ctx: ctx.replica_id_in_sync_group * 1.0)
      >>> [float(x) for x in v.values]
      [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]

    References:
      TensorFlow, ``tf.distribute.DistributedValues`` / ``PerReplica``.
    """

    stacked: Any
    strategy: Any
    rows: tuple[int, ...] | None = None

    @property
    def values(self) -> tuple:
        """The components this process holds, in replica order (each on its device).

        A padded component is cut to its real rows, so components may differ in length (and
        be empty), as TensorFlow's do.
        """
        return _local_components(self.stacked, self.rows)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of one component (padded: the largest replica's rows)."""
        return tuple(self.stacked.shape[1:])

    @property
    def dtype(self):
        """The components' dtype."""
        return self.stacked.dtype

    def __repr__(self) -> str:
        rows = "" if self.rows is None else f", rows={self.rows}"
        return (f"PerReplica(shape={self.shape}, dtype={self.dtype}, "
                f"num_replicas={self.stacked.shape[0]}{rows})")


@dataclasses.dataclass(frozen=True)
class Mirrored:
    """A value equal on every replica (TF's ``Mirrored``), held as a replicated array.

    Attributes:
      value: the array (replicated on the strategy's devices).
      strategy: the strategy whose replicas hold it (static).

    Returned by ``strategy.run`` for what the replica function wraps as
    ``px.tf.Mirrored(x)`` (a promise that ``x`` is equal everywhere, e.g. the result of an
    all-reduce: it is kept once per device instead of stacked), and passed to every replica
    unchanged.

    Example:
      >>> import jax.numpy as jnp, parallax as px
      >>> strategy = px.tf.MirroredStrategy()
      >>> m = strategy.run(lambda: px.tf.Mirrored(jnp.ones(2)))
      >>> m.value.tolist(), len(m.values)
      ([1.0, 1.0], 8)

    References:
      TensorFlow, ``tf.distribute.DistributedValues`` / ``Mirrored``.
    """

    value: Any
    strategy: Any = None

    @property
    def values(self) -> tuple:
        """One copy per device of this process, in replica order."""
        if isinstance(self.value, jax.core.Tracer) or not hasattr(self.value,
                                                                   "addressable_shards"):
            return (self.value,)
        return tuple(s.data for s in self.value.addressable_shards)

    def __repr__(self) -> str:
        return f"Mirrored(shape={tuple(self.value.shape)}, dtype={self.value.dtype})"


jax.tree_util.register_dataclass(PerReplica, data_fields=["stacked"],
                                 meta_fields=["strategy", "rows"])
jax.tree_util.register_dataclass(Mirrored, data_fields=["value"], meta_fields=["strategy"])
