"""Distributed autograd's records: per call, the callee's ``jax.vjp``; per RRef, its cotangent.

A call made under a ``dist_autograd.context()`` runs on its callee inside ``jax.vjp`` of the
function with respect to its floating-point array arguments and an *anchor* (a traced zero
scalar). Everything the function reads that lives elsewhere joins that trace through a
``jax.custom_vjp`` whose forward runs eagerly (JAX calls ``fwd`` with concrete values
outside ``jit``) and whose backward sends the cotangent where it belongs:

* ``RRef.local_value()`` / ``RRef.to_here()``: the value is tied to the anchor; its
  backward adds the cotangent to the RRef's owner (a parameter's gradient, summed over uses);
* a nested ``rpc_sync`` from inside a recorded call: the forward is the remote call
  (recorded on that callee), the backward sends the output cotangent to it and gets the
  input cotangents back.

The caller that opened the context keeps a *tape*: its top-level calls in order, and which
of their inputs were outputs of earlier calls (by object identity). ``backward`` walks the
tape in reverse, sending each call's output cotangent to its callee.

References:
  PyTorch, ``torch.distributed.autograd`` (send/recv functions recorded per context,
  ``backward`` across workers, gradients kept per context); the distributed autograd
  design note (FAST mode: the dependencies are the recorded calls).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from parallax.rpc.wire import is_float_array, to_host, zero_cotangent

_THREAD = threading.local()  # the context and anchor of the call this thread is running


def current_context() -> str | None:
    """The id of the distributed autograd context this thread runs under, if any."""
    return getattr(_THREAD, "context", None)


def current_anchor():
    """The traced anchor of the recorded call this thread is inside, if any."""
    return getattr(_THREAD, "anchor", None)


@contextlib.contextmanager
def scope(context: str | None, anchor=None):
    """Runs the body under ``context`` (and ``anchor``), restoring the previous ones after."""
    saved = current_context(), current_anchor()
    _THREAD.context, _THREAD.anchor = context, anchor
    try:
        yield
    finally:
        _THREAD.context, _THREAD.anchor = saved


def add_trees(a, b):
    """``a + b`` leaf by leaf, with None as zero."""
    if a is None:
        return b
    if b is None:
        return a
    return jax.tree.map(lambda x, y: np.asarray(x) + np.asarray(y), a, b)


class Record(NamedTuple):
    """A recorded call on its callee: the vjp and what its output cotangents look like."""

    vjp_fn: Callable
    zero_out: list  # a zero cotangent per float output leaf
    rref_id: str | None  # set for a remote(): its RRef's cotangent joins the output's


class Entry:
    """A top-level call on the tape of the context's origin."""

    def __init__(self, call_id: str, callee: str, edges: list, leaves: list,
                 rref_id: str | None):
        self.call_id, self.callee, self.edges, self.rref_id = call_id, callee, edges, rref_id
        self.leaves = leaves  # (input position, array): this worker's own arrays it sent
        self.num_out: int | None = None  # set when the call's result arrives


class Tape:
    """The origin's record of its calls under one context, which produced which input, and
    the gradients of the arrays of its own that it sent (PyTorch's leaf tensors)."""

    def __init__(self):
        self.entries: list[Entry] = []
        self.producers: dict[int, tuple[str, int]] = {}
        self.keep: list = []  # the output leaves, so that their ids stay theirs
        self.leaf_gradients: dict[int, list] = {}  # id(array) -> [array, its gradient]
        self.lock = threading.Lock()

    def record_call(self, call_id: str, callee: str, float_leaves: list,
                    rref_id: str | None) -> Entry:
        with self.lock:
            edges, leaves = [], []
            for j, leaf in enumerate(float_leaves):
                if id(leaf) in self.producers:
                    edges.append((j, self.producers[id(leaf)]))
                else:
                    leaves.append((j, leaf))
            entry = Entry(call_id, callee, edges, leaves, rref_id)
            self.entries.append(entry)
            return entry

    def record_outputs(self, entry: Entry, out) -> None:
        floats = [leaf for leaf in jax.tree.leaves(out) if is_float_array(leaf)]
        with self.lock:
            entry.num_out = len(floats)
            for i, leaf in enumerate(floats):
                self.producers[id(leaf)] = (entry.call_id, i)
                self.keep.append(leaf)

    def add_leaf_gradient(self, leaf, gradient) -> None:
        with self.lock:
            kept = self.leaf_gradients.setdefault(id(leaf), [leaf, None])
            kept[1] = add_trees(kept[1], gradient)


