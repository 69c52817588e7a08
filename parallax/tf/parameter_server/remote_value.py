"""What ``ClusterCoordinator.schedule`` returns, and the per-worker values it passes along."""

from __future__ import annotations

import threading
from typing import Any

import jax
import jax.numpy as jnp


class FunctionCancelledError(RuntimeError):
    """A scheduled function did not run: an earlier one failed, and the queue was cancelled.

    Example:
      >>> issubclass(FunctionCancelledError, RuntimeError)
      True
    """


class RemoteValue:
    """The future result of a scheduled function.

    Example:
      >>> value = RemoteValue()
      >>> value._set_result({"loss": 1.5})
      >>> value.fetch(), value.done()
      ({'loss': 1.5}, True)

    References:
      TensorFlow, ``tf.distribute.experimental.coordinator.RemoteValue``.
    """

    def __init__(self):
        self._ready = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the function has finished (or failed, or been cancelled)."""
        return self._ready.is_set()

    def fetch(self) -> Any:
        """Waits for the function and returns its result as numpy arrays.

        Raises:
          the function's error, :class:`FunctionCancelledError`, or
          :class:`parallax.ps.ServerUnavailableError` when a parameter server died.
        """
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def get(self) -> Any:
        """Waits for the function and returns its result as JAX arrays."""
        return jax.tree.map(jnp.asarray, self.fetch())

    def _set_result(self, value) -> None:
        self._value = value
        self._ready.set()

    def _set_error(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()


class PerWorkerValues:
    """One value per worker, standing in for the worker's own in a scheduled function's args.

    ``ClusterCoordinator.create_per_worker_dataset`` returns one; ``iter()`` of it gives a
    :class:`PerWorkerIterator`. When a function is dispatched, each worker substitutes its
    own dataset (or iterator), which lives on the worker between functions.

    Example:
      >>> values = PerWorkerValues(0)
      >>> iter(values)
      PerWorkerIterator(dataset 0)

    References:
      TensorFlow, ``tf.distribute.experimental.coordinator.PerWorkerValues``.
    """

    kind = "dataset"

    def __init__(self, dataset_id: int):
        self.dataset_id = dataset_id

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(self.dataset_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dataset {self.dataset_id})"


class PerWorkerIterator(PerWorkerValues):
    """Each worker's iterator over its per-worker dataset (advanced only on the worker).

    Example:
      >>> next(PerWorkerIterator(0))
      Traceback (most recent call last):
      ...
      TypeError: PerWorkerIterator: call next() inside a scheduled function, ...
    """

    kind = "iterator"

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self):
        raise TypeError("PerWorkerIterator: call next() inside a scheduled function, where "
                        "each worker has its own iterator.")
