"""The GPT's next-token loss as pipeline stages: embedding, one block, head and loss.

``next_token_stages`` is a :class:`parallax.pipeline.Stages`: called as
``next_token_stages(model, batch)`` it is ``next_token_loss`` (the same operations in the
same order); under ``px.Pipeline`` the runtime runs ``model.embed`` on the first virtual
stage, the stacked ``model.blocks`` split over the stage axis, and ``model.unembed`` with the
cross-entropy on the last.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from parallax.models import GPT, GPTConfig, next_token_loss
  >>> from parallax.models.gpt_pipeline import next_token_stages
  >>> model = GPT(GPTConfig.tiny(), rngs=nnx.Rngs(0))
  >>> batch = {"tokens": jnp.arange(34, dtype=jnp.int32).reshape(2, 17)}
  >>> bool(jnp.allclose(next_token_stages(model, batch), next_token_loss(model, batch)))
  True

For an MoE GPT (``GPTConfig(moe=...)``) the stages carry ``[B, T + 1, D]``: the residual
stream and one row that sums the layers' load-balancing and z losses, so the pipeline's one
activation array brings them to the last stage, which adds them to the loss. Under
``px.Pipeline`` the auxiliary losses are then per micro-batch (Switch's balancing loss of
each micro-batch's tokens, averaged over micro-batches, as Megatron-LM computes it), which
differs from the whole batch's; the per-layer statistics (``expert_load``) are not returned.

References:
  Huang et al. 2019, GPipe; Narayanan et al. 2021 (SC), Megatron-LM (embedding on the first
  stage, head on the last).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax

from parallax.models.gpt import GPT, Block, block_forward
from parallax.models.losses import next_token_loss
from parallax.models.gpt_moe import (
    moe_block_with_stats_row,
    split_stats_row,
    with_stats_row,
)
from parallax.models.packed_batch import refuse_packed
from parallax.nn.moe import MoE, aux_loss
from parallax.pipeline.stages import Stages


def _tokens(batch: Mapping[str, jax.Array]) -> jax.Array:
    tokens = batch["tokens"]
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(
            f"next_token_stages: batch['tokens'] must have shape [batch, seq + 1] with "
            f"seq >= 1, got {list(tokens.shape)}."
        )
    refuse_packed("next_token_stages", batch, "a pipeline's stages")
    return tokens


def embed_tokens(model: GPT, batch: Mapping[str, jax.Array]) -> jax.Array:
    """First stage: the residual stream of ``tokens[:, :-1]``, ``[B, T, D]``.

    For an MoE GPT, ``[B, T + 1, D]``: the stream and a row for the router's auxiliary
    losses, which the MoE blocks add to (:mod:`parallax.models.gpt_moe`).
    """
    x = model.embed(_tokens(batch)[:, :-1])
    moe = getattr(getattr(model, "config", None), "moe", None)
    if moe is None:
        return x
    if moe.aux_loss != "switch":
        raise ValueError(
            f"next_token_stages: an MoE GPT with MoEConfig(aux_loss={moe.aux_loss!r}) pools "
            "its router statistics over all layers, which a pipeline's stages (one summed "
            "row of losses) do not carry; use aux_loss='switch' under px.Pipeline.")
    return with_stats_row(x)


def apply_block(block: Block, x: jax.Array) -> jax.Array:
    """One stage step: one transformer block (``block_forward``), or one MoE block."""
    if isinstance(block.mlp, MoE):
        return moe_block_with_stats_row(block, x)
    return block_forward(block, x)


class _LastStage:
    """``next_token_loss``'s view of the last stage: a model whose hidden states are ``x``
    (the pipeline's activations) and whose head and loss are ``model``'s."""

    def __init__(self, model, x: jax.Array):
        self.model, self.x = model, x

    def hidden_states(self, tokens: jax.Array) -> jax.Array:
        del tokens  # the earlier stages embedded them
        return self.x

    def token_losses(self, x: jax.Array, labels: jax.Array) -> jax.Array:
        return self.model.token_losses(x, labels)


def head_loss(model: GPT, x: jax.Array, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Last stage: ``next_token_loss`` from the hidden states ``x``.

    The loss itself is ``next_token_loss``'s code (the chunked head and cross-entropy of
    ``model.token_losses``), called with a stand-in model whose hidden states are ``x``, so
    the two cannot drift apart. For an MoE GPT it adds the router's auxiliary losses carried
    in the stats row, as ``moe_next_token_loss`` does.
    """
    moe = getattr(getattr(model, "config", None), "moe", None)
    if moe is not None:
        x, stats = split_stats_row(x)
    if hasattr(model, "token_losses"):
        loss = next_token_loss(_LastStage(model, x), batch)
    else:  # a model with logits only (ParallelGPT)
        loss = next_token_loss(lambda tokens: model.unembed(x), batch)
    return loss if moe is None else loss + aux_loss(stats, moe)


next_token_stages = Stages(
    first=embed_tokens, stage=apply_block, last=head_loss, layers=lambda model: model.blocks
)
