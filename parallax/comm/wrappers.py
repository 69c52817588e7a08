"""Validated collectives over named mesh axes, for use inside ``jax.shard_map``.

Thin wrappers over ``lax``: the same semantics, but a wrong axis name, root, op or shape is a
``ValueError`` that says what is available and how to fix it (``lax`` answers a misspelt axis
with a bare ``AssertionError``). Every function takes an array or a pytree of arrays. The
point-to-point ``send`` and ``shift`` live in :mod:`parallax.comm.p2p`.

``all_reduce`` is also the one entry point to the algorithms: ``algorithm="xla"`` (the
default: one ``lax.psum``, what XLA and NCCL/ICI do best), ``"ring"``, ``"tree"``,
``"hierarchical"`` (``axis=(outer, inner)``) or ``"auto"`` (ring or tree, picked per leaf by
the alpha-beta model of :mod:`parallax.comm.cost`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from parallax.comm import checks, cost
from parallax.comm.compress import Compression, Wire, as_compression
from parallax.comm.hierarchical import hierarchical_all_reduce
from parallax.comm.ring import ring_all_reduce
from parallax.comm.tree import tree_all_reduce, tree_broadcast

ALGORITHMS = ("xla", "ring", "tree", "hierarchical", "auto")


def _xla_reduce(v, axis, op: str, comp: Compression):
    wire = Wire(comp, v.dtype)
    sent = wire.send(v)
    if op == "prod":  # lax has no product all-reduce: gather, then multiply locally
        out = jnp.prod(lax.all_gather(sent, axis), axis=0)
    else:
        out = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax, "min": lax.pmin}[op](
            sent, axis)
    if comp is Compression.none:
        return out
    return out.astype(v.dtype)


def all_reduce(x, axis, op: str = "sum", *, algorithm: str = "xla", compression=None,
               link: cost.Link | str | None = None):
    """Reduces ``x`` over ``axis`` and gives every device the result (MPI_Allreduce).

    Args:
      x: an array or pytree of arrays (the local block inside ``shard_map``).
      axis: a mesh axis name or a tuple of them. With ``algorithm="hierarchical"`` a pair
        ``(outer, inner)`` in mesh order, e.g. ``("data", "tensor")``.
      op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"prod"``.
      algorithm: ``"xla"`` (``lax.psum`` & co.: one ``all-reduce`` instruction; the result is
        invariant over ``axis``), ``"ring"`` (:func:`ring_all_reduce`), ``"tree"``
        (:func:`tree_all_reduce`), ``"hierarchical"`` (:func:`hierarchical_all_reduce`) or
        ``"auto"`` (ring or tree per leaf, whichever :func:`cost.choose_algorithm` predicts
        faster for its byte size on ``link``; it never picks ``"xla"``, and the presets'
        latencies are assumptions). The point-to-point results are typed varying.
      compression: ``None`` or a :class:`Compression` (``bf16``/``fp16`` on the wire).
      link: the :class:`cost.Link` (or preset name) ``"auto"`` decides with; by default the
        preset for the current backend.

    Returns:
      The reduction, same structure, shapes and dtypes as ``x`` (``mean`` of ints is float).

    Example:
      >>> mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.jit(jax.shard_map(lambda v: all_reduce(v, "data", "max"), mesh=mesh,
      ...                   in_specs=jax.P("data"), out_specs=jax.P()))
      >>> f(jnp.arange(8.0)).tolist()
      [7.0]

    References:
      MPI-3.1 standard, ``MPI_Allreduce``; Thakur, Rabenseifner & Gropp 2005.
    """
    api = "all_reduce"
    checks.check_choice(api, "algorithm", algorithm, ALGORITHMS)
    checks.check_op(api, op)
    comp = as_compression(api, compression)
    if algorithm == "hierarchical":
        if not (isinstance(axis, (tuple, list)) and len(axis) == 2):
            raise ValueError(
                f"{api}: algorithm='hierarchical' needs axis=(outer, inner), two mesh axes "
                f"such as ('data', 'tensor'); got axis={axis!r}."
            )
        return hierarchical_all_reduce(x, axis[1], axis[0], op=op, compression=comp,
                                       algorithm="xla" if op in ("sum", "mean") else "ring")
    axis, n = checks.check_axis(api, axis)
    if algorithm == "ring":
        return ring_all_reduce(x, axis, op=op, compression=comp)
    if algorithm == "tree":
        return tree_all_reduce(x, axis, op=op, compression=comp)
    if algorithm == "auto":
        chosen = cost.default_link() if link is None else cost.preset(link)

        def pick(v):
            v = jnp.asarray(v)
            nbytes = v.size * Wire(comp, v.dtype).wire.itemsize
            fn = {"ring": ring_all_reduce, "tree": tree_all_reduce}[
                cost.choose_algorithm(nbytes, n, chosen)]
            return fn(v, axis, op=op, compression=comp)

        return jax.tree.map(pick, x)
    return jax.tree.map(lambda v: _xla_reduce(jnp.asarray(v), axis, op, comp), x)


def all_gather(x, axis, *, dim: int = 0, tiled: bool = True, invariant: bool = False):
    """Concatenates (``tiled``) or stacks every device's block along ``dim`` (MPI_Allgather).

    Args:
      x: an array or pytree of arrays.
      axis: a mesh axis name or a tuple of them.
      dim: where the blocks go.
      tiled: ``True`` concatenates (length ``n * d``); ``False`` adds a new dimension ``n``.
      invariant: type the result invariant over ``axis`` (``to="invarying"``: it may be
        returned with ``out_specs=P()``; its transpose slices instead of reduce-scattering).
        The default, varying, is what FSDP wants: the gradient of a gathered parameter is
        reduce-scattered.

    Returns:
      ``lax.all_gather(x, axis, axis=dim, tiled=tiled)`` per leaf.

    Example:
      >>> mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.jit(jax.shard_map(lambda v: all_gather(v, "x", invariant=True), mesh=mesh,
      ...                   in_specs=jax.P("x"), out_specs=jax.P()))
      >>> f(jnp.arange(4.0)).tolist()
      [0.0, 1.0, 2.0, 3.0]

    References:
      MPI-3.1, ``MPI_Allgather``.
    """
    api = "all_gather"
    axis, _ = checks.check_axis(api, axis)

    def leaf(v):
        v = jnp.asarray(v)
        d = checks.check_dim(api, v, dim) if tiled else dim % (v.ndim + 1)
        return lax.all_gather(v, axis, axis=d, tiled=tiled,
                              to="invarying" if invariant else "varying")

    return jax.tree.map(leaf, x)


def reduce_scatter(x, axis, *, dim: int = 0, op: str = "sum"):
    """Sums over ``axis`` and leaves block ``i`` of the result on device ``i`` (tiled).

    Args:
      x: an array or pytree; ``x.shape[dim]`` must divide by the axis size (see
        :func:`ring_reduce_scatter` for any length, with padding).
      axis: a mesh axis name or a tuple of them.
      dim: the dimension to scatter.
      op: ``"sum"`` or ``"mean"``.

    Returns:
      ``lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)`` per leaf (divided by
      ``n`` for ``"mean"``): a real ``reduce-scatter`` instruction.

    Example:
      >>> mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.jit(jax.shard_map(lambda v: reduce_scatter(v, "x"), mesh=mesh,
      ...                   in_specs=jax.P(), out_specs=jax.P("x")))
      >>> f(jnp.arange(8.0)).tolist()
      [0.0, 4.0, 8.0, 12.0, 16.0, 20.0, 24.0, 28.0]

    References:
      MPI-3.1, ``MPI_Reduce_scatter_block``.
    """
    api = "reduce_scatter"
    axis, n = checks.check_axis(api, axis)
    checks.check_op(api, op, ("sum", "mean"))

    def leaf(v):
        v = jnp.asarray(v)
        d = checks.check_dim(api, v, dim)
        checks.check_divisible(api, v, d, axis, n,
                                  "pad the array, or use ring_reduce_scatter (pads for you)")
        out = lax.psum_scatter(v, axis, scatter_dimension=d, tiled=True)
        return out / n if op == "mean" else out

    return jax.tree.map(leaf, x)


def broadcast(x, axis, root: int = 0, *, algorithm: str = "xla"):
    """Every device gets the ``root`` device's ``x`` (MPI_Bcast).

    Args:
      x: an array or pytree of arrays.
      axis: a mesh axis name or a tuple of them.
      root: a static rank on ``axis``.
      algorithm: ``"xla"`` (``psum`` of ``x`` masked to the root: one ``all-reduce``; the
        result is invariant) or ``"tree"`` (:func:`tree_broadcast`: ``ceil(log2 n)``
        ``ppermute`` rounds).

    Returns:
      The root's value on every device, same structure as ``x``.

    Example:
      >>> mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.jit(jax.shard_map(lambda v: broadcast(v, "x", root=3), mesh=mesh,
      ...                   in_specs=jax.P("x"), out_specs=jax.P()))
      >>> f(jnp.arange(4.0)).tolist()
      [3.0]

    References:
      MPI-3.1, ``MPI_Bcast``.
    """
    api = "broadcast"
    checks.check_choice(api, "algorithm", algorithm, ("xla", "tree"))
    axis, n = checks.check_axis(api, axis)
    root = checks.check_root(api, root, axis, n)
    if algorithm == "tree":
        return tree_broadcast(x, axis, root)

    def leaf(v):
        v = jnp.asarray(v)
        kept = jnp.where(lax.axis_index(axis) == root, v, jnp.zeros_like(v))
        if v.dtype == jnp.bool_:
            return lax.psum(kept.astype(jnp.int32), axis).astype(jnp.bool_)
        return lax.psum(kept, axis)

    return jax.tree.map(leaf, x)


def reduce(x, axis, root: int = 0, op: str = "sum"):
    """Reduces over ``axis`` onto ``root`` (MPI_Reduce); other devices get zeros.

    Args:
      x: an array or pytree of arrays.
      axis: a mesh axis name or a tuple of them.
      root: the static rank that receives the result.
      op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"prod"``.

    Returns:
      The reduction on ``root`` and zeros elsewhere (SPMD programs return a value on every
      device; MPI leaves it undefined).

    Example:
      >>> mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.jit(jax.shard_map(lambda v: reduce(v, "x", root=1), mesh=mesh,
      ...                   in_specs=jax.P("x"), out_specs=jax.P("x")))
      >>> f(jnp.arange(4.0)).tolist()
      [0.0, 6.0, 0.0, 0.0]

    References:
      MPI-3.1, ``MPI_Reduce``.
    """
    api = "reduce"
    axis, n = checks.check_axis(api, axis)
    root = checks.check_root(api, root, axis, n)
    checks.check_op(api, op)

    def leaf(v):
        total = _xla_reduce(jnp.asarray(v), axis, op, Compression.none)
        return jnp.where(lax.axis_index(axis) == root, total, jnp.zeros_like(total))

    return jax.tree.map(leaf, x)


def all_to_all(x, axis, split_dim: int, concat_dim: int):
    """Splits ``split_dim`` into ``n`` blocks, sends block ``j`` to device ``j``, concatenates
    what arrives along ``concat_dim`` (MPI_Alltoall; tiled).

    Args:
      x: an array or pytree; ``x.shape[split_dim]`` must divide by the axis size.
      axis: a mesh axis name or a tuple of them.
      split_dim: the dimension that is split and sent.
      concat_dim: the dimension the received blocks are concatenated along.

    Returns:
      ``lax.all_to_all(x, axis, split_dim, concat_dim, tiled=True)`` per leaf.

    Example:
      >>> mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.jit(jax.shard_map(lambda v: all_to_all(v, "x", 1, 0), mesh=mesh,
      ...                   in_specs=jax.P("x"), out_specs=jax.P("x")))
      >>> f(jnp.arange(8.0).reshape(2, 4)).tolist()
      [[0.0, 1.0], [4.0, 5.0], [2.0, 3.0], [6.0, 7.0]]

    References:
      MPI-3.1, ``MPI_Alltoall``; used by sequence parallelism (DeepSpeed-Ulysses) and MoE.
    """
    api = "all_to_all"
    axis, n = checks.check_axis(api, axis)

    def leaf(v):
        v = jnp.asarray(v)
        s = checks.check_dim(api, v, split_dim, "split_dim")
        c = checks.check_dim(api, v, concat_dim, "concat_dim")
        checks.check_divisible(api, v, s, axis, n, "pad split_dim to a multiple of the "
                                  "axis size")
        return lax.all_to_all(v, axis, s, c, tiled=True)

    return jax.tree.map(leaf, x)
