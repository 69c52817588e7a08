"""``embedding_lookup``: rows of a sharded embedding table, pulled sparsely."""

from __future__ import annotations

from parallax.tf.parameter_server.sharded_variable import ShardedVariable, SparseRows


def embedding_lookup(table: ShardedVariable, ids) -> SparseRows:
    """Pulls the rows of ``table`` that ``ids`` names, each distinct row once.

    Only those rows cross the network, so a table larger than any worker's memory trains:
    a worker holds ``len(unique(ids)) x row_width`` values, never the table. Push their
    gradients back with ``table.apply_sparse_gradient(rows, row_grads)``.

    Args:
      table: a :class:`~parallax.tf.ShardedVariable` of shape ``[rows, dim]``.
      ids: integer ids of any shape.

    Returns:
      :class:`~parallax.tf.SparseRows`: ``rows.gather()`` is
      ``table[ids]``.

    Example:
      >>> import numpy as np, optax, parallax as px
      >>> strategy = px.tf.ParameterServerStrategy(px.tf.RayClusterResolver(1, num_ps=1))
      >>> strategy.set_optimizer(optax.sgd(0.1))
      >>> table = strategy.create_variable(np.eye(4), name="embedding")
      >>> rows = px.tf.embedding_lookup(table, np.array([[2, 2], [0, 3]]))
      >>> rows.count, rows.gather().shape
      (3, (2, 2, 4))
      >>> strategy.shutdown()

    References:
      TensorFlow, ``tf.nn.embedding_lookup`` on partitioned variables; Li et al., OSDI
      2014 (workers pull only the parameters their data touches).
    """
    return table.lookup(ids)
