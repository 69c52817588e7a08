"""The zigzag split of a sequence over ``n`` devices, and the way back to natural order.

The sequence is cut into ``2n`` equal chunks; device ``i`` holds chunks ``i`` and
``2n-1-i``. Under causal masking chunk ``k`` attends to ``k + 1`` chunks, so every device's
two chunks attend to ``2n + 1`` chunks together: the work is the same on every device
(the contiguous split gives device ``n-1`` about ``2n - 1`` times device 0's).

The model enters this order where it reads token ids (a gather of integers that every
device of the context axis holds anyway: no communication) and with positions read from
:func:`positions`, so position embeddings and RoPE see the global index. It leaves it
once, before the output projection, with :func:`to_natural`: two ``ppermute`` s of half
a device's activations each (the even and the odd chunks; one for ``n = 2``, where the
even chunks are already home), so the logits and the loss are in the order of the labels.

References:
  zhuzilin/ring-flash-attention (``zigzag_ring_flash_attn``) and Llama 3 (Dubey et al.,
  2024, section 3.3.2: "2 x CP chunks ... the i-th rank receives the i-th and the
  (2 x CP - 1 - i)-th chunks").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from parallax.strategies.context_parallel.stage_groups import StageGroups


def chunks(n: int) -> np.ndarray:
    """``[n, 2]``: the chunks device ``i`` holds, ``(i, 2n - 1 - i)``.

    Example:
      >>> chunks(2).tolist()
      [[0, 3], [1, 2]]
    """
    i = np.arange(n)
    return np.stack([i, 2 * n - 1 - i], axis=1)


def positions(length: int, n: int) -> np.ndarray:
    """The global position of each slot when the split sequence is read device by device.

    Args:
      length: T, a multiple of ``2n``.
      n: the context axis size.

    Returns:
      An int32 permutation of ``range(T)``: slot ``p`` of the model's sequence holds
      position ``positions[p]``; device ``i`` holds slots ``i*T/n .. (i+1)*T/n - 1``.

    Example:
      >>> positions(8, 2).tolist()
      [0, 1, 6, 7, 2, 3, 4, 5]
    """
    c = length // (2 * n)
    return (chunks(n).reshape(-1, 1) * c + np.arange(c)).reshape(-1).astype(np.int32)


def visible_pairs(n: int, c: int = 1) -> np.ndarray:
    """``[n]``: the causally visible query-key pairs of each device's queries under the zigzag
    split (what a device must compute at the least); equal on every device.

    Example:
      >>> visible_pairs(4, 2).tolist()
      [34, 34, 34, 34]
    """
    pos = positions(2 * n * c, n).reshape(n, 2 * c)
    return np.array([int(np.sum(p[:, None] + 1)) for p in pos])


def _routes(n: int, parity: int) -> list[tuple[int, int]]:
    """``(holder, natural owner)`` of each chunk of ``parity``: a permutation of devices."""
    holder = {int(c): i for i, pair in enumerate(chunks(n)) for c in pair}
    return [(holder[c], c // 2) for c in range(parity, 2 * n, 2)]


def _send(x, axis: str, pairs, groups: StageGroups | None):
    """``ppermute`` over ``pairs`` (within each stage under a pipeline: ``groups``); nothing
    when every device keeps its own (n = 2, even chunks), which XLA would still copy."""
    if all(a == b for a, b in pairs):
        return x
    if groups is None:
        return lax.ppermute(x, axis, pairs)
    return groups.permute(x, axis, len(pairs), pairs)


def to_natural(x: jax.Array, axis: str, n: int, groups: StageGroups | None = None
               ) -> jax.Array:
    """This device's zigzag slots ``[B, 2c, ...]`` -> its natural slots (chunks ``2i, 2i+1``).

    Call inside a ``shard_map`` manual over ``axis``. Each device holds one even and one odd
    chunk; each parity goes to its natural owner with one ``ppermute``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mesh = jax.make_mesh((2,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> zig = jnp.asarray(positions(8, 2))[None]  # each slot holds its position
      >>> f = jax.shard_map(lambda x: to_natural(x, "context", 2), mesh=mesh,
      ...                   in_specs=jax.P(None, "context"), out_specs=jax.P(None, "context"))
      >>> f(zig).tolist()
      [[0, 1, 2, 3, 4, 5, 6, 7]]
    """
    c = x.shape[1] // 2
    first, second = x[:, :c], x[:, c:]
    even_first = lax.axis_index(axis) % 2 == 0  # chunk i is even exactly when i is
    even = jnp.where(even_first, first, second)
    odd = jnp.where(even_first, second, first)
    even = _send(even, axis, _routes(n, 0), groups)
    odd = _send(odd, axis, _routes(n, 1), groups)
    return jnp.concatenate([even, odd], axis=1)


def to_zigzag(x: jax.Array, axis: str, n: int, groups: StageGroups | None = None
              ) -> jax.Array:
    """The inverse of :func:`to_natural` (its transpose): natural slots -> zigzag slots.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mesh = jax.make_mesh((2,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
      >>> f = jax.shard_map(lambda x: to_zigzag(x, "context", 2), mesh=mesh,
      ...                   in_specs=jax.P(None, "context"), out_specs=jax.P(None, "context"))
      >>> f(jnp.arange(8)[None]).tolist()
      [[0, 1, 6, 7, 2, 3, 4, 5]]
    """
    c = x.shape[1] // 2
    back = lambda pairs: [(dst, src) for src, dst in pairs]
    even = _send(x[:, :c], axis, back(_routes(n, 0)), groups)
    odd = _send(x[:, c:], axis, back(_routes(n, 1)), groups)
    even_first = lax.axis_index(axis) % 2 == 0
    return jnp.concatenate([jnp.where(even_first, even, odd),
                            jnp.where(even_first, odd, even)], axis=1)
