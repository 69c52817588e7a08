"""Is a value really replicated? Exact hashes of its bits compared across a mesh axis.

A ``shard_map`` with ``check_vma=False`` (TF's replica program, ``@hvd.jit``) returns an
output as replicated because its ``out_specs`` say so, not because every device holds the
same bits: a step that forgot to all-reduce its gradients returns device 0's parameters and
silently trains N models. :func:`differs` tells, inside the program, which values differ:
each device hashes each value's bits (a weighted sum in wrapping ``uint32`` arithmetic,
exact, so equal arrays give equal hashes whatever XLA fuses), and one ``pmax`` and one
``pmin`` of the hashes (one scalar per value) compare them. Its cost is one read of the
values (or of their first ``sample`` elements) and a few bytes of traffic. Where the check
must leave the program's collectives as they are (``@hvd.jit``, whose compiled program users
read), each device returns its :func:`hashes` instead and :func:`differs_on_host` compares
them after the call.

Example:
  >>> import jax, jax.numpy as jnp, parallax as px
  >>> mesh = px.make_mesh(data=-1)
  >>> f = jax.shard_map(lambda x: differs([x, jnp.ones(3)], ("data",)), mesh=mesh,
  ...                   in_specs=jax.P("data"), out_specs=jax.P(), check_vma=False)
  >>> f(jnp.arange(8.0)).tolist()  # each device's x is its own element; the ones agree
  [True, False]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils


def bits_hash(x, sample: int | None = None) -> jax.Array:
    """An exact hash of an array's bits (its first ``sample`` elements), a ``uint32`` scalar.

    Args:
      x: an array (PRNG keys hash their key data; complex numbers both parts).
      sample: hash only the first ``sample`` elements of the flattened array (None: all).

    Returns:
      ``sum(bits[i] * (2 i + 1))`` in wrapping ``uint32`` arithmetic.
    """
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag])
    x = x.reshape(-1)[:sample] if sample is not None else x.reshape(-1)
    if jnp.issubdtype(x.dtype, jnp.floating):
        bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    else:
        bits = x.astype(jnp.uint32)
    position = jnp.arange(bits.size, dtype=jnp.uint32) * 2 + 1
    return jnp.sum(bits * position, dtype=jnp.uint32)


def hashes(leaves, sample: int | None = None) -> jax.Array:
    """``[len(leaves)]`` ``uint32`` hashes of the leaves' bits (:func:`bits_hash`)."""
    if not leaves:
        return jnp.zeros((0,), jnp.uint32)
    return jnp.stack([bits_hash(x, sample) for x in leaves])


def differs(leaves, axes: tuple[str, ...], sample: int | None = None) -> jax.Array:
    """Inside ``shard_map``: ``[len(leaves)]`` booleans, True where the devices along ``axes``
    hold different values (compared on the first ``sample`` elements, or all)."""
    h = hashes(leaves, sample)
    return lax.pmax(h, axes) != lax.pmin(h, axes)


def differs_on_host(per_device: jax.Array) -> np.ndarray:
    """Outside the program: which hashes differ between devices, from a ``[devices, n]`` array
    of :func:`hashes` sharded one row per device. Compares this process's rows, and gathers
    every process's (``multihost_utils.process_allgather``) when there are several, so the
    program itself holds no collective for the check."""
    rows = np.concatenate([np.asarray(s.data).reshape(-1, per_device.shape[-1])
                           for s in per_device.addressable_shards])
    if jax.process_count() > 1:
        rows = np.asarray(multihost_utils.process_allgather(rows)).reshape(-1, rows.shape[-1])
    return (rows != rows[:1]).any(axis=0)
