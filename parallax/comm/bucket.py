"""Tensor fusion: all-reduce many small tensors as a few large flat buckets.

A model has hundreds of parameter tensors; all-reducing each one pays hundreds of latencies.
Horovod's *tensor fusion* copies ready tensors into a fusion buffer
(``HOROVOD_FUSION_THRESHOLD``, 64 MiB by default) and all-reduces the buffer; PyTorch DDP
groups parameters into *buckets* (``bucket_cap_mb``, 25 MiB) in the *reverse* order of
``model.parameters()``, because backward produces the last layers' gradients first, so the
first bucket can be sent while backward still runs.

:func:`bucketed_all_reduce` does the same inside one SPMD program: leaves of one dtype are
concatenated in (reverse) order into one flat stream, cut into buckets of ``bucket_bytes``
(a leaf may straddle two buckets, as in a fusion buffer that fills up), and each bucket is
one collective. So ``T`` bytes of one dtype cost exactly ``ceil(T / bucket_bytes)``
all-reduces. ``bucket_bytes=0`` turns fusion off (one collective per leaf).

XLA itself runs an all-reduce combiner pass (``cpu-all-reduce-combiner`` on CPU, a
thresholded one on GPU) that may merge independent ``all-reduce`` instructions into one
tuple-shaped instruction. The buckets are still separate operands of it;
``tests/comm/test_hlo.py`` checks both views.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallax.comm import checks
from parallax.comm.compress import Wire, as_compression
from parallax.comm.wrappers import all_reduce

DEFAULT_BUCKET_BYTES = 25 * 2**20  # PyTorch DDP's bucket_cap_mb=25


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One flat bucket: ``pieces`` are ``(leaf index, start, stop)`` ranges of flat leaves.

    Leaf indices follow ``jax.tree.leaves`` order; pieces appear in the bucket's order.
    """

    dtype: np.dtype
    pieces: tuple[tuple[int, int, int], ...]

    @property
    def size(self) -> int:
        """Elements in the bucket."""
        return sum(stop - start for _, start, stop in self.pieces)

    @property
    def nbytes(self) -> int:
        """Bytes in the bucket."""
        return self.size * np.dtype(self.dtype).itemsize


