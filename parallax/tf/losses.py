"""Loss scaling for synchronous replicas: divide by the *global* batch, then sum gradients.

Each replica sees ``global_batch / n`` examples. If every replica averaged its own loss and
the gradients were then summed over replicas, the update would be ``n`` times too large;
averaged instead, uneven batches would weigh examples unequally. TensorFlow's rule: each
replica sums its per-example losses and divides by the global batch size, and the
gradients are then *summed* across replicas (``ReduceOp.SUM``), which gives exactly the
gradient of the mean loss over the global batch.

On a padded partial batch (:mod:`parallax.tf.input.partial_batches`) the padding rows count for
nothing: their losses are masked out and this replica's batch size is its real rows, as
TensorFlow's replicas, whose batches have their own lengths, compute it.

References:
  TensorFlow ``tensorflow/python/ops/nn_impl_distribute.py`` (``compute_average_loss``,
  ``scale_regularization_loss``) and the custom training tutorial ("Custom training with
  tf.distribute.Strategy").
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
        dimensions are summed). Rows that pad a partial batch are left out.
      sample_weight: optional weights broadcastable to ``per_example_loss``.
      global_batch_size: examples in the global batch; default, as TensorFlow: this
        replica's batch (its real rows) times ``num_replicas_in_sync``. On a partial last
        batch TensorFlow's default therefore divides each replica's sum by a different
        number; pass the batch size you mean (the full ``GLOBAL_BATCH``, as TF's tutorial
        does, or the partial batch's true size) to weigh every example alike.

    Returns:
      A scalar: this replica's share of the global mean loss (``0`` when the global batch
      size is 0, TensorFlow's ``div_no_nan``). Summed over replicas
      (``strategy.reduce("SUM", ..., axis=None)``) it is the global mean.

    Raises:
      ValueError: a scalar ``per_example_loss``, ``global_batch_size`` not a non-negative
        int, or on a padded partial batch a ``per_example_loss`` that is not one row per
        example of it.

    Example:
      >>> float(compute_average_loss(jnp.array([1.0, 2.0, 3.0]), global_batch_size=6))
      1.0

    References:
      TensorFlow, ``tf.nn.compute_average_loss``
      (``tensorflow/python/ops/nn_impl_distribute.py``).
    """
    api = "px.tf.compute_average_loss"
    losses = jnp.asarray(per_example_loss)
    if losses.ndim == 0:
        raise ValueError(
            f"{api}: per_example_loss has shape (); pass one loss per example (shape "
            "[local_batch]), not their mean: the mean is taken over the global batch here.")
    if global_batch_size is not None and (
            isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int)
            or global_batch_size < 0):
        raise ValueError(f"{api}: global_batch_size={global_batch_size!r} must be a "
                         "non-negative int (the examples in one step over all replicas).")
    if sample_weight is not None:
        losses = losses * jnp.asarray(sample_weight, losses.dtype)
    ctx = get_replica_context()
    rows = losses.shape[0]
    if ctx is not None and ctx.batch_rows is not None:
        # A padded partial batch: TF's replica would see only its real rows.
        try:
            real = ctx.num_examples(rows)
        except ValueError as error:
            raise ValueError(f"{api}: {error}") from None
        mask = (jnp.arange(rows) < real).reshape((rows,) + (1,) * (losses.ndim - 1))
        losses = jnp.where(mask, losses, jnp.zeros_like(losses))
        rows = real
    if global_batch_size is None:
        global_batch_size = rows * _replicas()
    total = jnp.asarray(global_batch_size, losses.dtype)
    safe = jnp.where(total == 0, jnp.ones_like(total), total)
    return jnp.where(total == 0, jnp.zeros_like(total), jnp.sum(losses) / safe)


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
