"""Random streams under tensor parallelism: dropout that agrees where it must.

Megatron keeps two CUDA random states (its ``CudaRNGStatesTracker``): the default one,
seeded the same on every tensor-parallel rank, for dropout on *replicated* activations (the
residual stream after ``g``: every rank must drop the same elements or the copies diverge),
and a ``model-parallel`` one, seeded ``seed + 2718 + rank``, for dropout on *sharded*
activations (attention probabilities, split by head: each rank's heads need their own
masks). JAX keys are values, so the tracker becomes two pure functions:

- a replicated region uses the key as it is (the same on every rank);
- :func:`rank_key` folds the rank in, Megatron's per-rank stream.

:func:`dropout` goes one step further where JAX allows it: along a sharded dimension it
draws each slice's mask from the key folded with that slice's **global** index, so the
masks are the single-device masks, sliced. A tensor-parallel run with dropout on then
matches one device exactly, and the replicated masks agree across ranks. With
``rate=0`` (or no key) dropout is the identity and every layer equals the plain one.

Example:
  >>> import jax, jax.numpy as jnp, parallax.nn
  >>> x = jnp.ones((2, 4, 8))
  >>> y = parallax.nn.dropout(x, 0.5, jax.random.key(0), sharded_dim=1)
  >>> sorted(set(y.ravel().tolist()))        # dropped, or kept and scaled by 1 / (1 - rate)
  [0.0, 2.0]

References:
  Shoeybi et al., "Megatron-LM", 2019, section 3 (random number generation: dropout
  outside the model-parallel regions is seeded alike, inside differently per rank).
  Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", 2021.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parallax.nn import regions

__all__ = ["dropout", "keep_mask", "rank_key"]


def rank_key(key: jax.Array, axis: str = "tensor") -> jax.Array:
    """Megatron's model-parallel stream: ``key`` folded with this rank's index.

    Args:
      key: a PRNG key, the same on every rank.
      axis: the tensor-parallel mesh axis.

    Returns:
      A key that differs per rank inside a ``shard_map`` manual over ``axis``; ``key``
      folded with 0 elsewhere (one device is rank 0).

    Example:
      >>> import jax, parallax.nn
      >>> k = parallax.nn.rank_key(jax.random.key(0))
      >>> bool((jax.random.key_data(k) == jax.random.key_data(
      ...     jax.random.fold_in(jax.random.key(0), 0))).all())
      True
    """
    return jax.random.fold_in(key, regions.axis_index(axis))


def keep_mask(key: jax.Array, shape, rate: float, *, sharded_dim: int | None = None,
              axis: str = "tensor") -> jax.Array:
    """The boolean keep-mask of :func:`dropout` for an activation of local ``shape``.

    Args:
      key: a PRNG key, the same on every rank.
      shape: the local shape of the activation.
      rate: the probability of dropping an element.
      sharded_dim: the dimension split over ``axis`` (None: the activation is replicated,
        and so is the mask). Each global index along it gets its own stream.
      axis: the tensor-parallel mesh axis.

    Returns:
      A bool array of ``shape``, equal to the matching slice of the single-device mask.
    """
    shape = tuple(shape)
    if sharded_dim is None:
        return jax.random.bernoulli(key, 1.0 - rate, shape)
    d = sharded_dim % len(shape)
    rest = shape[:d] + shape[d + 1:]
    start = regions.axis_index(axis) * shape[d]
    index = start + jnp.arange(shape[d])
    masks = jax.vmap(lambda i: jax.random.bernoulli(jax.random.fold_in(key, i), 1.0 - rate,
                                                    rest))(index)
    return jnp.moveaxis(masks, 0, d)


def dropout(x: jax.Array, rate: float, key: jax.Array | None, *, sharded_dim: int | None = None,
            axis: str = "tensor") -> jax.Array:
    """Inverted dropout whose mask is the single-device mask on every tensor-parallel layout.

    Args:
      x: the activation (local shard inside ``shard_map``).
      rate: drop probability in ``[0, 1)``; 0 is the identity.
      key: a PRNG key, the same on every rank; None is the identity (evaluation).
      sharded_dim: the dimension of ``x`` split over ``axis`` (heads for attention
        probabilities, the sequence in a sequence-parallel region); None when ``x`` is
        replicated over ``axis``.
      axis: the tensor-parallel mesh axis.

    Returns:
      ``x * mask / (1 - rate)``.

    Raises:
      ValueError: ``rate`` outside ``[0, 1)``.
    """
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"px.nn.dropout: rate={rate!r} must be in [0, 1); use 0 for no dropout.")
    if key is None or rate == 0.0:
        return x
    keep = keep_mask(key, x.shape, rate, sharded_dim=sharded_dim, axis=axis)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))
