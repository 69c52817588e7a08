"""The batch: how it splits over the mesh, what it must look like, and assembling it from
the shares of several processes.

Every leaf of a batch is split along its leading dimension over the strategy's batch axes
(data parallel, and ZeRO's axis: each ZeRO rank sees its own slice). In a multi-process run
each process holds only its share of the global batch (as in DDP and Horovod), and
:func:`assemble` builds the global ``jax.Array`` from the shares.
"""

from __future__ import annotations

import zlib

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from parallax.mesh import axes_text, axis_size, describe
from parallax.rules import is_array
from parallax.strategy import Strategy

MAX_DIMS = 8  # dimensions compared per leaf when shapes differ between processes


def batch_spec(strategy: Strategy) -> PartitionSpec:
    """The ``PartitionSpec`` of every batch leaf: the leading dimension over the batch axes.

    Example:
      >>> import parallax as px
      >>> batch_spec(px.HSDP())
      P(('data', 'fsdp'),)
    """
    axes = strategy.batch_axes
    if not axes:
        return PartitionSpec()
    return PartitionSpec(axes[0] if len(axes) == 1 else axes)


def batch_sharding(strategy: Strategy, mesh) -> NamedSharding:
    """The one ``NamedSharding`` every batch leaf gets (a valid ``jit`` prefix for any batch)."""
    return NamedSharding(mesh, batch_spec(strategy))


def batch_shardings(batch, strategy: Strategy, mesh):
    """A ``NamedSharding`` per leaf of ``batch``."""
    sharding = batch_sharding(strategy, mesh)
    return jax.tree.map(lambda _: sharding, batch)


def check_batch_tree(batch, api: str) -> None:
    """A batch is a pytree of arrays with one leading (batch) dimension shared by all leaves.

    Runs while a step is traced (shapes only), and on the error path of a call.

    Raises:
      TypeError: a leaf is not an array (a string, None, a Python object).
      ValueError: a leaf is a scalar, or two leaves disagree on the batch size.
    """
    first = None
    for path, leaf in jax.tree_util.tree_flatten_with_path(
            batch, is_leaf=lambda x: x is None)[0]:
        where = jax.tree_util.keystr(path) or "(the batch itself)"
        if not is_array(leaf) and not isinstance(leaf, (bool, int, float, complex)):
            raise TypeError(
                f"{api}: the batch leaf {where} is a {type(leaf).__name__}, not an array; a "
                "batch is a pytree (dict, tuple) of arrays with a leading batch dimension. "
                "Pass other values as extra arguments to the step.")
        shape = tuple(getattr(leaf, "shape", ()))
        if not shape:
            raise ValueError(
                f"{api}: the batch leaf {where} is a scalar; every batch leaf needs a "
                "leading batch dimension. Pass constants as extra arguments to the step."
            )
        if first is None:
            first = (where, shape)
        elif shape[0] != first[1][0]:
            raise ValueError(
                f"{api}: the batch leaves disagree on the batch size: {first[0]} has shape "
                f"{first[1]} and {where} has shape {shape}; every leaf's leading dimension "
                "counts the same examples.")


def check_batch(batch, strategy: Strategy, mesh, api: str) -> None:
    """A pytree of arrays (:func:`check_batch_tree`) whose leading dimension the batch
    shards divide."""
    check_batch_tree(batch, api)
    axes = strategy.batch_axes
    ways = axis_size(mesh, axes)
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        where = jax.tree_util.keystr(path) or "batch"
        if shape[0] % ways:
            raise ValueError(
                f"{api}: the batch leaf {where} has shape {shape}: its leading (batch) "
                f"dimension {shape[0]} is not divisible by the {ways} batch shards "
                f"({axes_text(mesh, axes)}) of {strategy.name} on the mesh {describe(mesh)}; "
                f"use a batch size that is a multiple of {ways}."
            )
        break  # every leaf has the same leading dimension (checked above)


def local_signature(tree) -> tuple[str, list[tuple[str, tuple[int, ...], str]]]:
    """The structure, and every leaf's path, shape and dtype, of this process's batch."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return str(jax.tree.structure(tree)), [
        (jax.tree_util.keystr(p) or "batch", tuple(np.shape(x)), str(np.asarray(x).dtype)
         if not hasattr(x, "dtype") else str(x.dtype)) for p, x in leaves]


def _crc(text: str) -> np.uint32:
    return np.uint32(zlib.crc32(text.encode()))


def check_same_shapes(local, api: str) -> None:
    """Every process passed a batch of the same structure, shapes and dtypes (a no-op for one).

    One small all-gather of two checksums; only when they differ, a second gathers the
    shapes for the message.
    """
    if jax.process_count() == 1:
        return
    structure, leaves = local_signature(local)
    mine = np.array([_crc(structure), _crc(repr(leaves))], np.uint32)
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
    if (every == mine).all():
        return
    if (every[:, 0] != mine[0]).any():
        raise ValueError(
            f"{api}: the processes passed batches of different structure; process "
            f"{jax.process_index()} passed {structure}. Every process must pass the same "
            "keys (its own rows of each).")
    table = np.full((len(leaves), MAX_DIMS + 1), -1, np.int64)
    for i, (_, shape, dtype) in enumerate(leaves):
        table[i, 0] = _crc(dtype)
        table[i, 1:1 + min(len(shape), MAX_DIMS)] = shape[:MAX_DIMS]
    tables = np.asarray(multihost_utils.process_allgather(table))
    for i, (where, shape, dtype) in enumerate(leaves):
        if (tables[:, i] != table[i]).any():
            shapes = {p: tuple(int(d) for d in tables[p, i, 1:] if d >= 0)
                      for p in range(tables.shape[0])}
            raise ValueError(
                f"{api}: the batch leaf {where} differs between processes: shapes by process "
                f"{shapes} (this is process {jax.process_index()}, dtype {dtype}). Every process "
                "must pass the same shape: its own rows of the global batch "
                "(px.distributed.process_slice(global_batch_size) says which).")


def local_rows(leaf):
    """A leaf of this process's share as host data: a ``jax.Array`` on this process's devices
    only is read back (it holds this process's rows); a global ``jax.Array`` is kept."""
    if (isinstance(leaf, jax.Array) and leaf.is_fully_addressable
            and len(leaf.sharding.device_set) < jax.device_count()):
        return np.asarray(leaf)
    return leaf


def assemble(batch, strategy: Strategy, mesh, *, api: str = "px.train_step",
             check: bool = True):
    """The global batch from this process's share of it, as ``jax.Array``s.

    With one process this returns ``batch`` unchanged (``jit`` places host arrays itself).
    With several, every leaf that is not already a global ``jax.Array`` is this process's
    rows of the global batch; the shares are put together along the leading dimension with
    the strategy's batch sharding (``jax.make_array_from_process_local_data``), so the
    global batch is the concatenation of the processes' shares in process order. With
    ``check``, first :func:`check_same_shapes` (one small all-gather between processes).
    """
    if jax.process_count() == 1:
        return batch
    batch = jax.tree.map(local_rows, batch)
    if check:
        check_same_shapes(batch, api)
    sharding = batch_sharding(strategy, mesh)

    def one(leaf):
        if isinstance(leaf, jax.Array):
            return leaf
        return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))

    return jax.tree.map(one, batch)
