"""Dropless MoE under expert parallelism without padding: the exchange in rounds of chunks.

Dropless routing cannot drop a choice, so its slots must hold the busiest expert's tokens.
Padding every expert to ``C = S`` slots per sequence (what the capacity path does with
``capacity_factor=None``) costs ``E / k`` times the routed tokens' all-to-all bytes and
expert FLOPs. Here each device instead cuts its ``N k`` choices into rounds of
``c = ceil(N k / E)`` slots per expert (each expert's even share):

1. every choice gets its position among this device's choices of the same expert, so
   round ``r`` holds the choices at positions ``[r c, (r + 1) c)``;
2. the devices agree (``pmax`` over the step's batch axes) on
   ``rounds = ceil(max n_e / c)``, ``n_e`` the choices of expert e on one device, the
   maximum over experts and devices: the busiest expert's count, not ``S``;
3. each round scatters its choices into ``[1, E, c, D]`` slots, sends them through the
   strategy's exchange (two all-to-alls around the local experts) and gathers the outputs
   back, weighted by the gates.

The rounds are a ``lax.scan`` over the most rounds dropless can need
(``ceil(N / c)``, all of a device's tokens choosing one expert), each a ``lax.cond`` that
runs only when ``r < rounds``; the backward pass's scan skips the same rounds. So the
bytes and FLOPs that run follow the routed tokens: ``rounds x E c`` slots per device per
exchange, ``N k`` when the load is even (one round), and at most the padded path's when
one expert takes everything. Memory does not: the scan keeps each round's residuals,
sized for the most rounds (as the padded path's are).

Rounds are the CPU's exchange (``px.ExpertParallel(dropless_exchange="auto")`` on CPU):
XLA's CPU backend does not implement ``jax.lax.ragged_all_to_all`` (``UNIMPLEMENTED: HLO
opcode ragged-all-to-all is not supported by XLA:CPU``), and ``lax.ragged_dot`` on CPU
lowers to one dense matmul per group (``E`` times the FLOPs of the rows). The rounds use
only ``all_to_all`` and batched matmuls, so they run, and cost what they say, on every
backend. On GPUs and TPUs the ragged all-to-alls send exactly the routed tokens
(``parallax.nn.moe_ragged``).

References:
  Gale et al. 2022, "MegaBlocks" (dropless MoE; block-sparse grouped matmuls);
  Lepikhin et al. 2020, "GShard" (the dispatch and combine all-to-alls);
  Hwang et al. 2023, "Tutel" (adaptive capacity chosen per step from the real loads).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from parallax.comm.varying import to_varying, varying_axes

Exchange = Callable[[jax.Array, Callable[[jax.Array], jax.Array]], jax.Array]


def round_slots(tokens: int, top_k: int, num_experts: int) -> int:
    """``c``: slots per expert in one round, each expert's even share ``ceil(N k / E)``.

    Example:
      >>> round_slots(tokens=32, top_k=2, num_experts=8)
      8
    """
    return max(1, math.ceil(tokens * top_k / num_experts))


def most_rounds(tokens: int, top_k: int, num_experts: int) -> int:
    """The rounds dropless routing can need: every one of the N tokens picking one expert.

    Example:
      >>> most_rounds(tokens=32, top_k=2, num_experts=8)
      4
    """
    return math.ceil(tokens / round_slots(tokens, top_k, num_experts))


def rounds_needed(experts: jax.Array, num_experts: int) -> jax.Array:
    """``ceil(max_e n_e / c)`` for one device's ``[N, k]`` choices (int32 scalar).

    Example:
      >>> import jax.numpy as jnp
      >>> int(rounds_needed(jnp.array([[0, 1], [0, 2], [0, 3], [0, 1]]), num_experts=4))
      2
    """
    tokens, top_k = experts.shape
    c = round_slots(tokens, top_k, num_experts)
    busiest = jnp.max(jnp.bincount(experts.reshape(-1), length=num_experts))
    return ((busiest + c - 1) // c).astype(jnp.int32)


def positions(experts: jax.Array, num_experts: int) -> jax.Array:
    """Each choice's place among this device's earlier choices of the same expert, ``[N, k]``."""
    onehot = jax.nn.one_hot(experts.reshape(-1), num_experts, dtype=jnp.int32)
    return (jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, -1)
            .reshape(experts.shape).astype(jnp.int32))


def dropless_in_rounds(x: jax.Array, experts: jax.Array, gates: jax.Array,
                       run: Callable[[jax.Array], jax.Array], exchange: Exchange,
                       axis: str, num_experts: int,
                       agree: tuple[str, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """The gated sum of each token's k experts' outputs, every choice kept; ``[G, S, D]``.

    Called inside a ``shard_map`` manual over ``axis`` (the explicit step's).

    Args:
      x: this device's tokens, ``[G, S, D]``.
      experts: ``[G, S, k]`` chosen experts (global ids).
      gates: ``[G, S, k]`` their weights.
      run: the local experts, ``[n, E / n, c, D] -> [n, E / n, c, D]``.
      exchange: the strategy's ``(slots [1, E, c, D], run) -> [1, E, c, D]``.
      axis: the mesh axis the experts are split over (the rounds are agreed over it).
      num_experts: E.
      agree: the manual batch axes whose devices run the layer together (``axis`` is added):
        the rounds are their maximum. Not a pipeline's stage axis, whose devices run
        different layers at a time.

    Returns:
      ``(y, rounds)``: ``y [G, S, D] = sum_j gates[..., j] * expert_{experts[..., j]}(x)``,
      as one device computes it, and the rounds that ran (int32, the same over ``agree``).
    """
    g, s, d = x.shape
    tokens, k = g * s, experts.shape[-1]
    rows, experts = x.reshape(tokens, d), experts.reshape(tokens, k)
    gates = gates.reshape(tokens, k).astype(x.dtype)
    c = round_slots(tokens, k, num_experts)
    place = positions(experts, num_experts)
    # The step's batch axes run the same rounds: agreed over the expert axis only, data
    # shards running different counts aborted the process on XLA CPU (seen, jax 0.10).
    agree = tuple(sorted(set(agree) | {axis}))
    rounds = lax.pmax(rounds_needed(experts, num_experts), agree)
    spanned = tuple(sorted(varying_axes(rows) | varying_axes(rounds) | {axis}))
    sent = jnp.broadcast_to(rows[:, None], (tokens, k, d)).reshape(tokens * k, d)
    nowhere = num_experts * c  # out of range: scatter drops it, gather fills 0

    def one_round(r, out):
        first = r * c
        here = (place >= first) & (place < first + c)
        index = jnp.where(here, experts * c + place - first, nowhere)  # [N, k]
        slots = jnp.zeros((nowhere, d), x.dtype).at[index.reshape(-1)].set(sent, mode="drop")
        done = exchange(slots.reshape(1, num_experts, c, d), run).reshape(nowhere, d)
        got = done.at[index].get(mode="fill", fill_value=0)  # [N, k, D]
        return out + jnp.sum(got * gates[..., None], axis=1)

    def step(out, r):
        with jax.named_scope("dropless_round"):
            out = lax.cond(r < rounds, one_round, lambda r, out: out, r, out)
        return out, None

    start = to_varying(jnp.zeros((tokens, d), x.dtype), spanned)
    out, _ = lax.scan(step, start, jnp.arange(most_rounds(tokens, k, num_experts)))
    return out.reshape(g, s, d), rounds
