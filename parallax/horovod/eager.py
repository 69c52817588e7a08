"""Horovod's collectives on process-local values: one jitted program over the processes' rows.

Each process's value becomes its row of a global ``[processes, ...]`` array
(:mod:`parallax.distributed.local_arrays`) and one jitted program reduces, gathers or
selects rows; XLA runs the collective (gloo on CPU, NCCL on GPU). A process's row stands for
each of its ranks in the reduction (``counts``: how many of the ranks taking part each
process holds, :mod:`parallax.horovod.process_sets`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from parallax.distributed import local_arrays
from parallax.horovod.adasum import adasum_stack
from parallax.horovod.ops import ReduceOp


@functools.cache
def program(kind: str, *static):
    """One jitted program per kind and static arguments (jit caches by function identity)."""
    if kind == "reduce":
        fn = functools.partial(reduce_rows, op=static[0], wide=static[1], counts=static[2])
    elif kind == "pick":
        fn = functools.partial(_pick, root=static[0])
    else:
        fn = _gather
    return jax.jit(fn, out_shardings=local_arrays.replicated())


def _pick(rows, root: int):
    return rows[root]


def _gather(rows):
    return rows


def run(prog, value, out_like):
    """Runs ``prog`` on the processes' rows of ``value``; returns this process's copy."""
    out = prog(local_arrays.stack(value))
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


def gather_bytes(value: np.ndarray) -> np.ndarray:
    """Every process's ``value`` (same shape), exactly: ``[processes, *value.shape]``."""
    every = run(program("gather"), local_arrays.as_bytes(value), out_like=np.zeros(0))
    return local_arrays.from_bytes(every, value.dtype, (jax.process_count(),) + value.shape)


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

