"""``strategy.extended``: the lower-level half of a ``tf.distribute`` strategy's API.

TensorFlow splits a strategy's API in two: what a training loop calls (``run``, ``reduce``,
``experimental_distribute_dataset``) and ``strategy.extended``, a ``StrategyExtended`` for
code that places and updates variables itself (Keras' optimizers, custom aggregation):
``reduce_to``, ``batch_reduce_to``, ``update``, the worker and parameter devices. Here every
mirrored variable is an array replicated over the strategy's devices, so a destination is
always "every replica", a reduction to it is the strategy's all-reduce, and an update runs
once in the program (the same on every replica).

References:
  TensorFlow, ``tf.distribute.StrategyExtended`` (``python/distribute/distribute_lib.py``,
  ``StrategyExtendedV2``; ``mirrored_strategy.py``, ``MirroredExtended``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import jax
from flax import nnx

from parallax.tf import cross_replica
from parallax.tf.merge_call import MergedValue
from parallax.tf.reduce_op import ReduceOp, as_reduce_op
from parallax.tf.values import Mirrored, PerReplica

_DESTINATIONS = (str, jax.Device, jax.Array, nnx.Variable, Mirrored, PerReplica, MergedValue)


class StrategyExtended:
    """``strategy.extended`` of a :mod:`parallax.tf` strategy.

    Example (a Keras-style update: reduce the gradients, then apply them once):
      >>> import jax.numpy as jnp, parallax as px
      >>> from flax import nnx
      >>> strategy = px.tf.MirroredStrategy()
      >>> with strategy.scope():
      ...     model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
      >>> def subtract(variable, delta):
      ...     variable[...] -= delta
      >>> def apply(s, bias, grad):
      ...     grad = s.extended.reduce_to("MEAN", grad, destinations=bias)
      ...     s.extended.update(bias, subtract, args=(grad,))
      >>> def replica_fn(model):
      ...     ctx = px.tf.get_replica_context()
      ...     grad = jnp.ones(1) * ctx.replica_id_in_sync_group   # this replica's gradient
      ...     ctx.merge_call(apply, args=(model.bias, grad))
      >>> _ = strategy.run(replica_fn, args=(model,))
      >>> model.bias[...].tolist()                                  # 0 - mean(0, ..., 7)
      [-3.5]

    References:
      TensorFlow, ``tf.distribute.StrategyExtended``.
    """

    def __init__(self, strategy):
        self._strategy = strategy

    def __repr__(self) -> str:
        return f"StrategyExtended({self._strategy!r})"

    @property
    def _api(self) -> str:
        return f"{self._strategy.API}.extended"

    # ----- devices and roles
    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The devices this process runs replicas on (TF: this worker's compute devices)."""
        here = jax.process_index()
        return tuple(str(d) for d in self._strategy.devices if d.process_index == here)

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Where variables live: every replica's device (a mirrored copy on each)."""
        return tuple(str(d) for d in self._strategy.devices)

    @property
    def experimental_require_static_shapes(self) -> bool:
        """True: one compiled XLA program needs static shapes (TF: True on TPUs only)."""
        return True

    @property
    def experimental_between_graph(self) -> bool:
        """True when each worker runs its own copy of the program (several processes)."""
        return jax.process_count() > 1

    @property
    def experimental_should_init(self) -> bool:
        """Whether this worker initialises variables: every worker does (identical values)."""
        return True

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker saves checkpoints: the chief (process 0), as in TensorFlow."""
        return jax.process_index() == 0

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker writes summaries: the chief (process 0)."""
        return jax.process_index() == 0

    def value_container(self, value):
        """The distributed value holding ``value``: a mirrored variable is its own."""
        return value

    def non_slot_devices(self, var_list) -> tuple[str, ...]:
        """Where non-slot variables (an optimizer's step) live: every replica's device."""
        del var_list
        return self.parameter_devices

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable):
        """Variables created inside go where ``colocate_with_variable`` is.

        Every variable created under ``scope()`` is already on every replica's device, so
        this only checks its argument.
        """
        self._check_destination("colocate_vars_with", "colocate_with_variable",
                                colocate_with_variable)
        yield

    # ----- reductions and updates
    def reduce_to(self, reduce_op, value, destinations, options=None):
        """Reduces a per-replica ``value`` across the replicas, to ``destinations``.

        Args:
          reduce_op: ``SUM`` or ``MEAN``.
          value: a per-replica value (``run``'s result, or a ``merge_call`` argument), a
            ``Mirrored`` value, or an array.
          destinations: where the result goes (a variable, a device name, a distributed
            value): for a mirrored strategy, every replica.
          options: ``None`` or ``px.tf.CommunicationOptions`` (hints only).

        Returns:
          A ``Mirrored`` value (the same on every replica).
        """
        self._check_destination("reduce_to", "destinations", destinations)
        del options
        reduced = self._strategy.reduce(reduce_op, value, axis=None)
        return jax.tree.map(lambda x: Mirrored(x, self._strategy), reduced)

    def batch_reduce_to(self, reduce_op, value_destination_pairs: Sequence, options=None):
        """``reduce_to`` of many values at once, in one call of the cross-device op.

        Inside ``merge_call`` the values go to the strategy's cross-device op together
        (one fused all-reduce where the op fuses), as TensorFlow batches them.

        Args:
          reduce_op: ``SUM`` or ``MEAN``.
          value_destination_pairs: ``[(value, destinations), ...]``.
          options: ``None`` or ``px.tf.CommunicationOptions``.

        Returns:
          A list of ``Mirrored`` values, in order.
        """
        api = f"{self._api}.batch_reduce_to"
        op = as_reduce_op(api, reduce_op)
        pairs = list(value_destination_pairs)
        for i, pair in enumerate(pairs):
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
                raise TypeError(f"{api}: value_destination_pairs[{i}] must be a "
                                f"(value, destinations) pair; got {type(pair).__name__}.")
            self._check_destination("batch_reduce_to", f"value_destination_pairs[{i}][1]",
                                    pair[1])
        merged = [v for v, _ in pairs if isinstance(v, MergedValue)]
        if merged and len(merged) == len(pairs):
            ctx = merged[0].context
            total = ctx.all_reduce("SUM", [v.component for v in merged])
            if op is ReduceOp.MEAN:
                total = [t / ctx.num_replicas_in_sync for t in total]
            return [Mirrored(t, self._strategy) for t in total]
        return [self.reduce_to(op, v, d, options) for v, d in pairs]

    def update(self, var, fn: Callable, args=(), kwargs=None, group: bool = True):
        """Runs ``fn(var, *args, **kwargs)`` to update a mirrored variable.

        As in TensorFlow, ``args`` and ``kwargs`` may hold mirrored values (unwrapped before
        the call) but no per-replica ones: reduce them first (``reduce_to``).

        Args:
          var: the variable (an ``nnx.Variable`` or an array created under ``scope()``).
          fn: ``fn(var, *args, **kwargs)``; it may assign ``var[...]`` and return values.
          args: positional arguments.
          kwargs: keyword arguments.
          group: ``True``: the results as ``Mirrored`` values; ``False``: as they are.

        Returns:
          ``fn``'s results.

        Raises:
          ValueError: a per-replica argument.
        """
        api = f"{self._api}.update"
        if not callable(fn):
            raise TypeError(f"{api}: fn must be callable as fn(var, *args, **kwargs); got "
                            f"{type(fn).__name__}.")
        kwargs = {} if kwargs is None else kwargs

        def plain(path, x):
            if isinstance(x, (PerReplica, MergedValue)):
                raise ValueError(
                    f"{api}: {jax.tree_util.keystr(path)} is a per-replica value; update "
                    "takes mirrored arguments only (TensorFlow refuses them too): reduce it "
                    "first, e.g. strategy.extended.reduce_to('SUM', value, destinations=var).")
            return x.value if isinstance(x, Mirrored) else x

        args, kwargs = jax.tree_util.tree_map_with_path(
            plain, (tuple(args), dict(kwargs)), is_leaf=cross_replica.is_distributed)
        result = fn(var, *args, **kwargs)
        if not group:
            return result
        return jax.tree.map(lambda x: Mirrored(x, self._strategy), result)

    def _check_destination(self, method: str, name: str, value) -> None:
        leaves = jax.tree.leaves(value, is_leaf=lambda x: isinstance(x, _DESTINATIONS))
        if value is None or not leaves or not all(isinstance(x, _DESTINATIONS) for x in leaves):
            raise TypeError(
                f"{self._api}.{method}: {name} must be a variable, an array, a device name "
                f"or a distributed value (where the result goes); got "
                f"{type(value).__name__}: {value!r}.")
