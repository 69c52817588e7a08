"""``ParameterServerStrategy``: TensorFlow's asynchronous parameter-server training, on Ray.

Variables live on parameter-server actors as ``ShardedVariable``s (split along axis 0 by the
``variable_partitioner``, shards placed round-robin over the servers); the optimizer runs on
the servers (a :class:`parallax.ps.OptaxHandle`, given before or after the variables);
workers, driven by a :class:`parallax.tf.ClusterCoordinator`, pull, compute with ``jax.jit``
and push. A scheduled function that captures the strategy gets its worker view
(:mod:`parallax.tf.parameter_server.replica_api`: ``run``, ``reduce``, ...). The store
underneath is :class:`parallax.ps.KVStore` with eventual consistency: TensorFlow's
parameter-server training is asynchronous.
"""

from __future__ import annotations

import contextlib
import pathlib

import jax
import numpy as np
import optax
from flax import nnx

from parallax.ps import ASSIGN, KVStore, OptaxHandle
from parallax.ray_cluster.connect import init_cluster
from parallax.tf.parameter_server.cluster_resolver import RayClusterResolver
from parallax.tf.parameter_server.key_layout import Shard
from parallax.tf.parameter_server.partitioners import shard_rows
from parallax.tf.parameter_server.replica_api import ReplicaAPI, WorkerStrategy
from parallax.tf.parameter_server.server_model import ServerModel
from parallax.tf.parameter_server.missing_optimizer import MissingOptimizer
from parallax.tf.parameter_server.sharded_variable import ShardedVariable
from parallax.tf.replica_context import cross_replica_scope, current_scope


