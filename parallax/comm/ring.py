"""Ring reduce-scatter, ring all-gather and ring all-reduce, built only from ``ppermute``.

The devices of one mesh axis form a ring; each step every device sends one chunk to its right
neighbour and receives one from its left. Split the array into ``n`` chunks of ``c = ceil(S/n)``:

* reduce-scatter: ``n - 1`` steps; at step ``s`` device ``i`` sends its partial sum of chunk
  ``(i - s - 1) mod n`` and adds what arrives to its own copy of the next chunk. After the last
  step device ``i`` holds chunk ``i`` summed over all devices.
* all-gather: ``n - 1`` more steps passing the finished chunks around the ring.

So an all-reduce is ``2(n-1)`` messages of ``S/n`` per device: each device sends
``2(n-1)/n * S`` bytes whatever ``n`` is, which is the lower bound for an all-reduce (Patarasuk
& Yuan 2009), at the price of ``2(n-1)`` latencies. The loop over steps is unrolled in Python
(``n`` is static), so the compiled program shows one ``collective-permute`` per step.

The results equal ``lax.psum`` / ``lax.psum_scatter`` / ``lax.all_gather`` up to the order of
floating-point additions, and are identical on every device. They are typed *varying* over the
axis under ``check_vma=True`` (a ``ppermute`` result always is), so return them with
``out_specs=P(axis, ...)`` or use ``algorithm="xla"`` where an invariant value is needed.
Gradients are the exact transposes (a reverse ring); ``jax.grad`` works through them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from parallax.comm import checks
from parallax.comm._chunks import (COMBINE, finish, join_flat, put, ring_perm, split_dim,
                                   split_flat, take)
from parallax.comm.varying import to_varying
from parallax.comm.compress import Wire, as_compression, ppermute_wire


def rs_send_chunk(rank, step: int, n: int):
    """The chunk that ``rank`` sends at reduce-scatter step ``step`` (ints or traced ints)."""
    return (rank + 2 * n - step - 1) % n


def ag_send_chunk(rank, step: int, n: int):
    """The chunk that ``rank`` sends at all-gather step ``step``."""
    return (rank + 2 * n - step) % n


def reduce_scatter_chunks(chunks, axis, n: int, op: str, wire: Wire):
    """Ring reduce-scatter of ``chunks`` (``[n, c, ...]``): returns chunk ``i``, reduced."""
    rank = lax.axis_index(axis)
    chunks = chunks.astype(wire.acc)
    combine = COMBINE[op]
    acc = take(chunks, rs_send_chunk(rank, 0, n))
    for step in range(n - 1):
        received = ppermute_wire(wire.send(acc), axis, ring_perm(n))
        # what the left neighbour sent this step is our chunk rs_send_chunk(rank - 1, step)
        mine = take(chunks, rs_send_chunk(rank + n - 1, step, n))
        acc = combine(wire.recv(received), mine)
    return acc


def all_gather_chunks(chunk, axis, n: int, wire: Wire, dtype):
    """Ring all-gather of one chunk per device: returns ``[n, *chunk.shape]`` in ``dtype``."""
    rank = lax.axis_index(axis)
    current = wire.send(chunk)
    out = to_varying(jnp.zeros((n,) + chunk.shape, dtype), axis)
    out = put(out, wire.recv(current), rank)  # own chunk rounded like the others
    for step in range(n - 1):
        current = ppermute_wire(current, axis, ring_perm(n))
        out = put(out, wire.recv(current), ag_send_chunk(rank + n - 1, step, n))
    return out


def _out_dtype(dtype, op):
    return jnp.result_type(dtype, jnp.float32) if op == "mean" and not jnp.issubdtype(
        dtype, jnp.inexact) else jnp.dtype(dtype)


def ring_reduce_scatter(x, axis, *, dim: int = 0, op: str = "sum", compression=None):
    """Ring reduce-scatter along ``dim``: device ``i`` gets block ``i`` of the reduction.

    Args:
      x: an array or pytree of arrays (the local block inside ``shard_map``).
      axis: the mesh axis (or tuple of axes) that forms the ring.
      dim: the dimension to scatter. When its length ``d`` does not divide by ``n``, it is
        zero-padded to ``n * ceil(d/n)``: every device gets ``ceil(d/n)`` rows and the padded
        tail rows (on the last devices) are zeros.
      op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"prod"``.
      compression: ``None`` or a :class:`Compression` (cast on the wire, add in float32).

    Returns:
      Per leaf, ``x`` with ``dim`` of length ``ceil(d/n)``; for divisible ``d`` it equals
      ``lax.psum_scatter(x, axis, scatter_dimension=dim, tiled=True)``.

    Example:
      >>> mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.jit(jax.shard_map(lambda v: ring_reduce_scatter(v[0], "x"), mesh=mesh,
      ...                   in_specs=jax.P("x"), out_specs=jax.P("x")))
      >>> f(jnp.ones((4, 8))).tolist()   # device i: rows 2i, 2i+1 of the sum
      [4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0]

    References:
      Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
      workstations"; Baidu ``baidu-allreduce`` (Gibiansky 2017).
    """
    api = "ring_reduce_scatter"
    axis, n = checks.check_axis(api, axis)
    checks.check_op(api, op)
    comp = as_compression(api, compression)

    def leaf(v):
        v = jnp.asarray(v)
        d = checks.check_dim(api, v, dim)
        out = reduce_scatter_chunks(split_dim(v, n, d), axis, n, op, Wire(comp, v.dtype))
        return jnp.moveaxis(finish(out, op, n), 0, d).astype(_out_dtype(v.dtype, op))

    return jax.tree.map(leaf, x)


def ring_all_gather(x, axis, *, dim: int = 0, size: int | None = None, compression=None):
    """Ring all-gather: concatenates every device's block along ``dim``, in rank order.

    Args:
      x: an array or pytree of arrays (the local block).
      axis: the mesh axis (or tuple of axes) that forms the ring.
      dim: the dimension to concatenate along.
      size: when given, the result is cut to ``size`` along ``dim`` (drops the padding that
        :func:`ring_reduce_scatter` added for a length not divisible by ``n``).
      compression: ``None`` or a :class:`Compression`; every copy, the sender's own included,
        is rounded the same way, so all devices hold identical results.

    Returns:
      Per leaf, ``x`` with ``dim`` of length ``n * x.shape[dim]`` (or ``size``); equal to
      ``lax.all_gather(x, axis, axis=dim, tiled=True)``.

    Example:
      >>> mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.jit(jax.shard_map(lambda v: ring_all_gather(v, "x")[None], mesh=mesh,
      ...                   in_specs=jax.P("x"), out_specs=jax.P("x")))
      >>> f(jnp.arange(4.0))[0].tolist()
      [0.0, 1.0, 2.0, 3.0]

    References:
      Patarasuk & Yuan 2009; Thakur, Rabenseifner & Gropp 2005, "Optimization of collective
      communication operations in MPICH" (ring all-gather cost ``(n-1)a + (n-1)/n S b``).
    """
    api = "ring_all_gather"
    axis, n = checks.check_axis(api, axis)
    comp = as_compression(api, compression)

    def leaf(v):
        v = jnp.asarray(v)
        d = checks.check_dim(api, v, dim)
        moved = jnp.moveaxis(v, d, 0)
        out = all_gather_chunks(moved, axis, n, Wire(comp, v.dtype), v.dtype)
        out = out.reshape((n * moved.shape[0],) + moved.shape[1:])
        if size is not None:
            if not 0 < size <= out.shape[0]:
                raise ValueError(
                    f"{api}: size={size} must be in 1..{out.shape[0]} (the gathered length)."
                )
            out = out[:size]
        return jnp.moveaxis(out, 0, d)

    return jax.tree.map(leaf, x)


def ring_all_reduce(x, axis, *, op: str = "sum", compression=None):
    """Ring all-reduce: ring reduce-scatter, then ring all-gather, ``2(n-1)`` steps of ``S/n``.

    Any shape works: each leaf is flattened, zero-padded to ``n * ceil(S/n)`` elements, reduced
    and cut back. Every ``collective-permute`` carries ``ceil(S/n)`` elements.

    Args:
      x: an array or pytree of arrays (float, bfloat16, int...).
      axis: the mesh axis (or tuple of axes) that forms the ring.
      op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"prod"``.
      compression: ``None`` or a :class:`Compression`: send bf16/fp16, add in float32.

    Returns:
      The reduction, same shapes and dtypes as ``x`` (``mean`` of ints gives floats, as
      ``lax.pmean``), identical on every device, typed varying over ``axis``.

    Example:
      >>> mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.jit(jax.shard_map(lambda v: ring_all_reduce(v, "x"), mesh=mesh,
      ...                   in_specs=jax.P("x"), out_specs=jax.P("x")))
      >>> f(jnp.arange(4.0)).tolist()
      [6.0, 6.0, 6.0, 6.0]

    References:
      Baidu ring all-reduce (Gibiansky 2017, ``baidu-allreduce``), used by Horovod and NCCL;
      Patarasuk & Yuan 2009 (bandwidth optimality); Thakur et al. 2005 (costs).
    """
    api = "ring_all_reduce"
    axis, n = checks.check_axis(api, axis)
    checks.check_op(api, op)
    comp = as_compression(api, compression)

    def leaf(v):
        v = jnp.asarray(v)
        wire = Wire(comp, v.dtype)
        reduced = finish(reduce_scatter_chunks(split_flat(v, n), axis, n, op, wire), op, n)
        gathered = all_gather_chunks(reduced, axis, n, Wire(comp, reduced.dtype),
                                     reduced.dtype)
        return join_flat(gathered, v.shape).astype(_out_dtype(v.dtype, op))

    return jax.tree.map(leaf, x)


def ring_schedule(n: int) -> list[dict]:
    """Who holds what after each step of a ring all-reduce on ``n`` devices (pure Python).

    Uses the same chunk formulas as the JAX implementation. Each entry has ``phase``
    (``"start"``, ``"reduce-scatter"``, ``"all-gather"``), ``step``, ``sends`` (a list of
    ``(source, destination, chunk)``) and ``holds``: ``holds[d][k]`` is the sorted tuple of the
    devices whose contribution device ``d``'s copy of chunk ``k`` contains.

    Example:
      >>> s = ring_schedule(3)
      >>> len(s), s[-1]["holds"][0][0]
      (5, (0, 1, 2))

    References:
      Gibiansky 2017, "Bringing HPC techniques to deep learning" (the Baidu ring figures).
    """
    if n < 1:
        raise ValueError(f"ring_schedule: n={n} must be >= 1.")
    holds = [[{d} for _ in range(n)] for d in range(n)]
    snap = lambda: [[tuple(sorted(c)) for c in row] for row in holds]  # noqa: E731
    out = [{"phase": "start", "step": 0, "sends": [], "holds": snap()}]
    for phase, send_chunk in (("reduce-scatter", rs_send_chunk), ("all-gather", ag_send_chunk)):
        for step in range(n - 1):
            sends = [(i, (i + 1) % n, send_chunk(i, step, n)) for i in range(n)]
            sent = {src: set(holds[src][k]) for src, _, k in sends}
            for src, dst, k in sends:
                if phase == "reduce-scatter":
                    holds[dst][k] |= sent[src]
                else:
                    holds[dst][k] = set(sent[src])
            out.append({"phase": phase, "step": step + 1, "sends": sends, "holds": snap()})
    return out
