"""The reference models' training losses: next-token cross-entropy, plus MoE's router losses.

``next_token_loss`` is the loss of ``px.models``' GPT and Llama (and of any callable from
tokens to logits); ``moe_next_token_loss`` adds the router's auxiliary losses of an MoE GPT
or Llama (Mixtral).
For the reference models the logits are computed a chunk of the sequence at a time
(:func:`parallax.nn.chunked_cross_entropy`), so no ``[B, T, V]`` float32 buffer exists.

References:
  Radford et al., "Language Models are Unsupervised Multitask Learners" (GPT-2), 2019;
  Fedus et al. 2021, "Switch Transformers"; Zoph et al. 2022, "ST-MoE".
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from parallax.attention import whole_labels
from parallax.models.gpt import GPT
from parallax.models.gpt_config import GPTConfig
from parallax.models.gpt_moe import take_stats
from parallax.models.llama_config import LlamaConfig
from parallax.models.packed_batch import split_batch
from parallax.models.token_checks import check_token_ids
from parallax.nn.loss import cross_entropy
from parallax.nn.moe import aux_loss


def next_token_loss(model: GPT, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Mean next-token cross-entropy over all B * T positions, in float32.

    For ``px.models``' GPT and Llama (a model with ``hidden_states`` and ``token_losses``)
    the logits are computed a chunk of the sequence at a time and never held whole
    (``config.loss_chunks``, :func:`parallax.nn.chunked_cross_entropy`); for any other
    callable from tokens to logits, from its logits.

    Args:
      model: a ``GPT`` or ``Llama`` (or any callable from tokens ``[B, T]`` to logits
        ``[B, T, V]``).
      batch: ``{"tokens": int [B, T + 1]}``; inputs are ``tokens[:, :-1]``, targets
        ``tokens[:, 1:]``. Packed rows (``parallax.data``) add ``"segment_ids"`` and
        ``"positions"`` ``[B, T + 1]``: attention stays within documents (the model takes
        them as ``segment_ids=`` / ``positions=``); a target in another document (a
        document's last token) or padding counts zero (``models.packed_batch``).

    Returns:
      A float32 scalar: a plain mean over the B * T positions (those that do not count add
      zero), so every position weighs the same and the mean of equal-sized shards' losses
      is the full batch's (what data parallelism relies on).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.models import GPT, GPTConfig, next_token_loss
      >>> model = GPT(GPTConfig.tiny(), rngs=nnx.Rngs(0))
      >>> tokens = jnp.arange(34, dtype=jnp.int32).reshape(2, 17)
      >>> loss = next_token_loss(model, {"tokens": tokens})
      >>> bool(5.0 < loss < 6.0)  # about log(256) = 5.55 at init
      True
    """
    inputs, targets, packed, weights = split_batch("next_token_loss", batch)
    config = getattr(model, "config", None)
    if isinstance(config, GPTConfig):  # the targets too: the last column is never embedded
        check_token_ids("next_token_loss", batch["tokens"], config.vocab_size)
    labels = whole_labels(targets)
    if hasattr(model, "hidden_states") and hasattr(model, "token_losses"):
        losses = model.token_losses(model.hidden_states(inputs, **packed), labels)
    else:
        losses = cross_entropy(jnp.asarray(model(inputs, **packed), jnp.float32), labels)
    return jnp.mean(losses if weights is None else losses * weights)


def moe_next_token_loss(model: GPT, batch: Mapping[str, jax.Array]):
    """``next_token_loss`` plus the MoE router's auxiliary losses, with the statistics.

    For ``loss_fn`` with ``has_aux=True``: the loss is the cross-entropy plus
    ``balance_coef * load_balance_loss + z_coef * router_z_loss``, over the layers as
    ``moe.aux_loss`` says (``"switch"``: each layer's summed; ``"mixtral"``: one
    balancing loss pooled over all layers, as transformers' Mixtral, and no z-loss).

    Args:
      model: a ``GPT`` or ``Llama`` whose config has ``moe=MoEConfig(...)``.
      batch: ``{"tokens": int [B, T + 1]}``.

    Returns:
      ``(loss, stats)``: ``stats`` holds ``cross_entropy``, ``load_balance_loss``,
      ``router_z_loss``, ``dropped_fraction`` (scalars) and ``expert_load`` ``[L, E]``.
      Note: under ``px.value_and_grad`` an aux array whose leading dimension equals a
      device's batch rows is read as per-example; keep ``L != rows`` (or drop it).

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.models import GPT, GPTConfig, MoEConfig, moe_next_token_loss
      >>> model = GPT(GPTConfig.tiny(moe=MoEConfig(num_experts=4)), rngs=nnx.Rngs(0))
      >>> loss, stats = moe_next_token_loss(model, {"tokens": jnp.ones((2, 9), jnp.int32)})
      >>> stats["expert_load"].shape
      (2, 4)

    References:
      Fedus et al. 2021, "Switch Transformers"; Zoph et al. 2022, "ST-MoE".
    """
    config = getattr(model, "config", None)
    if not isinstance(config, (GPTConfig, LlamaConfig)) or config.moe is None:
        raise ValueError("moe_next_token_loss: the model must be a GPT or Llama built with "
                         "moe=MoEConfig(...) (GPTConfig or LlamaConfig); use next_token_loss "
                         "for a dense model.")
    ce = next_token_loss(model, batch)
    stats = take_stats(model)
    loss = ce + aux_loss(stats, model.config.moe)
    return loss, {"cross_entropy": ce, **stats}
