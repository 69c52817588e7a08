"""What the parameter servers hold until a strategy has an optimizer: gradients refused.

On Ray a pushed gradient is what the servers' optimizer applies (TensorFlow places the
optimizer's update ops with the variables; here the servers run it), so servers without
one must not add a gradient to the values as if it were a plain sum. They refuse it with
the reason and the fixes; variables updated by hand (``assign_sub``, ``assign_add``) need
no optimizer.
"""

from __future__ import annotations

import numpy as np

NO_OPTIMIZER = (
    "the parameter servers have no optimizer, and a pushed gradient is what the servers' "
    "optimizer applies: on Ray the optimizer runs on the servers, next to the variables. "
    "Give the strategy one (optimizer = px.tf.ServerOptimizer(optax.sgd(0.1)) in "
    "strategy.scope(), or strategy.set_optimizer(optax.sgd(0.1)); before or after the "
    "variables exist), or update the variable by hand with assign_sub / assign_add.")


class MissingOptimizerError(ValueError):
    """A gradient was pushed to servers that have no optimizer (see :data:`NO_OPTIMIZER`)."""


class MissingOptimizer:
    """The servers' handle until the strategy has an optimizer: gradients are refused.

    Example:
      >>> MissingOptimizer().push(np.ones(2), np.ones(2), None)
      Traceback (most recent call last):
      ...
      parallax.tf.parameter_server.missing_optimizer.MissingOptimizerError: the parameter ...
    """

    def init(self, values: np.ndarray) -> None:
        del values

    def push(self, stored, pushed, state):
        del stored, pushed, state
        raise MissingOptimizerError(NO_OPTIMIZER)

    def __eq__(self, other) -> bool:
        return type(other) is MissingOptimizer

    def __hash__(self) -> int:
        return hash(MissingOptimizer)

    def __repr__(self) -> str:
        return "MissingOptimizer()"
