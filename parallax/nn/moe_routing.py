"""The router of an MoE layer: scores, top-k choice, capacity slots, and its two losses.

Pure functions over ``[G, S, ...]`` arrays: G groups (sequences) of S tokens. Capacity is
per group, as GShard's is per group; with one group per sequence, which tokens drop does
not depend on how the batch is split over devices.

References:
  Lepikhin et al. 2020, "GShard", algorithm 1 (top-2 gating, capacity, priority of first
  choices over second choices); Fedus et al. 2021, "Switch Transformers", eq. 4-6 (the
  load-balancing loss ``E * sum_e f_e P_e``); Zoph et al. 2022, "ST-MoE", eq. 5 (router
  z-loss, the mean squared log-sum-exp of the logits); DeepSeek-AI 2024, "DeepSeek-V3",
  sec. 2.1.2 (sigmoid affinities normalised over the chosen experts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routing(NamedTuple):
    """A router's decision for every token.

    Attributes:
      probs: ``[G, S, E]`` float32 scores, normalised to sum 1 over experts (what the
        balancing loss's ``P_e`` averages).
      experts: ``[G, S, k]`` int32 chosen experts, best first.
      gates: ``[G, S, k]`` float32 weights of the chosen experts' outputs.
    """

    probs: jax.Array
    experts: jax.Array
    gates: jax.Array


def route(logits: jax.Array, top_k: int, score: str) -> Routing:
    """Scores and top-k choice from router logits ``[G, S, E]``.

    Softmax scores keep the chosen probability as the gate for k = 1 (Switch) and normalise
    the two gates to sum 1 for k = 2 (GShard, Mixtral). Sigmoid scores (DeepSeek-V3) are
    normalised over the chosen experts when k = 2, kept as is for k = 1.

    Example:
      >>> import jax.numpy as jnp
      >>> r = route(jnp.array([[[0.0, 2.0, 1.0]]]), top_k=2, score="softmax")
      >>> r.experts.tolist()
      [[[1, 2]]]
    """
    logits = logits.astype(jnp.float32)
    scores = jax.nn.softmax(logits, -1) if score == "softmax" else jax.nn.sigmoid(logits)
    top, experts = jax.lax.top_k(scores, top_k)
    gates = top / jnp.sum(top, -1, keepdims=True) if top_k > 1 else top
    probs = scores if score == "softmax" else scores / jnp.sum(scores, -1, keepdims=True)
    return Routing(probs, experts.astype(jnp.int32), gates)


def slots(experts: jax.Array, num_experts: int, capacity: int):
    """Each choice's slot in its expert's buffer, and whether it fits.

    Within a group, every token's first choice is placed before any second choice, and
    choices in token order (GShard's priority): ``position = (earlier choices of the same
    expert)``; a choice at ``position >= capacity`` is dropped.

    Args:
      experts: ``[G, S, k]`` chosen experts.
      num_experts: E.
      capacity: C, slots per expert and group.

    Returns:
      ``(position [G, S, k] int32, kept [G, S, k] bool)``.

    Example:
      >>> import jax.numpy as jnp
      >>> pos, kept = slots(jnp.array([[[0], [0], [1]]]), num_experts=2, capacity=1)
      >>> pos[..., 0].tolist(), kept[..., 0].tolist()
      ([[0, 1, 0]], [[True, False, True]])
    """
    g, s, k = experts.shape
    onehot = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32)  # [G, S, k, E]
    by_choice = jnp.swapaxes(onehot, 1, 2).reshape(g, k * s, num_experts)
    position = jnp.cumsum(by_choice, axis=1) - 1  # earlier claims on the same expert
    position = jnp.sum(position * by_choice, -1).reshape(g, k, s).swapaxes(1, 2)
    return position.astype(jnp.int32), position < capacity


def dispatch_tensors(routing: Routing, num_experts: int, capacity: int):
    """GShard's dispatch and combine tensors, ``[G, S, E, C]`` each, and the kept choices.

    ``dispatch[g, s, e, c]`` is 1 where token s of group g sits in slot c of expert e;
    ``combine`` holds the gate there instead. Dropped choices appear in neither.
    """
    position, kept = slots(routing.experts, num_experts, capacity)
    where = (jax.nn.one_hot(routing.experts, num_experts, dtype=jnp.float32)[..., None]
             * jax.nn.one_hot(jnp.where(kept, position, capacity), capacity,
                              dtype=jnp.float32)[..., None, :])  # [G, S, k, E, C]
    dispatch = jnp.sum(where, axis=2)
    combine = jnp.sum(where * routing.gates[..., None, None], axis=2)
    return dispatch, combine, kept


def router_stats(logits: jax.Array, routing: Routing, kept: jax.Array, num_experts: int,
                 global_mean: Callable[[jax.Array], jax.Array]) -> dict[str, jax.Array]:
    """The two auxiliary losses and the load statistics, over the whole batch.

    Args:
      logits: ``[G, S, E]`` router logits.
      routing: the router's decision.
      kept: ``[G, S, k]`` which choices found a slot.
      num_experts: E.
      global_mean: ``x -> x`` averaged over every batch shard (the identity on one
        device): ``f_e`` and ``P_e`` must be the whole batch's for the loss to be one
        device's, since a mean of products is not a product of means.

    Returns:
      ``{"load_balance_loss", "router_z_loss", "dropped_fraction"}`` (float32 scalars)
      and ``"expert_load"``: ``[E]``, the fraction of choices that picked each expert
      (``f_e``), ``"expert_importance"``: ``[E]``, the mean router probability of each
      expert (``P_e``); a model pools these two over its layers for Mixtral's loss.
    """
    chosen = jax.nn.one_hot(routing.experts, num_experts, dtype=jnp.float32)  # [G, S, k, E]
    load = global_mean(jnp.mean(chosen, axis=(0, 1, 2)))  # f_e: shares of all k * N choices
    importance = global_mean(jnp.mean(routing.probs, axis=(0, 1)))  # P_e
    z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return {
        "load_balance_loss": num_experts * jnp.sum(load * importance),
        "router_z_loss": global_mean(jnp.mean(z * z)),
        "dropped_fraction": global_mean(1.0 - jnp.mean(kept.astype(jnp.float32))),
        "expert_load": load,
        "expert_importance": importance,
    }
