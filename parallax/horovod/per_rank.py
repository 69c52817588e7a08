"""``hvd.PerRank``: values that differ between ranks, kept per rank by ``@hvd.jit``.

A step's arguments and results are replicated by default: every rank holds the same
parameters. Some state is each rank's own: gradients accumulated locally between
synchronisations (``DistributedOptimizer(backward_passes_per_step=k)``, DDP's ``no_sync``).
Wrapped in :class:`PerRank`, such a value keeps one copy per rank across ``@hvd.jit`` calls
(a leading axis over the Horovod mesh, hidden from the step). Outside ``@hvd.jit`` it is a
plain container.

Example:
  >>> import jax, jax.numpy as jnp
  >>> jax.tree.leaves(PerRank({"w": jnp.zeros(2)}))
  [Array([0., 0.], dtype=float32)]
"""

from __future__ import annotations

from typing import Any

import jax


@jax.tree_util.register_pytree_with_keys_class
class PerRank:
    """A pytree node whose leaves hold one value per rank inside ``@hvd.jit``."""

    def __init__(self, value: Any):
        self.value = value

    def tree_flatten_with_keys(self):
        return ((jax.tree_util.GetAttrKey("value"), self.value),), None

    def tree_flatten(self):
        return (self.value,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        del aux
        return cls(children[0])

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


def is_per_rank(x) -> bool:
    return isinstance(x, PerRank)
