"""``hvd.join()``: uneven data across processes, as Horovod's join.

A process that runs out of data calls ``hvd.join()``; until every process has joined, it
keeps taking part in the others' ``hvd.allreduce`` / ``hvd.grouped_allreduce`` calls with
zeros (so their sums and averages count it as zero, divided by ``size()`` as in Horovod),
and ``join`` returns the rank that joined last.

How: in a job of several processes every eager allreduce first exchanges a small header
(one ``process_allgather`` of a few integers: joined or not, the op, dtype and shape).
A joined process loops on that header: while some process is still active it runs the same
reduction program with zeros of the announced shape; once every header says "joined", all
leave. The header is one extra small collective per eager allreduce (none in one process).

What differs from Horovod, and why:

- Eager only, and refused inside ``@hvd.jit`` (``ValueError``). Join's defining act, a rank
  leaving the collectives while the others go on, has no SPMD form: one program is a fixed
  sequence of collectives that every rank runs. A per-rank ``active`` flag gives join's
  *numbers* (``hvd.allreduce(grad * active)``: the zeros of the ranks without data, divided
  by ``size()``; the last rank with data: ``hvd.allreduce(jnp.where(active, hvd.rank(),
  -1), op=hvd.Max)``, tested against eager join's numbers in tests/horovod/test_basics.py),
  but an ``hvd.join(active=)`` would have to change what every later ``hvd.allreduce`` of the
  trace means, so the flag stays explicit in the step.
- While a process has joined, the others may call ``hvd.allreduce``,
  ``hvd.grouped_allreduce`` and the eager ``DistributedOptimizer.update`` (Average or Sum; its
  gradients travel as one flat buffer per dtype through ``hvd.allreduce``'s program) on the
  global process set only (Horovod's join also covers allreduce only, in its PyTorch API);
  another collective then raises on the joined process.
- The unit is a process: with K devices per process, a process joins for its K ranks, and
  ``join`` returns the first rank of the process that joined last (ties: the highest).

Example:
  >>> import parallax.horovod as hvd
  >>> hvd.join()   # one process: nothing to wait for
  0

References:
  Horovod ``hvd.join()`` (horovod/torch/mpi_ops.py: "All ranks that did not call join()
  continue to process allreduce operations ... Returns: Id of the rank that joined last").
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

from parallax.comm import checks
from parallax.horovod import eager
from parallax.horovod.ops import ReduceOp
from parallax.horovod.ranks import AXIS, per_process
from parallax.horovod.timeline import scoped

OPS = tuple(ReduceOp)
DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64", "int16", "int8",
          "uint8", "uint32", "bool")
HEADER = 8 + 8  # joined, joined at, op, wire dtype, accumulate dtype, global set, counts, ndim; dims

# This process's count of header rounds (every process runs each round: the counts agree).
_ROUNDS = [0]


def _exchange(own: np.ndarray) -> np.ndarray:
    _ROUNDS[0] += 1
    return np.asarray(multihost_utils.process_allgather(own)).reshape(jax.process_count(), -1)


def announce(api: str, op: ReduceOp, sent: np.ndarray, wide, counts, followable: bool) -> None:
    """An active process's header before an eager reduction (multi-process jobs only)."""
    if jax.process_count() == 1:
        return
    names = (str(np.dtype(sent.dtype)), str(np.dtype(wide)))
    followable = followable and all(n in DTYPES for n in names) and len(sent.shape) <= 8
    own = np.zeros(HEADER, np.int64)
    own[2] = OPS.index(op)
    own[3:5] = [DTYPES.index(n) if n in DTYPES else -1 for n in names]
    own[5] = int(followable and all(c == per_process() for c in counts))
    own[6] = counts[jax.process_index()]
    if followable:
        own[7] = len(sent.shape)
        own[8:8 + len(sent.shape)] = sent.shape
    _exchange(own)


@scoped("join")
def join(device: int = -1) -> int:
    """Marks this process as out of data; takes part in the others' allreduces with zeros
    until every process has joined, then returns the rank that joined last.

    Args:
      device: Horovod's device for the zero tensors; accepted and ignored.

    Returns:
      The Horovod rank (first rank of its process) that joined last.
    """
    del device
    if AXIS in checks.available_axes():
        raise ValueError(
            "hvd.join: called inside a program over the Horovod axis; every rank runs every "
            "step of one SPMD program, so none can leave early. Eagerly: run the steps outside "
            "@hvd.jit (tx.update of hvd.DistributedOptimizer, hvd.allreduce or "
            "hvd.grouped_allreduce on this process's gradients) and call hvd.join() after its "
            "last batch. Inside @hvd.jit: pass each rank an active flag (0 without data) and "
            "reduce hvd.allreduce(grad * active) (join's zeros, divided by hvd.size()); the "
            "last rank with data is hvd.allreduce(jnp.where(active, hvd.rank(), -1), "
            "op=hvd.Max).")
    if jax.process_count() == 1:
        return 0
    joined_at = _ROUNDS[0]
    while True:
        own = np.zeros(HEADER, np.int64)
        own[0], own[1] = 1, joined_at
        headers = _exchange(own)
        active = [h for h in headers if h[0] == 0]
        if not active:
            last = max(range(len(headers)), key=lambda p: (headers[p, 1], p))
            return last * per_process()
        _follow(active[0])


def _follow(header: np.ndarray) -> None:
    """Runs the reduction an active process announced, with zeros."""
    if header[5] != 1 or header[3] < 0 or header[4] < 0:
        raise ValueError(
            "hvd.join: this process has joined, and another called a collective it cannot "
            "take part in with zeros (only hvd.allreduce / hvd.grouped_allreduce on the "
            "global process set, of the dtypes " + ", ".join(DTYPES) + ").")
    op, wire, wide = OPS[header[2]], np.dtype(DTYPES[header[3]]), np.dtype(DTYPES[header[4]])
    shape = tuple(int(d) for d in header[8:8 + header[7]])
    counts = (per_process(),) * jax.process_count()
    zeros = np.zeros(shape, wire)
    eager.run(eager.program("reduce", op, wide, counts), zeros, out_like=zeros)
