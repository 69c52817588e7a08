"""What one worker holds: the values its RRefs own (with user counts), its share of every
autograd context, its optimizers' states; and how it runs a call."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import jax
import numpy as np

from parallax.rpc.functions import ASYNC_EXECUTION
from parallax.rpc.recording import AutogradStore, Record, execute
from parallax.rpc.wire import to_host


class WorkerState:
    """One worker's objects; every method is what a call to this worker may run.

    Args:
      name: the worker's name (for error messages).

    Example:
      >>> state = WorkerState("w")
      >>> state.run(lambda x: x + 1, (1,), {}, None, None, "r1")
      >>> state.fetch("r1"), state.num_owned()
      (2, 1)
      >>> state.release("r1"); state.num_owned()
      0

    References:
      PyTorch, ``torch.distributed.rpc``'s RRef context on the owner (``OwnerRRef`` values,
      the fork/delete protocol); its distributed autograd container per worker.
    """

    def __init__(self, name: str):
        self.name = name
        self.values: dict[str, object] = {}
        self.users: dict[str, int] = {}
        self.autograd = AutogradStore()
        self.optimizers: dict[str, tuple] = {}
        # reentrant, and values are dropped outside it: freeing a value may free RRefs it
        # holds to values of this worker (a module holding its parameters' RRefs), whose
        # release takes the lock again, in this thread
        self.lock = threading.RLock()

    def run(self, fn: Callable, args: tuple, kwargs: dict, context: str | None,
            call_id: str | None, rref_id: str | None):
        """Runs a call; keeps the result under ``rref_id`` (for ``remote``) or returns it."""
        if context is not None and getattr(fn, ASYNC_EXECUTION, False):
            raise NotImplementedError(
                f"parallax.rpc: {getattr(fn, '__name__', fn)!r} is @async_execution; "
                "dist_autograd does not record such calls: call it outside the context")
        out, parts = execute(self.autograd, fn, args, kwargs, context, call_id)
        if getattr(fn, ASYNC_EXECUTION, False):
            out = out.wait()
        if parts is not None:
            with self.autograd.lock:
                self.autograd.records[(context, call_id)] = Record(*parts, rref_id)
        if rref_id is not None:
            self.store(rref_id, out)
            return None
        return to_host(out)

    def store(self, rref_id: str, value, users: int = 1) -> None:
        with self.lock:
            self.values[rref_id] = value
            self.users[rref_id] = self.users.get(rref_id, 0) + users

    def fetch(self, rref_id: str):
        with self.lock:
            if rref_id not in self.values:
                raise LookupError(f"parallax.rpc: worker {self.name!r} holds no value for RRef "
                                  f"{rref_id} (it was freed when its last user went away)")
            return self.values[rref_id]

    def replace(self, rref_id: str, value) -> None:
        with self.lock:
            old, self.values[rref_id] = self.values.get(rref_id), value
        del old  # outside the lock: see __init__

    def fork(self, rref_id: str) -> None:
        with self.lock:
            self.users[rref_id] = self.users.get(rref_id, 0) + 1

    def release(self, rref_id: str) -> None:
        freed = None
        with self.lock:
            self.users[rref_id] = self.users.get(rref_id, 0) - 1
            if self.users[rref_id] <= 0:
                del self.users[rref_id]
                freed = self.values.pop(rref_id, None)
        del freed  # outside the lock: see __init__

    def num_owned(self) -> int:
        with self.lock:
            return len(self.values)

    def pid(self) -> int:
        return os.getpid()

    def backward(self, context: str, call_id: str, out_cotangents, retain_graph: bool = False):
        return self.autograd.backward(context, call_id, out_cotangents, retain_graph)

    def seed(self, context: str, rref_id: str) -> None:
        """Ones as the cotangent of an owned value: a root of ``RRef.backward``."""
        value = self.fetch(rref_id)
        self.autograd.accumulate(context, rref_id, jax.tree.map(
            lambda leaf: np.ones(np.shape(leaf), np.asarray(leaf).dtype), value))

    def accumulate(self, context: str, rref_id: str, cotangent) -> None:
        self.autograd.accumulate(context, rref_id, cotangent)

    def release_context(self, context: str) -> None:
        self.autograd.release(context)

    def gradients(self, context: str) -> dict:
        with self.autograd.lock:
            return dict(self.autograd.cotangents.get(context, {}))

    def register_optimizer(self, optimizer_id: str, tx) -> None:
        with self.lock:
            self.optimizers[optimizer_id] = (tx, {})

    def release_optimizer(self, optimizer_id: str) -> None:
        with self.lock:
            self.optimizers.pop(optimizer_id, None)

    def optimizer_step(self, optimizer_id: str, rref_ids: list, context: str,
                       allow_unused: bool, describe: list) -> None:
        """Applies the optimizer to this worker's parameters with their gradients in
        ``context``: every parameter must have one, unless ``allow_unused`` (then those
        without are left as they are, optimizer state included, as PyTorch's optimizers skip
        a parameter whose gradient is None). Nothing is updated if one is refused."""
        import optax

        tx, states = self.optimizers[optimizer_id]
        gradients = self.gradients(context)
        missing = [i for i, rref_id in enumerate(rref_ids) if rref_id not in gradients]
        if missing and not allow_unused:
            i = missing[0]
            value = self.fetch(rref_ids[i])
            shapes = jax.tree.map(lambda leaf: f"{np.shape(leaf)} {np.asarray(leaf).dtype}", value)
            raise RuntimeError(
                f"parallax.rpc.DistributedOptimizer.step: no gradient reached parameter "
                f"{describe[i]} (owned by {self.name!r}, {shapes}) in dist_autograd context "
                f"{context!r}, nor {len(missing) - 1} other(s) of the {len(rref_ids)} on this "
                "worker: no recorded call read it through its RRef. An RRef holds a value of its "
                "own (a JAX array does not change in place), so a forward that reads the "
                "module's attribute (self.w) instead of the RRef (self.w_rref.local_value()) "
                "neither trains nor sees the optimizer's updates. Read parameters in the forward "
                "through their RRefs; or, if a step may leave some parameters unused, pass "
                "allow_unused=True to skip them (PyTorch skips a parameter without a gradient)")
        for rref_id in rref_ids:
            grads = gradients.get(rref_id)
            if grads is None:
                continue
            params = self.fetch(rref_id)
            if rref_id not in states:
                states[rref_id] = tx.init(params)
            updates, states[rref_id] = tx.update(grads, states[rref_id], params)
            self.replace(rref_id, to_host(optax.apply_updates(params, updates)))
