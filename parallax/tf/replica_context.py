"""Where code runs: inside one replica (``strategy.run``) or across replicas (``scope()``).

TensorFlow code asks ``tf.distribute.get_replica_context()`` which replica it is and reduces
across replicas through it. Here ``strategy.run`` traces the replica function once, inside
a ``shard_map`` over the replica axes, with a :class:`ReplicaContext` active; its
``replica_id_in_sync_group`` is ``lax.axis_index`` (a traced value, different on every
device) and ``all_reduce`` is the strategy's cross-device op. Outside any strategy a default
context with one replica is returned, so the same replica function runs on one device
unchanged (its all-reduces are identities), as in TensorFlow.

Both contexts are scoped with ``contextvars`` (set on entry, restored on exit), never module
globals that outlive the ``with`` block.

References:
  TensorFlow, ``tf.distribute.ReplicaContext``, ``get_replica_context``,
  ``in_cross_replica_context``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from parallax.context import binding
from parallax.tf.merge_call import unwrap, wrap
from parallax.tf.reduce_op import as_reduce_op


@dataclasses.dataclass(frozen=True)
class ReplicaContext:
    """The replica a traced function runs as, and its collectives.

    Attributes:
      strategy: the strategy running the replica (None for the default context).
      num_replicas_in_sync: how many replicas run the function together.
      replica_axes: the mesh axes that index the replicas (``()`` outside ``run``).
      batch_rows: ``None``, or when ``run``'s batch is split unevenly over the replicas (a
        partial last batch, :mod:`parallax.tf.input.partial_batches`) each replica's real rows;
        the batch every replica sees is then padded with zero rows to ``max(batch_rows)``.
      reads: records that the replica function asked which rows are real (``run`` refuses a
        padded batch whose rows nobody masked); not part of equality.

    Example:
      >>> ctx = get_replica_context()          # no strategy: one replica
      >>> ctx.num_replicas_in_sync, int(ctx.replica_id_in_sync_group)
      (1, 0)
      >>> float(ctx.all_reduce("SUM", 3.0))
      3.0

    References:
      TensorFlow, ``tf.distribute.ReplicaContext``.
    """

    strategy: Any = None
    num_replicas_in_sync: int = 1
    replica_axes: tuple[str, ...] = ()
    batch_rows: tuple[int, ...] | None = None
    reads: list | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def replica_id_in_sync_group(self) -> jax.Array:
        """This replica's index, ``0 .. num_replicas_in_sync - 1`` (traced inside ``run``)."""
        if not self.replica_axes:
            return jnp.int32(0)
        return lax.axis_index(self.replica_axes)

    def num_examples(self, rows: int) -> jax.Array | int:
        """This replica's real examples in a per-replica batch of ``rows`` rows.

        TensorFlow's replicas see batches of their own length; here a partial last batch is
        padded (:mod:`parallax.tf.input.partial_batches`), and this is the length TF's would have.

        Args:
          rows: the leading dimension of a per-replica batch (or of per-example values).

        Returns:
          ``rows`` when the batch is not padded, else this replica's count (traced).

        Raises:
          ValueError: ``rows`` is not the padded batch's length.
        """
        if self.batch_rows is None:
            return rows
        width = max(self.batch_rows)
        if rows != width:
            raise ValueError(
                f"px.tf.ReplicaContext: a value with {rows} rows, but this step's per-replica "
                f"batch is padded to {width} rows (the replicas hold {list(self.batch_rows)} "
                "real rows: a partial last batch); pass one value per example of the batch, "
                f"shape [{width}, ...].")
        if self.reads is not None:
            self.reads.append(rows)
        return jnp.asarray(self.batch_rows, jnp.int32)[self.replica_id_in_sync_group]

    def example_mask(self, rows: int) -> jax.Array:
        """Which of the ``rows`` rows of this replica's batch are real examples (not padding).

        Args:
          rows: the leading dimension of a per-replica batch.

        Returns:
          A ``bool[rows]`` array: all True unless ``run``'s batch is a padded partial batch.

        Example:
          >>> get_replica_context().example_mask(3).tolist()
          [True, True, True]
        """
        return jnp.arange(rows) < self.num_examples(rows)

    def all_reduce(self, reduce_op, value):
        """Reduces ``value`` (a pytree of arrays) across the replicas; all get the result.

        Args:
          reduce_op: ``px.tf.ReduceOp.SUM`` or ``MEAN`` (or their names).
          value: this replica's pytree of arrays.

        Returns:
          The reduction, same structure, on every replica, computed by the strategy's
          cross-device op (``strategy.cross_device_ops``).
        """
        op = as_reduce_op("px.tf.ReplicaContext.all_reduce", reduce_op)
        leaves, treedef = jax.tree.flatten(value)
        leaves = [jnp.asarray(v) for v in leaves]
        if not self.replica_axes or not leaves:
            return jax.tree.unflatten(treedef, leaves)
        ops = self.strategy.cross_device_ops
        reduced = ops.all_reduce(leaves, self.replica_axes, op, self.strategy.mesh)
        return jax.tree.unflatten(treedef, reduced)

    def all_gather(self, value, axis: int):
        """Concatenates every replica's ``value`` along ``axis`` (replica order).

        Args:
          value: this replica's pytree of arrays (each of rank >= 1).
          axis: the dimension to concatenate along.

        Returns:
          The gathered pytree, the same on every replica.
        """
        if not self.replica_axes:
            return jax.tree.map(jnp.asarray, value)
        return jax.tree.map(
            lambda v: lax.all_gather(jnp.asarray(v), self.replica_axes, axis=axis, tiled=True),
            value)

    def merge_call(self, merge_fn, args=(), kwargs=None):
        """Runs ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context.

        Each array in ``args`` / ``kwargs`` reaches ``merge_fn`` as a per-replica value (the
        replicas' values together, as TensorFlow's ``PerReplica``); the strategy's
        cross-replica calls on it (``reduce``, ``gather``, ``experimental_local_results``,
        ``extended.reduce_to`` / ``batch_reduce_to`` / ``update``) are collectives over the
        replicas. The result comes back unwrapped: a per-replica value as this replica's
        component, a reduced (``Mirrored``) one as the common value
        (:mod:`parallax.tf.merge_call`).

        Args:
          merge_fn: ``merge_fn(strategy, *args, **kwargs)``.
          args: positional arguments (a tuple or list).
          kwargs: keyword arguments.

        Returns:
          ``merge_fn``'s result, unwrapped for this replica.

        Example:
          >>> import jax.numpy as jnp, parallax as px
          >>> strategy = px.tf.MirroredStrategy()
          >>> def replica_fn():
          ...     ctx = px.tf.get_replica_context()
          ...     x = ctx.replica_id_in_sync_group.astype(jnp.float32)
          ...     return ctx.merge_call(lambda s, v: s.reduce("SUM", v, axis=None), args=(x,))
          >>> strategy.run(replica_fn).values[5]           # 0 + 1 + ... + 7 on every replica
          Array(28., dtype=float32)

        References:
          TensorFlow, ``tf.distribute.ReplicaContext.merge_call``.
        """
        api = "px.tf.ReplicaContext.merge_call"
        kwargs = check_call(api, "merge_fn", "as merge_fn(strategy, *args, **kwargs)",
                            merge_fn, args, kwargs)
        if self.strategy is None:
            raise ValueError(
                f"{api}: called outside any strategy (the default replica context), where "
                "TensorFlow passes its default strategy; parallax has none to pass. Run the "
                "function under a strategy: px.tf.OneDeviceStrategy('cpu:0').run(fn) for one "
                "device.")
        args, kwargs = wrap(self, (tuple(args), kwargs))
        with merging(self.strategy):
            return unwrap(merge_fn(self.strategy, *args, **kwargs))


