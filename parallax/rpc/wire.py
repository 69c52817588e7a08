"""What travels between workers: pytrees whose JAX arrays go as NumPy arrays.

A NumPy array is sent by Ray's object store as an out-of-band buffer (pickle protocol 5)
and read back as a view of the store's shared memory, without a copy; a ``jax.Array`` on
the CPU is turned into one by ``np.asarray`` (a view, no copy). What arrives is a NumPy array
(read-only when it came through the store): JAX functions take it as it is.
"""

from __future__ import annotations

import jax
import numpy as np


def to_host(tree):
    """``tree`` with every ``jax.Array`` leaf as a NumPy array (other leaves as they are).

    Example:
      >>> import jax.numpy as jnp
      >>> type(to_host({"w": jnp.ones(2)})["w"]).__name__
      'ndarray'
    """
    return jax.tree.map(lambda leaf: np.asarray(leaf) if isinstance(leaf, jax.Array) else leaf,
                        tree)


def is_float_array(leaf) -> bool:
    """Whether ``leaf`` is an array that carries gradients (a floating-point or complex one).

    Example:
      >>> is_float_array(np.ones(2)), is_float_array(np.arange(2)), is_float_array(1.0)
      (True, False, False)
    """
    return (isinstance(leaf, (np.ndarray, jax.Array))
            and np.issubdtype(leaf.dtype, np.inexact))


def zero_cotangent(leaf):
    """The zero cotangent of an output leaf: zeros of its dtype, or ``float0`` for integers.

    Example:
      >>> zero_cotangent(np.arange(3)).dtype
      dtype([('float0', 'V')])
    """
    leaf = np.asarray(leaf)
    if np.issubdtype(leaf.dtype, np.inexact):
        return np.zeros(leaf.shape, leaf.dtype)
    return np.zeros(leaf.shape, jax.dtypes.float0)
