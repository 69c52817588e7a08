"""Horovod's ranks in parallax: one rank per device (Horovod's one rank per accelerator).

``@hvd.jit`` runs a step on every device of every process, and its collectives and
``DistributedOptimizer`` reduce over those devices; so a rank is a device everywhere:
``size()`` is the number of devices, ``rank()`` a device's index on ``hvd.mesh()``, and
Horovod's recipes (``lr * hvd.size()``, ``dataset.shard(hvd.size(), hvd.rank())``) keep their
meaning. With one device per process (Horovod's own setup) a rank is a process.

Inside ``@hvd.jit`` (a program binding the Horovod axis) ``rank()`` and ``local_rank()`` are
each device's own (traced) numbers. Outside, a process holding K ranks answers for its first:
``rank()`` is the index of its first device, so ``hvd.rank() == 0`` is still the one process
that logs and saves. Outside a program a process's value stands for each of its ranks (as a
replicated argument of ``@hvd.jit`` does): an eager ``hvd.allreduce(x, op=hvd.Sum)`` counts it
K times.

Example:
  >>> import jax, parallax.horovod as hvd
  >>> hvd.size() == jax.device_count(), hvd.rank()
  (True, 0)

References:
  Horovod's ``hvd.rank()``, ``hvd.size()``, ``hvd.local_rank()``, ``hvd.local_size()``,
  ``hvd.cross_rank()``, ``hvd.cross_size()``, ``hvd.is_homogeneous()``
  (horovod/common/basics.py): one process per GPU, so one rank per accelerator.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax import lax

from parallax.comm import checks
from parallax.distributed import runtime

AXIS = "data"  # the mesh axis of @hvd.jit: every device of every process


def per_process() -> int:
    """Ranks each process holds: its devices (the same on every process)."""
    return jax.local_device_count()


def _in_program() -> bool:
    return AXIS in checks.available_axes()


def size() -> int:
    """The number of ranks: every device of every process.

    Example:
      >>> import jax, parallax.horovod as hvd
      >>> hvd.size() == jax.device_count()
      True
    """
    return jax.device_count()


def rank():
    """This rank's index: inside ``@hvd.jit`` each device's own, outside this process's first.

    Example:
      >>> import parallax.horovod as hvd
      >>> hvd.rank()
      0
    """
    if _in_program():
        return lax.axis_index(AXIS)
    return runtime.rank() * per_process()


def local_size() -> int:
    """The ranks on this host: its processes' devices.

    Example:
      >>> import jax, parallax.horovod as hvd
      >>> hvd.local_size() == jax.local_device_count()
      True
    """
    return runtime.local_size() * per_process()


def local_rank():
    """This rank's index on its host (inside ``@hvd.jit`` each device's own).

    Example:
      >>> import parallax.horovod as hvd
      >>> hvd.local_rank()
      0
    """
    first = runtime.local_rank() * per_process()
    if _in_program():
        return first + lax.axis_index(AXIS) % per_process()
    return first


def owner(api: str, root_rank: int) -> int:
    """The process holding ``root_rank`` (checked against :func:`size`)."""
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not (
            0 <= root_rank < size()):
        raise ValueError(f"{api}: root_rank={root_rank!r} is not a rank of this job "
                         f"(0 .. {size() - 1}: one rank per device).")
    return root_rank // per_process()


def _env_int(names: tuple[str, ...]) -> int | None:
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def cross_size() -> int:
    """The number of nodes (Horovod: the ranks sharing this rank's local rank, one per node).

    From ``parallax launch``'s ``PARALLAX_NUM_NODES`` (or horovodrun's ``HOROVOD_CROSS_SIZE``),
    else the processes over the processes per host.

    Example:
      >>> import parallax.horovod as hvd
      >>> hvd.cross_size()
      1
    """
    nodes = _env_int(("PARALLAX_NUM_NODES", "HOROVOD_CROSS_SIZE"))
    return nodes if nodes else max(1, runtime.size() // runtime.local_size())


def cross_rank() -> int:
    """This node's index (``PARALLAX_NODE_RANK`` or ``HOROVOD_CROSS_RANK``, else the process
    index over the processes per host: processes numbered node by node).

    Example:
      >>> import parallax.horovod as hvd
      >>> hvd.cross_rank()
      0
    """
    node = _env_int(("PARALLAX_NODE_RANK", "HOROVOD_CROSS_RANK"))
    return node if node is not None else runtime.rank() // runtime.local_size()


def is_homogeneous() -> bool:
    """True when every node holds the same number of ranks (checked across processes).

    Example:
      >>> import parallax.horovod as hvd
      >>> hvd.is_homogeneous()
      True
    """
    if jax.process_count() == 1:
        return True
    from jax.experimental import multihost_utils
    sizes = np.asarray(multihost_utils.process_allgather(np.int64(local_size())))
    return bool((sizes == sizes.reshape(-1)[0]).all())
