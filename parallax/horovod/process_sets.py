"""Horovod's process sets: collectives over a subset of the ranks.

``hvd.add_process_set([0, 1])`` registers a set of ranks and returns a :class:`ProcessSet`;
every collective takes ``process_set=`` (default :data:`global_process_set`, every rank).
``hvd.remove_process_set(ps)`` unregisters it. As in Horovod, a set must be registered
before use, the same ranks cannot be registered twice, and the global set cannot be removed.

Where it runs decides how a subset is reached:

- inside ``@hvd.jit`` (one program over every rank) a collective on a set is XLA's
  collective with ``replica_groups``: ``lax.psum(..., axis_index_groups=[members, [r], ...])``
  (the members in one group, every other rank alone), so the compiled all-reduce names the
  set's devices. Every rank runs the same program, so a rank outside the set cannot be left
  out: it gets its own value back (as Horovod's TensorFlow ``DistributedOptimizer`` does for
  non-members, ``_allreduce_cond`` in horovod/tensorflow/__init__.py), for allgather the
  set's gather (the only result of the members' shape). Ops whose grouped form XLA lacks
  (Product, an allgather, an alltoall) gather over the whole axis and pick the members'
  rows: the traffic of the whole axis, the result of the set.
- eagerly (process-local values) a process's value stands for each of its ranks in the set
  (:mod:`parallax.horovod.ranks`). The eager program spans every process (JAX's
  multi-controller rule: every process runs each program), so every process of the job makes
  the call, and a process holding none of the set's ranks takes part with no weight and gets
  its own value back (allgather: the set's gather). In Horovod only the members call, and a
  non-member's call is an error: so do the eager ``alltoall`` and
  ``DistributedOptimizer(process_set=)``, whose programs span the members' processes only
  (:mod:`parallax.horovod.eager`; a non-member's ``alltoall`` raises, its optimizer
  steps with its own gradient and makes no call).

Example:
  >>> import numpy as np, parallax.horovod as hvd
  >>> evens = hvd.add_process_set([0, 2, 4, 6])
  >>> evens.size(), evens.included()
  (4, True)
  >>> float(hvd.allreduce(np.float32(1.0), op=hvd.Sum, process_set=evens))
  4.0
  >>> hvd.remove_process_set(evens)
  True

References:
  Horovod's horovod/common/process_sets.py (``ProcessSet``, ``add_process_set``,
  ``remove_process_set``, ``global_process_set``) and the ``process_set=`` argument of
  horovod/torch/mpi_ops.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from parallax.horovod.ranks import per_process, size


class ProcessSet:
    """A set of Horovod ranks (``None``: every rank, the global set).

    Args:
      ranks: the ranks (one per device), in any order; kept sorted.

    Example:
      >>> import parallax.horovod as hvd
      >>> hvd.ProcessSet([3, 1]).ranks
      [1, 3]
    """

    def __init__(self, ranks: Sequence[int] | None = None):
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        self.process_set_id: int | None = None

    def _members(self) -> list[int]:
        return list(range(size())) if self.ranks is None else self.ranks

    def size(self) -> int:
        """The number of ranks in the set."""
        return len(self._members())

    def included(self) -> bool:
        """True if this process holds at least one of the set's ranks."""
        first = jax.process_index() * per_process()
        return any(first <= r < first + per_process() for r in self._members())

    def rank(self):
        """This rank's index in the set: inside ``@hvd.jit`` each device's own (-1 outside the
        set), outside this process's first rank in the set (None if it holds none)."""
        from parallax.horovod.ranks import AXIS, _in_program
        members = self._members()
        if _in_program():
            me = lax.axis_index(AXIS)
            table = jnp.full((size(),), -1, jnp.int32).at[jnp.asarray(members)].set(
                jnp.arange(len(members), dtype=jnp.int32))
            return table[me]
        first = jax.process_index() * per_process()
        mine = [i for i, r in enumerate(members) if first <= r < first + per_process()]
        return mine[0] if mine else None

    def __eq__(self, other) -> bool:
        return isinstance(other, ProcessSet) and self.ranks == other.ranks

    def __hash__(self) -> int:
        return hash(None if self.ranks is None else tuple(self.ranks))

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet(None)
global_process_set.process_set_id = 0

