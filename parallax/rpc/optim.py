"""``DistributedOptimizer``: an optax optimizer applied where each parameter lives."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import optax

from parallax.rpc.agent import DEFAULT_TIMEOUT, current_agent
from parallax.rpc.future import wait_all
from parallax.rpc.rref import RRef


class DistributedOptimizer:
    """Updates RRef'ed parameters on their owners with their gradients of a context.

    Each owner keeps the optimizer's state of its parameters; ``step`` sends only ids.

    Args:
      optimizer: an ``optax.GradientTransformation`` (sent once to every owner).
      params_rref: the RRefs of the parameters (pytrees of arrays) to update.
      timeout: seconds for each call.

    Example:
      >>> import jax.numpy as jnp, optax, parallax.rpc as rpc
      >>> from parallax.rpc import dist_autograd
      >>> rpc.init_rpc("main")
      >>> w = rpc.RRef(jnp.array([1.0, 2.0]))
      >>> opt = rpc.DistributedOptimizer(optax.sgd(0.5), [w])
      >>> def loss(w):
      ...     return jnp.sum(w.local_value() ** 2)
      >>> with dist_autograd.context() as ctx:
      ...     dist_autograd.backward(ctx, [rpc.rpc_sync("main", loss, args=(w,))])
      ...     opt.step(ctx)
      >>> w.to_here()
      array([0., 0.], dtype=float32)
      >>> rpc.shutdown()

    References:
      PyTorch, ``torch.distributed.optim.DistributedOptimizer`` (one local optimizer per
      owner, ``step(context_id)`` applying the context's gradients there).
    """

    def __init__(self, optimizer: optax.GradientTransformation, params_rref: Sequence[RRef],
                 timeout: float | None = DEFAULT_TIMEOUT):
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError("parallax.rpc.DistributedOptimizer: `optimizer` must be an "
                            f"optax.GradientTransformation (e.g. optax.adam(1e-3)), got "
                            f"{type(optimizer).__name__}")
        for i, rref in enumerate(params_rref):
            if not isinstance(rref, RRef):
                raise TypeError(f"parallax.rpc.DistributedOptimizer: params_rref[{i}] must be an "
                                f"RRef, got {type(rref).__name__}")
        agent = current_agent("DistributedOptimizer")
        self._id, self._timeout = uuid.uuid4().hex, timeout
        self._rrefs = list(params_rref)  # held: the parameters live as long as the optimizer
        self._by_owner: dict[str, list[str]] = {}
        for rref in self._rrefs:
            self._by_owner.setdefault(rref.owner_name(), []).append(rref._id)
        wait_all([agent.call(owner, "register_optimizer", (self._id, optimizer),
                             timeout=timeout, describe=agent.describe(owner, "an optimizer"))
                  for owner in self._by_owner])

    def step(self, context_id: str) -> None:
        """Applies one update on every owner, with the gradients of ``context_id``."""
        agent = current_agent("DistributedOptimizer.step")
        wait_all([agent.call(owner, "optimizer_step", (self._id, ids, context_id),
                             timeout=self._timeout,
                             describe=agent.describe(owner, "DistributedOptimizer.step"))
                  for owner, ids in self._by_owner.items()])