def pack_buckets(tree, bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
                reverse: bool = True) -> list[Bucket]:
    """How :func:`bucketed_all_reduce` packs ``tree``: a static list of :class:`Bucket`.

    Args:
      tree: a pytree of arrays or ``jax.ShapeDtypeStruct``.
      bucket_bytes: the bucket capacity; ``0``: one bucket per leaf (no fusion); ``None``: one
        bucket per dtype.
      reverse: fill buckets from the last leaf backwards (DDP's order).

    Returns:
      Buckets in the order their collectives are issued.

    Example:
      >>> tree = {"a": jnp.zeros(300), "b": jnp.zeros(200), "c": jnp.zeros(100)}
      >>> [(b.size, b.pieces) for b in pack_buckets(tree, bucket_bytes=1600)]
      [(400, ((2, 0, 100), (1, 0, 200), (0, 0, 100))), (200, ((0, 100, 300),))]

    References:
      Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
      Training" (VLDB; buckets, reverse order); Horovod tensor fusion (Sergeev & Del Balso
      2018).
    """
    api = "pack_buckets"
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(
            bucket_bytes, (int, np.integer)) or bucket_bytes < 0):
        raise ValueError(
            f"{api}: bucket_bytes={bucket_bytes!r} must be an int >= 0 (0 disables fusion) "
            "or None (one bucket per dtype)."
        )
    leaves = jax.tree.leaves(tree)
    order = list(range(len(leaves)))[::-1] if reverse else list(range(len(leaves)))
    by_dtype: dict[np.dtype, list[int]] = {}
    for i in order:
        by_dtype.setdefault(np.dtype(leaves[i].dtype), []).append(i)
    buckets = []
    for dtype, indices in by_dtype.items():
        sizes = {i: int(np.prod(np.shape(leaves[i]), dtype=np.int64)) for i in indices}
        if bucket_bytes == 0:
            buckets += [Bucket(dtype, ((i, 0, sizes[i]),)) for i in indices if sizes[i]]
            continue
        cap = None if bucket_bytes is None else max(1, bucket_bytes // dtype.itemsize)
        pieces, room = [], cap
        for i in indices:
            start = 0
            while start < sizes[i]:
                take = sizes[i] - start if room is None else min(room, sizes[i] - start)
                pieces.append((i, start, start + take))
                start += take
                if room is not None:
                    room -= take
                    if room == 0:
                        buckets.append(Bucket(dtype, tuple(pieces)))
                        pieces, room = [], cap
        if pieces:
            buckets.append(Bucket(dtype, tuple(pieces)))
    return buckets


PACKINGS = ("flat", "operands")


def _reduce_operands(pieces, axis, op: str, compression):
    """One ``psum`` (``pmean``, ...) over a bucket's pieces, each in its own shape: XLA reduces
    them as one variadic all-reduce (after its combiner), with no copy into a flat buffer."""
    comp = as_compression("bucketed_all_reduce", compression)
    sent = [Wire(comp, p.dtype).send(p) for p in pieces]
    reduce = {"sum": lax.psum, "mean": lax.pmean, "max": lax.pmax, "min": lax.pmin}[op]
    return [r.astype(p.dtype) for r, p in zip(reduce(sent, axis), pieces)]


def bucketed_all_reduce(tree, axis, *, bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
                        reverse: bool = True, op: str = "sum", algorithm: str = "xla",
                        compression=None, packing: str = "flat"):
    """All-reduces a pytree as flat buckets: one collective per bucket (tensor fusion).

    Args:
      tree: a pytree of arrays (gradients, typically), local blocks inside ``shard_map``.
      axis: a mesh axis name or a tuple (``(outer, inner)`` for ``"hierarchical"``).
      bucket_bytes: bucket capacity in bytes (default 25 MiB, DDP's); ``0`` disables fusion;
        ``None`` puts each dtype in one bucket.
      reverse: fill from the last leaf backwards (DDP's order).
      op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"prod"``.
      algorithm: as in :func:`all_reduce` (``"xla"``, ``"ring"``, ``"tree"``, ``"auto"``,
        ``"hierarchical"``), per bucket.
      compression: ``None`` or a :class:`Compression`.
      packing: ``"flat"`` (the fusion buffer: each bucket's pieces are concatenated into one
        flat array, one collective of any ``algorithm``) or ``"operands"`` (no copy: with
        ``"xla"`` each bucket is one ``psum`` over its pieces in their own shapes, which XLA
        lowers to one variadic all-reduce when its combiner runs, as it does by default;
        with a point-to-point algorithm each piece is reduced on its own, in bucket order).
        On CPU the flat buffer's ``concatenate`` costs a pass over every gradient (measured
        in ``docs/distributed.md``); ``"operands"`` compiles to the same program as one
        ``psum`` per leaf.

    Returns:
      The reduced tree, same structure, shapes and dtypes.

    Unlike DDP, a leaf may be split across two buckets (so the count is exactly
    ``ceil(T / bucket_bytes)``), and XLA's all-reduce combiner may merge bucket collectives
    into one tuple-shaped instruction; overlap with the backward pass is left to XLA.

    Example:
      >>> mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> grads = {"w": jnp.ones((4, 3)), "b": jnp.ones((4,))}
      >>> f = jax.jit(jax.shard_map(lambda g: bucketed_all_reduce(g, "x", bucket_bytes=16),
      ...                   mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P()))
      >>> f(grads)["w"].tolist()
      [[4.0, 4.0, 4.0]]

    References:
      Horovod tensor fusion (Sergeev & Del Balso 2018, "Horovod: fast and easy distributed
      deep learning in TensorFlow"); Li et al. 2020 (PyTorch DDP gradient buckets).
    """
    api = "bucketed_all_reduce"
    checks.check_op(api, op)
    checks.check_choice(api, "packing", packing, PACKINGS)
    if packing == "operands" and algorithm == "xla" and op == "prod":
        raise ValueError(
            f"{api}: packing='operands' with algorithm='xla' reduces with XLA's all-reduce, "
            "which has no product; use packing='flat' or a point-to-point algorithm "
            "('ring', 'tree') for op='prod'.")
    if packing == "operands":  # XLA: one psum over the pieces; else each piece on its own
        reduce_pieces = (
            (lambda pieces: _reduce_operands(pieces, axis, op, compression)) if algorithm == "xla"
            else (lambda pieces: all_reduce(pieces, axis, op, algorithm=algorithm,
                                            compression=compression)))
        return over_buckets(tree, reduce_pieces, bucket_bytes=bucket_bytes, reverse=reverse,
                            flat=False)
    return over_buckets(
        tree, lambda flat: all_reduce(flat, axis, op, algorithm=algorithm, compression=compression),
        bucket_bytes=bucket_bytes, reverse=reverse)


def over_buckets(tree, reduce_bucket, *, bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
                 reverse: bool = True, flat: bool = True):
    """``tree`` packed into buckets (:func:`pack_buckets`), ``reduce_bucket`` applied to each,
    and the results put back in the tree's leaves, shapes and dtypes.

    With ``flat`` (the fusion buffer) ``reduce_bucket`` gets one flat array per bucket, the
    bucket's pieces concatenated, and returns an array of the same size; otherwise it gets
    the list of pieces (whole leaves in their shapes, or flat slices of a split leaf) and
    returns a list like it.
    """
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [jnp.asarray(v) for v in leaves]
    flats = [jnp.ravel(v) for v in leaves]
    parts: dict[int, list[tuple[int, jax.Array]]] = {i: [] for i in range(len(leaves))}
    for bucket in pack_buckets(leaves, bucket_bytes, reverse):
        if not flat:
            pieces = [leaves[i] if stop - start == leaves[i].size else flats[i][start:stop]
                      for i, start, stop in bucket.pieces]
            for (i, start, _), reduced in zip(bucket.pieces, reduce_bucket(pieces)):
                parts[i].append((start, jnp.ravel(reduced)))
            continue
        pieces = [flats[i][start:stop] for i, start, stop in bucket.pieces]
        reduced = reduce_bucket(pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces))
        offset = 0
        for i, start, stop in bucket.pieces:
            parts[i].append((start, reduced[offset:offset + stop - start]))
            offset += stop - start
    out = []
    for i, v in enumerate(leaves):
        chunks = [p for _, p in sorted(parts[i], key=lambda t: t[0])]
        if not chunks:  # an empty leaf
            out.append(v)
            continue
        joined = chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks)
        out.append(joined.reshape(v.shape))
    return jax.tree.unflatten(treedef, out)
