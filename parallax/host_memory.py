"""Training state held in host memory between steps (ZeRO-Offload), moved inside a step.

JAX types every value with a memory space and refuses to mix the two in one operation, so
a leaf that ``px.ZeRO(..., offload=...)`` keeps in ``pinned_host`` memory is copied to
device memory before the step computes with it, and back after:

- ``px.train_step`` calls :func:`to_device` on the state it is given, before the user's
  step sees it. For a ``px.TrainState`` it leaves the optimizer state in host memory:
  ``TrainState.apply_gradients`` fetches it with ``after=grads``, so that no copy of it can
  start before the gradients exist (XLA's scheduler moves a copy as early as its operand
  allows; without the barrier the whole optimizer state could be back on the device during
  the backward pass, where the activations peak).
- After the step, ``px.train_step`` calls :func:`to_host` with the strategy's layout, which
  copies back every leaf whose sharding names host memory.

Each is one ``jax.device_put`` per leaf inside the trace: one host-to-device and one
device-to-host copy per offloaded leaf in the compiled program (``annotate_device_placement``
in a GPU or TPU lowering; the CPU backend, whose host and device memories are one, lowers
them to nothing and keeps the ``S(5)`` host memory space on the arguments and results).
Outside a trace neither is needed: ``px.init``, ``px.shard`` and ``px.checkpoint.restore``
place leaves in host memory through their shardings.

Example:
  >>> import jax, jax.numpy as jnp
  >>> host = jax.device_put(jnp.ones(4), jax.memory.Space.Host)
  >>> on_host(host)
  True
  >>> jax.jit(lambda x: to_device(x) * 2)(host).sharding.memory_kind
  'device'

References:
  Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC 2021
  (state on the host, moved around the update); the JAX guide "Memories and host
  offloading" (``jax.device_put`` with memory kinds inside ``jax.jit``).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

HOST = "pinned_host"


def on_host(x) -> bool:
    """Whether ``x`` (an array or a tracer) is typed as host memory."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def to_device(tree, after=None):
    """``tree`` with every leaf held in host memory copied to device memory.

    Args:
      tree: a pytree of arrays (or tracers).
      after: optional pytree of values the copies must wait for (the gradients): an
        ``optimization_barrier`` ties the host leaves to them, so no copy starts earlier.

    Returns:
      ``tree``, its host leaves replaced by device copies (``tree`` itself when none is on
      the host: nothing is added to the program).
    """
    leaves, treedef = jax.tree.flatten(tree)
    hosted = [i for i, x in enumerate(leaves) if on_host(x)]
    if not hosted:
        return tree
    moving = [leaves[i] for i in hosted]
    if after is not None:
        _, moving = jax.lax.optimization_barrier((after, moving))
    for i, x in zip(hosted, moving):
        leaves[i] = jax.device_put(x, jax.memory.Space.Device)
    return jax.tree.unflatten(treedef, leaves)


def to_host(tree, shardings):
    """``tree`` with every leaf whose sharding (in a tree like ``tree``) names host memory
    copied there; the others as they are."""
    def place(x, sharding: NamedSharding):
        return jax.device_put(x, jax.memory.Space.Host) if sharding.memory_kind == HOST else x

    return jax.tree.map(place, tree, shardings)
