"""Horovod's broadcasts of state: parameters, optimizer state, any Python object (and
``allgather_object``: every rank's object).

Processes that start from different seeds (or a restarted process) train one model once
every process holds rank 0's parameters and optimizer state; these are
``px.distributed.broadcast`` under Horovod's names. ``root_rank`` is a Horovod rank (one per
device, :mod:`parallax.horovod.ranks`): the process holding it sends.
"""

from __future__ import annotations

import pickle

import jax
import numpy as np

from parallax.distributed import broadcasting
from parallax.horovod.ranks import owner


def broadcast(tree, root_rank: int, api: str = "hvd.broadcast_parameters"):
    """``px.distributed.broadcast`` from the process holding rank ``root_rank``."""
    return broadcasting.broadcast(tree, owner(api, root_rank))


def broadcast_parameters(params, root_rank: int = 0):
    """Every process's ``params`` become ``root_rank``'s (returned: JAX arrays are values).

    Args:
      params: a pytree (numpy, process-local or global ``jax.Array`` s, e.g. a
        ``px.TrainState`` from ``px.init``).
      root_rank: the rank whose values win (its process sends).

    Returns:
      The tree with root's values, each leaf keeping its kind and sharding.

    Example:
      >>> import numpy as np, parallax.horovod as hvd
      >>> hvd.broadcast_parameters({"w": np.zeros(2)})["w"]
      array([0., 0.])

    References:
      Horovod ``broadcast_parameters``; PyTorch DDP's broadcast of the module state.
    """
    return broadcast(params, root_rank)


def broadcast_optimizer_state(opt_state, root_rank: int = 0):
    """Every process's optimizer state becomes ``root_rank``'s.

    Example:
      >>> import jax.numpy as jnp, optax, parallax.horovod as hvd
      >>> state = hvd.broadcast_optimizer_state(optax.adam(1e-3).init({"w": jnp.ones(2)}))

    References:
      Horovod ``broadcast_optimizer_state``.
    """
    return broadcast(opt_state, root_rank, "hvd.broadcast_optimizer_state")


def broadcast_object(obj, root_rank: int = 0):
    """Any picklable object from ``root_rank`` to every process (Horovod's ``broadcast_object``).

    Example:
      >>> import parallax.horovod as hvd
      >>> hvd.broadcast_object({"epoch": 3})
      {'epoch': 3}

    References:
      Horovod ``broadcast_object``.
    """
    root = owner("hvd.broadcast_object", root_rank)
    if jax.process_count() == 1:
        return obj
    data = np.frombuffer(pickle.dumps(obj), np.uint8) if jax.process_index() == root else \
        np.zeros(0, np.uint8)
    size = int(broadcasting.broadcast(np.int64(data.size), root))
    buffer = np.zeros(size, np.uint8)
    if jax.process_index() == root:
        buffer[:] = data
    return pickle.loads(broadcasting.broadcast(buffer, root).tobytes())


def allgather_object(obj, name=None, process_set=None) -> list:
    """Every rank's picklable ``obj``, in rank order (Horovod's ``allgather_object``).

    A process holding K ranks contributes its object once per rank (as ``hvd.allgather``).

    Example:
      >>> import parallax.horovod as hvd
      >>> objs = hvd.allgather_object({"rank": hvd.rank()})
      >>> len(objs) == hvd.size(), objs[0]
      (True, {'rank': 0})

    References:
      Horovod ``allgather_object`` (horovod/torch/functions.py: pickled, sizes gathered, then
      the bytes).
    """
    from parallax.horovod.collectives import allgather
    from parallax.horovod.process_sets import global_process_set
    process_set = global_process_set if process_set is None else process_set
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = allgather(np.array([data.size], np.int64), name, process_set)
    every = allgather(data, name, process_set)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    return [pickle.loads(every[starts[i]:starts[i + 1]].tobytes()) for i in range(len(sizes))]
