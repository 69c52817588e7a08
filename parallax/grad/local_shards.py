"""Collectives on the local shards of the automatic (GSPMD) axes of a leaf.

Inside the ``shard_map`` that ``px.value_and_grad`` opens over the batch axes, the tensor
axes stay automatic. A collective over a batch axis on a leaf whose other dimensions are
sharded over an automatic axis (a tensor-parallel kernel) makes XLA gather those dimensions
first (measured: the whole kernel moved over ``tensor`` before the all-gather over
``fsdp``). Running the collective in a nested ``shard_map`` over the leaf's automatic axes
keeps it on the local tensor-parallel shard. Where that nested region would be out of the
mesh's axis order (``stage`` inside ``data``), it is made manual over every automatic axis
(:mod:`parallax.comm.nesting`: XLA 0.12 aborts otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
from jax.sharding import PartitionSpec

from parallax.layout import LeafLayout
from parallax.comm.nesting import widened
from parallax.rules import as_tuple


def auto_axes(lays: Sequence[LeafLayout], manual_axes) -> tuple[str, ...]:
    """The automatic mesh axes that any of the leaves is sharded over."""
    return tuple(sorted({a for lay in lays for e in lay.base if e is not None
                         for a in as_tuple(e) if a not in manual_axes}))


def local_spec(lay: LeafLayout, manual_axes) -> PartitionSpec:
    """The leaf's base spec without the manual axes (its spec over the automatic ones)."""
    return PartitionSpec(*(
        None if e is None else tuple(a for a in as_tuple(e) if a not in manual_axes) or None
        for e in lay.base
    ))


def on_local_shards(fn: Callable, x: jax.Array, lay: LeafLayout, manual_axes) -> jax.Array:
    """``fn(x, lay)``, run on the local shard of the leaf's automatic axes."""
    auto = auto_axes([lay], manual_axes)
    if not auto:
        return fn(x, lay)
    spec = local_spec(lay, manual_axes)
    return jax.shard_map(
        lambda v: fn(v, lay), in_specs=spec, out_specs=spec, axis_names=widened(auto)
    )(x)


def group_on_local_shards(fn: Callable, leaves: list, lays: Sequence[LeafLayout],
                          manual_axes) -> list:
    """``fn(leaves)`` for a group of leaves, in ONE nested ``shard_map`` over their automatic
    axes, so that a bucketing sync sees every leaf of the group at once."""
    auto = auto_axes(lays, manual_axes)
    if not auto:
        return list(fn(list(leaves)))
    specs = [local_spec(lay, manual_axes) for lay in lays]
    return list(jax.shard_map(lambda ls: list(fn(ls)), in_specs=(specs,), out_specs=specs,
                              axis_names=widened(auto))(list(leaves)))
