"""Tree all-reduce by recursive doubling: ``log2 n`` rounds of the whole message.

Round ``k`` pairs device ``i`` with ``i XOR 2^k``; both send everything they have and combine.
After ``log2 n`` rounds everyone has the full reduction. Each round is one ``ppermute`` of the
whole array, so the cost is ``log2 n * (a + S b)``: fewer latencies than the ring's ``2(n-1)``,
more bytes (``S log2 n`` instead of ``2 S (n-1)/n``). It wins for small messages, where latency
dominates; :mod:`parallax.comm.cost` says where the crossover lies.

When ``n`` is not a power of two (Thakur, Rabenseifner & Gropp 2005, section 4): let
``p = 2^floor(log2 n)`` and ``r = n - p``. First the ``r`` odd devices among the first ``2r``
send their value to their even neighbour and drop out; the ``p`` remaining devices run
recursive doubling; finally each even device of the first ``2r`` sends the result back to its
odd neighbour. That is ``log2 p + 2`` rounds.

Both partners of a round add the same two values, and IEEE addition is commutative, so every
device ends with bit-identical results. Results are typed varying over the axis (see
:mod:`parallax.comm.ring`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallax.comm import checks
from parallax.comm._chunks import COMBINE, finish
from parallax.comm.compress import Wire, as_compression, ppermute_wire


def tree_rounds(n: int) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    """The rounds of a recursive-doubling all-reduce on ``n`` devices (pure Python).

    Returns:
      A list of ``(kind, pairs)`` with kind ``"fold"`` (odd device sends to its even
      neighbour, which combines), ``"exchange"`` (pairs swap and both combine) or ``"unfold"``
      (even device sends the result to its odd neighbour, which keeps it). ``pairs`` are
      ``(source, destination)`` ranks.

    Example:
      >>> [kind for kind, _ in tree_rounds(8)]
      ['exchange', 'exchange', 'exchange']
      >>> [kind for kind, _ in tree_rounds(6)]
      ['fold', 'exchange', 'exchange', 'unfold']

    References:
      Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication
      operations in MPICH", IJHPCA 19(1).
    """
    if n < 1:
        raise ValueError(f"tree_rounds: n={n} must be >= 1.")
    p = 1 << (n.bit_length() - 1)
    r = n - p
    old = [2 * j if j < r else j + r for j in range(p)]  # active rank j -> device
    rounds = []
    if r:
        rounds.append(("fold", tuple((2 * j + 1, 2 * j) for j in range(r))))
    bit = 1
    while bit < p:
        rounds.append(("exchange", tuple((old[j], old[j ^ bit]) for j in range(p))))
        bit <<= 1
    if r:
        rounds.append(("unfold", tuple((2 * j, 2 * j + 1) for j in range(r))))
    return rounds


def _receivers(pairs, n: int):
    mask = np.zeros(n, bool)
    mask[[d for _, d in pairs]] = True
    return jnp.asarray(mask)


def tree_all_reduce(x, axis, *, op: str = "sum", compression=None):
    """All-reduce by recursive doubling (any ``n``; ``log2 n`` rounds when a power of two).

    Args:
      x: an array or pytree of arrays (the local block inside ``shard_map``).
      axis: the mesh axis (or tuple of axes) to reduce over.
      op: ``"sum"``, ``"mean"``, ``"max"``, ``"min"`` or ``"prod"``.
      compression: ``None`` or a :class:`Compression`; each device rounds its own value the
        way it rounds what it sends, so partners stay identical.

    Returns:
      The reduction, same shapes and dtypes as ``x`` (``mean`` of ints gives floats),
      identical on every device, typed varying over ``axis``.

    Example:
      >>> mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.jit(jax.shard_map(lambda v: tree_all_reduce(v, "x"), mesh=mesh,
      ...                   in_specs=jax.P("x"), out_specs=jax.P("x")))
      >>> f(jnp.arange(8.0)).tolist()
      [28.0, 28.0, 28.0, 28.0, 28.0, 28.0, 28.0, 28.0]

    References:
      Thakur, Rabenseifner & Gropp 2005 (recursive doubling, non-power-of-two handling);
      NCCL's tree algorithm (double binary trees, Sanders et al. 2009) serves the same
      small-message regime.
    """
    api = "tree_all_reduce"
    axis, n = checks.check_axis(api, axis)
    checks.check_op(api, op)
    comp = as_compression(api, compression)
    rounds = tree_rounds(n)
    combine = COMBINE[op]

    def leaf(v):
        v = jnp.asarray(v)
        wire = Wire(comp, v.dtype)
        rank = lax.axis_index(axis)
        acc = wire.round(v.astype(wire.acc))
        for kind, pairs in rounds:
            received = wire.recv(ppermute_wire(wire.send(acc), axis, pairs))
            gets = _receivers(pairs, n)[rank]
            new = received if kind == "unfold" else combine(acc, received)
            acc = jnp.where(gets, wire.round(new), acc)
        out = finish(acc, op, n)
        if op == "mean" and not jnp.issubdtype(v.dtype, jnp.inexact):
            return out
        return out.astype(v.dtype)

    return jax.tree.map(leaf, x)


def broadcast_rounds(n: int, root: int = 0) -> list[tuple[tuple[int, int], ...]]:
    """The rounds of a binomial-tree broadcast from ``root``: ``ceil(log2 n)`` of them.

    In round ``k`` every device that already has the value (relative rank ``< 2^k``) sends it
    to the device ``2^k`` further on.

    Example:
      >>> broadcast_rounds(4)
      [((0, 1),), ((0, 2), (1, 3))]
    """
    rounds, have = [], 1
    while have < n:
        rounds.append(tuple(((r + root) % n, (r + have + root) % n)
                            for r in range(have) if r + have < n))
        have *= 2
    return rounds


def tree_broadcast(x, axis, root: int = 0):
    """Broadcast from ``root`` along a binomial tree of ``ppermute`` steps.

    Args:
      x: an array or pytree of arrays; only the root's value matters.
      axis: the mesh axis (or tuple of axes).
      root: the static rank whose value every device receives.

    Returns:
      The root's ``x`` on every device (typed varying over ``axis``), after
      ``ceil(log2 n)`` rounds, each sending the whole message.

    Example:
      >>> mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.jit(jax.shard_map(lambda v: tree_broadcast(v, "x", root=2), mesh=mesh,
      ...                   in_specs=jax.P("x"), out_specs=jax.P("x")))
      >>> f(jnp.arange(4.0)).tolist()
      [2.0, 2.0, 2.0, 2.0]

    References:
      Thakur, Rabenseifner & Gropp 2005 (binomial-tree broadcast, MPICH ``MPI_Bcast``).
    """
    api = "tree_broadcast"
    axis, n = checks.check_axis(api, axis)
    root = checks.check_root(api, root, axis, n)
    rounds = broadcast_rounds(n, root)

    def leaf(v):
        v = jnp.asarray(v)
        rank = lax.axis_index(axis)
        for pairs in rounds:
            received = ppermute_wire(v, axis, pairs)
            v = jnp.where(_receivers(pairs, n)[rank], received, v)
        return v

    return jax.tree.map(leaf, x)
