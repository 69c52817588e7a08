"""The GPT's and the Llama's forward pass over new tokens with a key/value cache.

The same layers as training, in the same order (embedding, each block's norm -> attention ->
residual, norm -> MLP -> residual, final norm and output projection), with the attention
given ``cache=`` (:mod:`parallax.nn.kv_cache`): it writes the new tokens' keys and values at
the cache's length and attends over everything written so far. The blocks run as one
``nnx.scan`` over their stacked parameters and the stacked cache, as training scans them.
Only the last position's logits are made (all that decoding reads).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from parallax.activations import constrain
from parallax.models.gpt import GPT
from parallax.models.llama import Llama
from parallax.nn.kv_cache import KVCache, empty_cache
from parallax.nn.layers import RESIDUAL

FAMILIES = (GPT, Llama)


def new_cache(model: GPT | Llama, batch: int, max_length: int) -> KVCache:
    """An empty stacked cache ``[L, B, max_length, G, K]`` for ``model``, in its compute dtype.

    Example:
      >>> from flax import nnx
      >>> from parallax.models import GPT, GPTConfig
      >>> new_cache(GPT(GPTConfig.tiny(), rngs=nnx.Rngs(0)), 2, 8).key.shape
      (2, 2, 8, 4, 16)
    """
    c = model.config
    kv_heads = c.num_kv_heads if isinstance(model, Llama) else c.num_heads
    return empty_cache(batch, max_length, kv_heads, c.embed_dim // c.num_heads, c.dtype,
                       layers=c.num_layers)


def _gpt_block(block, x, cache):
    h, cache = block.attn(block.ln1(x), cache=cache)
    x = constrain(x + h, RESIDUAL)
    return constrain(x + block.mlp(block.ln2(x)), RESIDUAL), cache


def _llama_block(positions):
    def forward(block, x, cache):
        h, cache = block.attn(block.attn_norm(x), positions, cache=cache)
        x = constrain(x + h, RESIDUAL)
        return constrain(x + block.mlp(block.mlp_norm(x)), RESIDUAL), cache
    return forward


def forward_with_cache(model: GPT | Llama, tokens: jax.Array, cache: KVCache
                       ) -> tuple[jax.Array, KVCache]:
    """Runs ``tokens`` ``[B, T]`` (at positions ``cache.length ..``) through ``model``.

    Returns:
      ``(float32 logits of the last token [B, V], the cache with the T tokens written)``.

    Example:
      >>> import jax.numpy as jnp
      >>> from flax import nnx
      >>> from parallax.models import Llama, LlamaConfig
      >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
      >>> logits, cache = forward_with_cache(model, jnp.zeros((2, 3), jnp.int32),
      ...                                    new_cache(model, 2, 8))
      >>> logits.shape, cache.length.tolist()
      ((2, 256), [3, 3])
    """
    positions = cache.length[0] + jnp.arange(tokens.shape[1])
    if isinstance(model, GPT):
        x = model.embed(tokens, jnp.broadcast_to(positions, tokens.shape))
        step = _gpt_block
    else:
        x = model.embed_tokens(tokens)
        step = _llama_block(positions)

    @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0),
              transform_metadata={nnx.PARTITION_NAME: "layers"})
    def body(x, block, layer_cache):
        return step(block, x, layer_cache)

    x, cache = body(x, model.blocks, cache)
    return model.unembed(x[:, -1:])[:, 0], cache
