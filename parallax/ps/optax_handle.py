"""An optax optimizer as a server handle: the server applies the update to its shard."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax


def _bucket(size: int) -> int:
    """The next power of two (at least 8): sparse pushes of any size share a few programs."""
    return max(8, 1 << max(0, size - 1).bit_length())


class OptaxHandle:
    """Treats pushed values as gradients and applies ``tx`` to the stored parameters.

    The server runs ``updates, state = tx.update(grads, state, params)`` then
    ``optax.apply_updates`` on the elements a push touches, under ``jax.jit``. A push of a
    server's whole shard is exactly ``tx`` on that shard; for element-wise optimizers (SGD,
    momentum, Adam, Adagrad, RMSProp...) that is exactly ``tx`` on the full model, because
    each element's update depends only on that element. Optimizers that look at whole
    tensors (global-norm clipping, LAMB, Adafactor's factored moments) see one server's flat
    shard instead, as they do in any parameter server. A sparse push (some rows of an
    embedding table) updates only those rows and their moments ("lazy" Adam); shared state
    such as Adam's step count advances once per push.

    Args:
      tx: any optax ``GradientTransformation``.

    Example:
      >>> import optax
      >>> handle = OptaxHandle(optax.sgd(0.5))
      >>> params = np.ones(3, np.float32)
      >>> new, state = handle.push(params, np.full(3, 2, np.float32), handle.init(params))
      >>> new.tolist()
      [0.0, 0.0, 0.0]

    References:
      Li et al., "Scaling Distributed Machine Learning with the Parameter Server", OSDI 2014
      (server-side updates); Dean et al., "Large Scale Distributed Deep Networks" (Downpour
      SGD), NeurIPS 2012.
    """

    def __init__(self, tx: optax.GradientTransformation):
        if not isinstance(tx, optax.GradientTransformation):
            raise TypeError(f"px.ps.OptaxHandle: tx must be an optax GradientTransformation "
                            f"(e.g. optax.sgd(0.1)), got {type(tx).__name__}.")
        self.tx = tx
        self._apply = None

    def __getstate__(self):
        return {"tx": self.tx}  # the jitted function is rebuilt where the handle lands

    def __setstate__(self, state):
        self.tx, self._apply = state["tx"], None

    def init(self, values: np.ndarray) -> Any:
        return jax.tree.map(np.asarray, self.tx.init(jnp.asarray(values)))

    def push(self, stored: np.ndarray, pushed: np.ndarray, state: Any) -> tuple[np.ndarray, Any]:
        if self._apply is None:
            self._apply = jax.jit(self._update)
        size = stored.size
        padded = _bucket(size)

        def pad(leaf):
            leaf = np.asarray(leaf)
            if leaf.shape != stored.shape or padded == size:
                return leaf
            return np.concatenate([leaf, np.zeros(padded - size, leaf.dtype)])

        params, state = self._apply(pad(stored), pad(pushed), jax.tree.map(pad, state))
        def unpad(leaf):
            return np.asarray(leaf)[:size] if leaf.shape == (padded,) else np.asarray(leaf)

        return unpad(params), jax.tree.map(unpad, state)

    def _update(self, params, grads, state):
        updates, state = self.tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def __repr__(self) -> str:
        return f"OptaxHandle({self.tx!r})"
