"""The optimizer of a parameter-server job: it runs on the servers, next to the variables.

In TensorFlow's ``ParameterServerStrategy`` an optimizer created in ``strategy.scope()``
places its slot variables with their variables on the parameter servers, and the update
ops of ``optimizer.apply_gradients`` run there. Here the servers are Ray actors holding the
variables' rows, and an optimizer is their *handle*: an optax transformation applied to
the gradients they receive (:class:`parallax.ps.OptaxHandle`). So:

- :class:`ServerOptimizer` wraps an optax transformation with Keras's
  ``apply_gradients(grads_and_vars)``; created in ``strategy.scope()`` (or after the
  variables: their values are kept, its slots start at their initial values, as Keras
  creates them at the first ``apply_gradients``), it becomes the strategy's optimizer;
- until a strategy has one, the servers hold
  :class:`~parallax.tf.parameter_server.missing_optimizer.MissingOptimizer`, which refuses
  a gradient with the reason and the fixes instead of adding it to the values. Variables
  updated by hand (``assign_sub``, ``assign_add``) need no optimizer.

One strategy has one optimizer (its servers run one handle).
"""

from __future__ import annotations

import numpy as np
import optax

from parallax.ps import UPDATE
from parallax.tf.parameter_server.key_layout import KeyLayout
from parallax.tf.parameter_server.sharded_variable import ShardedVariable
from parallax.tf.parameter_server.strategy import ParameterServerStrategy
from parallax.tf.replica_context import current_scope

class ServerOptimizer:
    """An optax optimizer run by the parameter servers, applied with Keras's call.

    Args:
      tx: the optax transformation the servers apply (``optax.sgd(0.1)`` is Keras's
        ``SGD(learning_rate=0.1)``).
      strategy: the :class:`parallax.tf.ParameterServerStrategy`; by default the one whose
        ``scope()`` is active.

    Raises:
      TypeError: ``tx`` is not an optax transformation.
      ValueError: no parameter-server strategy, or the strategy already runs another
        optimizer.

    Example:
      >>> import numpy as np, optax, parallax as px
      >>> strategy = px.tf.ParameterServerStrategy(px.tf.RayClusterResolver(1, 2))
      >>> with strategy.scope():
      ...     w = px.tf.Variable(np.ones((2, 2), np.float32), name="w")
      ...     optimizer = px.tf.ServerOptimizer(optax.sgd(0.5))
      >>> optimizer.apply_gradients([(np.ones((2, 2)), w)])
      >>> w.numpy().tolist()
      [[0.5, 0.5], [0.5, 0.5]]
      >>> strategy.shutdown()

    References:
      TensorFlow, ``tf.keras.optimizers.Optimizer.apply_gradients`` under
      ``ParameterServerStrategy`` (slots and update ops placed with their variables);
      Li et al., OSDI 2014 (server-side updates).
    """

    def __init__(self, tx: optax.GradientTransformation, strategy=None):
        api = "px.tf.ServerOptimizer"
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(f"{api}: tx must be an optax GradientTransformation (e.g. "
                            f"optax.sgd(0.1) for Keras's SGD(learning_rate=0.1)), got "
                            f"{type(tx).__name__}.")
        strategy = current_scope() if strategy is None else strategy
        if not isinstance(strategy, ParameterServerStrategy):
            raise ValueError(f"{api}: create it inside `with strategy.scope():` of a "
                             f"px.tf.ParameterServerStrategy (or pass strategy=); the "
                             f"optimizer runs on that strategy's parameter servers.")
        strategy.set_optimizer(tx)
        self.tx = tx

    def apply_gradients(self, grads_and_vars) -> None:
        """Sends each gradient to its variable's servers, which apply the optimizer.

        Args:
          grads_and_vars: ``(gradient, variable)`` pairs; a variable is a
            :class:`~parallax.tf.ShardedVariable` or one of its ``variables`` (a shard),
            the gradient an array of its shape. Pairs whose gradient is None are skipped,
            as Keras skips them. One request per server carries every pair.

        Raises:
          ValueError: a gradient of the wrong shape, a variable given twice, no pairs.
          TypeError: a variable that lives elsewhere (not on parameter servers).
        """
        api = "px.tf.ServerOptimizer.apply_gradients"
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        if not pairs:
            raise ValueError(f"{api}: no gradients were given (every pair's gradient is None).")
        for i, (grad, var) in enumerate(pairs):
            if not isinstance(var, ShardedVariable):
                raise TypeError(f"{api}: pair {i}'s variable is a {type(var).__name__}; "
                                f"the servers update px.tf.Variable / ShardedVariable objects "
                                f"(or their .variables shards).")
            if np.shape(grad) != var.shape:
                raise ValueError(f"{api}: the gradient for {var.name!r} has shape "
                                 f"{np.shape(grad)}, the variable {var.shape}.")
        keys = [s.first_key for _, v in pairs for s in v.shards]
        if len(set(keys)) != len(keys):
            raise ValueError(f"{api}: a variable (or a shard and its whole variable) appears "
                             f"twice; give each variable one gradient.")
        variables = [v for _, v in pairs]
        layout = KeyLayout(variables)
        flat = layout.join([np.asarray(g, np.float32) for g, _ in pairs])
        variables[0].push_flat(layout.keys, flat, layout.lens, UPDATE)

    def __repr__(self) -> str:
        return f"ServerOptimizer({self.tx!r})"
