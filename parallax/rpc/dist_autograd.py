"""Distributed autograd: ``context()``, ``backward(context_id, roots)``, ``get_gradients``.

Under a context, every RPC call records its callee's ``jax.vjp`` (see
:mod:`parallax.rpc.recording`); ``backward`` walks this worker's calls in reverse order,
sending each output's cotangent to its callee, whose vjp sends its own remote inputs'
cotangents on. Gradients of the RRef'ed values read in those calls (``local_value()`` or
``to_here()``) are summed on their owners, per context.

Local work on a call's result is not seen (JAX keeps no global tape): compute the loss in
a call too (``rpc_sync`` to oneself runs locally, recorded), so that ``backward`` can reach
it. Inside recorded calls, read RRefs outside ``jax.jit`` (jit the math on the values).

References:
  PyTorch, ``torch.distributed.autograd`` (``context``, ``backward``, ``get_gradients``).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator, Sequence

import numpy as np

from parallax.rpc.agent import DEFAULT_TIMEOUT, current_agent
from parallax.rpc.recording import add_trees, scope
from parallax.rpc.rref import RRef


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
        for name in agent.handles:
            agent.send_after(name, None, "release_context", (context_id,))


def backward(context_id: str, roots: Sequence, timeout: float | None = DEFAULT_TIMEOUT) -> None:
    """Backpropagates from ``roots`` (results of calls made in this context) across workers.

    Args:
      context_id: the id ``context()`` yielded.
      roots: arrays returned by RPC calls under the context (each seeded with ones).
      timeout: seconds for each worker's part of the backward.

    References:
      PyTorch, ``torch.distributed.autograd.backward``.
    """
    agent = current_agent("dist_autograd.backward")
    tape = agent.state.autograd.tapes.get(context_id)
    if tape is None:
        raise ValueError(f"parallax.rpc.dist_autograd.backward: context {context_id!r} has no "
                         "call recorded on this worker; make the forward's RPC calls inside "
                         "`with dist_autograd.context() as ctx:` on this worker")
    cotangents: dict = {}
    for i, root in enumerate(roots):
        key = tape.producers.get(id(root))
        if key is None:
            raise ValueError(
                f"parallax.rpc.dist_autograd.backward: roots[{i}] (shape {np.shape(root)}) is not "
                "an output of an RPC call in this context; local JAX work is not recorded: "
                "compute the loss in a call (rpc_sync to this worker runs it locally, recorded)")
        cotangents[key] = add_trees(cotangents.get(key), np.ones_like(np.asarray(root)))
    for entry in reversed(tape.entries):
        if entry.num_out is None:
            continue  # the call never answered: nothing of it reached the roots
        outs = [cotangents.pop((entry.call_id, i), None) for i in range(entry.num_out)]
        if entry.rref_id is None and all(c is None for c in outs):
            continue
        inputs = agent.call_and_wait(
            entry.callee, "backward", (context_id, entry.call_id, outs), timeout=timeout,
            describe=agent.describe(entry.callee, "dist_autograd.backward"))
        for j, key in entry.edges if inputs is not None else ():
            cotangents[key] = add_trees(cotangents.get(key), inputs[j])


def get_gradients(context_id: str) -> dict:
    """This worker's gradients in the context: ``{RRef: gradient}`` of the values it owns.

    A value read in several calls (on any workers) gets the sum. Call it on another worker
    through ``rpc_sync(worker, dist_autograd.get_gradients, args=(ctx,))``.

    References:
      PyTorch, ``torch.distributed.autograd.get_gradients``.
    """
    agent = current_agent("dist_autograd.get_gradients")
    return {RRef._user_local(agent, rref_id): grads
            for rref_id, grads in agent.state.gradients(context_id).items()}