# The job's table of registered sets by id (Horovod keeps it in its C++ runtime).
_REGISTERED: dict[int, ProcessSet] = {0: global_process_set}


def _check_ranks(api: str, ranks) -> list[int]:
    ranks = list(ranks)
    bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int)
           or not 0 <= r < size()]
    if not ranks or bad or len(set(ranks)) != len(ranks):
        raise ValueError(f"{api}: ranks={ranks!r} must be distinct ranks of this job "
                         f"(0 .. {size() - 1}: one rank per device), at least one.")
    return sorted(ranks)


def add_process_set(process_set) -> ProcessSet:
    """Registers a set of ranks (a :class:`ProcessSet` or a list of ranks) and returns it.

    Example:
      >>> import parallax.horovod as hvd
      >>> ps = hvd.add_process_set([0, 1]); ps.process_set_id > 0
      True
      >>> _ = hvd.remove_process_set(ps)
    """
    api = "hvd.add_process_set"
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None:
        raise ValueError(f"{api}: the global process set is always registered.")
    ps.ranks = _check_ranks(api, ps.ranks)
    for other in _REGISTERED.values():
        if other._members() == ps.ranks:
            raise ValueError(f"{api}: a process set with ranks {ps.ranks} is already "
                             f"registered ({other!r}); reuse it.")
    ps.process_set_id = max(_REGISTERED) + 1
    _REGISTERED[ps.process_set_id] = ps
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregisters ``process_set``; False if it was not registered (or is the global set).

    Example:
      >>> import parallax.horovod as hvd
      >>> hvd.remove_process_set(hvd.global_process_set)
      False
    """
    pid = getattr(process_set, "process_set_id", None)
    if not pid or _REGISTERED.get(pid) is not process_set:
        return False
    del _REGISTERED[pid]
    process_set.process_set_id = None
    return True


def members(api: str, process_set) -> tuple[int, ...] | None:
    """The set's ranks (None for every rank), checked to be a registered :class:`ProcessSet`."""
    if process_set is None or process_set is global_process_set:
        return None
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"{api}: process_set={process_set!r} is not an hvd.ProcessSet "
                        "(hvd.add_process_set([ranks]) returns one).")
    if process_set.process_set_id is None or _REGISTERED.get(
            process_set.process_set_id) is not process_set:
        raise ValueError(f"{api}: {process_set!r} is not registered; pass it to "
                         "hvd.add_process_set first (it may have been removed).")
    ranks = tuple(process_set._members())
    if ranks[-1] >= size():
        raise ValueError(f"{api}: {process_set!r} names ranks beyond this job's {size()}.")
    return None if len(ranks) == size() else ranks


def eager_counts(ranks: tuple[int, ...] | None) -> tuple[int, ...]:
    """How many of the set's ranks each process holds (0 for a process outside the set)."""
    k, processes = per_process(), jax.process_count()
    if ranks is None:
        return (k,) * processes
    return tuple(sum(p * k <= r < (p + 1) * k for r in ranks) for p in range(processes))


def groups(ranks: tuple[int, ...], n: int) -> list[list[int]]:
    """``axis_index_groups``: the set in one group, every other rank alone."""
    return [list(ranks)] + [[r] for r in range(n) if r not in ranks]


def is_member(ranks: tuple[int, ...], axis_name: str):
    """Traced: whether this device's rank is in the set."""
    return jnp.isin(lax.axis_index(axis_name), jnp.asarray(ranks))


def position(ranks: tuple[int, ...], axis_name: str, n: int):
    """Traced: this device's index in the set (0 for non-members)."""
    table = jnp.zeros((n,), jnp.int32).at[jnp.asarray(ranks)].set(
        jnp.arange(len(ranks), dtype=jnp.int32))
    return table[lax.axis_index(axis_name)]


def gather_members(x, ranks: tuple[int, ...], axis_name: str):
    """``[len(ranks), *x.shape]``: every member's ``x`` (one all-gather over the whole axis)."""
    every = lax.all_gather(x, axis_name, axis=0, tiled=False)
    return every[jnp.asarray(ranks)]
