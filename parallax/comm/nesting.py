"""Nested ``shard_map`` regions in the order newer XLA requires.

``px.value_and_grad``'s explicit style opens a ``shard_map`` over the batch axes (``data``,
``fsdp``), and code inside it opens nested ones over other axes: the pipeline runtime over
``stage``, :func:`parallax.grad.local_shards.on_local_shards` over a leaf's automatic axes. XLA
0.12's Shardy export (``ExportStablehloShardingsPass``) aborts the whole process (``Check
failed: ... Manual axes must be sorted by mesh axis index``) when the manual axes, outer
region first, are out of the mesh's axis order while some axis is still automatic: ``stage``
(first in parallax's order) inside ``data`` with ``tensor`` automatic. XLA 0.10.2 compiles
the same program. With every axis manual the program compiles on both.

Reproduced without parallax in ``tests/comm/test_nesting.py`` (run in a subprocess there, since
the abort cannot be caught). What parallax does about it:

- :func:`widened` makes a nested region that only reads local shards (``on_local_shards``)
  manual over every remaining axis too, which XLA accepts: the leaf is replicated over
  the added axes, so each device computes the same values.
- :func:`check` turns the abort into a ``ValueError`` that names the region and the fix
  where the nested region needs GSPMD inside it (the pipeline's stage bodies run
  tensor-parallel layers through sharding constraints).
"""

from __future__ import annotations

import jax

# Versions treated as aborting: seen with jax/jaxlib 0.12.0.1; 0.10.2 compiles it, and so
# does 0.12.1 (tests/comm/test_nesting.py's program). Every 0.12 stays covered until the pipelines
# that the check refuses (a stage-first mesh) are checked on 0.12.1.
ABORTS = tuple(jax.__version_info__[:2]) >= (0, 12)

# What a pipelined step can change (the stage bodies need GSPMD for tensor parallelism).
PIPELINE_FIX = (
    "Build the mesh with px.make_mesh (it names the pipeline axis after the batch axes), or "
    "name it so yourself (jax.sharding.Mesh(devices, ('data', 'stage', 'tensor'))); or, on "
    "this jax, compose the pipeline with tensor parallelism or with the batch axes, not both.")


def _mesh():
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(mesh, "axis_names", ()) or ())
    manual = frozenset(getattr(mesh, "manual_axes", ()) or ())
    return names, manual


def out_of_order(inner) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(outer manual axes, automatic axes left)`` when a ``shard_map`` over ``inner``,
    opened here, is one XLA 0.12 aborts on; ``((), ())`` when it compiles.

    Example:
      >>> out_of_order({"stage"})   # outside any shard_map
      ((), ())
    """
    names, manual = _mesh()
    inner = {a for a in inner if a not in manual}
    if not ABORTS or not manual or not inner:
        return (), ()
    rank = {a: i for i, a in enumerate(names)}
    left = tuple(a for a in names if a not in manual and a not in inner)
    if not left or max(rank[a] for a in manual) < min(rank[a] for a in inner):
        return (), ()
    return tuple(a for a in names if a in manual), left


def widened(inner) -> frozenset[str]:
    """The axes a nested ``shard_map`` that reads local shards only should be manual over:
    ``inner``, plus every automatic axis when ``inner`` alone would abort XLA 0.12."""
    outer, left = out_of_order(inner)
    return frozenset(inner) | frozenset(left) if outer else frozenset(inner)


def check(inner, api: str, fix: str) -> None:
    """Raises ``ValueError`` where a nested ``shard_map`` over ``inner`` would abort XLA.

    Args:
      inner: the axes the nested ``shard_map`` makes manual.
      api: the parallax API opening it, for the message.
      fix: what the user can change.

    Raises:
      ValueError: naming the axes, their nesting, the jax version and ``fix``.
    """
    outer, left = out_of_order(inner)
    if outer:
        raise ValueError(
            f"{api}: a shard_map over {tuple(sorted(inner))} nested inside the one over "
            f"{outer}, with {left} left automatic, makes XLA {jax.__version__} abort the "
            f"process (Shardy: 'Manual axes must be sorted by mesh axis index'; XLA 0.10 "
            f"compiles it). {fix}")
