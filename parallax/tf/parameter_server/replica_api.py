"""What a scheduled function asks of a parameter-server strategy: ``run``, ``reduce``, ...

TensorFlow's ``ParameterServerStrategy`` (V2, ``parameter_server_strategy_v2.py``) runs a
scheduled function on a worker in the strategy's scope (cross-replica context:
``ClusterCoordinator.schedule`` enters ``strategy.scope()``). There:

- ``num_replicas_in_sync`` is the number of GPUs per worker, or 1 (``_num_replicas_in_sync``:
  ``self._num_gpus_per_worker or 1``); here a worker runs one replica on its default device,
  so it is 1;
- ``run(fn, args, kwargs)`` calls ``fn`` once as that replica
  (``mirrored_run.call_for_each_replica`` with one device), with a replica context whose
  ``all_reduce`` is the identity;
- ``reduce(op, value, axis)`` with ``axis=None`` returns a value that is not distributed as
  it is (``_reduce_to``: ``get_values`` passes such values through), and with an axis sums
  (SUM) or averages (MEAN) over it first (``distribute_lib.Strategy.reduce``);
- ``extended.worker_devices`` is ``("/device:CPU:0",)`` (or the worker's GPUs), and
  ``extended.parameter_devices`` is, in TensorFlow 2.21, the coordinator's CPU
  (``"/job:chief/replica:0/task:0/device:CPU:0"``: V2's extended calls V1's ``__init__``
  without a cluster resolver, whose ``_initialize_local`` sets it); a variable shard's
  ``device`` names its server;
- ``distribute_datasets_from_function(dataset_fn)`` calls ``dataset_fn`` with an
  ``InputContext`` of one pipeline, id 0 ("no synchronization beyond a worker"), on each
  worker; built lazily when ``ClusterCoordinator.create_per_worker_dataset`` takes it.

:class:`ReplicaAPI` holds these for :class:`parallax.tf.ParameterServerStrategy` (on the
coordinator) and :class:`WorkerStrategy`, what the strategy becomes when a scheduled
function that uses it is shipped to a worker.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from parallax.tf.input.distributed import InputContext
from parallax.tf.merge_call import MergedValue
from parallax.tf.reduce_op import ReduceOp, as_reduce_op
from parallax.tf.replica_context import (ReplicaContext, check_call, cross_replica_scope,
                                         get_replica_context, replica)

# TensorFlow 2.21's ``strategy.extended.parameter_devices`` on the coordinator (the chief).
COORDINATOR_DEVICE = "/job:chief/replica:0/task:0/device:CPU:0"


@dataclasses.dataclass(frozen=True)
class ParameterServerExtended:
    """``strategy.extended`` of a parameter-server strategy (TensorFlow's devices).

    Attributes:
      worker_devices: where a worker's replica runs (TensorFlow's ``/device:CPU:0``, or
        ``/device:GPU:0`` for workers given a GPU).
      parameter_devices: TensorFlow 2.21's value: the coordinator's CPU (see the module
        docstring); each shard's ``device`` names its parameter server.

    Example:
      >>> ParameterServerExtended(("/device:CPU:0",)).parameter_devices
      ('/job:chief/replica:0/task:0/device:CPU:0',)

    References:
      TensorFlow, ``ParameterServerStrategyV2Extended.worker_devices`` and
      ``ParameterServerStrategyExtended.parameter_devices``.
    """

    worker_devices: tuple[str, ...]
    parameter_devices: tuple[str, ...] = (COORDINATOR_DEVICE,)


@dataclasses.dataclass(frozen=True)
class PerWorkerInput:
    """A dataset built on each worker: ``distribute_datasets_from_function`` /
    ``experimental_distribute_dataset`` of a parameter-server strategy (lazy, as TF's).

    Example:
      >>> PerWorkerInput(dataset_fn=lambda ctx: [ctx.input_pipeline_id]).build()
      [0]
    """

    dataset_fn: Callable | None = None
    dataset: Any = None

    def build(self):
        """The dataset: ``dataset_fn(InputContext(1, 0, 1))``, or the dataset itself."""
        if self.dataset_fn is None:
            return self.dataset
        return self.dataset_fn(InputContext(num_input_pipelines=1, input_pipeline_id=0,
                                            num_replicas_in_sync=1))


class ReplicaAPI:
    """``run``, ``reduce`` and the facts of one replica per worker (a mixin).

    Subclasses set ``API`` (the name in messages) and ``_worker_devices``.
    """

    API = "px.tf.ParameterServerStrategy"
    _worker_devices: tuple[str, ...] = ("/device:CPU:0",)

    @property
    def num_replicas_in_sync(self) -> int:
        """1: each worker runs the replica function once, on its default device."""
        return 1

    @property
    def extended(self) -> ParameterServerExtended:
        """TensorFlow's ``strategy.extended``: ``worker_devices``, ``parameter_devices``."""
        return ParameterServerExtended(tuple(self._worker_devices))

    def run(self, fn: Callable, args=(), kwargs=None, options=None):
        """Calls ``fn(*args, **kwargs)`` as this worker's one replica; returns its result.

        Inside ``fn`` ``px.tf.get_replica_context()`` is the replica's context (id 0, one
        replica: its ``all_reduce`` returns the value, ``merge_call`` runs its function
        here in cross-replica context).

        Example:
          >>> import parallax as px
          >>> strategy = WorkerStrategy(num_workers=1, num_ps=1)
          >>> strategy.run(lambda x: x * px.tf.get_replica_context().num_replicas_in_sync,
          ...              args=(3.0,))
          3.0

        References:
          TensorFlow, ``tf.distribute.Strategy.run`` on ``ParameterServerStrategy``.
        """
        del options
        kwargs = check_call(f"{self.API}.run", "fn", "as fn(*args, **kwargs)", fn, args, kwargs)
        with replica(ReplicaContext(strategy=self, num_replicas_in_sync=1)):
            return fn(*args, **kwargs)

    def reduce(self, reduce_op, value, axis: int | None = None):
        """Reduces what ``run`` returned across the one replica (and over ``axis``).

        Args:
          reduce_op: ``px.tf.ReduceOp.SUM`` or ``MEAN`` (or their names).
          value: a pytree of arrays.
          axis: None: the value as it is (one replica); an int: SUM or MEAN over it.

        Raises:
          ValueError: inside ``run`` (replica context), or an axis out of range.

        Example:
          >>> import numpy as np
          >>> strategy = WorkerStrategy(num_workers=1, num_ps=1)
          >>> float(strategy.reduce("SUM", np.float32(2.5), axis=None))
          2.5
          >>> float(strategy.reduce("MEAN", np.arange(4.0), axis=0))
          1.5
        """
        api = f"{self.API}.reduce"
        op = as_reduce_op(api, reduce_op)
        context = get_replica_context()
        if context is not None and context.strategy is not None:
            raise ValueError(f"{api}: called inside strategy.run (replica context), where "
                             f"TensorFlow requires cross-replica context; reduce what run "
                             f"returns, or use px.tf.get_replica_context().all_reduce or "
                             f"merge_call inside the replica function.")

        def one(x):
            if isinstance(x, MergedValue):
                return x.reduce(api, op, axis)
            if axis is None:
                return x
            x = jnp.asarray(x)
            if not -x.ndim <= axis < x.ndim:
                raise ValueError(f"{api}: axis={axis} is out of range for a value of rank "
                                 f"{x.ndim} (shape {x.shape}).")
            total = jnp.sum(x, axis=axis)
            return total if op is ReduceOp.SUM else total / x.shape[axis]

        return jax.tree.map(one, value, is_leaf=lambda x: isinstance(x, MergedValue))

    def experimental_local_results(self, value) -> tuple:
        """``(value,)``: the one replica's result."""
        return (value,)

    def gather(self, value, axis: int):
        """The one replica's value (nothing to concatenate)."""
        del axis
        return value

    def distribute_datasets_from_function(self, dataset_fn: Callable,
                                          options=None) -> PerWorkerInput:
        """``dataset_fn(input_context)`` on each worker, built when a coordinator takes it
        (``create_per_worker_dataset``); the context is one pipeline, id 0, as TF's."""
        del options
        if not callable(dataset_fn):
            raise TypeError(f"{self.API}.distribute_datasets_from_function: dataset_fn must "
                            f"be callable as dataset_fn(input_context); got "
                            f"{type(dataset_fn).__name__}.")
        return PerWorkerInput(dataset_fn=dataset_fn)

    def experimental_distribute_dataset(self, dataset, options=None) -> PerWorkerInput:
        """``dataset`` on each worker (a copy each), for ``create_per_worker_dataset``."""
        del options
        return PerWorkerInput(dataset=dataset)


class WorkerStrategy(ReplicaAPI):
    """A :class:`parallax.tf.ParameterServerStrategy` as a scheduled function sees it.

    The strategy (its servers, its coordinator) stays on the coordinator; a function that
    captures it carries this instead, which answers ``run``, ``reduce``,
    ``num_replicas_in_sync``, ``extended`` and the dataset calls as the strategy does.

    Example:
      >>> WorkerStrategy(num_workers=2, num_ps=1).extended.worker_devices
      ('/device:CPU:0',)
    """

    API = "px.tf.ParameterServerStrategy (on a worker)"

    def __init__(self, num_workers: int, num_ps: int,
                 worker_devices: tuple[str, ...] = ("/device:CPU:0",)):
        self.num_workers, self.num_ps = num_workers, num_ps
        self._worker_devices = tuple(worker_devices)

    @contextlib.contextmanager
    def scope(self):
        """Cross-replica context (the scheduled function already runs in it)."""
        with cross_replica_scope(self):
            yield self

    def create_variable(self, *args, **kwargs):
        raise ValueError(f"{self.API}: variables are created on the coordinator, in "
                         f"strategy.scope() before scheduling; a scheduled function uses them.")

    def __reduce__(self):
        return (WorkerStrategy, (self.num_workers, self.num_ps, self._worker_devices))

    def __repr__(self) -> str:
        return f"WorkerStrategy(num_workers={self.num_workers}, num_ps={self.num_ps})"
