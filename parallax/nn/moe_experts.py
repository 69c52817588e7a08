"""The MoE layer's experts: SwiGLU on capacity slots, or grouped on rows sorted by expert.

Used by ``parallax.nn.MoE`` and by its exchanges (``moe_dropless``, ``moe_ragged``,
``moe_gspmd``), which run the local experts on what they received.

References:
  Shazeer 2020, "GLU Variants Improve Transformer" (SwiGLU); Gale et al. 2022, "MegaBlocks"
  (grouped matmuls, ``jax.lax.ragged_dot`` here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def swiglu_experts(tokens: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                   w_down: jax.Array) -> jax.Array:
    """Each expert's SwiGLU on its slots: ``[G, E, C, D]`` -> ``[G, E, C, D]``.

    ``E`` is however many experts the weights hold (all, or one device's share). The gate
    and up projections run as one matmul on the two weights stacked, so that under tensor
    parallelism the backward pass sums their input gradients before its one all-reduce
    (as Megatron fuses its column-parallel input projections).
    """
    gate, up = jnp.einsum("gecd,kedf->kgecf", tokens, jnp.stack([w_gate, w_up]))
    return jnp.einsum("gecf,efd->gecd", jax.nn.silu(gate) * up, w_down)


def swiglu_grouped(rows: jax.Array, sizes: jax.Array, weights) -> jax.Array:
    """Each expert's SwiGLU on its consecutive rows: three ``ragged_dot``s, ``[M, D]``.

    ``sizes [E]`` are the rows of each expert of ``weights`` in order; rows past their sum
    give 0.
    """
    w_gate, w_up, w_down = weights
    h = jax.nn.silu(lax.ragged_dot(rows, w_gate, sizes)) * lax.ragged_dot(rows, w_up, sizes)
    return lax.ragged_dot(h, w_down, sizes)


def grouped_experts(x: jax.Array, routing, weights) -> jax.Array:
    """Dropless: the ``N k`` choices sorted by expert, three ``ragged_dot``s, unsorted."""
    g, s, d = x.shape
    k = routing.experts.shape[-1]
    flat = routing.experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=weights[0].shape[0]).astype(jnp.int32)
    rows = x.reshape(g * s, d)[order // k]
    out = jnp.zeros((g * s * k, d), x.dtype).at[order].set(swiglu_grouped(rows, sizes,
                                                                           weights))
    gates = routing.gates.reshape(g * s, k, 1).astype(x.dtype)
    return jnp.sum(out.reshape(g * s, k, d) * gates, axis=1).reshape(g, s, d)
