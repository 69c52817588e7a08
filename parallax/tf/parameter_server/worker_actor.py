"""The process a ``ClusterCoordinator`` worker runs: functions in, numpy results out."""

from __future__ import annotations

import contextlib
import inspect
import os

import jax
import ray

from parallax.tf.input.distributed import InputContext
from parallax.tf.parameter_server.remote_value import PerWorkerValues
from parallax.tf.parameter_server.replica_api import PerWorkerInput
from parallax.tf.replica_context import cross_replica_scope


class WorkerActor:
    """A worker (run as a Ray actor that Ray restarts when its process dies).

    It keeps the functions it was sent (unpickled once, so their ``jax.jit`` caches last)
    and its per-worker datasets and iterators, which the coordinator rebuilds after a
    restart.

    A function runs in its strategy's scope (cross-replica context, as TensorFlow's
    ``schedule`` runs it in ``strategy.scope()``), where ``strategy.run`` is one replica.

    Args:
      index: the worker's index.
      num_workers: how many workers the job has.
      strategy: the strategy's worker view
        (:class:`~parallax.tf.parameter_server.replica_api.WorkerStrategy`), or None.

    Example:
      >>> from parallax.tf.parameter_server.remote_value import PerWorkerIterator
      >>> worker = WorkerActor(0, 1)
      >>> worker.build_datasets({0: lambda: [1, 2]})
      >>> worker.run(lambda it: next(it), (PerWorkerIterator(0),), {})
      1

    References:
      TensorFlow, ``ClusterCoordinator``'s ``Worker`` (``cluster_coordinator.py``).
    """

    def __init__(self, index: int, num_workers: int, strategy=None):
        self.index, self.num_workers = index, num_workers
        self._strategy = strategy
        self._functions: dict[str, object] = {}
        self._datasets: dict[int, object] = {}
        self._iterators: dict[int, object] = {}

    def pid(self) -> int:
        return os.getpid()

    def build_datasets(self, dataset_fns: dict) -> None:
        """(Re)builds every per-worker dataset from its function, iterators from the start."""
        context = InputContext(num_input_pipelines=self.num_workers,
                               input_pipeline_id=self.index,
                               num_replicas_in_sync=self.num_workers)
        for dataset_id, dataset_fn in dataset_fns.items():
            if isinstance(dataset_fn, PerWorkerInput):
                dataset = dataset_fn
            else:
                takes_context = len(inspect.signature(dataset_fn).parameters) > 0
                dataset = dataset_fn(context) if takes_context else dataset_fn()
            while isinstance(dataset, PerWorkerInput):  # distribute_datasets_from_function
                dataset = dataset.build()
            self._datasets[dataset_id] = dataset
            self._iterators.pop(dataset_id, None)

    def run(self, function, args, kwargs):
        """Calls the function with per-worker values substituted; returns numpy results."""
        if isinstance(function, tuple):  # (ObjectRef,): a function shipped once, cached here
            key = function[0].hex()
            if key not in self._functions:
                self._functions[key] = ray.get(function[0])
            function = self._functions[key]
        is_placeholder = lambda x: isinstance(x, PerWorkerValues)
        args, kwargs = jax.tree.map(self._local, (args, kwargs), is_leaf=is_placeholder)
        scope = (contextlib.nullcontext() if self._strategy is None
                 else cross_replica_scope(self._strategy))
        with scope:
            return jax.device_get(function(*args, **kwargs))

    def _local(self, value):
        if not isinstance(value, PerWorkerValues):
            return value
        if value.dataset_id not in self._datasets:
            raise ValueError(f"worker {self.index}: per-worker dataset {value.dataset_id} "
                             f"was not created on this worker.")
        if value.kind == "dataset":
            return self._datasets[value.dataset_id]
        if value.dataset_id not in self._iterators:
            dataset = self._datasets[value.dataset_id]
            numpy = getattr(dataset, "as_numpy_iterator", None)  # tf.data: numpy elements
            self._iterators[value.dataset_id] = numpy() if callable(numpy) else iter(dataset)
        return self._iterators[value.dataset_id]
