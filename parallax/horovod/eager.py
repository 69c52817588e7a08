"""Horovod's collectives on process-local values: one jitted program over the processes' rows.

Each process taking part puts its value in its row of a ``[processes, ...]`` array laid out
on those processes' devices (axes ``process`` x ``local``), and one jitted program reduces,
gathers, selects or exchanges rows; XLA runs the collective (gloo on CPU, NCCL on GPU). The
processes are a :class:`~parallax.horovod.ProcessSet`'s, or every process (the global set:
the rows of :mod:`parallax.distributed.local_arrays`' process mesh).

A jitted program whose devices belong to some processes is run by those processes alone
(JAX's multi-controller rule asks every process *holding a device of the program* to run
it), and XLA's collectives connect only them. So an eager collective over a set's members
(``alltoall``, ``DistributedOptimizer(process_set=)``) is called by the members only, as
in Horovod, where a non-member's call is an error. The reductions of ``allreduce`` and
``broadcast`` span every process instead, a process's row standing for each of its ranks
taking part (``counts``: how many each process holds, :mod:`parallax.horovod.process_sets`;
0 outside the set).

Example:
  >>> import numpy as np
  >>> gather_bytes(np.arange(3.0))                          # one process: its own row
  array([[0., 1., 2.]])
  >>> ones = np.ones(2, np.float32)                          # a row standing for 2 ranks
  >>> run(program("reduce", ReduceOp.Sum, np.float32, (2,)), ones, out_like=ones)
  array([2., 2.], dtype=float32)

References:
  Horovod's process sets (horovod/common/process_sets.py; operations.cc refuses a
  non-member's call: "Rank ... is not a member of the provided process set").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from parallax.distributed import local_arrays
from parallax.distributed.local_arrays import LOCAL, PROCESS
from parallax.horovod.adasum import adasum_stack
from parallax.horovod.ops import ReduceOp


def members_mesh(processes: tuple[int, ...] | None = None) -> Mesh:
    """The mesh ``process`` x ``local`` over the devices of ``processes`` (in that order);
    None, or every process in order, is the global set: the process mesh."""
    if processes is None or processes == tuple(range(jax.process_count())):
        return local_arrays.process_mesh()
    return _subset_mesh(processes)


def _or_global(mesh: Mesh | None) -> Mesh:
    return members_mesh() if mesh is None else mesh


@functools.cache
def _subset_mesh(processes: tuple[int, ...]) -> Mesh:
    by_process = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
                  for p in processes]
    return Mesh(np.array(by_process, dtype=object), (PROCESS, LOCAL),
                axis_types=(AxisType.Auto, AxisType.Auto))


def stack(x, mesh: Mesh | None = None) -> jax.Array:
    """This process's ``x`` as its row of a ``[processes, *x.shape]`` array on ``mesh``
    (None: every process's)."""
    sharding = NamedSharding(_or_global(mesh), PartitionSpec(PROCESS))
    return jax.make_array_from_process_local_data(sharding, np.asarray(x)[None])


def jit(fn, mesh: Mesh | None = None):
    """``fn`` over rows, jitted so that every process of ``mesh`` (None: every process)
    holds its whole result."""
    return jax.jit(fn, out_shardings=NamedSharding(_or_global(mesh), PartitionSpec()))


@functools.cache
def program(kind: str, *static, mesh: Mesh | None = None):
    """One jitted program per kind, static arguments and mesh (jit caches by function
    identity): ``reduce`` (op, wide dtype, counts), ``pick`` (root row), ``gather``, and
    ``exchange`` (rows ``[source, destination, ...]`` to ``[destination, source, ...]``,
    row ``d`` on member ``d``)."""
    if kind == "exchange":
        return jax.jit(lambda rows: jnp.swapaxes(rows, 0, 1),
                       out_shardings=NamedSharding(_or_global(mesh), PartitionSpec(PROCESS)))
    if kind == "reduce":
        fn = functools.partial(reduce_rows, op=static[0], wide=static[1], counts=static[2])
    elif kind == "pick":
        fn = functools.partial(_pick, root=static[0])
    else:
        fn = _gather
    return jit(fn, mesh)


def _pick(rows, root: int):
    return rows[root]


def _gather(rows):
    return rows


def run(prog, value, out_like, mesh: Mesh | None = None):
    """Runs ``prog`` on the rows of ``value`` (on ``mesh``; None: every process's); returns
    this process's copy, in the kind of ``out_like``."""
    out = prog(stack(value, mesh))
    return local_arrays.like(local_arrays.local_copy(out), out_like)


def repeat_rows(rows, counts: tuple[int, ...]):
    """Row ``p`` repeated ``counts[p]`` times: one row per rank taking part."""
    if all(c == 1 for c in counts):
        return rows
    return jnp.repeat(rows, np.asarray(counts), axis=0, total_repeat_length=sum(counts))


def reduce_rows(rows, op: ReduceOp, wide, counts: tuple[int, ...]):
    """Reduces ``[processes, ...]`` over the ranks taking part (``counts`` per process)."""
    rows = repeat_rows(rows.astype(wide), counts)
    if op in (ReduceOp.Sum, ReduceOp.Average):
        total = jnp.sum(rows, axis=0)
        return total / rows.shape[0] if op is ReduceOp.Average else total
    if op is ReduceOp.Adasum:
        return adasum_stack(rows)
    return {ReduceOp.Min: jnp.min, ReduceOp.Max: jnp.max, ReduceOp.Product: jnp.prod}[op](
        rows, axis=0)


def gather_bytes(value, mesh: Mesh | None = None) -> np.ndarray:
    """Every process's ``value`` (same shape on each; the processes of ``mesh``, None: every
    one), exactly: ``[processes, *value.shape]``."""
    value = np.asarray(value)
    every = run(program("gather", mesh=mesh), local_arrays.as_bytes(value),
                out_like=np.zeros(0), mesh=mesh)
    rows = _or_global(mesh).shape[PROCESS]
    return local_arrays.from_bytes(every, value.dtype, (rows,) + value.shape)


def exchange(chunks: np.ndarray, mesh: Mesh) -> np.ndarray:
    """``chunks[j]`` goes to member ``j`` of ``mesh``; returns ``[members, ...]``, row ``s``
    from member ``s``."""
    out = program("exchange", mesh=mesh)(stack(local_arrays.as_bytes(chunks), mesh))
    return local_arrays.from_bytes(local_arrays.local_copy(out)[0], chunks.dtype, chunks.shape)


def reduce_on_host(api: str, sent: np.ndarray, op: ReduceOp, wide,
                   counts: tuple[int, ...]) -> np.ndarray:
    """Reduces 64-bit values that JAX would compute in 32 bits: gather bytes, reduce in numpy."""
    if op is ReduceOp.Adasum:
        raise TypeError(f"{api}: hvd.Adasum of a {sent.dtype} tensor needs jax_enable_x64 on "
                        "every process (or pass float32).")
    every = np.repeat(gather_bytes(sent).astype(wide), counts, axis=0)  # one row per rank
    reduce = {ReduceOp.Sum: np.sum, ReduceOp.Average: np.mean, ReduceOp.Min: np.min,
              ReduceOp.Max: np.max, ReduceOp.Product: np.prod}[op]
    return reduce(every, axis=0)