def check_call(api: str, name: str, how: str, fn, args, kwargs) -> dict:
    """Checks a function and its ``args`` / ``kwargs`` (``run``, ``merge_call``).

    Returns:
      ``kwargs`` as a dict (``{}`` for None).
    """
    if not callable(fn):
        raise TypeError(f"{api}: {name} must be callable {how}; got "
                        f"{type(fn).__name__}: {fn!r}.")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"{api}: args must be a tuple or list of arguments; got "
                        f"{type(args).__name__} (wrap a single argument: args=(x,)).")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise TypeError(f"{api}: kwargs must be a dict of keyword arguments or None; got "
                        f"{type(kwargs).__name__}.")
    return kwargs


_DEFAULT = ReplicaContext()
_replica: contextvars.ContextVar[ReplicaContext | None] = contextvars.ContextVar(
    "parallax_tf_replica_context", default=None)
_scope: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "parallax_tf_strategy_scope", default=None)


def get_replica_context() -> ReplicaContext | None:
    """The current :class:`ReplicaContext`.

    Returns:
      Inside ``strategy.run``: the replica's context. Inside ``strategy.scope()`` but
      outside ``run`` (cross-replica context): ``None``. Outside any strategy: the default
      context (one replica).

    Example:
      >>> import parallax as px
      >>> strategy = px.tf.MirroredStrategy()
      >>> with strategy.scope():
      ...     print(get_replica_context())
      None
      >>> strategy.run(lambda: get_replica_context().replica_id_in_sync_group).values[3]
      Array(3, dtype=int32)

    References:
      TensorFlow, ``tf.distribute.get_replica_context``.
    """
    current = _replica.get()
    if current is not None:
        return current
    return None if _scope.get() is not None else _DEFAULT


def in_cross_replica_context() -> bool:
    """True inside ``strategy.scope()`` and outside ``strategy.run``.

    Example:
      >>> in_cross_replica_context()
      False
    """
    return _replica.get() is None and _scope.get() is not None


def current_scope():
    """The strategy whose ``scope()`` is active, or None."""
    return _scope.get()


@contextlib.contextmanager
def replica(context: ReplicaContext):
    """Makes ``context`` the replica context inside the ``with`` block (used by ``run``)."""
    with binding(_replica, context):
        yield context


@contextlib.contextmanager
def merging(strategy):
    """Cross-replica context inside a replica function (``merge_call``'s ``merge_fn``)."""
    with binding(_replica, None), binding(_scope, strategy):
        yield strategy


@contextlib.contextmanager
def cross_replica_scope(strategy):
    """Marks ``strategy``'s scope active inside the ``with`` block (used by ``scope()``)."""
    with binding(_scope, strategy):
        yield strategy