class AutogradStore:
    """One worker's share of every context: its records, its RRefs' cotangents, its tapes."""

    def __init__(self):
        self.records: dict[tuple[str, str], Record] = {}
        self.cotangents: dict[str, dict[str, object]] = {}
        self.tapes: dict[str, Tape] = {}
        self.lock = threading.Lock()

    def accumulate(self, context: str, rref_id: str, cotangent) -> None:
        with self.lock:
            per_context = self.cotangents.setdefault(context, {})
            per_context[rref_id] = add_trees(per_context.get(rref_id), cotangent)

    def release(self, context: str) -> None:
        with self.lock:
            self.cotangents.pop(context, None)
            self.tapes.pop(context, None)
            for key in [k for k in self.records if k[0] == context]:
                del self.records[key]

    def backward(self, context: str, call_id: str, out_cotangents: list | None,
                 retain_graph: bool = False):
        """Runs one recorded call's vjp; returns its float inputs' cotangents (or None).

        Without ``retain_graph`` the record is dropped (a second backward through it fails,
        as PyTorch's does)."""
        with self.lock:
            records = self.records
            record = (records.get if retain_graph else records.pop)((context, call_id), None)
            own = (self.cotangents.get(context, {}).pop(record.rref_id, None)
                   if record is not None and record.rref_id else None)
        if record is None:
            raise RuntimeError(
                f"parallax.rpc.dist_autograd.backward: call {call_id} of context {context} has "
                "no record here: backward already ran through it (pass retain_graph=True to "
                "the first backward to run it again), or the context was released")
        cotangents = list(out_cotangents or [None] * len(record.zero_out))
        if own is not None:
            own_floats = [leaf for leaf in jax.tree.leaves(own) if is_float_array(leaf)]
            cotangents = [add_trees(c, o) for c, o in zip(cotangents, own_floats)]
        if all(c is None for c in cotangents):
            return None
        cotangents = [z if c is None else c for c, z in zip(cotangents, record.zero_out)]
        float_cotangents, _ = record.vjp_fn(cotangents)
        return to_host(float_cotangents)


def _split(tree):
    leaves, treedef = jax.tree.flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if is_float_array(leaf)]
    return leaves, treedef, positions


def _merge(leaves, treedef, positions, floats):
    full = list(leaves)
    for i, value in zip(positions, floats):
        full[i] = value
    return jax.tree.unflatten(treedef, full)


def execute(store: AutogradStore, fn: Callable, args: tuple, kwargs: dict,
            context: str | None, call_id: str | None):
    """``fn(*args, **kwargs)``; under a context, inside ``jax.vjp``, recorded as ``call_id``.

    Returns:
      ``(out, record_parts)``: the output, and under a context the vjp pieces the caller
      stores with :class:`Record` (None outside a context).
    """
    if context is None:
        with scope(None):
            return fn(*args, **kwargs), None
    leaves, treedef, positions = _split((args, kwargs))
    rest = {}

    def traced(floats, anchor):
        call_args, call_kwargs = _merge(leaves, treedef, positions, floats)
        with scope(context, anchor):
            out = fn(*call_args, **call_kwargs)
        out_leaves, out_def, out_positions = _split(out)
        rest.update(leaves=out_leaves, treedef=out_def, positions=out_positions)
        return [out_leaves[i] for i in out_positions]

    float_out, vjp_fn = jax.vjp(traced, [leaves[i] for i in positions], np.float32(0))
    out = _merge(rest["leaves"], rest["treedef"], rest["positions"], to_host(float_out))
    return out, (vjp_fn, [zero_cotangent(leaf) for leaf in float_out])


def tie(value, send_cotangent: Callable[[object], None]):
    """``value`` joined to the running recorded call: its cotangent goes to ``send_cotangent``.

    Outside a recorded call ``value`` comes back as it is.
    """
    anchor = current_anchor()
    if anchor is None:
        return value
    leaves, treedef, positions = _split(value)
    if not positions:
        return value

    @jax.custom_vjp
    def joined(floats, anchor):
        return floats

    def forward(floats, anchor):
        return floats, None

    def backward(_, cotangents):
        full = [np.zeros(np.shape(leaf), np.asarray(leaf).dtype) for leaf in leaves]
        send_cotangent(_merge(full, treedef, positions, to_host(cotangents)))
        return [jnp.zeros_like(c) for c in cotangents], jnp.zeros((), jnp.float32)

    joined.defvjp(forward, backward)
    return _merge(leaves, treedef, positions, joined([leaves[i] for i in positions], anchor))


def call_in_trace(args: tuple, kwargs: dict, run: Callable, run_backward: Callable):
    """A remote call made from inside a recorded call, differentiable through the trace.

    Args:
      run: ``run(args, kwargs) -> out`` makes the (recorded) remote call with concrete values.
      run_backward: ``run_backward(out_cotangents) -> input float cotangents or None``.
    """
    anchor = current_anchor()
    leaves, treedef, positions = _split((args, kwargs))
    rest = {}

    def call(floats):
        out = run(*_merge(leaves, treedef, positions, floats))
        out_leaves, out_def, out_positions = _split(out)
        rest.update(leaves=out_leaves, treedef=out_def, positions=out_positions)
        return [jnp.asarray(out_leaves[i]) for i in out_positions]

    @jax.custom_vjp
    def remote_call(floats, anchor):
        return call(floats)

    def forward(floats, anchor):
        return call(floats), [jnp.zeros_like(f) for f in floats]

    def backward(zeros, cotangents):
        returned = run_backward(to_host(cotangents))
        floats = zeros if returned is None else [jnp.asarray(c) for c in returned]
        return floats, jnp.zeros((), jnp.float32)

    remote_call.defvjp(forward, backward)
    float_out = remote_call([jnp.asarray(leaves[i]) for i in positions], anchor)
    return _merge(rest["leaves"], rest["treedef"], rest["positions"], float_out)
