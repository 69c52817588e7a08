"""Process-local values as global arrays: one row per process, for collectives over processes.

A collective over processes (Horovod's ``allreduce`` of a numpy array, a broadcast of
parameters from rank 0) is, in JAX, a jitted program over a global array. Each process puts
its value in its own row of a ``[processes, ...]`` array laid out on the *process mesh*
(axes ``process`` x ``local``: every device of a process holds that process's row), and the
program reduces, gathers or selects rows; XLA turns that into its collectives (gloo on CPU,
NCCL on GPU). No data moves outside JAX.

Example:
  >>> import numpy as np
  >>> rows = stack(np.arange(3.0))
  >>> rows.shape, rows.sharding.spec
  ((1, 3), P('process',))
  >>> like(rows[0], np.zeros(3))
  array([0., 1., 2.], dtype=float32)

Data that only moves (broadcast, gather) travels as its bytes (:func:`as_bytes`), so every
dtype arrives bit for bit, float64 included when JAX computes in 32 bits.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

PROCESS, LOCAL = "process", "local"


@functools.cache
def _process_mesh(devices: tuple) -> Mesh:
    count = jax.process_count()
    by_process = [[d for d in devices if d.process_index == p] for p in range(count)]
    if len({len(ds) for ds in by_process}) != 1:
        raise ValueError(
            "parallax.distributed: the processes have different numbers of devices "
            f"({[len(ds) for ds in by_process]}); collectives over processes need the same "
            "number on each (parallax launch --devices-per-process K).")
    return Mesh(np.array(by_process, dtype=object), (PROCESS, LOCAL),
                axis_types=(AxisType.Auto, AxisType.Auto))


def process_mesh() -> Mesh:
    """The mesh ``process`` x ``local`` over every device, rows in process order."""
    return _process_mesh(tuple(jax.devices()))


def is_local(x) -> bool:
    """A process-local value: numpy, a Python number, or a ``jax.Array`` on one process only
    (in a multi-process job; with one process every array counts as local)."""
    if isinstance(x, jax.Array):
        return jax.process_count() == 1 or (
            x.is_fully_addressable and len(x.sharding.device_set) < jax.device_count())
    return isinstance(x, (np.ndarray, np.generic, int, float, complex, bool))


def stack(x) -> jax.Array:
    """This process's ``x`` as its row of a global ``[processes, *x.shape]`` array."""
    sharding = NamedSharding(process_mesh(), PartitionSpec(PROCESS))
    return jax.make_array_from_process_local_data(sharding, np.asarray(x)[None])


def replicated() -> NamedSharding:
    """Every device holds the whole value (the output sharding of a collective)."""
    return NamedSharding(process_mesh(), PartitionSpec())


def local_copy(x: jax.Array):
    """This process's copy of a replicated (or process-row) global array, as numpy."""
    return np.asarray(x.addressable_data(0))


def like(value, template):
    """``value`` (numpy) in the kind of ``template``: numpy stays numpy, a ``jax.Array``
    becomes one on this process's first device, a Python scalar a NumPy scalar."""
    if isinstance(template, jax.Array):
        return jax.device_put(value, jax.local_devices()[0])
    if isinstance(template, np.ndarray):
        return np.asarray(value)
    return np.asarray(value)[()]


def as_bytes(x) -> np.ndarray:
    """``x`` as ``uint8`` of shape ``[*x.shape, itemsize]``: moves any dtype exactly.

    Example:
      >>> b = as_bytes(np.array([1.5, 2.5]))
      >>> b.shape, from_bytes(b, np.float64, (2,))
      ((2, 8), array([1.5, 2.5]))
    """
    x = np.ascontiguousarray(np.asarray(x))
    return x.reshape(-1).view(np.uint8).reshape(x.shape + (x.dtype.itemsize,))


def from_bytes(data, dtype, shape) -> np.ndarray:
    """The inverse of :func:`as_bytes`."""
    data = np.ascontiguousarray(np.asarray(data, np.uint8))
    return data.reshape(-1).view(np.dtype(dtype)).reshape(shape)
