"""Hierarchical (2D) all-reduce: reduce-scatter inside, all-reduce across, all-gather inside.

On a machine with fast links inside a node (NVLink, a TPU slice's ICI) and slow links
between nodes (Ethernet, InfiniBand, DCN), a flat ring over every device pays the slow link
on every step. The hierarchical scheme of Horovod (``HOROVOD_HIERARCHICAL_ALLREDUCE``) and
NCCL's tree/ring mix does three steps instead:

1. reduce-scatter over ``inner_axis`` (fast): each device owns ``S / n_inner`` summed inside
   its node;
2. all-reduce of that shard over ``outer_axis`` (slow): only ``S / n_inner`` crosses nodes;
3. all-gather over ``inner_axis`` (fast).

The slow network carries ``n_inner`` times fewer bytes than a flat all-reduce would put on it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from parallax.comm import checks
from parallax.comm._chunks import finish, join_flat, split_flat
from parallax.comm.compress import Wire, as_compression
from parallax.comm.ring import all_gather_chunks, reduce_scatter_chunks, ring_all_reduce
from parallax.comm.tree import tree_all_reduce

ALGORITHMS = ("xla", "ring")
OUTER_ALGORITHMS = ("xla", "ring", "tree")


def hierarchical_all_reduce(
    x,
    inner_axis: str,
    outer_axis: str,
    *,
    op: str = "sum",
    algorithm: str = "xla",
    outer_algorithm: str | None = None,
    compression=None,
):
    """All-reduce over two mesh axes: reduce-scatter on the inner, all-reduce on the outer.

    Args:
      x: an array or pytree of arrays (the local block inside ``shard_map``). Any size:
        each leaf is flattened and zero-padded to a multiple of ``n_inner``.
      inner_axis: the fast axis (devices in one node), e.g. ``"tensor"`` or ``"fsdp"``.
      outer_axis: the slow axis (across nodes), e.g. ``"data"``.
      op: ``"sum"`` or ``"mean"`` with ``algorithm="xla"`` (``lax.psum_scatter`` only sums);
        also ``"max"``, ``"min"``, ``"prod"`` with ``algorithm="ring"``.
      algorithm: ``"xla"`` (``psum_scatter`` / ``psum`` / ``all_gather``: real
        ``reduce-scatter``, ``all-reduce``, ``all-gather`` instructions) or ``"ring"`` (the
        point-to-point rings of :mod:`parallax.comm.ring` on both axes).
      outer_algorithm: the step across nodes: ``"xla"``, ``"ring"`` or ``"tree"``; by default
        the same as ``algorithm``.
      compression: ``None`` or a :class:`Compression`, applied on all three steps. With
        ``"xla"`` steps the collective reduces in the wire dtype (the CPU backend promotes it
        back to float32 on the wire).

    Returns:
      The reduction over both axes, same shapes and dtypes as ``x``, identical on every
      device (typed varying over ``inner_axis``, and over ``outer_axis`` unless the outer
      step is ``"xla"``).

    Example:
      >>> mesh = jax.make_mesh((2, 4), ("data", "tensor"),
      ...                      axis_types=(jax.sharding.AxisType.Auto,) * 2)
      >>> f = jax.jit(jax.shard_map(lambda v: hierarchical_all_reduce(v, "tensor", "data"),
      ...                   mesh=mesh, in_specs=jax.P(("data", "tensor")),
      ...                   out_specs=jax.P(("data", "tensor"))))
      >>> f(jnp.arange(8.0)).tolist()
      [28.0, 28.0, 28.0, 28.0, 28.0, 28.0, 28.0, 28.0]

    References:
      Horovod hierarchical all-reduce (Sergeev & Del Balso 2018); Jia et al. 2018, "Highly
      scalable deep learning training system with mixed-precision" (2D all-reduce); NCCL
      (intra-node then inter-node rings/trees); Thakur et al. 2005 (the cost terms).
    """
    api = "hierarchical_all_reduce"
    inner, n_in = checks.check_axis(api, inner_axis)
    outer, n_out = checks.check_axis(api, outer_axis)
    checks.check_choice(api, "algorithm", algorithm, ALGORITHMS)
    outer_algorithm = algorithm if outer_algorithm is None else outer_algorithm
    checks.check_choice(api, "outer_algorithm", outer_algorithm, OUTER_ALGORITHMS)
    inner_names = inner if isinstance(inner, tuple) else (inner,)
    outer_names = outer if isinstance(outer, tuple) else (outer,)
    if set(inner_names) & set(outer_names):
        raise ValueError(
            f"{api}: inner_axis={inner_axis!r} and outer_axis={outer_axis!r} overlap; pass "
            "two different mesh axes (fast one inner, slow one outer)."
        )
    checks.check_op(api, op, ("sum", "mean") if algorithm == "xla" else checks.OPS)
    if outer_algorithm == "xla" and op in ("prod",):
        raise ValueError(f"{api}: op='prod' needs outer_algorithm='ring' or 'tree'.")
    comp = as_compression(api, compression)
    n = n_in * n_out

    def outer_step(chunk):
        if outer_algorithm == "ring":
            return ring_all_reduce(chunk, outer, op=_partial_op(op), compression=comp)
        if outer_algorithm == "tree":
            return tree_all_reduce(chunk, outer, op=_partial_op(op), compression=comp)
        wire = Wire(comp, chunk.dtype)
        reduce = {"sum": lax.psum, "mean": lax.psum, "max": lax.pmax, "min": lax.pmin}
        return wire.recv(reduce[op](wire.send(chunk), outer))

    def leaf(v):
        v = jnp.asarray(v)
        wire = Wire(comp, v.dtype)
        chunks = split_flat(v.astype(wire.acc), n_in)
        if algorithm == "ring":
            mine = reduce_scatter_chunks(chunks, inner, n_in, _partial_op(op), wire)
        else:
            mine = wire.recv(lax.psum_scatter(
                wire.send(chunks), inner, scatter_dimension=0, tiled=True))[0]
        mine = finish(outer_step(mine), op, n)
        if algorithm == "ring":
            gathered = all_gather_chunks(mine, inner, n_in, Wire(comp, mine.dtype), mine.dtype)
        else:
            w = Wire(comp, mine.dtype)
            own = w.round(mine)  # round own shard as the others are rounded
            gathered = w.recv(lax.all_gather(w.send(own), inner, axis=0, tiled=False))
        out = join_flat(gathered, v.shape)
        if op == "mean" and not jnp.issubdtype(v.dtype, jnp.inexact):
            return out
        return out.astype(v.dtype)

    return jax.tree.map(leaf, x)


def _partial_op(op: str) -> str:
    """The reduction each step does: a mean is summed everywhere and divided once."""
    return "sum" if op == "mean" else op
