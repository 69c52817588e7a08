"""Attention with dropout on its probabilities (GPT-2's ``attn_dropout``), one device's masks.

GPT-2 drops elements of the softmax probabilities ``[B, H, T, S]`` before they weight the
values. The fused kernels (cuDNN, Pallas, XLA's ``jax.nn.dot_product_attention``) never show
the probabilities, so in training this module computes attention in XLA itself: scores in
float32, the causal (and packed-document) mask, softmax, the stock ``nnx.Dropout`` on the
probabilities, then the weighted sum. With the dropout inactive (rate 0, ``model.eval()``)
it is :func:`parallax.attention.dot_product_attention`, kernel choice and all.

The mask is the one a single device draws, under every layout that keeps the probabilities'
order: ``nnx.Dropout`` draws ``bernoulli(key, shape)`` with JAX's partitionable threefry,
whose bits do not depend on how GSPMD splits the array (heads over ``"tensor"``, batch over
``"data"``/``"fsdp"``), and ``px.value_and_grad`` hands a shard of the batch a key that draws
its rows of one device's mask (:mod:`parallax.grad.sliced_rng`). Context parallelism holds the
sequence in its zigzag order and computes attention blockwise, so neither the order nor the
blocks are one device's: dropout under it is refused (:func:`refuse_reordered_sequence`).

:func:`dropout_layer` and :func:`apply_dropout` are the two helpers the GPT's blocks use for
their other dropouts (embeddings, residual branches): a layer only where the rate asks.

Example:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from parallax.nn.attention_dropout import attention_with_dropout
  >>> q = jnp.ones((2, 5, 4, 8))
  >>> attention_with_dropout(q, q, q, nnx.Dropout(0.1, rngs=nnx.Rngs(0))).shape
  (2, 5, 4, 8)

References:
  Radford et al., GPT-2, 2019 and Hugging Face transformers ``GPT2Attention``
  (``attn_dropout`` on the probabilities); Srivastava et al., "Dropout", JMLR 2014.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from parallax import context
from parallax.activations import constrain
from parallax.attention import document_mask, dot_product_attention

PROBS = ("batch", "heads", "length", None)  # [B, H, T, S]: split as the heads are


def dropout_layer(rate: float, rngs: nnx.Rngs) -> nnx.Dropout | None:
    """GPT-2's dropout at ``rate`` with its own RNG stream (forked from ``rngs``'s
    ``"dropout"`` stream, else its default one); None at rate 0: no layer, no state."""
    return nnx.Dropout(rate, rngs=rngs) if rate > 0 else None


def apply_dropout(dropout: nnx.Dropout | None, x: jax.Array) -> jax.Array:
    """``dropout(x)``, or ``x`` where the model has no such dropout."""
    return x if dropout is None else dropout(x)


def is_active(dropout: nnx.Dropout | None) -> bool:
    """Whether ``dropout`` would drop anything when called (a rate above 0, training mode)."""
    return dropout is not None and dropout.rate > 0 and not dropout.deterministic


def refuse_reordered_sequence(api: str, what: str) -> None:
    """Raises where the active step holds the sequence out of one device's order.

    Under ``px.ContextParallel`` the residual stream is in the zigzag order and attention
    runs blockwise on a ring: a mask drawn there is not one device's mask.
    """
    ctx = context.current()
    split = None if ctx is None else ctx.strategy.sequence_split
    if split is None or ctx.mesh.shape.get(split.axis, 1) == 1:
        return
    raise ValueError(
        f"{api}: {what} is not taken under context parallelism ({ctx.strategy.name}, axis "
        f"{split.axis!r} of size {ctx.mesh.shape[split.axis]}): the sequence is held in its "
        "zigzag order and attention runs blockwise, so the dropout masks could not be one "
        "device's. Set GPTConfig's embed_dropout, attention_dropout and residual_dropout to "
        "0 for this run (or call model.eval()), or train without px.ContextParallel.")


def _refuse_fused_kernel(api: str) -> None:
    ctx = context.current()
    if ctx is not None and ctx.attention in ("cudnn", "pallas"):
        raise ValueError(
            f"{api}: px.train_step(attention={ctx.attention!r}) cannot apply attention "
            "dropout: the fused kernel never forms the probabilities the mask drops. Use "
            "attention='auto' or 'xla' (dropout then runs XLA's attention), or set "
            "GPTConfig(attention_dropout=0.0).")


def attention_with_dropout(query: jax.Array, key: jax.Array, value: jax.Array,
                           dropout: nnx.Dropout | None, *, causal: bool = True,
                           segment_ids: jax.Array | None = None) -> jax.Array:
    """Softmax attention ``[B, T, H, K]`` whose probabilities pass through ``dropout``.

    Args:
      query, key, value: ``[B, T, H, K]`` (self-attention, as GPT-2's).
      dropout: an ``nnx.Dropout`` (its rate, its RNG stream, its mode); None or inactive
        gives :func:`parallax.attention.dot_product_attention`.
      causal: mask each query from the keys after it.
      segment_ids: int ``[B, T]`` of packed documents (attention stays inside each).

    Returns:
      ``[B, T, H, K]``: ``dropout(softmax(q k^T / sqrt(K) + mask)) v``.

    Raises:
      ValueError: under context parallelism, or with a fused kernel asked for by the step.
    """
    if not is_active(dropout):
        return dot_product_attention(query, key, value, causal=causal, segment_ids=segment_ids)
    api = "px.models.GPT (attention dropout)"
    refuse_reordered_sequence(api, "attention dropout")
    _refuse_fused_kernel(api)
    t, s, k = query.shape[1], key.shape[1], query.shape[-1]
    with jax.named_scope("parallax.attention[xla, dropout]"):
        scores = jnp.einsum("bthk,bshk->bhts", query, key,
                            preferred_element_type=jnp.float32) / jnp.sqrt(jnp.float32(k))
        allowed = jnp.ones((1, 1, t, s), bool)
        if causal:
            allowed = jnp.tril(allowed)
        if segment_ids is not None:
            allowed = allowed & document_mask(segment_ids, query.shape[:2], s)
        scores = jnp.where(allowed, scores, jnp.finfo(jnp.float32).min)
        probs = constrain(jax.nn.softmax(scores, axis=-1), PROBS)
        probs = dropout(probs).astype(value.dtype)
        return jnp.einsum("bhts,bshk->bthk", probs, value)
