"""Eager programs over the processes of a process set only: the members talk, the rest don't.

A jitted program whose devices belong to some processes is run by those processes alone
(JAX's multi-controller rule asks every process *holding a device of the program* to run
it), and XLA's collectives (gloo on CPU, NCCL on GPU) connect only them. So an eager
collective on a :class:`~parallax.horovod.ProcessSet` can be called by the set's members
only, as in Horovod, where a non-member's call is an error: each member puts its value in
its row of a ``[members, ...]`` array laid out on the members' devices, and one program
moves the rows.

Example:
  >>> import numpy as np
  >>> mesh = members_mesh((0,))
  >>> gather_bytes(np.arange(3.0), mesh)      # one member: its own row
  array([[0., 1., 2.]])

References:
  Horovod's process sets (horovod/common/process_sets.py; operations.cc refuses a
  non-member's call: "Rank ... is not a member of the provided process set").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from parallax.distributed import local_arrays
from parallax.distributed.local_arrays import LOCAL, PROCESS


@functools.cache
def members_mesh(processes: tuple[int, ...]) -> Mesh:
    """The mesh ``process`` x ``local`` over the devices of ``processes`` (in that order)."""
    by_process = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                  for p in processes]
    return Mesh(np.array(by_process, dtype=object), (PROCESS, LOCAL),
                axis_types=(AxisType.Auto, AxisType.Auto))


def stack(x, mesh: Mesh) -> jax.Array:
    """This member's ``x`` as its row of a ``[members, *x.shape]`` array on ``mesh``."""
    return jax.make_array_from_process_local_data(
        NamedSharding(mesh, PartitionSpec(PROCESS)), np.asarray(x)[None])


@functools.cache
def _program(kind: str, mesh: Mesh):
    if kind == "gather":  # every member gets every row
        return jax.jit(lambda rows: rows, out_shardings=NamedSharding(mesh, PartitionSpec()))
    # rows [source, destination, ...] -> [destination, source, ...], row d on member d
    return jax.jit(lambda rows: jnp.swapaxes(rows, 0, 1),
                   out_shardings=NamedSharding(mesh, PartitionSpec(PROCESS)))


def gather_bytes(value: np.ndarray, mesh: Mesh) -> np.ndarray:
    """Every member's ``value`` (same shape on each), exactly: ``[members, *value.shape]``."""
    value = np.asarray(value)
    out = _program("gather", mesh)(stack(local_arrays.as_bytes(value), mesh))
    return local_arrays.from_bytes(local_arrays.local_copy(out), value.dtype,
                                   (mesh.shape[PROCESS],) + value.shape)


def exchange(chunks: np.ndarray, mesh: Mesh) -> np.ndarray:
    """``chunks[j]`` goes to member ``j``; returns ``[members, ...]``, row ``s`` from member
    ``s``."""
    out = _program("exchange", mesh)(stack(local_arrays.as_bytes(chunks), mesh))
    return local_arrays.from_bytes(local_arrays.local_copy(out)[0], chunks.dtype, chunks.shape)
