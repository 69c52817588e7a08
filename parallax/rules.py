"""Logical-axis rules: from the names a model gives its dimensions to mesh axes.

A model says what each dimension *is* (``"embed"``, ``"mlp"``, ``"heads"``, ``"vocab"``,
``"layers"`` for parameters; ``"batch"``, ``"sequence"`` for activations) and never which mesh
axis shards it. A strategy holds a small table from logical names to mesh axes; this module
turns names + table + mesh into a ``PartitionSpec`` for every leaf, checking divisibility.
It is pure: nothing here reads the step being traced (``px.constrain``, which does, is
:mod:`parallax.constrain`).

Names are read from three kinds of trees:

- Flax NNX state: the ``out_sharding`` metadata that ``nnx.with_partitioning`` puts on a
  ``Variable`` (older flax calls it ``sharding_names``);
- Flax Linen params: ``nn.LogicallyPartitioned`` boxes (logical names) and ``nn.Partitioned``
  boxes (mesh axes already);
- plain pytrees: no names, so every dimension is unmapped (replicated); ZeRO then shards the
  largest divisible dimension (see ``parallax.strategies.zero``).

Example:
  >>> import jax, parallax as px
  >>> mesh = px.make_mesh(data=4, tensor=2)
  >>> px.rules.resolve_spec(("embed", "mlp"), (64, 256), {"mlp": "tensor"}, mesh)
  P(None, 'tensor')
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from flax.core import meta as linen_meta
from flax.linen.spmd import LogicallyPartitioned
from jax.sharding import PartitionSpec

from parallax.mesh import axes_text, axis_size

# The logical name of a stacked-layer axis (``nnx.vmap`` over blocks): pipelines shard it,
# ZeRO never picks it (slicing a layer per scan iteration must not move data).
LAYERS = "layers"

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]
Names = tuple[str | None, ...]


class AnnotatedLeaf(NamedTuple):
    """One array leaf of a tree, with its path and what its dimensions are called."""

    path: tuple
    leaf: Any
    names: Names | None  # logical names; None when the tree gives none
    physical: bool  # True when ``names`` are mesh axes already (Linen ``Partitioned``)


def _is_box(x) -> bool:
    return isinstance(x, (nnx.Variable, linen_meta.Partitioned))


def _box_names(box) -> tuple[Names | None, bool]:
    if isinstance(box, nnx.Variable):
        metadata = box.get_metadata()
        names = metadata.get("out_sharding") or metadata.get("sharding_names")
        return (tuple(names) if names else None), False
    if isinstance(box, LogicallyPartitioned):
        return tuple(box.names), False
    return tuple(box.names), True  # nn.Partitioned: mesh axis names


def annotated_leaves(tree) -> list[AnnotatedLeaf]:
    """Every array leaf of ``tree`` in ``jax.tree.leaves`` order, with its logical names."""
    out = []
    for path, node in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_box)[0]:
        names, physical = _box_names(node) if _is_box(node) else (None, False)
        for sub, leaf in jax.tree_util.tree_flatten_with_path(node)[0]:
            out.append(AnnotatedLeaf(path + sub, leaf, names, physical))
    return out


def readable_path(path: tuple) -> str:
    """``keystr`` of a parameter's path without NNX's trailing ``.value``."""
    return jax.tree_util.keystr(tuple(
        k for k in path if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")))


def is_array(x) -> bool:
    """Arrays (``jax.Array``, tracers, numpy) as opposed to static Python values: the leaves
    a layout places (a batch, a state, a model's outputs) rather than carries along."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def as_tuple(axes: MeshAxes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def format_rules(rules: Mapping[str, MeshAxes]) -> str:
    return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in rules.items()) + "}"


def resolve_spec(
    names: Names | None,
    shape: Sequence[int],
    rules: Mapping[str, MeshAxes],
    mesh,
    *,
    path: str = "",
    api: str = "parallax",
    physical: bool = False,
    skip_axes: frozenset[str] = frozenset(),
) -> PartitionSpec:
    """The ``PartitionSpec`` of one array, from its logical names and a rule table.

    Args:
      names: one logical name (or None) per dimension; None for an unannotated array.
      shape: the array's shape.
      rules: logical name -> mesh axis, tuple of mesh axes, or None. Names not in the table
        are replicated.
      mesh: the mesh (its axis sizes are used for the divisibility check).
      path: the pytree path, for messages.
      api: the public API name, for messages.
      physical: ``names`` are mesh axes already (Linen ``nn.Partitioned``).
      skip_axes: mesh axes to leave out (manual ones inside ``shard_map``).

    Returns:
      A ``PartitionSpec`` with one entry per dimension. A mesh axis shards at most one
      dimension: when two dimensions map to the same axis, the first keeps it.

    Raises:
      ValueError: the names do not match the rank, or a dimension is not divisible by the
        mesh axes it maps to (the message names the path, shape, axes and a fix).
    """
    shape = tuple(shape)
    if names is None:
        return PartitionSpec(*([None] * len(shape)))
    where = f" {path}" if path else ""
    if len(names) != len(shape):
        raise ValueError(
            f"{api}: the array{where} has shape {shape} ({len(shape)} dimensions) but its "
            f"sharding annotation {names} names {len(names)}; give one name (or None) per "
            "dimension."
        )
    used: set[str] = set()
    entries = []
    for dim, (name, size) in enumerate(zip(names, shape)):
        axes = as_tuple(name if physical else rules.get(name)) if name is not None else ()
        axes = tuple(a for a in axes if a not in used and a not in skip_axes)
        for a in axes:
            if a not in mesh.shape:
                raise ValueError(
                    f"{api}: logical axis {name!r} of{where} maps to mesh axis {a!r}, which "
                    f"the mesh does not have (axes {tuple(mesh.axis_names)}); add it to the "
                    "mesh or change the rule."
                )
        ways = axis_size(mesh, axes)
        if size % ways:
            raise ValueError(
                f"{api}: cannot shard{where} of shape {shape}: dimension {dim} "
                f"({name!r}, size {size}) maps to mesh axes {axes_text(mesh, axes)} "
                f"({ways} shards), and "
                f"{size} is not divisible by {ways}. Fix: make that dimension a multiple of "
                f"{ways} (pad it), or map {name!r} to None in the rules."
            )
        used.update(axes)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)
