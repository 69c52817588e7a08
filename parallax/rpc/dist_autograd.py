"""Distributed autograd: ``context()``, ``backward(context_id, roots, retain_graph)``,
``get_gradients``.

Under a context, every RPC call records its callee's ``jax.vjp`` (see
:mod:`parallax.rpc.recording`); ``backward`` walks this worker's calls in reverse order,
sending each output's cotangent to its callee, whose vjp sends its own remote inputs'
cotangents on. Gradients of the RRef'ed values read in those calls (``local_value()`` or
``to_here()``) are summed on their owners, per context; gradients of the arrays this worker
sent in its calls (PyTorch's leaf tensors) are summed here.

Local work on a call's result is not seen (JAX keeps no global tape): compute the loss in
a call too (``rpc_sync`` to oneself runs locally, recorded), so that ``backward`` can reach
it. Inside recorded calls, read RRefs outside ``jax.jit`` (jit the math on the values).

References:
  PyTorch, ``torch/distributed/autograd/__init__.py`` (``context``, ``backward``,
  ``get_gradients``) and its design note (a context's gradients accumulate per worker).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Mapping, Sequence

from parallax.rpc.agent import current_agent
from parallax.rpc.backward_pass import backward_pass
from parallax.rpc.options import UNSET_RPC_TIMEOUT
from parallax.rpc.recording import scope
from parallax.rpc.rref import RRef


def is_available() -> bool:
    """Whether distributed autograd can be used (it can wherever ``parallax.rpc`` can).

    References:
      PyTorch, ``torch.distributed.autograd.is_available``.
    """
    return True


@contextlib.contextmanager
def context() -> Iterator[str]:
    """Opens a distributed autograd context; yields its id. On exit, every worker drops it.

    Example:
      >>> import jax.numpy as jnp, parallax.rpc as rpc
      >>> from parallax.rpc import dist_autograd
      >>> rpc.init_rpc("main")
      >>> w = rpc.RRef(jnp.array([1.0, 2.0]))
      >>> def loss(w, x):
      ...     return jnp.sum(w.local_value() * x)
      >>> with dist_autograd.context() as ctx:
      ...     out = rpc.rpc_sync("main", loss, args=(w, jnp.array([3.0, 4.0])))
      ...     dist_autograd.backward(ctx, [out])
      ...     print(dist_autograd.get_gradients(ctx)[w])
      [3. 4.]
      >>> rpc.shutdown()
    """
    agent = current_agent("dist_autograd.context")
    context_id = uuid.uuid4().hex
    try:
        with scope(context_id):
            yield context_id
    finally:
        agent.state.release_context(context_id)
        for name in agent.peers:
            if name != agent.name:
                agent.send_one_way(name, "release_context", (context_id,))


def backward(context_id: str, roots: Sequence, retain_graph: bool = False, *,
             rref_roots: Sequence[RRef] = (), timeout: float | None = UNSET_RPC_TIMEOUT) -> None:
    """Backpropagates from ``roots`` (results of calls made in this context) across workers.

    Args:
      context_id: the id ``context()`` yielded.
      roots: arrays returned by RPC calls under the context (each seeded with ones).
      retain_graph: keep the calls' records, so that a second ``backward`` through them
        works (its gradients add to the first's, as PyTorch's accumulate).
      rref_roots: RRefs made by ``remote()`` in the context, also seeded with ones
        (``RRef.backward``).
      timeout: seconds for each worker's part of the backward (-1: the group's default).

    References:
      PyTorch, ``torch.distributed.autograd.backward(context_id, roots, retain_graph=False)``.
    """
    backward_pass(context_id, roots, retain_graph, rref_roots, timeout)


class Gradients(Mapping):
    """``get_gradients``'s answer: a gradient per RRef (of a value this worker owns) and per
    array this worker sent in its calls; arrays are looked up by identity, as PyTorch looks
    up tensors.

    Example:
      >>> import numpy as np
      >>> x = np.ones(2)
      >>> grads = Gradients({}, [(x, np.full(2, 3.0))])
      >>> grads[x], len(grads), x in grads, np.ones(2) in grads
      (array([3., 3.]), 1, True, False)
    """

    def __init__(self, by_rref: dict, by_array: list):
        self._by_rref, self._by_array = dict(by_rref), list(by_array)

    def __getitem__(self, key):
        if isinstance(key, RRef):
            return self._by_rref[key]
        for array, gradient in self._by_array:
            if array is key:
                return gradient
        raise KeyError(f"no gradient for this {type(key).__name__} in the context (not an "
                       "RRef owned here, nor an array this worker sent in a recorded call)")

    def __iter__(self):
        yield from self._by_rref
        yield from (array for array, _ in self._by_array)

    def __len__(self) -> int:
        return len(self._by_rref) + len(self._by_array)

    def __repr__(self) -> str:
        return f"Gradients({len(self._by_rref)} RRefs, {len(self._by_array)} arrays)"


def get_gradients(context_id: str) -> Gradients:
    """This worker's gradients in the context: ``{RRef: gradient}`` of the values it owns,
    and ``{array: gradient}`` of the arrays it sent in calls it made in the context.

    A value read in several calls (on any workers) gets the sum. Call it on another worker
    through ``rpc_sync(worker, dist_autograd.get_gradients, args=(ctx,))``.

    References:
      PyTorch, ``torch.distributed.autograd.get_gradients``.
    """
    agent = current_agent("dist_autograd.get_gradients")
    by_rref = {RRef._user_local(agent, rref_id): grads
               for rref_id, grads in agent.state.gradients(context_id).items()}
    tape = agent.state.autograd.tapes.get(context_id)
    by_array = [] if tape is None else [tuple(kept) for kept in tape.leaf_gradients.values()]
    return Gradients(by_rref, by_array)
