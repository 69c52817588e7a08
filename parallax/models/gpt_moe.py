"""The GPT's mixture-of-experts blocks: their forward pass, scan, and router statistics.

With ``GPTConfig(moe=MoEConfig(...))`` every block's MLP is a :class:`parallax.nn.MoE`.
The scanned blocks then return each layer's router statistics beside the residual stream;
the GPT keeps them, stacked over layers, as a sown value (``model.moe_stats``, an
``nnx.Intermediate``) that :func:`take_stats` reads and removes, so the loss can add the
auxiliary losses (``moe_next_token_loss``). The dense GPT is untouched by this file.

References:
  Fedus et al. 2021, "Switch Transformers" (an auxiliary loss per MoE layer, summed);
  Lepikhin et al. 2020, "GShard" (MoE in place of the transformer's feed-forward layer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from parallax.activations import constrain
from parallax.comm.varying import to_varying, varying_axes
from parallax.models.remat import remat_layer
from parallax.nn.attention_dropout import apply_dropout
from parallax.nn.layers import RESIDUAL


def moe_block_forward(block, x: jax.Array, segment_ids: jax.Array | None = None
                      ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One MoE block: ``(residual stream [B, T, D], this layer's router statistics)``."""
    packed = {} if segment_ids is None else {"segment_ids": segment_ids}  # ParallelGPT's: none
    probs, resid = getattr(block, "attn_dropout", None), getattr(block, "resid_dropout", None)
    if probs is not None:
        packed["probs_dropout"] = probs
    x = constrain(x + apply_dropout(resid, block.attn(block.ln1(x), **packed)), RESIDUAL)
    y, stats = block.mlp(block.ln2(x))
    return constrain(x + apply_dropout(resid, y), RESIDUAL), stats


STATS_IN_ROW = ("load_balance_loss", "router_z_loss")


def with_stats_row(x: jax.Array) -> jax.Array:
    """``[B, T, D]`` -> ``[B, T + 1, D]``: a zero row after the stream for the auxiliary losses.

    A pipeline carries one activation array between its stages; the row brings each layer's
    losses (summed) to the last stage. Needs ``D >= 2``.
    """
    if x.shape[-1] < len(STATS_IN_ROW):
        raise ValueError(f"next_token_stages: an MoE GPT under a pipeline carries its "
                         f"{len(STATS_IN_ROW)} auxiliary losses in the embedding dimension, "
                         f"which has {x.shape[-1]} entries; use embed_dim >= 2.")
    return jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)


def split_stats_row(x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``[B, T + 1, D]`` -> (the stream ``[B, T, D]``, the summed losses as scalars)."""
    row = x[0, -1].astype(jnp.float32)
    return x[:, :-1], {name: row[i] for i, name in enumerate(STATS_IN_ROW)}


def moe_block_with_stats_row(block, x: jax.Array) -> jax.Array:
    """One MoE block on ``[B, T + 1, D]``: the stream through the block, its losses added."""
    stream, row = x[:, :-1], x[:, -1:]
    y, stats = moe_block_forward(block, stream)
    # The losses are the same on every batch shard; typed as varying like the stream, so the
    # backward pass sums their cotangents over the shards explicitly (shard_map's check).
    losses = to_varying(jnp.stack([stats[name] for name in STATS_IN_ROW]).astype(x.dtype),
                        tuple(varying_axes(x)))
    padding = jnp.zeros(x.shape[-1] - len(STATS_IN_ROW), x.dtype)
    added = jnp.concatenate([losses, to_varying(padding, tuple(varying_axes(x)))])
    return jnp.concatenate([y, row + added], axis=1)


def apply_moe_blocks(model, x: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """All L MoE blocks as one ``nnx.scan``; the statistics are kept on ``model``.
    (``segment_ids``: packed documents; the router's statistics count padding tokens too.)"""
    return scan_moe_blocks(model, x, lambda block, x: moe_block_forward(block, x, segment_ids))


def scan_moe_blocks(model, x: jax.Array, block_forward) -> jax.Array:
    """``model.blocks`` as one ``nnx.scan`` of ``block_forward(block, x) -> (x, stats)`` under
    the config's remat policy; the stacked router statistics are kept on ``model`` (for
    :func:`take_stats`). The MoE GPT's and the MoE Llama's blocks both run through it."""
    layers = {nnx.PARTITION_NAME: "layers"}
    forward = remat_layer(block_forward, model.config.remat)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0), transform_metadata=layers)
    def body(x: jax.Array, block):
        return forward(block, x)

    x, stats = body(x, model.blocks)
    model.moe_stats = nnx.Intermediate(stats)
    return x


def take_stats(model) -> dict[str, jax.Array]:
    """The router statistics of the model's last forward pass, removed from the model.

    Works for every model whose scanned MoE blocks sow ``moe_stats`` (the GPT's and the
    Llama's, ``config.moe``).

    Returns:
      ``load_balance_loss`` as ``config.moe.aux_loss`` defines it over the layers
      (``"switch"``: each layer's summed, as Switch adds one per MoE layer; ``"mixtral"``:
      :func:`pooled_balance_loss`), ``router_z_loss`` summed over layers,
      ``dropped_fraction`` averaged over layers, and ``expert_load`` ``[L, E]``: per layer,
      the share of routing choices each expert got.

    Raises:
      ValueError: the model has run no MoE forward pass since the last call.
    """
    sown = getattr(model, "moe_stats", None)
    if sown is None:
        raise ValueError(
            "moe_next_token_loss: the model holds no router statistics; call it with a GPT "
            "or Llama built with moe=MoEConfig(...), whose forward pass records them.")
    stats = sown.get_value()
    del model.moe_stats
    moe = model.config.moe
    if moe.aux_loss == "mixtral":
        balance = pooled_balance_loss(stats["expert_load"], stats["expert_importance"],
                                      moe.top_k)
    else:
        balance = jnp.sum(stats["load_balance_loss"])
    return {
        "load_balance_loss": balance,
        "router_z_loss": jnp.sum(stats["router_z_loss"]),
        "dropped_fraction": jnp.mean(stats["dropped_fraction"]),
        "expert_load": stats["expert_load"],
    }


def pooled_balance_loss(load: jax.Array, importance: jax.Array, top_k: int) -> jax.Array:
    """Mixtral's load-balancing loss: ``E sum_e f_e P_e`` over all layers' tokens at once.

    Hugging Face transformers' ``load_balancing_loss_func`` (``modeling_mixtral.py``)
    concatenates the router logits of every layer, so ``f_e`` (how many of a token's
    ``top_k`` choices went to expert e, per token: ``top_k`` times the share of choices)
    and ``P_e`` (the mean router probability) are each averaged over layers and tokens
    before their product; one loss for the whole model, not one per layer.

    Args:
      load: ``[L, E]`` per layer, the share of all routing choices each expert got.
      importance: ``[L, E]`` per layer, each expert's mean router probability.
      top_k: k, the choices per token.

    Example:
      >>> import jax.numpy as jnp
      >>> even = jnp.full((3, 4), 0.25)             # 3 layers, 4 experts, perfectly even
      >>> float(pooled_balance_loss(even, even, top_k=2))   # k at balance (Switch's: 1)
      2.0
    """
    num_experts = load.shape[-1]
    tokens_per_expert = top_k * jnp.mean(load, axis=0)
    return num_experts * jnp.sum(tokens_per_expert * jnp.mean(importance, axis=0))
