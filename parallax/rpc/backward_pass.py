"""The backward pass of distributed autograd: the context's tape walked in reverse, each call's
cotangents sent to its callee, the input cotangents it answers carried on to the calls that
produced them (``dist_autograd.backward`` and ``RRef.backward`` both run it; kept apart from
both so that neither module imports the other).

References:
  PyTorch, ``torch/csrc/distributed/autograd/engine/dist_engine.cpp`` (the backward pass
  from the roots, sending gradients to the workers that recorded the calls).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from parallax.rpc.agent import current_agent
from parallax.rpc.options import resolve_timeout
from parallax.rpc.recording import add_trees


def backward_pass(context_id: str, roots: Sequence, retain_graph: bool, rref_roots: Sequence,
                  timeout) -> None:
    """Runs the backward from ``roots`` (arrays) and ``rref_roots`` (RRefs made by
    ``remote()`` in the context), each seeded with ones; see ``dist_autograd.backward``."""
    agent = current_agent("dist_autograd.backward")
    timeout = resolve_timeout(timeout, agent.default_timeout, "dist_autograd.backward")
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
    made_here = {entry.rref_id for entry in tape.entries if entry.rref_id is not None}
    for rref in rref_roots:
        if rref._id not in made_here:
            raise ValueError(
                f"parallax.rpc.RRef.backward: {rref!r} was not made by a remote() call of this "
                f"worker in context {context_id!r}, so no recorded call produced its value; "
                "call backward on the worker that made it, in the context it was made in")
        rref._wait_created("backward", timeout)
        agent.call_and_wait(rref.owner_name(), "seed", (context_id, rref._id), timeout=timeout,
                            describe=agent.describe(rref.owner_name(), "RRef.backward"))
    for entry in reversed(tape.entries):
        if entry.num_out is None:
            continue  # the call never answered: nothing of it reached the roots
        outs = [cotangents.pop((entry.call_id, i), None) for i in range(entry.num_out)]
        if entry.rref_id is None and all(c is None for c in outs):
            continue
        inputs = agent.call_and_wait(
            entry.callee, "backward", (context_id, entry.call_id, outs, retain_graph),
            timeout=timeout, describe=agent.describe(entry.callee, "dist_autograd.backward"))
        if inputs is None:
            continue
        for j, key in entry.edges:
            cotangents[key] = add_trees(cotangents.get(key), inputs[j])
        for j, leaf in entry.leaves:
            tape.add_leaf_gradient(leaf, inputs[j])
