"""``ClusterCoordinator``: schedules functions on workers and survives their failures.

(Over 300 lines: TensorFlow's scheduling, error and failure semantics are one state
machine around one queue; split, each part would reach into the others' state.)

One dispatcher thread per worker takes functions from a shared queue, runs each on its
worker actor and records the result in a ``RemoteValue``. TensorFlow's guarantees are kept:

- a function runs at least once: if its worker dies, it goes back to the front of the queue
  for any live worker, and the worker is restarted (Ray starts a new process) with its
  per-worker datasets rebuilt from the start;
- an error raised by a function is raised once by the next ``schedule``, ``join`` or
  ``done``, then cleared; the functions still queued are cancelled;
- a result already received survives its worker's death (it lives in this process);
- a dead parameter server makes ``join``, ``done``, ``schedule`` and the pending
  ``fetch``es raise :class:`parallax.ps.ServerUnavailableError`, until the run restarts
  from a checkpoint (``strategy.save`` / ``strategy.restore``).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import ray

from parallax.ps import ServerUnavailableError
from parallax.tf.parameter_server.replica_api import PerWorkerInput
from parallax.tf.parameter_server.strategy import ParameterServerStrategy
from parallax.tf.parameter_server.remote_value import (FunctionCancelledError, PerWorkerValues,
                                                       RemoteValue)
from parallax.tf.parameter_server.server_model import ServerModel
from parallax.tf.parameter_server.sharded_variable import ShardedVariable
from parallax.tf.parameter_server.worker_actor import WorkerActor

_WORKER_OPTIONS = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": 0}
_RESTART_TIMEOUT_S = 300.0


class _Closure:
    """A scheduled call and the value it will fill."""

    def __init__(self, function, args, kwargs):
        self.function, self.args, self.kwargs = function, args, kwargs
        self.value = RemoteValue()


class ClusterCoordinator:
    """Dispatches functions to the strategy's workers (TensorFlow's ``ClusterCoordinator``).

    Args:
      strategy: the :class:`parallax.tf.ParameterServerStrategy` whose variables the
        functions use; its cluster resolver says how many workers to start.

    Attributes:
      executions: functions started on a worker (re-runs included).
      redispatched: functions sent again because their worker died.
      restarts: worker restarts.

    Example:
      >>> import numpy as np, optax, parallax as px
      >>> strategy = px.tf.ParameterServerStrategy(px.tf.RayClusterResolver(1, num_ps=1))
      >>> strategy.set_optimizer(optax.sgd(1.0))
      >>> counter = strategy.create_variable(np.zeros(1), name="counter")
      >>> coordinator = px.tf.ClusterCoordinator(strategy)
      >>> def add_one():
      ...     counter.apply_gradient(-np.ones(1))          # sgd(1.0): counter + 1
      ...     return counter.read()
      >>> values = [coordinator.schedule(add_one) for _ in range(3)]
      >>> coordinator.join()
      >>> float(counter.read()[0]), sorted(float(v.fetch()[0]) for v in values)
      (3.0, [1.0, 2.0, 3.0])
      >>> coordinator.shutdown(); strategy.shutdown()

    References:
      TensorFlow, ``tf.distribute.experimental.coordinator.ClusterCoordinator``
      (``cluster_coordinator.py``: closures, queue, worker failure handling).
    """

    def __init__(self, strategy: ParameterServerStrategy):
        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(f"px.tf.ClusterCoordinator: strategy must be a "
                            f"px.tf.ParameterServerStrategy, got {type(strategy).__name__}.")
        self.strategy = strategy
        resolver = strategy.cluster_resolver
        options = dict(_WORKER_OPTIONS, **(resolver.worker_options or {}))
        actor = ray.remote(WorkerActor).options(**options)
        self._workers = [actor.remote(i, resolver.num_workers, strategy)  # its worker view
                         for i in range(resolver.num_workers)]
        self._cv = threading.Condition()
        self._queue: collections.deque[_Closure] = collections.deque()
        self._in_flight = 0
        self._error: BaseException | None = None  # raised once, then cleared
        self._fatal: BaseException | None = None  # a dead parameter server: stays
        self._datasets: dict[int, Callable] = {}
        self._functions: dict[int, tuple] = {}  # id(fn) -> (fn, (ObjectRef,))
        self._stopping = False
        self._alive = len(self._workers)
        self.executions = self.redispatched = self.restarts = 0
        self._threads = [threading.Thread(target=self._serve, args=(i,), daemon=True,
                                          name=f"parallax-coordinator-worker-{i}")
                         for i in range(len(self._workers))]
        for thread in self._threads:
            thread.start()

    # -- TensorFlow's API ----------------------------------------------------------------------

    def schedule(self, fn: Callable, args=(), kwargs=None) -> RemoteValue:
        """Queues ``fn(*args, **kwargs)`` for some worker; returns at once.

        Raises:
          the error of a previously scheduled function (once), or
          :class:`parallax.ps.ServerUnavailableError` if a parameter server died.
        """
        if not callable(fn):
            raise TypeError(f"ClusterCoordinator.schedule: fn must be callable, got "
                            f"{type(fn).__name__}.")
        closure = _Closure(self._shipped(fn), tuple(args), dict(kwargs or {}))
        with self._cv:
            self._raise_pending()
            self._queue.append(closure)
            self._cv.notify_all()
        return closure.value

    def join(self) -> None:
        """Blocks until every scheduled function has finished; raises a pending error once."""
        with self._cv:
            self._cv.wait_for(lambda: (not self._queue and self._in_flight == 0)
                              or self._fatal is not None)
            self._raise_pending()

    def done(self) -> bool:
        """Whether every scheduled function has finished; raises a pending error once."""
        with self._cv:
            self._raise_pending()
            return not self._queue and self._in_flight == 0

    def fetch(self, values) -> Any:
        """The numpy value of every ``RemoteValue``, ``ShardedVariable`` and ``ServerModel``
        in the structure ``values`` (waiting for the functions)."""
        def one(value):
            if isinstance(value, RemoteValue):
                return value.fetch()
            if isinstance(value, ShardedVariable):
                return value.read()
            if isinstance(value, ServerModel):
                return value.pull_params()
            return value
        fetchable = lambda x: isinstance(x, (RemoteValue, ShardedVariable, ServerModel))
        return jax.tree.map(one, values, is_leaf=fetchable)

    def create_per_worker_dataset(self, dataset_fn) -> PerWorkerValues:
        """Builds ``dataset_fn()`` (or ``dataset_fn(input_context)``) on every worker.

        Args:
          dataset_fn: a function returning the worker's dataset (any iterable, or a
            ``tf.data.Dataset`` where TensorFlow is installed on the workers), which may
            return ``strategy.distribute_datasets_from_function(fn)``; or, as TensorFlow
            also accepts, a dataset itself (``strategy.experimental_distribute_dataset``'s
            result, or an iterable that pickles: each worker iterates its own copy).

        Returns:
          A :class:`~parallax.tf.PerWorkerValues`; pass it (or ``iter()`` of it) to
          scheduled functions, and each worker uses its own. A ``tf.data`` dataset's
          iterator gives numpy arrays (``as_numpy_iterator``).
        """
        if not callable(dataset_fn) and not hasattr(dataset_fn, "__iter__") and \
                not isinstance(dataset_fn, PerWorkerInput):
            raise TypeError(f"ClusterCoordinator.create_per_worker_dataset: dataset_fn must be "
                            f"callable (dataset_fn() or dataset_fn(input_context)) or a "
                            f"dataset, got {type(dataset_fn).__name__}.")
        if not callable(dataset_fn) and not isinstance(dataset_fn, PerWorkerInput):
            dataset_fn = PerWorkerInput(dataset=dataset_fn)
        try:
            ray.cloudpickle.dumps(dataset_fn)
        except Exception as error:  # noqa: BLE001 - e.g. a tf.data.Dataset object
            raise TypeError(f"ClusterCoordinator.create_per_worker_dataset: the dataset does "
                            f"not travel to the workers ({type(error).__name__}: {error}); "
                            f"pass a function that builds it on each worker (a tf.data "
                            f"dataset does not pickle).") from None
        dataset_id = len(self._datasets)
        with self._cv:
            self._datasets[dataset_id] = dataset_fn
        ray.get([w.build_datasets.remote({dataset_id: dataset_fn}) for w in self._workers])
        return PerWorkerValues(dataset_id)

    # -- beyond TensorFlow's API -----------------------------------------------------------------

    def worker_pids(self) -> list[int]:
        """The workers' process ids (new ones after restarts; waits for a restarting one)."""
        return [_call_when_alive(lambda: worker.pid.remote()) for worker in self._workers]

    def shutdown(self) -> None:
        """Stops the dispatcher threads and the worker actors."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for thread in self._threads:
            thread.join(timeout=10)
        for worker in self._workers:
            ray.kill(worker, no_restart=True)

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- dispatch --------------------------------------------------------------------------------

    def _shipped(self, fn):
        """``fn`` as ``(ObjectRef,)``: put in the object store once, unpickled once per worker."""
        entry = self._functions.get(id(fn))
        if entry is None or entry[0] is not fn:
            entry = (fn, (ray.put(fn),))
            self._functions[id(fn)] = entry
        return entry[1]

    def _raise_pending(self) -> None:
        if self._fatal is not None:
            raise self._fatal
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _serve(self, index: int) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._stopping)
                if self._stopping:
                    return
                closure = self._queue.popleft()
                self._in_flight += 1
                self.executions += 1
            try:
                result = ray.get(self._workers[index].run.remote(
                    closure.function, closure.args, closure.kwargs))
            except ray.exceptions.RayTaskError as error:
                self._failed(closure, error.cause)
            except ray.exceptions.RayActorError:
                if not self._worker_died(index, closure):
                    return  # gone for good (shut down): the other workers carry on
            else:
                closure.value._set_result(result)
                self._finished()

    def _finished(self) -> None:
        with self._cv:
            self._in_flight -= 1
            self._cv.notify_all()

    def _failed(self, closure: _Closure, error: BaseException) -> None:
        with self._cv:
            closure.value._set_error(error)
            if isinstance(error, ServerUnavailableError):
                self._fatal = ServerUnavailableError(
                    f"ClusterCoordinator: a parameter server died; the variables it held are "
                    f"lost. Shut this coordinator and strategy down, create them again with "
                    f"the same variables, strategy.restore(<checkpoint>) and schedule the "
                    f"rest of the run. ({error})")
            elif self._error is None:
                self._error = error
            cancelled = FunctionCancelledError(
                f"ClusterCoordinator: cancelled because a previously scheduled function "
                f"raised {type(error).__name__}: {error}")
            while self._queue:
                self._queue.popleft().value._set_error(self._fatal or cancelled)
            self._in_flight -= 1
            self._cv.notify_all()

    def _worker_died(self, index: int, closure: _Closure) -> bool:
        """Puts the closure back for a live worker, then brings this worker back.

        Returns:
          Whether the worker is back (False once it is gone for good).
        """
        with self._cv:
            self._queue.appendleft(closure)
            self._in_flight -= 1
            self.redispatched += 1
            self._cv.notify_all()
        worker = self._workers[index]
        try:
            _call_when_alive(lambda: worker.build_datasets.remote(dict(self._datasets)))
        except ray.exceptions.RayActorError:
            with self._cv:
                self._alive -= 1
                if self._alive == 0 and not self._stopping:
                    self._fatal = RuntimeError(
                        "ClusterCoordinator: every worker is gone for good (killed without "
                        "restart); create a new coordinator.")
                    while self._queue:
                        self._queue.popleft().value._set_error(self._fatal)
                self._cv.notify_all()
            return False
        with self._cv:
            self.restarts += 1
        return not self._stopping


def _call_when_alive(call):
    """``ray.get(call())``, retried while Ray restarts the actor (a new process starts).

    Raises:
      ray.exceptions.ActorDiedError: the actor is gone for good (or the restart timed out).
    """
    deadline = time.monotonic() + _RESTART_TIMEOUT_S
    while True:
        try:
            return ray.get(call())
        except ray.exceptions.ActorUnavailableError:  # restarting: a new process comes
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
