"""The Llama's mixture-of-experts blocks (Mixtral): their forward pass and scan.

With ``LlamaConfig(moe=MoEConfig(...))`` every block's SwiGLU MLP is a
:class:`parallax.nn.MoE`: a softmax router over all experts, the top k renormalised (for
k = 2), SwiGLU experts stacked on a leading ``"expert"`` axis. The scanned blocks return
each layer's router statistics beside the residual stream, kept on the model as a sown
value (``model.moe_stats``, as the MoE GPT's) for ``moe_next_token_loss``. Attention,
norms, RoPE and the head are the dense Llama's.

``MoEConfig(capacity_factor=None)`` is Mixtral's routing: every token reaches its k
experts (dropless). ``aux_loss="mixtral"`` is its auxiliary loss as Hugging Face
transformers computes it (pooled over layers, no z-loss); ``px.models.from_pretrained``
sets both from a ``mixtral`` checkpoint.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> import parallax as px
  >>> moe = px.models.MoEConfig(num_experts=4, top_k=2, capacity_factor=None,
  ...                           aux_loss="mixtral", balance_coef=0.001)
  >>> model = px.models.Llama(px.models.LlamaConfig.tiny(moe=moe), rngs=nnx.Rngs(0))
  >>> loss, stats = px.models.moe_next_token_loss(model, {"tokens": jnp.ones((2, 9), jnp.int32)})
  >>> stats["expert_load"].shape   # [layers, experts]
  (2, 4)

References:
  Jiang et al. 2024, "Mixtral of Experts"; Hugging Face transformers,
  ``models/mixtral/modeling_mixtral.py`` (``MixtralSparseMoeBlock``,
  ``load_balancing_loss_func``).
"""

from __future__ import annotations

import jax

from parallax.activations import constrain
from parallax.attention import sequence_positions
from parallax.models.gpt_moe import scan_moe_blocks
from parallax.nn.layers import RESIDUAL


def mixtral_block_forward(block, x: jax.Array, *, segment_ids: jax.Array | None = None,
                          positions: jax.Array | None = None
                          ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One Llama block whose MLP is an MoE: ``(residual stream [B, T, D], router stats)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.models import LlamaConfig, MoEConfig
      >>> from parallax.models.llama import LlamaBlock
      >>> block = LlamaBlock(LlamaConfig.tiny(moe=MoEConfig(num_experts=4)), rngs=nnx.Rngs(0))
      >>> y, stats = mixtral_block_forward(block, jnp.ones((2, 8, 64)))
      >>> y.shape, stats["expert_load"].shape
      ((2, 8, 64), (4,))
    """
    if positions is None:
        positions = sequence_positions(x.shape[1], "Llama")
    x = constrain(x + block.attn(block.attn_norm(x), positions, segment_ids=segment_ids),
                  RESIDUAL)
    y, stats = block.mlp(block.mlp_norm(x))
    return constrain(x + y, RESIDUAL), stats


def apply_mixtral_blocks(model, x: jax.Array, segment_ids: jax.Array | None = None,
                         positions: jax.Array | None = None) -> jax.Array:
    """All L MoE blocks as one ``nnx.scan``; the router statistics are kept on ``model``
    (packed documents: the router's statistics count every token, padding included)."""
    return scan_moe_blocks(model, x, lambda block, x: mixtral_block_forward(
        block, x, segment_ids=segment_ids, positions=positions))
