"""Loss scaling for synchronous replicas: divide by the *global* batch, then sum gradients.

Each replica sees ``global_batch / n`` examples. If every replica averaged its own loss and
the gradients were then summed over replicas, the update would be ``n`` times too large;
averaged instead, uneven batches would weigh examples unequally. TensorFlow's rule: each
replica sums its per-example losses and divides by the global batch size, and the
gradients are then *summed* across replicas (``ReduceOp.SUM``), which gives exactly the
gradient of the mean loss over the global batch.

References:
  TensorFlow ``tf.nn.compute_average_loss``, ``tf.nn.scale_regularization_loss`` and the
  custom training tutorial ("Distributed training with Keras / custom training loops").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parallax.tf.replica_context import get_replica_context


def _replicas() -> int:
    ctx = get_replica_context()
    return 1 if ctx is None else ctx.num_replicas_in_sync


def compute_average_loss(per_example_loss, sample_weight=None,
                         global_batch_size: int | None = None) -> jax.Array:
    """Sum of this replica's per-example losses divided by the global batch size.

    Args:
      per_example_loss: ``[local_batch, ...]`` losses of this replica's examples (all
        dimensions are summed).
      sample_weight: optional weights broadcastable to ``per_example_loss``.
      global_batch_size: examples in the global batch; default: this replica's batch
        times ``num_replicas_in_sync`` (of the current replica context).

    Returns:
      A scalar: this replica's share of the global mean loss. Summed over replicas
      (``strategy.reduce("SUM", ..., axis=None)``) it is the global mean.

    Raises:
      ValueError: a scalar ``per_example_loss``, or ``global_batch_size`` not positive.

    Example:
      >>> float(compute_average_loss(jnp.array([1.0, 2.0, 3.0]), global_batch_size=6))
      1.0

    References:
      TensorFlow, ``tf.nn.compute_average_loss``.
    """
    api = "px.tf.compute_average_loss"
    losses = jnp.asarray(per_example_loss)
    if losses.ndim == 0:
        raise ValueError(
            f"{api}: per_example_loss has shape (); pass one loss per example (shape "
            "[local_batch]), not their mean: the mean is taken over the global batch here.")
    if sample_weight is not None:
        losses = losses * jnp.asarray(sample_weight, losses.dtype)
    if global_batch_size is None:
        global_batch_size = losses.shape[0] * _replicas()
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or (
            global_batch_size <= 0):
        raise ValueError(f"{api}: global_batch_size={global_batch_size!r} must be a positive "
                         "int (the examples in one step over all replicas).")
    return jnp.sum(losses) / global_batch_size


def scale_regularization_loss(regularization_loss) -> jax.Array:
    """A regularization term divided by ``num_replicas_in_sync``.

    The term is computed on every replica from the (mirrored) parameters; after the
    gradients are summed over replicas it counts once.

    Args:
      regularization_loss: a scalar computed from the parameters.

    Returns:
      ``regularization_loss / num_replicas_in_sync``.

    Example:
      >>> float(scale_regularization_loss(jnp.float32(4.0)))   # one replica
      4.0

    References:
      TensorFlow, ``tf.nn.scale_regularization_loss``.
    """
    return jnp.sum(jnp.asarray(regularization_loss)) / _replicas()
