"""Predicted messages and memory of context parallelism (``px.ContextParallel``).

With the sequence of ``T`` positions split over ``n`` devices of the context axis (``T/n``
each, in the zigzag order), one device's keys and values of one layer are
``kv = 2 b (T/n) (G/t) K`` elements (``b`` rows per device, ``G`` key/value heads, GQA's
for Llama, ``t`` the tensor-parallel size, ``K`` the head size). Per layer and step:

==================  ===========================================================  ==========
method              messages                                                     source
==================  ===========================================================  ==========
``ring``            forward ``n - 1`` collective-permutes of ``kv`` (the model's  Liu et al.
                    dtype); backward ``n - 1`` of ``kv`` again and ``n`` of its   2023
                    gradients ``dK, dV`` (float32; the ``n``-th takes them home)
``all_gather``      forward one all-gather of the stacked ``K, V`` (result        Llama 3,
                    ``n kv``); backward one more (the attention is recomputed,    sec. 3.3.2
                    not stored) and one reduce-scatter of ``dK, dV`` (``n kv``)
==================  ===========================================================  ==========

and once per step the exchange back to natural order before the output layer (a
collective-permute of half a device's ``[b, T/n, D]`` per chunk parity that moves: one for
``n = 2``, two above) and its transpose in the backward pass.

Parameters are replicated over the context axis, which acts as a batch axis for the
gradients: GSPMD sums every parameter's gradient over it (an all-reduce of ``Ψ``; a tied
embedding's two parts, the lookup's and the logits', are summed apart), and the loss.

Activations per device fall as ``1/n``: every per-layer term of Korthikanti's formula is
taken at ``T/n`` positions; the attention's ``custom_vjp`` keeps no scores (the ring keeps
each row's log-sum-exp, FlashAttention's residual), and its working set is one block of
float32 scores: ``(T/n)^2`` per head for the ring, ``(T/n) x T`` (and the gathered K, V)
for the all-gather.

References:
  Liu, Zaharia & Abbeel, "Ring Attention with Blockwise Transformers", 2023; Dubey et al.,
  "The Llama 3 Herd of Models", 2024, section 3.3.2; Korthikanti et al. 2022, section 4.
"""

from __future__ import annotations

import jax.numpy as jnp

from parallax.planner.setting import StepSetting

F32 = 4


def _kv_heads(s: StepSetting) -> int:
    c = s.config
    return getattr(c, "num_kv_heads", c.num_heads)


def kv_bytes(s: StepSetting, itemsize: int | None = None) -> float:
    """One device's K and V of one layer: ``2 b (T/n) (G/t) K`` elements, in bytes.

    Example:
      >>> import jax, jax.numpy as jnp, optax, parallax as px
      >>> from flax import nnx
      >>> from parallax.planner.setting import read_setting
      >>> config = px.models.LlamaConfig.tiny(max_seq_len=16)   # 2 kv heads of 16
      >>> state = jax.eval_shape(lambda: px.TrainState.create(
      ...     px.models.Llama(config, rngs=nnx.Rngs(0)), optax.sgd(0.1)))
      >>> s = read_setting(px.make_mesh(context=4, devices=jax.devices()[:4]),
      ...                  px.ContextParallel(), state,
      ...                  {"tokens": jax.ShapeDtypeStruct((4, 17), jnp.int32)})
      >>> kv_bytes(s) == 2 * 4 * (16 // 4) * 2 * 16 * 4
      True
    """
    c = s.config
    e = itemsize or jnp.dtype(c.dtype).itemsize
    return 2 * s.rows_per_device * s.local_seq_len * _kv_heads(s) / s.tensor * c.head_dim * e


