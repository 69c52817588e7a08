"""Softmax cross-entropy from vocabulary-split logits: Megatron's three scalars per position.

Each rank holds the logits of its slice of the vocabulary ``[..., V/T]``. The softmax
cross-entropy ``log sum_v exp(l_v) - l_target`` needs three numbers per position across
ranks, each an all-reduce of ``[...]`` scalars, never of ``[..., V]``:

1. the maximum logit (for a stable exponent; no gradient flows through it);
2. the sum of ``exp(l - max)`` over the local slice, summed over ranks;
3. the target's logit, which only the rank owning the target id contributes.

The backward pass is local: the gradient of each slice is its softmax minus the one-hot
target, which the autodiff of ``g`` (identity backward) gives with no communication.

Two forms: :func:`vocab_parallel_cross_entropy` issues the three all-reduces itself inside
``shard_map`` (the explicit layers of ``px.nn``); :func:`cross_entropy` is written so that
GSPMD, given logits whose vocabulary a strategy splits, partitions it into the same three
(the reference models' loss).

References:
  Shoeybi et al., "Megatron-LM", 2019, section 3 (fusing the output GEMM with the
  cross-entropy to reduce the communicated logits to scalars).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from parallax import comm
from parallax.nn import regions


def vocab_parallel_cross_entropy(logits: jax.Array, labels: jax.Array, *,
                                 axis: str = "tensor") -> jax.Array:
    """Softmax cross-entropy per position from vocabulary-split logits, in float32.

    Args:
      logits: ``[..., V]`` on one device; inside ``shard_map`` over ``axis`` this rank's
        slice ``[..., V/T]`` of ids ``[r V/T, (r+1) V/T)``.
      labels: int target ids ``[...]``, the same on every rank.
      axis: the tensor-parallel mesh axis.

    Returns:
      float32 losses ``[...]``, the same on every rank (invariant over ``axis``).

    Raises:
      ValueError: ``labels`` does not have the shape of ``logits`` without its last axis.

    Example:
      >>> import jax, jax.numpy as jnp, optax, parallax as px, parallax.nn
      >>> mesh = px.make_mesh(tensor=4, devices=jax.devices()[:4])
      >>> logits = jax.random.normal(jax.random.key(0), (3, 16))
      >>> labels = jnp.array([0, 7, 15])
      >>> f = jax.shard_map(px.nn.vocab_parallel_cross_entropy, mesh=mesh,
      ...                   in_specs=(jax.P(None, "tensor"), jax.P()), out_specs=jax.P())
      >>> expected = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      >>> bool(jnp.allclose(jax.jit(f)(logits, labels), expected, rtol=1e-6))
      True

    References:
      Shoeybi et al., "Megatron-LM", 2019, section 3.
    """
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"px.nn.vocab_parallel_cross_entropy: labels have shape {tuple(labels.shape)} but "
            f"logits {tuple(logits.shape)}; labels need the logits' shape without the last "
            "(vocabulary) axis."
        )
    return vocab_parallel_losses_and_lse(logits, labels, axis)[0]


def vocab_parallel_losses_and_lse(logits: jax.Array, labels: jax.Array,
                                  axis: str = "tensor") -> tuple[jax.Array, jax.Array]:
    """``(losses, logsumexp)`` per position from vocabulary-split logits: the losses of
    :func:`vocab_parallel_cross_entropy` and the log-sum-exp over the whole vocabulary, which
    a backward pass that recomputes the logits needs (``softmax = exp(logits - lse)``)."""
    logits = jnp.asarray(logits, jnp.float32)
    local = logits.shape[-1]
    manual = regions.is_manual(axis)
    peak = lax.stop_gradient(jnp.max(logits, axis=-1))
    if manual:
        peak = comm.all_reduce(peak, axis, "max")
    shifted = logits - peak[..., None]
    sum_exp = regions.reduce_from_tensor(jnp.sum(jnp.exp(shifted), axis=-1), axis)
    offset = labels - regions.axis_index(axis) * local
    inside = (offset >= 0) & (offset < local)
    picked = jnp.take_along_axis(shifted, jnp.where(inside, offset, 0)[..., None], axis=-1)
    target = regions.reduce_from_tensor(jnp.where(inside, picked[..., 0], 0.0), axis)
    return jnp.log(sum_exp) - target, jnp.log(sum_exp) + peak


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Softmax cross-entropy per position, ``logsumexp(logits) - logits[label]``, in float32.

    The values of ``optax.softmax_cross_entropy_with_integer_labels``, written for GSPMD:
    the target's logit is a masked sum over the vocabulary rather than a gather, so when a
    strategy splits the vocabulary (tensor parallelism's tied output layer) XLA partitions
    the loss into Megatron's three ``[...]`` all-reduces (maximum, sum of exponentials,
    target logit) on every jax version. A gather there was left to the partitioner's
    choice, which jax 0.12.1 made with two more ``[...]`` all-reduces per step.

    Args:
      logits: ``[..., V]``.
      labels: int target ids ``[...]``.

    Returns:
      float32 losses ``[...]``; NaN where a label is outside ``[0, V)``, as optax's.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> logits = jax.random.normal(jax.random.key(0), (3, 16))
      >>> labels = jnp.array([0, 7, 15])
      >>> expected = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      >>> bool(jnp.allclose(cross_entropy(logits, labels), expected, rtol=1e-6))
      True
    """
    return cross_entropy_and_lse(logits, labels)[0]


def cross_entropy_and_lse(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(losses, logsumexp)`` per position, in float32: :func:`cross_entropy` and the
    log-sum-exp a backward pass that recomputes the logits needs."""
    logits = jnp.asarray(logits, jnp.float32)
    peak = lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    log_sum_exp = jnp.log(jnp.sum(jnp.exp(logits - peak), axis=-1)) + peak[..., 0]
    vocab = logits.shape[-1]
    hit = jnp.arange(vocab, dtype=labels.dtype) == labels[..., None]
    target = jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
    # an id with no logit is NaN, as optax's gather gives it (px.train_step's check_finite
    # names it), never a silent 0
    target = jnp.where((labels >= 0) & (labels < vocab), target, jnp.nan)
    return log_sum_exp - target, log_sum_exp
