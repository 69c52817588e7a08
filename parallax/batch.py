"""The batch: how it splits over the mesh, what it must look like, and assembling it from
the shares of several processes.

Every leaf of a batch is split along its leading dimension over the strategy's batch axes
(data parallel, and ZeRO's axis: each ZeRO rank sees its own slice). In a multi-process run
each process holds only its share of the global batch (as in DDP and Horovod), and
:func:`assemble` builds the global ``jax.Array`` from the shares.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from parallax.mesh import axes_text, axis_size, describe
from parallax.strategy import Strategy


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


def check_batch(batch, strategy: Strategy, mesh, api: str) -> None:
    """Every batch leaf needs a leading dimension divisible by the batch shards."""
    axes = strategy.batch_axes
    ways = axis_size(mesh, axes)
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        where = jax.tree_util.keystr(path) or "batch"
        if not shape:
            raise ValueError(
                f"{api}: the batch leaf {where} is a scalar; every batch leaf needs a "
                "leading batch dimension. Pass constants as extra arguments to the step."
            )
        if shape[0] % ways:
            raise ValueError(
                f"{api}: the batch leaf {where} has shape {shape}: its leading (batch) "
                f"dimension {shape[0]} is not divisible by the {ways} batch shards "
                f"({axes_text(mesh, axes)}) of {strategy.name} on the mesh {describe(mesh)}; "
                f"use a batch size that is a multiple of {ways}."
            )


def assemble(batch, strategy: Strategy, mesh):
    """The global batch from this process's share of it (host arrays), as ``jax.Array``s.

    With one process this returns ``batch`` unchanged (``jit`` places host arrays itself).
    With several, every leaf that is not already a ``jax.Array`` is this process's rows of
    the global batch; the shares are put together along the leading dimension with the
    strategy's batch sharding (``jax.make_array_from_process_local_data``), so the global
    batch is the concatenation of the processes' shares in process order.
    """
    if jax.process_count() == 1:
        return batch
    sharding = batch_sharding(strategy, mesh)

    def one(leaf):
        if isinstance(leaf, jax.Array):
            return leaf
        return jax.make_array_from_process_local_data(sharding, np.asarray(leaf))

    return jax.tree.map(one, batch)
