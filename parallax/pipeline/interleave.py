"""Interleaved schedules: moving the stacked layers to the stages that run them.

With ``v`` chunks per stage, chunk ``c`` of stage ``s`` is virtual stage ``k = c S + s``
(Megatron's round-robin), which runs layers ``[k L_c, (k + 1) L_c)``. The parameters are
stored contiguously over the stage axis (rule ``("layers", "stage")``): stage ``s`` holds
blocks ``s v .. s v + v - 1``. So block ``k`` lives on stage ``k // v`` (local index
``k % v``) and runs on stage ``k % S`` (chunk ``k // S``).

:func:`to_chunks` moves every block to its runner with one ``ppermute`` per (local index,
chunk) pair (``v * v`` in all, each a one-to-one map between stages), so every block crosses
the stage axis at most once per step; :func:`from_chunks` sends the gradients back the same
way. GSPMD, asked for the same reshard as a reshape of ``[L]`` into ``[v, S, L_c]``, moved
the local stack twice each way (an all-to-all and a collective-permute, measured).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax


@functools.cache
def routes(stages: int, virtual_stages: int) -> dict[tuple[int, int], tuple[tuple[int, int], ...]]:
    """``{(i, c): ((src, dst), ...)}``: the local block ``i`` of ``src`` is chunk ``c`` of ``dst``.

    Example:
      >>> routes(2, 2)[(1, 0)]      # block 1 (layers of virtual stage 1) goes 0 -> 1
      ((0, 1),)
    """
    S, v = stages, virtual_stages
    return {
        (i, c): tuple((s, (s * v + i) % S) for s in range(S) if (s * v + i) // S == c)
        for i in range(v)
        for c in range(v)
    }


def to_chunks(local, axis: str, stages: int, virtual_stages: int):
    """A stage's stored blocks ``[v * L_c, ...]`` -> the chunks it runs ``[v, L_c, ...]``."""
    v = virtual_stages
    blocks = local.reshape(v, local.shape[0] // v, *local.shape[1:])
    if v == 1:
        return blocks
    table = routes(stages, v)
    chunks = []
    for c in range(v):
        parts = [lax.ppermute(blocks[i], axis, table[i, c]) for i in range(v) if table[i, c]]
        chunks.append(functools.reduce(jnp.add, parts))  # one part is not zero: the owner's
    return jnp.stack(chunks)


def from_chunks(chunks, axis: str, stages: int, virtual_stages: int):
    """The inverse of :func:`to_chunks`: gradients ``[v, L_c, ...]`` -> ``[v * L_c, ...]``."""
    v = virtual_stages
    if v == 1:
        return chunks.reshape(-1, *chunks.shape[2:])
    table = routes(stages, v)
    blocks = []
    for i in range(v):
        parts = [lax.ppermute(chunks[c], axis, tuple((d, s) for s, d in table[i, c]))
                 for c in range(v) if table[i, c]]
        blocks.append(functools.reduce(jnp.add, parts))
    return jnp.concatenate(blocks)
