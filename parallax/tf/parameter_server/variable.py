"""``px.tf.Variable``: TensorFlow's ``tf.Variable`` inside ``ParameterServerStrategy.scope()``.

In TensorFlow, a variable created inside a parameter-server strategy's scope is placed on
the parameter servers: split by the ``variable_partitioner`` and its shards placed
round-robin over the ``ps`` tasks. :func:`Variable` does the same through the strategy
whose ``scope()`` is active (:meth:`parallax.tf.ParameterServerStrategy.create_variable`).
JAX arrays and Flax modules created in the scope are not intercepted (JAX has no variable
creator hook): place a model's parameters with ``strategy.distribute_model``.
"""

from __future__ import annotations

import numpy as np

from parallax.tf.replica_context import current_scope


def Variable(initial_value, trainable: bool = True, *, name: str | None = None,  # noqa: N802
             dtype=None, shape=None):
    """Creates a variable on the parameter servers of the strategy whose scope is active.

    Args:
      initial_value: an array, or ``initializer(shard_shape, dtype) -> array``.
      trainable: accepted for TensorFlow's signature (JAX differentiates what a function
        is given, not what a variable says).
      name: a unique name (default ``variable_<n>``).
      dtype: None or float32 (what the servers store).
      shape: the full shape, required with an initializer function.

    Returns:
      A :class:`parallax.tf.ShardedVariable` (shards round-robin over the servers).

    Example:
      >>> import numpy as np, optax, parallax as px
      >>> strategy = px.tf.ParameterServerStrategy(px.tf.RayClusterResolver(1, 2))
      >>> strategy.set_optimizer(optax.sgd(0.5))
      >>> with strategy.scope():
      ...     a, b = px.tf.Variable(np.ones(3), name="a"), px.tf.Variable(np.ones(3), name="b")
      >>> [s.server for s in a.shards + b.shards]         # round-robin over the ps tasks
      [0, 1]
      >>> strategy.shutdown()

    References:
      TensorFlow, ``tf.Variable`` under ``ParameterServerStrategy.scope()``
      (``parameter_server_strategy_v2.py``: ``_create_variable``, round-robin placement).
    """
    from parallax.tf.parameter_server.replica_api import WorkerStrategy
    from parallax.tf.parameter_server.strategy import ParameterServerStrategy

    del trainable
    strategy = current_scope()
    if dtype is not None and np.dtype(dtype) != np.float32:
        raise TypeError(f"px.tf.Variable: dtype={np.dtype(dtype).name}; the parameter servers "
                        f"store float32 values (pass dtype=None or np.float32).")
    if isinstance(strategy, WorkerStrategy):
        strategy.create_variable()  # raises: variables are created on the coordinator
    if not isinstance(strategy, ParameterServerStrategy):
        where = ("outside any strategy's scope" if strategy is None
                 else f"inside the scope of {type(strategy).__name__}")
        raise ValueError(f"px.tf.Variable: called {where}; create parameter-server variables "
                         f"inside `with strategy.scope():` of a px.tf.ParameterServerStrategy "
                         f"(or call strategy.create_variable).")
    return strategy.create_variable(initial_value, name=name, shape=shape)
