"""All-gather context parallelism: local queries against every key, one key block at a time.

Llama 3's method (Dubey et al. 2024, section 3.3.2): each layer all-gathers K and V over
the context axis, and each device's queries (its ``t = T / n`` positions in the zigzag
order) attend to all ``T`` keys; the backward reduce-scatters the keys' and values'
gradients back to their owners. Called inside a ``shard_map`` manual over the axis.

The gathered keys arrive as ``n`` blocks of ``t`` (device-major), and both passes walk them
with a ``lax.scan``, so no ``t x T`` score matrix is ever held: the forward folds each block
into its rows' output with the online softmax and keeps the rows' log-sum-exp; the backward
rebuilds each block's probabilities from that log-sum-exp (FlashAttention's backward) and
re-gathers K and V rather than keeping them (``O(T)`` per layer) as residuals. Temporaries
are ``O(t^2)`` per device, as in the ring, where autodiff of a ``t x T`` softmax held four
such matrices (more than ``1 / n`` of the one-device program's three ``T x T``).

Messages per call (``b`` = bytes of one device's K and V): forward one all-gather of
``n b``; backward one all-gather of ``n b`` and one reduce-scatter of ``n b`` in float32.

References:
  Dubey et al., "The Llama 3 Herd of Models", 2024, section 3.3.2; Milakov & Gimelshein,
  "Online normalizer calculation for softmax", 2018; Dao et al., "FlashAttention", 2022.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from parallax.comm.varying import to_varying, varying_axes
from parallax.strategies.context_parallel.ring import block_grads, grouped, scores

F32 = jnp.float32


def _start(inputs, *values):
    """A scan's initial carry, varying over every manual axis one of ``inputs`` varies over
    (the carry the body returns does: a constant start would not match it)."""
    axes = frozenset().union(*map(varying_axes, inputs))
    return tuple(to_varying(x, axes) for x in values)


def _blocks(key, value, axis: str, positions: np.ndarray):
    """The gathered ``[n, 2, B, t, G, K]`` key/value blocks, their ``[n, t]`` positions and
    this device's ``[t]`` query positions."""
    t = key.shape[1]
    kv = lax.all_gather(jnp.stack([key, value]), axis, axis=2, tiled=True)  # [2, B, T, G, K]
    n = kv.shape[2] // t
    kv = jnp.moveaxis(kv.reshape(kv.shape[:2] + (n, t) + kv.shape[3:]), 2, 0)
    pos = jnp.asarray(positions)
    return kv, pos.reshape(n, t), lax.dynamic_slice_in_dim(pos, lax.axis_index(axis) * t, t)


def forward(query, key, value, *, axis: str, positions: np.ndarray, causal: bool,
            scale: float):
    """``(out [B, t, H, K], lse [B, G, H/G, t])``: the attention of this device's queries
    over the gathered keys, and each query row's log-sum-exp, which :func:`backward` needs.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from parallax.strategies.context_parallel import zigzag
      >>> mesh = jax.make_mesh((2,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.shard_map(lambda q: forward(q, q, q, axis="context",
      ...     positions=zigzag.positions(8, 2), causal=True, scale=0.5)[0], mesh=mesh,
      ...     in_specs=jax.P(None, "context"), out_specs=jax.P(None, "context"))
      >>> f(jnp.ones((1, 8, 2, 4))).shape
      (1, 8, 2, 4)
    """
    q = grouped(query, key)
    kv, block_pos, mine = _blocks(key, value, axis, positions)
    rows = q.shape[:1] + q.shape[2:4] + q.shape[1:2]  # [B, G, R, t]

    def fold(acc, block):
        (o, m, l), (kv_j, pos_j) = acc, block
        s = scores(q, kv_j[0], scale)
        if causal:
            s = jnp.where(mine[:, None] >= pos_j[None, :], s, -jnp.inf)
        new_m = jnp.maximum(m, jnp.max(s, axis=-1))
        # a row that has seen no key yet keeps m = -inf: exponents are taken from 0 there
        ref = jnp.where(jnp.isfinite(new_m), new_m, 0.0)
        carried, p = jnp.exp(m - ref), jnp.exp(s - ref[..., None])
        at_rows = lambda a: jnp.moveaxis(a, -1, 1)[..., None]  # [B,G,R,t] -> [B,t,G,R,1]
        o = o * at_rows(carried) + jnp.einsum("bgrqs,bsgk->bqgrk", p, kv_j[1].astype(F32))
        return (o, new_m, l * carried + jnp.sum(p, axis=-1)), None

    start = _start((q, kv), jnp.zeros(q.shape, F32), jnp.full(rows, -jnp.inf, F32),
                   jnp.zeros(rows, F32))
    (o, m, l), _ = lax.scan(fold, start, (kv, block_pos))
    out = o / jnp.moveaxis(l, -1, 1)[..., None]
    return out.reshape(query.shape).astype(query.dtype), m + jnp.log(l)


def backward(query, key, value, out, lse, d_out, *, axis: str, positions: np.ndarray,
             causal: bool, scale: float):
    """``(d_query, d_key, d_value)`` from :func:`forward`'s output and log-sum-exp: K and V
    gathered again, each block's gradients from its probabilities, the keys' and values'
    gradients reduce-scattered to their owners."""
    q = grouped(query, key)
    do = d_out.reshape(q.shape).astype(F32)
    delta = jnp.moveaxis(jnp.sum(do * out.reshape(q.shape).astype(F32), axis=-1), 1, -1)
    kv, block_pos, mine = _blocks(key, value, axis, positions)

    def block(dq, xs):
        kv_j, pos_j = xs
        mask = mine[:, None] >= pos_j[None, :] if causal else None
        gq, gk, gv = block_grads(q, kv_j[0], kv_j[1], do, lse, delta, scale, mask)
        return dq + gq, jnp.stack([gk, gv])

    start, = _start((q, kv, do, lse), jnp.zeros(q.shape, F32))
    dq, dkv = lax.scan(block, start, (kv, block_pos))
    dkv = jnp.moveaxis(dkv, 0, 2)  # [2, B, n, t, G, K]
    dkv = dkv.reshape(dkv.shape[:2] + (-1,) + dkv.shape[4:])
    dkv = lax.psum_scatter(dkv, axis, scatter_dimension=2, tiled=True)
    return (dq.reshape(query.shape).astype(query.dtype), dkv[0].astype(key.dtype),
            dkv[1].astype(value.dtype))
