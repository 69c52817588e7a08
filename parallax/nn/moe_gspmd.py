"""Dropless MoE in the GSPMD style: the explicit exchanges in a ``shard_map`` of the layer.

In the GSPMD style (``px.ExpertParallel(style="gspmd")``) the MoE layer runs on global
arrays, and its capacity slots reach the experts through sharding constraints that XLA turns
into all-to-alls. Dropless routing then needs ``C = S`` slots per expert (padded: ``E / k``
times the routed tokens' bytes and FLOPs), since a constraint cannot say "only the routed
rows". Here the dropless layer's exchange alone runs in a ``shard_map`` manual over the
step's batch axes (the expert axis among them), with the explicit style's code: the ragged
all-to-alls (``parallax.nn.moe_ragged``) or the rounds (``parallax.nn.moe_dropless``), as
``ExpertExchange.dropless_exchange`` picks for the mesh. The router, its statistics and the
rest of the model stay GSPMD.

The tokens enter split over the batch axes (as the step splits them), the expert weights
split over the expert axis and replicated over the other manual axes (ZeRO's shards of them
are gathered at the region's edge, as the layer's use of them needs anyway); other mesh axes
stay automatic.

References:
  Lepikhin et al. 2020, "GShard" (the layer under GSPMD); Gale et al. 2022, "MegaBlocks".
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from parallax.nn.moe_dropless import dropless_in_rounds
from parallax.nn.moe_experts import swiglu_experts, swiglu_grouped
from parallax.nn.moe_ragged import dropless_ragged


def dropless_in_shard_map(x: jax.Array, experts: jax.Array, gates: jax.Array, weights,
                          exchange, mesh: Mesh, batch_axes: tuple[str, ...],
                          num_experts: int, collective=None) -> jax.Array:
    """The dropless layer's expert outputs on global arrays, ``[B, S, D]``.

    Args:
      x: the tokens, ``[B, S, D]`` (B split over ``batch_axes`` by the step).
      experts: ``[B, S, k]`` chosen experts; gates: ``[B, S, k]`` their weights.
      weights: the stacked ``(w_gate, w_up, w_down)``, ``[E, ...]``.
      exchange: the strategy's ``ExpertExchange`` (its axis, its ``exchange``).
      mesh: the step's mesh.
      batch_axes: the strategy's batch axes (``exchange.axis`` among them).
      num_experts: E.
      collective: the ragged all-to-all, or None for the rounds.

    Returns:
      ``y [B, S, D] = sum_j gates[..., j] * expert_{experts[..., j]}(x)``.
    """
    axis = exchange.axis
    agree = tuple(a for a in batch_axes if a != axis)
    tokens, split = jax.P(batch_axes), jax.P(axis)

    def local(x, experts, gates, *weights):
        if collective is not None:
            run = lambda rows, sizes: swiglu_grouped(rows, sizes, weights)  # noqa: E731
            return dropless_ragged(x, experts, gates, run, axis, num_experts, collective)
        run = lambda t: swiglu_experts(t, *weights)  # noqa: E731
        y, _ = dropless_in_rounds(x, experts, gates, run, exchange.exchange, axis,
                                  num_experts, agree)
        return y

    return jax.shard_map(local, mesh=mesh, in_specs=(tokens,) * 3 + (split,) * 3,
                         out_specs=tokens, axis_names=frozenset(batch_axes))(
        x, experts, gates, *weights)