class ParameterServerStrategy(ReplicaAPI):
    """Variables on parameter servers, functions on workers (TensorFlow 2's PS strategy).

    Args:
      cluster_resolver: the job's shape (:class:`parallax.tf.RayClusterResolver`, or
        :class:`parallax.tf.TFConfigClusterResolver` on the ``chief``: one server per
        ``ps`` task, one worker actor per ``worker`` task); None for a local cluster with
        2 workers and 1 parameter server.
      variable_partitioner: how to split each variable along axis 0
        (:class:`~parallax.tf.FixedShardsPartitioner`, :class:`~parallax.tf.MinSizePartitioner`,
        :class:`~parallax.tf.MaxSizePartitioner`, or any ``(shape, dtype) -> [shards, 1, ...]``);
        None keeps every variable whole.

    Example:
      >>> import numpy as np, optax, parallax as px
      >>> strategy = px.tf.ParameterServerStrategy(
      ...     px.tf.RayClusterResolver(num_workers=1, num_ps=2),
      ...     variable_partitioner=px.tf.FixedShardsPartitioner(2))
      >>> v = strategy.create_variable(np.ones((4, 3)), name="w")
      >>> [(s.rows, s.server) for s in v.shards]       # shards round-robin over the servers
      [(2, 0), (2, 1)]
      >>> strategy.set_optimizer(optax.sgd(0.5))         # before or after the variables
      >>> v.apply_gradient(np.ones((4, 3)))
      >>> float(v.read().sum())                          # 12 * (1 - 0.5)
      6.0
      >>> strategy.num_replicas_in_sync, strategy.run(lambda x: x + 1, args=(1,))
      (1, 2)
      >>> strategy.shutdown()

    References:
      TensorFlow, ``tf.distribute.experimental.ParameterServerStrategy`` (TF 2,
      ``parameter_server_strategy_v2.py``) and its partitioners; Li et al., "Scaling
      Distributed Machine Learning with the Parameter Server", OSDI 2014.
    """

    def __init__(self, cluster_resolver: RayClusterResolver | None = None,
                 variable_partitioner=None):
        resolver = RayClusterResolver() if cluster_resolver is None else cluster_resolver
        if not isinstance(resolver, RayClusterResolver):
            raise TypeError(f"px.tf.ParameterServerStrategy: cluster_resolver must be a "
                            f"px.tf.RayClusterResolver, got {type(resolver).__name__}.")
        task_type = getattr(resolver, "task_type", None)
        if task_type not in (None, "chief"):
            raise ValueError(
                f"px.tf.ParameterServerStrategy: this process is TF_CONFIG task {task_type}:"
                f"{resolver.task_id}; only the chief creates the strategy. The chief starts a "
                f"Ray actor for every worker and ps task, so this process has nothing to run: "
                f"px.tf.Server(resolver).join() returns at once (TensorFlow's blocks).")
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise TypeError(f"px.tf.ParameterServerStrategy: variable_partitioner must be "
                            f"callable as partitioner(shape, dtype), e.g. "
                            f"px.tf.FixedShardsPartitioner(2); got "
                            f"{type(variable_partitioner).__name__}.")
        self.cluster_resolver = resolver
        self.variable_partitioner = variable_partitioner
        init_cluster(resolver.address)
        self._store = KVStore(num_servers=resolver.num_ps, handle=MissingOptimizer(),
                              consistency="eventual")
        self._next_key = [r.begin for r in self._store.server_key_ranges()]
        self._next_server = 0  # round-robin placement of shards, across variables
        self._optimizer = None
        self._names: set[str] = set()

    @property
    def num_workers(self) -> int:
        return self.cluster_resolver.num_workers

    @property
    def num_ps(self) -> int:
        return self.cluster_resolver.num_ps

    @property
    def store(self) -> KVStore:
        """The key-value store of the parameter servers (:class:`parallax.ps.KVStore`)."""
        return self._store

    @property
    def _worker_devices(self) -> tuple[str, ...]:
        gpus = (self.cluster_resolver.worker_options or {}).get("num_gpus", 0)
        return ("/device:GPU:0",) if gpus else ("/device:CPU:0",)

    def set_optimizer(self, optimizer: optax.GradientTransformation) -> None:
        """Sets the optimizer the servers apply to pushed gradients (once per strategy).

        Before or after the variables exist: their values are kept, and the optimizer's
        per-element state (slots) starts at its initial value, as Keras creates slots at
        the first ``apply_gradients``. :class:`parallax.tf.ServerOptimizer` calls this.
        """
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"ParameterServerStrategy: the optimizer must be an optax "
                            f"GradientTransformation (e.g. optax.adam(1e-3)), got "
                            f"{type(optimizer).__name__}.")
        if self._optimizer is optimizer:
            return
        if self._optimizer is not None:
            raise ValueError("ParameterServerStrategy: the servers already run another "
                             "optimizer; one strategy has one optimizer (it runs where the "
                             "variables live). Pass the same optax object, or create a new "
                             "strategy.")
        self._store.set_handle(OptaxHandle(optimizer))
        self._optimizer = optimizer

    def create_variable(self, initial_value, *, name: str | None = None,
                        shape=None) -> ShardedVariable:
        """Creates a variable on the servers, sharded by the partitioner.

        Args:
          initial_value: an array, or ``initializer(shard_shape, dtype) -> array`` called
            once per shard (so no process ever holds a large table whole).
          name: a unique name (default ``variable_<n>``).
          shape: the full shape, required when ``initial_value`` is a function.

        Returns:
          The :class:`~parallax.tf.ShardedVariable`.
        """
        name = f"variable_{len(self._names)}" if name is None else str(name)
        if name in self._names:
            raise ValueError(f"ParameterServerStrategy.create_variable: a variable named "
                             f"{name!r} exists already; names must be unique.")
        value = None if callable(initial_value) else np.asarray(initial_value, np.float32)
        full_shape = tuple(shape) if value is None else value.shape
        if value is None and shape is None:
            raise ValueError("ParameterServerStrategy.create_variable: pass shape= with an "
                             "initializer function.")
        shards = self._place(name, full_shape)
        self._names.add(name)
        variable = ShardedVariable(name, full_shape, shards, self._store)
        client, width = self._store.client(), variable.row_width
        stamps = []
        for shard in shards:
            part = (initial_value((shard.rows,) + full_shape[1:], np.float32) if value is None
                    else value.reshape(variable.rows, width)[shard.row_start:
                                                             shard.row_start + shard.rows])
            keys = np.arange(shard.rows, dtype=np.uint64) + np.uint64(shard.first_key)
            stamps.append(client.push(keys, np.asarray(part, np.float32), cmd=ASSIGN))
        for stamp in stamps:
            client.wait(stamp)
        return variable

    @contextlib.contextmanager
    def scope(self):
        """Variables created inside (:func:`parallax.tf.Variable`) go to the servers.

        As in TensorFlow, each is split by the ``variable_partitioner`` and its shards are
        placed round-robin over the parameter servers. An optimizer (:meth:`set_optimizer`,
        :class:`parallax.tf.ServerOptimizer`) runs on the servers, where the variables live.

        Raises:
          ValueError: inside the scope of a different strategy.

        Example:
          >>> import numpy as np, optax, parallax as px
          >>> strategy = px.tf.ParameterServerStrategy(px.tf.RayClusterResolver(1, 1))
          >>> strategy.set_optimizer(optax.sgd(0.1))
          >>> with strategy.scope():
          ...     v = px.tf.Variable(np.zeros((2, 2)), name="v")
          >>> v.read().shape
          (2, 2)
          >>> strategy.shutdown()

        References:
          TensorFlow, ``tf.distribute.experimental.ParameterServerStrategy.scope``.
        """
        outer = current_scope()
        if outer is not None and outer is not self:
            raise ValueError(f"px.tf.ParameterServerStrategy.scope: already inside the scope "
                             f"of {type(outer).__name__}; one strategy at a time (leave the "
                             f"other scope first).")
        with cross_replica_scope(self):
            yield self

    def distribute_model(self, model: nnx.Module, optimizer: optax.GradientTransformation
                         ) -> ServerModel:
        """Places ``model``'s parameters (and, on the servers, ``optimizer``'s state).

        Returns:
          A :class:`~parallax.tf.ServerModel` that workers pull and push through.
        """
        if not isinstance(model, nnx.Module):
            raise TypeError(f"ParameterServerStrategy.distribute_model: model must be an "
                            f"nnx.Module, got {type(model).__name__}.")
        self.set_optimizer(optimizer)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        prefix = f"model_{len(self._names)}"
        names, variables = [], []
        for path, leaf in paths_leaves:
            if not np.issubdtype(np.asarray(leaf).dtype, np.floating):
                raise TypeError(f"ParameterServerStrategy.distribute_model: parameter "
                                f"{jax.tree_util.keystr(path)} has dtype {leaf.dtype}; the "
                                f"servers store float32 parameters.")
            name = jax.tree_util.keystr(path).removesuffix(".value")
            names.append(name)
            value = np.asarray(leaf, np.float32)
            variables.append(self.create_variable(value.reshape(value.shape or (1,)),
                                                  name=f"{prefix}/{name}"))
        variables = [ShardedVariable(v.name, np.shape(leaf), v.shards, self._store)
                     for v, (_, leaf) in zip(variables, paths_leaves)]
        return ServerModel(graphdef, rest, treedef, names, variables, self._store)

    def save(self, directory) -> pathlib.Path:
        """Checkpoints the servers' state (values and optimizer state) with Orbax."""
        return self._store.save(directory)

    def restore(self, directory) -> None:
        """Loads a :meth:`save` checkpoint into this strategy's servers.

        Create the same variables first (same model, partitioner and number of servers):
        their keys are where the checkpoint puts the values.
        """
        self._store.restore(directory)

    def server_pids(self) -> list[int]:
        """The parameter servers' process ids."""
        return self._store.server_pids()

    def shutdown(self) -> None:
        """Stops the parameter servers."""
        self._store.shutdown()

    def __enter__(self) -> ParameterServerStrategy:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _place(self, name: str, shape: tuple[int, ...]) -> tuple[Shard, ...]:
        rows = shape[0] if shape else 1
        count = 1
        if self.variable_partitioner is not None and len(shape) >= 1:
            partitions = list(self.variable_partitioner(shape, np.float32))
            if len(partitions) != len(shape) or any(p != 1 for p in partitions[1:]) or \
                    not 1 <= partitions[0] <= rows:
                raise ValueError(f"ParameterServerStrategy: the partitioner returned "
                                 f"{partitions} for variable {name!r} of shape {shape}; it "
                                 f"must be [shards, 1, ...] with 1 <= shards <= {rows}.")
            count = int(partitions[0])
        shards, start = [], 0
        for size in shard_rows(rows, count):
            server = self._next_server % self.num_ps
            self._next_server += 1
            shards.append(Shard(start, size, server, self._next_key[server]))
            self._next_key[server] += size
            start += size
        return tuple(shards)

    def __reduce__(self):
        """A scheduled function that captures the strategy carries its worker view."""
        return (WorkerStrategy, (self.num_workers, self.num_ps, self._worker_devices))