def attention_messages(s: StepSetting, add) -> None:
    """ContextParallel's own messages per step (its ``shard_map`` s), through ``add(kind,
    axes, bytes, count, how)``; nothing when the step has no context axis or no GPT/Llama.

    Example:
      >>> import jax, jax.numpy as jnp, optax, parallax as px
      >>> from flax import nnx
      >>> from parallax.planner.setting import read_setting
      >>> config = px.models.GPTConfig.tiny(max_seq_len=16)
      >>> state = jax.eval_shape(lambda: px.TrainState.create(
      ...     px.models.GPT(config, rngs=nnx.Rngs(0)), optax.sgd(0.1)))
      >>> s = read_setting(px.make_mesh(context=2, devices=jax.devices()[:2]),
      ...                  px.ContextParallel(method="ring"), state,
      ...                  {"tokens": jax.ShapeDtypeStruct((4, 17), jnp.int32)})
      >>> counts = []
      >>> attention_messages(s, lambda kind, axes, nbytes, n, how: counts.append((kind, n)))
      >>> counts     # 2 layers x (3n - 2), then the zigzag's way back and its transpose
      [('collective-permute', 8), ('collective-permute', 2)]
    """
    axis, c = s.context_axis, s.config
    if axis is None or c is None or s.seq_len is None:
        return
    n, layers = s.context, c.num_layers
    kv = kv_bytes(s)
    if s.context_method == "ring":
        add("collective-permute", (axis,), layers * (2 * (n - 1) * kv + n * kv_bytes(s, F32)),
            layers * (3 * n - 2),
            "ring: per layer forward (n-1) K,V blocks; backward (n-1) K,V and n dK,dV (float32)")
    else:
        add("all-gather", (axis,), 2 * layers * n * kv, 2 * layers,
            "all-gather: per layer K,V gathered forward and again in the recomputing backward")
        add("reduce-scatter", (axis,), layers * n * kv, layers,
            "all-gather: per layer dK,dV reduce-scattered")
    moves = 1 if n == 2 else 2  # chunk parities that leave their device
    half = s.rows_per_device * s.local_seq_len / 2 * c.embed_dim * jnp.dtype(c.dtype).itemsize
    add("collective-permute", (axis,), 2 * moves * half, 2 * moves,
        "zigzag back to natural order and its transpose: half of [b, T/n, D] per chunk parity")


def gradient_sum(s: StepSetting, add) -> None:
    """GSPMD's sum of the gradients over the context axis (parameters are replicated there)."""
    axis = s.context_axis
    if axis is None:
        return
    params = [x for x in s.leaves if x.role == "param" and axis not in x.axes]
    psi = sum(x.nbytes / x.rule_ways for x in params)
    tied = 0.0
    if s.config is not None and getattr(s.config, "tie_embeddings", False):
        tied = sum(x.nbytes / x.rule_ways for x in params if "['wte']" in x.path)
    add("all-reduce", (axis,), psi + tied + 4, 1,
        "GSPMD sums the gradients Ψ over the context axis (a tied embedding's two parts "
        "apart), and the loss")


def activation_bytes(s: StepSetting, per_layer_rest: float, head: float) -> tuple[float, str]:
    """Per-layer activations under context parallelism: Korthikanti's terms at ``T/n``
    positions without the scores (the custom_vjp keeps none), plus the ring's log-sum-exp.

    ``per_layer_rest`` and ``head`` are the formula's per-layer terms without the scores and
    the loss's, already at ``T/n`` positions."""
    c = s.config
    rows, heads = s.rows_per_device, c.num_heads / s.tensor
    lse = F32 * rows * heads * s.local_seq_len if s.context_method == "ring" else 0.0
    how = ("CP: L (s' b h (2 + 2 + 4/t) + 2 s' b F/t" + (" + lse" if lse else "")
           + ") + s' b V/t, s' = T/n (no scores kept)")
    return c.num_layers * (per_layer_rest + lse) + head, how


def working_set_bytes(s: StepSetting) -> tuple[float, str]:
    """One layer's attention working set: a block of float32 scores (and the gathered K, V)."""
    c = s.config
    rows, heads, local = s.rows_per_device, c.num_heads / s.tensor, s.local_seq_len
    if s.context_method == "ring":
        return F32 * rows * heads * local * local, "one (T/n)^2 block of float32 scores"
    scores = F32 * rows * heads * local * s.seq_len
    return scores + s.context * kv_bytes(s), "(T/n) x T float32 scores + the gathered K, V"
