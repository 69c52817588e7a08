"""``OneDeviceStrategy``: the ``tf.distribute`` API on a single device.

TensorFlow's ``OneDeviceStrategy(device)`` places variables and computation on one device and
keeps the distribution API, so a script written for ``MirroredStrategy`` runs unchanged on
one device: ``run`` returns plain tensors (not ``PerReplica``), ``reduce`` of a plain value
returns it (reducing over ``axis`` when given), ``experimental_local_results(v)`` is
``(v,)`` and the distributed dataset yields the batches themselves, on the device
(``python/distribute/one_device_strategy.py``). Here it is the mirrored strategy with one
replica, whose results are unwrapped as TensorFlow's are.

References:
  TensorFlow, ``tf.distribute.OneDeviceStrategy``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp

from parallax.tf.cross_replica import is_distributed
from parallax.tf.merge_call import MergedValue
from parallax.tf.mirrored.strategy import MirroredStrategy
from parallax.tf.reduce_op import ReduceOp, as_reduce_op
from parallax.tf.values import Mirrored, PerReplica


def _plain(x):
    """The one replica's value (also of a ``merge_call`` argument)."""
    if isinstance(x, MergedValue):
        return x.component
    if isinstance(x, PerReplica):
        return x.stacked[0]
    if isinstance(x, Mirrored):
        return x.value
    return x


class OneDeviceStrategy(MirroredStrategy):
    """Training on one device with TensorFlow's ``tf.distribute`` API.

    Args:
      device: the device: a ``jax.Device``, its id, or a name like ``"cpu:0"`` /
        ``"/gpu:0"`` (TensorFlow's spelling).

    Example:
      >>> import jax.numpy as jnp, parallax as px
      >>> strategy = px.tf.OneDeviceStrategy("cpu:0")
      >>> for batch in strategy.experimental_distribute_dataset([jnp.arange(4.0)]):
      ...     loss = strategy.run(lambda x: jnp.sum(x ** 2), args=(batch,))
      >>> float(loss), float(strategy.reduce("SUM", loss, axis=None))
      (14.0, 14.0)

    References:
      TensorFlow, ``tf.distribute.OneDeviceStrategy``.
    """

    API = "px.tf.OneDeviceStrategy"

    def __init__(self, device):
        if isinstance(device, (list, tuple)):
            raise TypeError(f"{self.API}: device must be one device (e.g. 'gpu:0'); got a "
                            f"{type(device).__name__} of {len(device)}: use "
                            "px.tf.MirroredStrategy(devices=...) for several.")
        super().__init__(devices=[device])

    def __repr__(self) -> str:
        return f"OneDeviceStrategy({self.devices[0]})"

    def run(self, fn: Callable, args: Sequence = (), kwargs: dict | None = None):
        """Runs ``fn(*args, **kwargs)`` on the device; returns its results as they are."""
        outputs = super().run(fn, args, kwargs)
        return jax.tree.map(_plain, outputs, is_leaf=is_distributed)

    def reduce(self, reduce_op, value, axis: int | None = None):
        """One replica: ``value`` itself, or its SUM / MEAN over ``axis``.

        Example:
          >>> import jax.numpy as jnp, parallax as px
          >>> px.tf.OneDeviceStrategy("cpu:0").reduce("MEAN", jnp.arange(4.0), axis=0)
          Array(1.5, dtype=float32)
        """
        api = f"{self.API}.reduce"
        op = as_reduce_op(api, reduce_op)
        if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
            raise TypeError(f"{api}: axis must be None or an int; got {axis!r}.")

        def one(x):
            x = jnp.asarray(_plain(x))
            if axis is None:
                return x
            if not -x.ndim <= axis < x.ndim:
                raise ValueError(f"{api}: axis={axis} is out of range for a value of shape "
                                 f"{tuple(x.shape)}.")
            return jnp.mean(x, axis) if op is ReduceOp.MEAN else jnp.sum(x, axis)

        return jax.tree.map(one, value, is_leaf=is_distributed)

    def gather(self, value, axis: int):
        """One replica: ``value`` itself."""
        del axis
        return jax.tree.map(lambda x: jnp.asarray(_plain(x)), value, is_leaf=is_distributed)

    def experimental_local_results(self, value) -> tuple:
        """``(value,)``: the one replica's result."""
        return (jax.tree.map(_plain, value, is_leaf=is_distributed),)

    def experimental_distribute_dataset(self, dataset: Iterable, options=None):
        """The batches of ``dataset``, each put on the device (TF prefetches them there)."""
        super().experimental_distribute_dataset([], options)  # validates options
        return _OnDevice(dataset, self.devices[0])


class _OnDevice:
    """Iterates a dataset, putting each batch on one device."""

    def __init__(self, dataset: Iterable, device: jax.Device):
        self._dataset, self._device = dataset, device

    def __iter__(self) -> Iterator:
        for batch in self._dataset:
            yield jax.device_put(batch, self._device)
