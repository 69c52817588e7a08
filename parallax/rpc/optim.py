"""``DistributedOptimizer``: an optax optimizer applied where each parameter lives."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import optax

from parallax.rpc.agent import agent_or_none, current_agent
from parallax.rpc.future import wait_all
from parallax.rpc.options import UNSET_RPC_TIMEOUT, resolve_timeout
from parallax.rpc.rref import RRef


class DistributedOptimizer:
    """Updates RRef'ed parameters on their owners with their gradients of a context.

    Each owner keeps the optimizer's state of its parameters; ``step`` sends only ids.

    A parameter that got no gradient in the step's context is refused (``RuntimeError``,
    naming it): with JAX's immutable arrays that almost always means the forward read a copy
    (a module attribute) rather than the RRef, and the step would silently do nothing.
    ``allow_unused=True`` skips such parameters instead, as PyTorch's optimizers skip a
    parameter whose gradient is None.

    Args:
      optimizer: an ``optax.GradientTransformation`` (sent once to every owner).
      params_rref: the RRefs of the parameters (pytrees of arrays) to update.
      allow_unused: skip parameters without a gradient in a step instead of refusing them.
      timeout: seconds for each call (-1: the group's default).

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

    def __init__(self, optimizer: optax.GradientTransformation, params_rref: Sequence[RRef], *,
                 allow_unused: bool = False, timeout: float | None = UNSET_RPC_TIMEOUT):
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError("parallax.rpc.DistributedOptimizer: `optimizer` must be an "
                            f"optax.GradientTransformation (e.g. optax.adam(1e-3)), got "
                            f"{type(optimizer).__name__}")
        for i, rref in enumerate(params_rref):
            if not isinstance(rref, RRef):
                raise TypeError(f"parallax.rpc.DistributedOptimizer: params_rref[{i}] must be an "
                                f"RRef, got {type(rref).__name__}")
        agent = current_agent("DistributedOptimizer")
        timeout = resolve_timeout(timeout, agent.default_timeout, "DistributedOptimizer")
        self._id, self._timeout, self._allow_unused = uuid.uuid4().hex, timeout, allow_unused
        self._rrefs = list(params_rref)  # held: the parameters live as long as the optimizer
        self._by_owner: dict[str, tuple[list[str], list[str]]] = {}
        for i, rref in enumerate(self._rrefs):
            ids, names = self._by_owner.setdefault(rref.owner_name(), ([], []))
            ids.append(rref._id)
            names.append(f"params_rref[{i}] {rref!r}")
        wait_all([agent.call(owner, "register_optimizer", (self._id, optimizer),
                             timeout=timeout, describe=agent.describe(owner, "an optimizer"))
                  for owner in self._by_owner])

    def step(self, context_id: str) -> None:
        """Applies one update on every owner, with the gradients of ``context_id``."""
        agent = current_agent("DistributedOptimizer.step")
        wait_all([agent.call(owner, "optimizer_step",
                             (self._id, ids, context_id, self._allow_unused, names),
                             timeout=self._timeout,
                             describe=agent.describe(owner, "DistributedOptimizer.step"))
                  for owner, (ids, names) in self._by_owner.items()])

    def __del__(self):
        try:
            agent = agent_or_none()
            for owner in getattr(self, "_by_owner", ()):
                if agent is not None:
                    agent.send_one_way(owner, "release_optimizer", (self._id,))
        except Exception:  # interpreter or RPC shutting down: nothing left to free
            pass
