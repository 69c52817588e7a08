"""Batches across processes: each process loads its rows, the step sees one global batch.

In a multi-process run every process feeds only its share of the global batch, as in DDP and
Horovod. :func:`process_slice` says which rows of a global batch a process should load (from
the strategy's batch sharding: its devices' rows), and :func:`global_batch` assembles the
shares into global ``jax.Array`` s with that sharding, after checking that every process
passed the same structure, shapes and dtypes.

A loader shards by process with these two numbers, e.g. grain's
``ShardByJaxProcess`` or a plain iterator that reads ``rows[process_slice(B, mesh, strategy)]``.
"""

from __future__ import annotations

import jax
import numpy as np

from parallax.step import batch as batch_lib
from parallax.mesh import axes_text, axis_size, describe
from parallax.strategy import Strategy

def _check_int(api: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{api}: {name} must be an int, got {type(value).__name__}.")
    if value < 1:
        raise ValueError(f"{api}: {name}={value} must be >= 1.")
    return int(value)


def process_slice(global_batch_size: int, mesh=None, strategy: Strategy | None = None) -> slice:
    """The rows of a global batch that this process loads.

    Without a mesh, the batch is split evenly over the processes in process order (DDP's and
    Horovod's convention). With a mesh and strategy, the rows are those the strategy's batch
    sharding puts on this process's devices: a pipeline whose stage axis spans the
    processes, for instance, gives every process the whole batch.

    Args:
      global_batch_size: rows in the global batch.
      mesh: the mesh of the step (optional).
      strategy: the strategy of the step (with ``mesh``).

    Returns:
      A ``slice`` of rows.

    Raises:
      ValueError: the batch does not split evenly over the processes (or the batch shards).

    Example:
      >>> import parallax as px
      >>> px.distributed.process_slice(64)          # one process: every row
      slice(0, 64, None)
      >>> px.distributed.process_slice(64, px.make_mesh(data=8), px.DataParallel("data"))
      slice(0, 64, None)

    References:
      PyTorch ``DistributedSampler``; grain ``ShardByJaxProcess``; Horovod's per-rank shards.
    """
    api = "px.distributed.process_slice"
    size = _check_int(api, "global_batch_size", global_batch_size)
    if mesh is None:
        count, index = jax.process_count(), jax.process_index()
        if size % count:
            raise ValueError(
                f"{api}: a global batch of {size} rows does not split evenly over {count} "
                f"processes; use a multiple of {count}.")
        share = size // count
        return slice(index * share, (index + 1) * share)
    if strategy is None:
        raise TypeError(f"{api}: pass strategy= with mesh= (the batch sharding comes from it).")
    ways = axis_size(mesh, strategy.batch_axes)
    if size % ways:
        raise ValueError(
            f"{api}: a global batch of {size} rows does not split over the {ways} batch shards "
            f"({axes_text(mesh, strategy.batch_axes)}) of {strategy.name} on the mesh "
            f"{describe(mesh)}; use a multiple of {ways}.")
    sharding = batch_lib.batch_sharding(strategy, mesh)
    rows = sorted({(s[0].start or 0, size if s[0].stop is None else s[0].stop)
                   for s in sharding.addressable_devices_indices_map((size,)).values()})
    start, stop = rows[0][0], rows[0][1]
    for lo, hi in rows[1:]:
        if lo != stop:
            raise ValueError(
                f"{api}: this process's devices hold rows {rows} of the batch, which are not "
                f"one contiguous block on the mesh {describe(mesh)}; order the mesh's devices "
                "by process (px.make_mesh does) so each process holds one block.")
        stop = hi
    return slice(start, stop)


def global_batch(local, mesh, strategy: Strategy, *, check: bool = True):
    """The global batch from this process's share of it, with the strategy's batch sharding.

    Every leaf of ``local`` is this process's rows (``process_slice`` says which); the
    global batch is their concatenation in process order, each leaf a ``jax.Array`` split over
    the strategy's batch axes (``jax.make_array_from_process_local_data``). With one process
    the batch is simply placed with that sharding.

    Args:
      local: a pytree of host arrays (numpy, or ``jax.Array`` on this process's devices).
      mesh: the step's mesh.
      strategy: the step's strategy.
      check: first check that every process passed the same structure, shapes and dtypes
        (one small all-gather per call).

    Returns:
      The global batch, a pytree of ``jax.Array``.

    Raises:
      ValueError: the processes passed different shapes (the message lists them), or a
        leaf does not split over the batch shards.

    Example:
      >>> import numpy as np, parallax as px
      >>> mesh, strategy = px.make_mesh(data=8), px.DataParallel("data")
      >>> batch = px.distributed.global_batch({"x": np.ones((16, 3))}, mesh, strategy)
      >>> batch["x"].shape, batch["x"].sharding.spec
      ((16, 3), P('data',))

    References:
      ``jax.make_array_from_process_local_data``; PyTorch DDP and Horovod, where each process
      feeds its own share of the batch.
    """
    api = "px.distributed.global_batch"
    if not isinstance(strategy, Strategy):
        raise TypeError(f"{api}: strategy must be a px.Strategy, got {type(strategy).__name__}.")
    if jax.process_count() == 1:
        batch_lib.check_batch(local, strategy, mesh, api)
        return jax.device_put(local, batch_lib.batch_shardings(local, strategy, mesh))
    local = jax.tree.map(batch_lib.local_rows, local)
    if check:
        batch_lib.check_same_shapes(local, api)
    _check_local_rows(local, mesh, strategy, api)
    return batch_lib.assemble(local, strategy, mesh, api=api, check=False)


def _local_batch_shards(mesh, strategy: Strategy) -> int:
    """How many distinct batch shards this process's devices hold."""
    names = list(mesh.axis_names)
    positions = set()
    for index in np.ndindex(mesh.devices.shape):
        if mesh.devices[index].process_index == jax.process_index():
            positions.add(tuple(index[names.index(a)] for a in strategy.batch_axes))
    return max(1, len(positions))


def _check_local_rows(local, mesh, strategy: Strategy, api: str) -> None:
    shards = _local_batch_shards(mesh, strategy)
    for path, leaf in jax.tree_util.tree_flatten_with_path(local)[0]:
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            continue  # already global
        shape = np.shape(leaf)
        where = jax.tree_util.keystr(path) or "batch"
        if not shape or shape[0] % shards:
            raise ValueError(
                f"{api}: this process's share of the batch leaf {where} has shape {shape}: its "
                f"leading dimension must split over the {shards} batch shards this process "
                f"holds ({axes_text(mesh, strategy.batch_axes)} of {strategy.name} on the mesh "
                f"{describe(mesh)}); load a multiple of {shards} rows per process.")
