"""Ring attention: K/V blocks go round the context axis while queries stay put.

Called inside a ``shard_map`` over the context axis, on each device's part of the sequence
in the zigzag order (:mod:`parallax.strategies.context_parallel.zigzag`): device ``i`` of ``n`` holds
chunks ``i`` and ``2n-1-i`` of ``2n``, i.e. ``2c`` positions with ``c = T / 2n``. At step
``s`` the device holds the keys and values of device ``j = (i - s) mod n`` and folds their
scores into its queries' output with the online softmax (a running max ``m``, sum ``l``
and unnormalised output per query row), then passes them on with one ``ppermute``.

With causal masking the zigzag makes every step cost the same on every device:

- ``s = 0`` (own block): chunk ``i`` sees itself causally, chunk ``2n-1-i`` sees chunk ``i``
  whole and itself causally: one masked ``2c x 2c`` block;
- ``j < i``: both query chunks see key chunk ``j`` whole and key chunk ``2n-1-j`` not at
  all: a ``2c x c`` block, no mask;
- ``j > i``: query chunk ``i`` sees nothing, chunk ``2n-1-i`` sees both key chunks whole:
  a ``c x 2c`` block, no mask.

So after step 0 every device computes ``2c^2`` scores per step (``lax.cond`` picks the
case), half of the full block, and no device waits on another.

The backward pass (a ``custom_vjp``) runs the ring again: keys and values travel with
their gradient accumulators, which after ``n`` shifts are back on their owner; the
forward keeps only ``q, k, v``, the output and each row's log-sum-exp (FlashAttention's
residuals), so memory is ``O(T / n)`` per device whatever ``n`` is, never the
``n`` blocks of scores autodiff through the loop would store.

Messages per call (``b`` = bytes of one device's K and V together, ``B T/n G K`` each):
forward ``n - 1`` collective-permutes of ``b``; backward ``n - 1`` of ``b`` (K, V) and
``n`` of ``b`` in float32 (their gradients). The loop is unrolled (``n`` is the axis size),
so the compiled program holds each of them.

References:
  Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite
  Context", 2023; Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018;
  Dao et al., "FlashAttention", 2022 (the backward from the log-sum-exp);
  zhuzilin/ring-flash-attention and Brandon et al., "Striped Attention", 2023 (balancing
  causal rings; the zigzag split is the former's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from parallax.comm.p2p import ring_perm
from parallax.strategies.context_parallel.stage_groups import StageGroups, permute

F32 = jnp.float32


def scores(q, k, scale):
    """``[B, G, R, Q, S]`` float32 scores of ``q [B, Q, G, R, K]`` against ``k [B, S, G, K]``."""
    return jnp.einsum("bqgrk,bsgk->bgrqs", q, k, preferred_element_type=F32) * scale


def _block(q, k, v, scale, mask=None):
    """One block's ``(o, m, l)``: unnormalised output, row max and row sum of exp."""
    s = scores(q, k, scale)
    if mask is not None:
        s = jnp.where(mask, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    o = jnp.einsum("bgrqs,bsgk->bqgrk", p, v.astype(F32))
    return o, m, jnp.sum(p, axis=-1)


def _merge(acc, new):
    """The online softmax's merge of two partial results over the same query rows."""
    (o1, m1, l1), (o2, m2, l2) = acc, new
    m = jnp.maximum(m1, m2)
    a1, a2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    rows = lambda a: jnp.moveaxis(a, -1, 1)[..., None]  # [B,G,R,Q] -> [B,Q,G,R,1]
    return o1 * rows(a1) + o2 * rows(a2), m, l1 * a1 + l2 * a2


def _rows(acc, start, stop):
    o, m, l = acc
    return o[:, start:stop], m[..., start:stop], l[..., start:stop]


def _concat(a, b):
    return (jnp.concatenate([a[0], b[0]], 1), jnp.concatenate([a[1], b[1]], -1),
            jnp.concatenate([a[2], b[2]], -1))


def diagonal_mask(c: int) -> jax.Array:
    """The causal mask of a device's own block in zigzag order: ``[[tril, 0], [1, tril]]``
    (the same on every device: chunk ``i`` always precedes chunk ``2n-1-i``). Slot ``p``
    holds local position ``p`` for ``p < c`` and ``2c + p`` past it (any gap above ``c``
    gives the same mask).

    Example:
      >>> diagonal_mask(1).astype(int).tolist()
      [[1, 0], [1, 1]]
    """
    slot = jnp.arange(2 * c)
    pos = jnp.where(slot < c, slot, slot + 2 * c)
    return pos[:, None] >= pos[None, :]


def _shift(x, axis, n, groups):
    """Device ``i``'s ``x`` to device ``i + 1`` round the axis (within its stage under a
    pipeline: :mod:`parallax.strategies.context_parallel.stage_groups`)."""
    return permute(x, axis, n, ring_perm(n, 1), groups)


def _forward(q, k, v, axis, n, causal, scale, groups=None):
    """``(out, lse)`` of the ring; ``q [B, 2c, G, R, K]``."""
    i, c = lax.axis_index(axis), q.shape[1] // 2
    kv = jnp.stack([k, v])
    acc = _block(q, k, v, scale, diagonal_mask(c) if causal else None)
    for s in range(1, n):
        kv = _shift(kv, axis, n, groups)  # now device (i - s) mod n's keys and values
        kk, vv = kv[0], kv[1]
        if not causal:
            acc = _merge(acc, _block(q, kk, vv, scale))
            continue

        def earlier(acc, kk=kk, vv=vv):  # j < i: all queries, key chunk j
            return _merge(acc, _block(q, kk[:, :c], vv[:, :c], scale))

        def later(acc, kk=kk, vv=vv):  # j > i: query chunk 2n-1-i, both key chunks
            return _concat(_rows(acc, 0, c),
                           _merge(_rows(acc, c, 2 * c), _block(q[:, c:], kk, vv, scale)))

        acc = lax.cond((i - s) % n < i, earlier, later, acc)
    o, m, l = acc
    out = o / jnp.moveaxis(l, -1, 1)[..., None]
    return out.astype(q.dtype), m + jnp.log(l)


def block_grads(q, k, v, do, lse, delta, scale, mask=None):
    """``(dq, dk, dv)`` of one block, from the rows' log-sum-exp (FlashAttention)."""
    s = scores(q, k, scale)
    p = jnp.exp(s - lse[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dv = jnp.einsum("bgrqs,bqgrk->bsgk", p, do)
    dp = jnp.einsum("bqgrk,bsgk->bgrqs", do, v.astype(F32))
    ds = p * (dp - delta[..., None])
    dq = jnp.einsum("bgrqs,bsgk->bqgrk", ds, k.astype(F32)) * scale
    dk = jnp.einsum("bgrqs,bqgrk->bsgk", ds, q.astype(F32)) * scale
    return dq, dk, dv


def _backward(q, k, v, out, lse, do, axis, n, causal, scale, groups=None):
    """``(dq, dk, dv)``: the ring again, gradients of K and V travelling with them."""
    i, c = lax.axis_index(axis), q.shape[1] // 2
    do = do.astype(F32)
    delta = jnp.moveaxis(jnp.sum(do * out.astype(F32), axis=-1), 1, -1)  # [B, G, R, Q]
    dq, dk, dv = block_grads(q, k, v, do, lse, delta, scale,
                              diagonal_mask(c) if causal else None)
    kv, dkv = jnp.stack([k, v]), jnp.stack([dk, dv])
    for s in range(1, n):
        kv, dkv = _shift(kv, axis, n, groups), _shift(dkv, axis, n, groups)
        kk, vv = kv[0], kv[1]
        if not causal:
            gq, gk, gv = block_grads(q, kk, vv, do, lse, delta, scale)
            dq, dkv = dq + gq, dkv + jnp.stack([gk, gv])
            continue

        def earlier(dq, dkv, kk=kk, vv=vv):  # all query rows, key chunk j
            gq, gk, gv = block_grads(q, kk[:, :c], vv[:, :c], do, lse, delta, scale)
            return dq + gq, dkv.at[:, :, :c].add(jnp.stack([gk, gv]))

        def later(dq, dkv, kk=kk, vv=vv):  # query chunk 2n-1-i, both key chunks
            gq, gk, gv = block_grads(q[:, c:], kk, vv, do[:, c:], lse[..., c:],
                                      delta[..., c:], scale)
            return dq.at[:, c:].add(gq), dkv + jnp.stack([gk, gv])

        dq, dkv = lax.cond((i - s) % n < i, earlier, later, dq, dkv)
    dkv = _shift(dkv, axis, n, groups) if n > 1 else dkv  # the n-th shift takes them home
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _ring(q, k, v, axis, n, causal, scale):
    return _forward(q, k, v, axis, n, causal, scale)[0]


def _ring_fwd(q, k, v, axis, n, causal, scale):
    out, lse = _forward(q, k, v, axis, n, causal, scale)
    return out, (q, k, v, out, lse)


def _ring_bwd(axis, n, causal, scale, res, do):
    return _backward(*res, do, axis, n, causal, scale)


_ring.defvjp(_ring_fwd, _ring_bwd)


def grouped(query, key):
    b, t, h, d = query.shape
    return query.reshape(b, t, key.shape[2], h // key.shape[2], d)


def forward(query, key, value, *, axis: str, n: int, causal: bool, scale: float,
            groups: StageGroups | None = None):
    """``(out [B, 2c, H, K], lse [B, G, H/G, 2c])``: the ring's output and each query row's
    log-sum-exp, which :func:`backward` needs. Inside a ``shard_map`` manual over ``axis``;
    ``groups``: the pipeline's stages, inside its runtime."""
    out, lse = _forward(grouped(query, key), key, value, axis, n, causal, float(scale),
                        groups)
    return out.reshape(query.shape), lse


def backward(query, key, value, out, lse, d_out, *, axis: str, n: int, causal: bool,
             scale: float, groups: StageGroups | None = None):
    """``(d_query, d_key, d_value)`` from :func:`forward`'s output and log-sum-exp."""
    q = grouped(query, key)
    dq, dk, dv = _backward(q, key, value, out.reshape(q.shape), lse,
                           d_out.reshape(q.shape), axis, n, causal, float(scale), groups)
    return dq.reshape(query.shape), dk, dv


def ring_attention(query, key, value, *, axis: str, n: int, causal: bool,
                   scale: float) -> jax.Array:
    """Attention of this device's queries over the whole sequence, by the ring.

    Call it inside a ``shard_map`` that is manual over ``axis``, on each device's part of the
    sequence in zigzag order. (Nested in another ``shard_map``, jax 0.10 cannot lower the
    residuals of a ``custom_vjp`` inside the inner one; ``px.ContextParallel`` therefore
    wraps :func:`forward` and :func:`backward` in their own ``shard_map`` s instead.)

    Args:
      query: ``[B, 2c, H, K]`` (this device's two chunks).
      key, value: ``[B, 2c, G, K]``, ``H`` a multiple of ``G``.
      axis: the context mesh axis; ``n`` its size.
      causal: mask each query from later positions (by global position).
      scale: the logits' scale.

    Returns:
      ``[B, 2c, H, K]`` in the query's dtype.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mesh = jax.make_mesh((2,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> q = jnp.ones((1, 8, 2, 4))  # T = 8 over 2 devices: 4 each
      >>> f = jax.shard_map(lambda q: ring_attention(q, q, q, axis="context", n=2,
      ...     causal=True, scale=0.5), mesh=mesh, in_specs=jax.P(None, "context"),
      ...     out_specs=jax.P(None, "context"))
      >>> f(q).shape
      (1, 8, 2, 4)
    """
    q = grouped(query, key)
    return _ring(q, key, value, axis, n, causal, float(scale)).reshape(query.shape)
