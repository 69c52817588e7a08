"""``MirroredStrategy``: synchronous data parallelism with TensorFlow's API, one SPMD program.

TensorFlow's ``tf.distribute.MirroredStrategy`` keeps a copy of every variable on each
device, runs the replica function on each device in its own thread, and all-reduces the
gradients. ``px.tf.MirroredStrategy`` keeps the API and replaces the threads with JAX's
single-program model: variables created under ``scope()`` are arrays replicated on the
strategy's mesh; ``run`` traces the replica function once and runs it in one compiled
``shard_map`` over the replica axes (see :mod:`parallax.tf.mirrored.replica_program`); values
that differ per replica are :class:`~parallax.tf.values.PerReplica` arrays sharded over
those axes. ``docs/tf.md`` maps every TensorFlow concept to its counterpart here.

References:
  TensorFlow, ``tf.distribute.MirroredStrategy`` and the guide "Custom training with
  tf.distribute.Strategy".

(Over 300 lines: TensorFlow's MirroredStrategy is one class with a wide public API; its
mechanisms live in replica_program, cross_replica and input.distributed.)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding

from parallax.tf import cross_replica
from parallax.tf.input import partial_batches
from parallax.tf.mirrored import divergence, replica_program
from parallax.tf.mirrored.cross_device_ops import CollectiveAllReduce, CrossDeviceOps
from parallax.tf.input.distributed import (
    DistributedDataset, DistributedDatasetsFromFunction, InputContext, ValueContext)
from parallax.tf.mirrored.extended import StrategyExtended
from parallax.tf.input.options import check_options
from parallax.tf.replica_context import check_call, cross_replica_scope, current_scope
from parallax.tf.values import Mirrored, PerReplica


def _resolve_devices(api: str, devices) -> tuple:
    available = jax.local_devices()
    if devices is None:
        return tuple(available)
    if isinstance(devices, (str, jax.Device)) or not isinstance(devices, Sequence):
        raise TypeError(f"{api}: devices must be a list of jax.Device, device ids or names "
                        f"such as 'cpu:0'; got {devices!r}.")
    names = {f"{d.platform}:{d.id}": d for d in available}
    by_id = {d.id: d for d in available}
    out = []
    for d in devices:
        key = d.lower().lstrip("/").replace("device:", "") if isinstance(d, str) else d
        found = (d if isinstance(d, jax.Device) and d in available else
                 names.get(key) if isinstance(d, str) else
                 by_id.get(d) if isinstance(d, int) and not isinstance(d, bool) else None)
        if found is None:
            raise ValueError(f"{api}: unknown device {d!r}; this process has "
                             f"{sorted(names)}.")
        out.append(found)
    if len(set(out)) != len(out) or not out:
        raise ValueError(f"{api}: devices={list(map(str, out))} must be distinct and not "
                         "empty.")
    return tuple(out)


class MirroredStrategy:
    """Synchronous training on the devices of one machine, with TF's ``tf.distribute`` API.

    Args:
      devices: the devices (``jax.Device``, ids, or names like ``"gpu:0"``); default:
        every local device.
      cross_device_ops: how gradients are all-reduced
        (:mod:`parallax.tf.mirrored.cross_device_ops`); default: ``CollectiveAllReduce()``,
        XLA's all-reduce, as ``px.DataParallel``.

    The strategy is an immutable value: equal devices and cross-device op compare equal.

    Example:
      >>> import jax.numpy as jnp, parallax as px
      >>> strategy = px.tf.MirroredStrategy()
      >>> batches = [{"x": jnp.arange(16.0)}]
      >>> for batch in strategy.experimental_distribute_dataset(batches):
      ...     per_replica = strategy.run(lambda b: jnp.sum(b["x"]), args=(batch,))
      ...     print(float(strategy.reduce("SUM", per_replica, axis=None)))
      120.0

    References:
      TensorFlow, ``tf.distribute.MirroredStrategy``.
    """

    API = "px.tf.MirroredStrategy"
    MULTI_WORKER = False  # TF refuses PER_REPLICA input on the multi-worker strategy

    def __init__(self, devices=None, cross_device_ops: CrossDeviceOps | None = None):
        api = self.API
        if cross_device_ops is None:
            cross_device_ops = CollectiveAllReduce()
        if not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(
                f"{api}: cross_device_ops must be a px.tf cross-device op (NcclAllReduce(), "
                "HierarchicalCopyAllReduce(), ReductionToOneDevice(), CollectiveAllReduce()); "
                f"got {type(cross_device_ops).__name__}.")
        self._devices = self._devices_for(devices)
        self._ops = cross_device_ops
        names, sizes = zip(*self._mesh_axes())
        grid = np.array(self._devices, dtype=object).reshape(sizes)
        self._mesh = Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))
        if hasattr(cross_device_ops, "root_index"):
            cross_device_ops.root_index(self._mesh)  # an unknown reduce_to_device fails here

    # Overridden by the multi-worker strategy: which devices, and how they form a mesh.
    def _devices_for(self, devices) -> tuple:
        return _resolve_devices(self.API, devices)

    def _mesh_axes(self) -> tuple[tuple[str, int], ...]:
        return self._ops.mesh_axes(len(self._devices))

    def __eq__(self, other) -> bool:
        return (type(other) is type(self) and other._devices == self._devices
                and other._ops == self._ops)

    def __hash__(self) -> int:
        return hash((type(self), self._devices, self._ops))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.num_replicas_in_sync} replicas on "
                f"{self._devices[0].platform}, cross_device_ops={self._ops!r})")

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run each step together."""
        return len(self._devices)

    @property
    def num_local_replicas(self) -> int:
        """Replicas on this process's devices."""
        return sum(d.process_index == jax.process_index() for d in self._devices)

    @property
    def devices(self) -> tuple:
        """The devices, in replica order."""
        return self._devices

    @property
    def extended(self) -> StrategyExtended:
        """The lower-level API (``reduce_to``, ``update``, devices): TF's ``extended``."""
        return StrategyExtended(self)

    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        """The all-reduce algorithm."""
        return self._ops

    @property
    def mesh(self) -> Mesh:
        """The replica mesh (axes :attr:`replica_axes`)."""
        return self._mesh

    @property
    def replica_axes(self) -> tuple[str, ...]:
        """The mesh axes that index the replicas (``('replica',)`` unless the op needs two)."""
        return tuple(self._mesh.axis_names)

    @property
    def batch_spec(self) -> jax.P:
        """The spec of a per-replica value's leading (replica) dimension."""
        axes = self.replica_axes
        return jax.P(axes if len(axes) > 1 else axes[0])

    @contextlib.contextmanager
    def scope(self):
        """Arrays and NNX objects created inside are mirrored (replicated on the devices).

        It sets the strategy's mesh (``jax.set_mesh``), so every array created in it is
        replicated over the replicas, and makes this the current strategy
        (``px.tf.get_replica_context()`` is None: cross-replica context).

        Raises:
          ValueError: inside the scope of a different strategy.

        Example:
          >>> import jax.numpy as jnp, parallax as px
          >>> strategy = px.tf.MirroredStrategy()
          >>> with strategy.scope():
          ...     weights = jnp.zeros(3)
          >>> weights.sharding.is_fully_replicated, len(weights.devices())
          (True, 8)
        """
        outer = current_scope()
        if outer is not None and outer != self:
            raise ValueError(f"{self.API}.scope: already inside the scope of {outer!r}; "
                             "one strategy at a time (leave the other scope first).")
        with jax.set_mesh(self._mesh), cross_replica_scope(self):
            yield self

    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None):
        """Runs ``fn(*args, **kwargs)`` on every replica, as one compiled program.

        Args:
          fn: the replica function. It sees its replica's component of each ``PerReplica``
            argument and the whole of every other array; NNX objects passed in are
            updated in place afterwards (mirrored variables must be written identically:
            all-reduce gradients with ``px.tf.get_replica_context().all_reduce``, as Keras'
            optimizers do; a mirrored variable written differently is refused).
          args: positional arguments (a tuple or list).
          kwargs: keyword arguments.

        Returns:
          What ``fn`` returns, each array as a ``PerReplica`` value (``Mirrored`` where
          ``fn`` wrapped it so).

        Raises:
          TypeError: ``fn`` is not callable, or an argument is not an array, NNX object,
            distributed value or hashable Python value.
          ValueError: an argument belongs to another strategy, the replicas wrote a
            mirrored variable differently (:mod:`parallax.tf.mirrored.divergence`), or the batch
            is a padded partial batch whose padding the function never masked
            (:func:`parallax.tf.input.partial_batches.refuse_unmasked`); the NNX objects
            then keep their values from before the call.

        Example:
          >>> import jax.numpy as jnp, optax, parallax as px
          >>> from flax import nnx
          >>> strategy = px.tf.MirroredStrategy()
          >>> with strategy.scope():
          ...     model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
          ...     optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
          >>> def step(model, optimizer, x):
          ...     loss, grads = nnx.value_and_grad(
          ...         lambda m: px.tf.compute_average_loss(m(x)[:, 0] ** 2))(model)
          ...     grads = px.tf.get_replica_context().all_reduce("SUM", grads)
          ...     optimizer.update(model, grads)
          ...     return loss
          >>> x = next(iter(strategy.experimental_distribute_dataset([jnp.ones((16, 2))])))
          >>> losses = strategy.run(step, args=(model, optimizer, x))
          >>> len(losses.values), int(optimizer.step[...])
          (8, 1)
        """
        api = f"{self.API}.run"
        kwargs = check_call(api, "fn", "(the replica function, e.g. train_step)", fn, args,
                            kwargs)
        sig, per_replica, broadcast, state, nodes = replica_program.signature_of(
            self, fn, args, kwargs, functools.partial(self._place, api))
        outputs, new_state, flags, facts = replica_program.replica_program(
            sig, per_replica, broadcast, state)
        partial_batches.refuse_unmasked(api, sig.batch_rows, facts.masked)
        if nodes:
            divergence.raise_if_diverged(api, nodes, replica_program.mirrored_leaves(sig),
                                             flags)
            nnx.update(nodes, jax.tree.unflatten(sig.state_treedef, new_state))
        return outputs

    def _another(self, api: str, where: str, what: str, other) -> ValueError:
        return ValueError(
            f"{api}: {where} is {what} of another strategy ({other}); this strategy is "
            f"{self!r} on {[str(d) for d in self._devices]}. A distributed value belongs to "
            "the strategy that made it: create it with this strategy (its "
            "experimental_distribute_dataset, run, or scope()), or bring it to the host "
            "first (experimental_local_results / reduce).")

    def _place(self, api: str, x, where: str):
        """``x``'s array, checked to live on this strategy's devices (replicated if on one)."""
        if isinstance(x, PerReplica):
            if x.strategy != self:
                raise self._another(api, where, "a PerReplica value", x.strategy)
            return x.stacked
        if isinstance(x, Mirrored):
            if x.strategy is not None and x.strategy != self:
                raise self._another(api, where, "a Mirrored value", x.strategy)
            x = x.value
        if isinstance(x, jax.core.Tracer):
            return x
        if isinstance(x, jax.Array) and x.sharding.device_set == set(self._devices):
            return x
        if isinstance(x, jax.Array) and len(x.sharding.device_set) > 1:
            devices = x.sharding.device_set
            raise self._another(api, where, f"an array on {len(devices)} devices "
                                f"{sorted(str(d) for d in devices)}",
                                "created under another strategy's scope or mesh")
        if jax.process_count() > 1:  # a one-device array reaches other processes via the host
            x = np.asarray(x)
        return jax.device_put(x, NamedSharding(self._mesh, jax.P()))

    def reduce(self, reduce_op, value, axis: int | None = None):
        """Reduces per-replica values across the replicas (and over ``axis`` of each).

        Args:
          reduce_op: ``px.tf.ReduceOp.SUM`` or ``MEAN`` (or their names).
          value: a ``PerReplica`` value (what ``run`` returned) or a pytree of them.
            ``Mirrored`` values and plain arrays are accepted with ``axis=None``: MEAN
            returns them, SUM of a Mirrored value is ``num_replicas`` times it, and SUM of a
            plain array is refused (as in TensorFlow: nothing says it is per replica).
          axis: ``None``: combine the replicas' values element-wise. An int: also reduce
            that dimension of each component, i.e. over the *global batch* when it is the
            batch dimension; MEAN divides by the global count along it.

        Returns:
          The reduced value (replicated), same structure.

        Raises:
          ValueError: an axis with a value that is not per-replica, an axis out of range,
            SUM of a plain array, a value of another strategy, an unknown ReduceOp.

        Example:
          >>> import numpy as np, parallax as px
          >>> strategy = px.tf.MirroredStrategy()
          >>> rows = next(iter(strategy.experimental_distribute_dataset([np.arange(16.0)])))
          >>> float(strategy.reduce("MEAN", rows, axis=0))     # the global batch's mean
          7.5
          >>> strategy.reduce("SUM", rows, axis=None).tolist()  # replica-wise: [0+2+..., 1+3+...]
          [56.0, 64.0]
        """
        return cross_replica.reduce(self, f"{self.API}.reduce", reduce_op, value, axis,
                                    self._place)

    def gather(self, value, axis: int):
        """Concatenates every replica's component along ``axis`` (replica order).

        Args:
          value: a ``PerReplica`` value or a pytree of them (a ``Mirrored`` value or array
            counts as the same component on every replica).
          axis: the dimension to concatenate along, of components of rank >= 1.

        Returns:
          The gathered arrays (replicated).

        Example:
          >>> import numpy as np, parallax as px
          >>> strategy = px.tf.MirroredStrategy()
          >>> rows = next(iter(strategy.experimental_distribute_dataset([np.arange(16.0)])))
          >>> strategy.gather(rows, axis=0).tolist()[:5]
          [0.0, 1.0, 2.0, 3.0, 4.0]
        """
        return cross_replica.gather(self, f"{self.API}.gather", value, axis, self._place)

    def experimental_local_results(self, value) -> tuple:
        """The components this process holds, one per local replica, in replica order.

        Args:
          value: a ``PerReplica`` or ``Mirrored`` value, or a pytree of them.

        Returns:
          A tuple with one entry per local replica (each a pytree like ``value``); a plain
          value gives ``(value,)``.

        Example:
          >>> import numpy as np, parallax as px
          >>> strategy = px.tf.MirroredStrategy()
          >>> rows = next(iter(strategy.experimental_distribute_dataset([np.arange(16.0)])))
          >>> strategy.experimental_local_results(rows)[3].tolist()
          [6.0, 7.0]
        """
        return cross_replica.local_results(value, self.num_local_replicas)

    def input_context(self) -> InputContext:
        """The :class:`InputContext` this process's input pipeline is built with."""
        return InputContext(1, 0, self.num_replicas_in_sync)

    def local_replica_ids(self) -> list[int]:
        """The replicas whose devices belong to this process (consecutive ids)."""
        here = jax.process_index()
        return [i for i, d in enumerate(self._devices) if d.process_index == here]

    def distribute_global_batch(self, array, rows: tuple[int, ...] | None = None) -> PerReplica:
        """A global batch as a ``PerReplica`` value: replica ``i`` gets the next ``rows[i]`` rows.

        Args:
          array: ``[sum(rows), ...]``, the same on every process (each sends only its
            replicas' rows).
          rows: rows per replica (:func:`parallax.tf.input.partial_batches.split_rows`); default:
            an even split.

        Returns:
          The ``PerReplica`` value, padded with zero rows where ``rows`` differ.
        """
        array = np.asarray(array)
        n = self.num_replicas_in_sync
        if rows is None:
            rows = partial_batches.split_rows(array.shape[0], array.shape[0], n)
        stacked = partial_batches.pad_components(array, rows)
        ids = self.local_replica_ids()
        return self.distribute_local_components(stacked[ids[0]:ids[-1] + 1],
                                                partial_batches.padding_of(rows))

    def distribute_local_components(self, stacked, rows=None) -> PerReplica:
        """``stacked[i]`` on this process's ``i``-th replica, as a ``PerReplica`` value.

        ``rows``: every replica's count of real rows when the components are padded.
        """
        sharding = NamedSharding(self._mesh, self.batch_spec)
        return PerReplica(jax.make_array_from_process_local_data(sharding, np.asarray(stacked)),
                          self, rows)

    def experimental_distribute_dataset(self, dataset: Iterable, options=None):
        """Splits each global batch of ``dataset`` over the replicas.

        Args:
          dataset: an iterable of global batches (pytrees of arrays, leading dimension =
            global batch). Split as TensorFlow splits them
            (:mod:`parallax.tf.input.partial_batches`): a partial last batch, or a global
            batch that does not divide, gives the replicas different numbers of rows, padded
            for the one program.
            A :class:`~parallax.tf.Dataset` carries its auto-sharding policy
            (:mod:`parallax.tf.input.auto_shard`): over several workers it is sharded by it.
          options: a :class:`~parallax.tf.InputOptions` (:mod:`parallax.tf.input.options`:
            which values parallax honours), or None.

        Returns:
          A :class:`~parallax.tf.input.distributed.DistributedDataset` yielding pytrees of
          ``PerReplica`` values.

        Raises:
          NotImplementedError: ``PER_REPLICA`` replication (TensorFlow's rule).
          ValueError: an option value parallax cannot honour.
        """
        options = self._check_options("experimental_distribute_dataset", options, False)
        return DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options=None):
        """Builds this worker's input pipeline with ``dataset_fn(InputContext)``.

        Args:
          dataset_fn: returns an iterable of per-replica batches.
          options: a :class:`~parallax.tf.InputOptions`, or None. With
            ``experimental_replication_mode=PER_REPLICA`` (``MirroredStrategy`` only, as in
            TF) ``dataset_fn`` is called once per replica, with
            ``InputContext(num_replicas, replica_id, num_replicas)``.

        Returns:
          A :class:`~parallax.tf.input.distributed.DistributedDatasetsFromFunction`.

        Raises:
          NotImplementedError: ``PER_REPLICA`` on ``MultiWorkerMirroredStrategy`` (TF's rule).
          ValueError: TF's placement rules; an option value parallax cannot honour.

        Example:
          >>> import numpy as np, parallax as px
          >>> strategy = px.tf.MirroredStrategy()
          >>> options = px.tf.InputOptions(
          ...     experimental_replication_mode=px.tf.InputReplicationMode.PER_REPLICA)
          >>> def dataset_fn(ctx):                  # one pipeline per replica
          ...     return [np.full((2,), ctx.input_pipeline_id, np.float32)]
          >>> batch = next(iter(strategy.distribute_datasets_from_function(dataset_fn, options)))
          >>> batch.values[5].tolist()
          [5.0, 5.0]
        """
        api = f"{self.API}.distribute_datasets_from_function"
        options = self._check_options("distribute_datasets_from_function", options, True)
        if not callable(dataset_fn):
            raise TypeError(f"{api}: dataset_fn must be callable as dataset_fn(input_context); "
                            f"got {type(dataset_fn).__name__}.")
        return DistributedDatasetsFromFunction(self, dataset_fn, options)

    def _check_options(self, method: str, options, from_function: bool):
        return check_options(f"{self.API}.{method}", options, from_function=from_function,
                             multi_worker=self.MULTI_WORKER)

    def experimental_distribute_values_from_function(self, value_fn: Callable) -> PerReplica:
        """A ``PerReplica`` value whose component ``i`` is ``value_fn(ValueContext(i, n))``.

        Args:
          value_fn: called once per local replica with a
            :class:`~parallax.tf.input.distributed.ValueContext`; returns arrays of one
            shape for every replica.

        Returns:
          A ``PerReplica`` value (or a pytree of them).
        """
        n = self.num_replicas_in_sync
        parts = [value_fn(ValueContext(i, n)) for i in self.local_replica_ids()]
        return jax.tree.map(lambda *xs: self.distribute_local_components(np.stack(xs)), *parts)


def get_strategy() -> MirroredStrategy:
    """The strategy whose ``scope()`` is active, else a one-device default.

    Example:
      >>> get_strategy().num_replicas_in_sync
      1

    References:
      TensorFlow, ``tf.distribute.get_strategy``.
    """
    current = current_scope()
    return current if current is not None else MirroredStrategy(jax.local_devices()[:1])
