"""``hvd.DistributedOptimizer``: an optax transformation that averages gradients over ranks.

It wraps any optax optimizer. Its ``update`` first reduces the gradients over the
data-parallel ranks, then calls the wrapped optimizer, which therefore sees exactly the
gradient of the global batch. Where it runs decides how it reduces:

- inside ``@hvd.jit`` (or any ``shard_map`` binding its ``axis_name``): per device, with
  ``parallax.comm.bucketed_all_reduce`` (Horovod's fusion buffer: flat buckets of
  ``fusion_bytes``, one all-reduce each; with ``algorithm="tree" | "ring" | "auto"`` each
  bucket is summed by ``parallax.comm``'s point-to-point exchanges instead of XLA's
  all-reduce, which is faster on CPU clusters over gloo: see ``docs/distributed.md``), or
  Adasum's pairwise rounds;
- eagerly, on process-local gradients: one flat buffer per dtype (Horovod's fusion buffer)
  reduced by ``hvd.allreduce``'s program over the processes' rows, each standing for the
  process's K ranks (one per device, :mod:`parallax.horovod.ranks`); a process that called
  ``hvd.join()`` follows it with zeros;
- with ``process_set=``, over the set's ranks only (:mod:`parallax.horovod.optimizer_sets`);
- inside ``px.train_step``: the strategy (``px.DataParallel``, ZeRO, ...) has already
  averaged the gradients over the batch axes, so only the local accumulation below applies.

``backward_passes_per_step=k`` accumulates ``k`` calls' gradients locally (summed, as in
Horovod) and synchronises and applies once per step; when a step happens, after ``k``
passes (Horovod's TensorFlow optimizer) or when ``update(..., step=True)`` says so
(Horovod's torch ``step()``), is :mod:`parallax.horovod.passes`. ``gradient_predivide_factor=f``
divides by ``f`` before the sum and by ``size/f`` after (with ``op=hvd.Average`` only), to
keep fp16 sums in range.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from parallax import comm, context
from parallax.comm import checks
from parallax.distributed import local_arrays
from parallax.horovod import eager, gradient_groups, optimizer_sets, passes
from parallax.horovod import process_sets as sets
from parallax.horovod.adasum import adasum_all_reduce, adasum_stack
from parallax.horovod.collectives import AXIS, eager_reduce
from parallax.horovod.per_rank import PerRank
from parallax.horovod.process_sets import global_process_set
from parallax.horovod.ranks import per_process
from parallax.horovod.ops import Compression, ReduceOp, check_compression, check_op
from parallax.strategies.sync import SYNC_ALGORITHMS

API = "hvd.DistributedOptimizer"
FUSION_BYTES = 64 * 2**20  # Horovod's HOROVOD_FUSION_THRESHOLD default


class DistributedOptimizerState(NamedTuple):
    """State of :func:`DistributedOptimizer`.

    Attributes:
      inner: the wrapped optimizer's state.
      accumulated: this rank's sum of gradients since the last sync (like the parameters,
        in a :class:`~parallax.horovod.per_rank.PerRank`: each rank keeps its own), or ``()``
        when ``backward_passes_per_step == 1``.
      count: calls since the last sync, int32 scalar.
    """

    inner: Any
    accumulated: Any
    count: jax.Array


def _mode(grads, axis_name: str) -> str:
    if axis_name in checks.available_axes():
        return "program"
    if context.current() is not None:
        return "strategy"
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(grads)):
        raise ValueError(
            f"{API}: update was traced where the Horovod axis {axis_name!r} is not bound "
            "(inside a plain jax.jit each process runs alone). Run the step with @hvd.jit "
            "(one program over every device), inside px.train_step with a data-parallel "
            "strategy, or call update outside jit on process-local gradients.")
    return "eager"


def _reduce(grads, mode: str, op: ReduceOp, wire, predivide: float, fusion_bytes: int,
            axis_name: str, algorithm: str, groups=None, ranks=None):
    """The gradients reduced over the ranks (or the process set ``ranks``) as ``op`` says."""
    if mode == "strategy" and ranks is not None:
        raise ValueError(
            f"{API}: process_set= inside px.train_step, whose strategy has already averaged "
            "the gradients over every rank of its batch axes; run the step with @hvd.jit "
            "(the set's replica groups) or call update eagerly.")
    if mode == "strategy" or (mode == "eager" and jax.device_count() == 1):
        return grads  # reduced by the strategy already, or one rank
    if ranks is not None:
        return optimizer_sets.reduce(grads, mode, op, wire, predivide, fusion_bytes,
                                     axis_name, groups, ranks)
    # eagerly a process's gradient stands for each of its K ranks (parallax.horovod.ranks)
    leaves, treedef = jax.tree.flatten(grads)
    if op is ReduceOp.Adasum:
        rounded = [g.astype(wire.wire_dtype(g.dtype)).astype(g.dtype) for g in leaves]
        if mode == "program":
            return jax.tree.unflatten(treedef, adasum_all_reduce(rounded, axis_name))
        summed = _eager_adasum(rounded)
        return jax.tree.unflatten(treedef, summed)
    scaled = [g / predivide for g in leaves] if predivide != 1.0 else leaves
    if mode == "program":
        ranks = lax.axis_size(axis_name)
        if groups is None:
            summed = comm.bucketed_all_reduce(scaled, axis_name, bucket_bytes=fusion_bytes,
                                              op="sum", compression=wire, algorithm=algorithm)
        else:  # Horovod's explicit groups: one fused all-reduce each (per dtype)
            summed = list(scaled)
            for group in groups:
                out = comm.bucketed_all_reduce([scaled[i] for i in group], axis_name,
                                               bucket_bytes=None, op="sum", compression=wire,
                                               algorithm=algorithm)
                for i, o in zip(group, out):
                    summed[i] = o
    else:
        ranks = jax.device_count()
        summed = _eager_fused_sum(scaled, wire)
    if op is ReduceOp.Average:
        summed = [s * (predivide / ranks) for s in summed]
    return jax.tree.unflatten(treedef, summed)


def _adasum_rows(rows, copies):
    return [adasum_stack(jnp.repeat(r, copies, axis=0)) for r in rows]  # one row per rank


def _eager_fused_sum(leaves, wire) -> list:
    """Eagerly, every rank's sum of each leaf: one flat buffer per dtype (Horovod's fusion
    buffer) summed by ``hvd.allreduce``'s eager program, which announces it, so processes
    that called ``hvd.join()`` take part with zeros (:mod:`parallax.horovod.join`)."""
    counts = (per_process(),) * jax.process_count()
    by_dtype: dict = {}
    for i, g in enumerate(leaves):
        by_dtype.setdefault(np.dtype(g.dtype), []).append(i)
    out = list(leaves)
    for indices in by_dtype.values():
        flat = np.concatenate([np.asarray(leaves[i]).reshape(-1) for i in indices])
        total = np.asarray(eager_reduce(API, flat, ReduceOp.Sum, wire, counts))
        offset = 0
        for i in indices:
            size = int(np.size(leaves[i]))
            out[i] = jnp.asarray(total[offset:offset + size].reshape(np.shape(leaves[i])))
            offset += size
    return out


@functools.cache
def _adasum_program(copies: int):
    """The jitted Adasum of every process's rows (jit caches by function identity)."""
    return eager.jit(functools.partial(_adasum_rows, copies=copies))


def _eager_adasum(leaves):
    """Adasum of every process's rows of ``leaves`` (one program), as this process's arrays."""
    rows = [eager.stack(np.asarray(g)) for g in leaves]
    program = _adasum_program(per_process())
    return [jnp.asarray(local_arrays.local_copy(o)) for o in program(rows)]


def DistributedOptimizer(tx: optax.GradientTransformation, named_parameters=None,
                         compression=Compression.none, backward_passes_per_step: int = 1,
                         op=ReduceOp.Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0,
                         groups=None, process_set=global_process_set, *,
                         fusion_bytes: int = FUSION_BYTES, algorithm: str = "xla",
                         axis_name: str = AXIS) -> optax.GradientTransformation:
    """Wraps ``tx`` so that its updates use the gradients averaged over every rank.

    Args:
      tx: the optax optimizer to wrap.
      named_parameters: accepted for Horovod's signature (optax sees the whole tree).
      compression: ``hvd.Compression.none|fp16|bf16``: gradients travel in 16 bits.
      backward_passes_per_step: calls (backward passes) accumulated locally per step;
        their gradients are summed, as in Horovod and DDP's ``no_sync``. The ``k``-th call
        steps (Horovod's TensorFlow optimizer), or, with ``update(grads, state, params,
        step=True | False)``, the call that says so (Horovod's torch ``step()``: an early
        step applies the passes so far; :mod:`parallax.horovod.passes`).
      op: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum``.
      gradient_predivide_factor: split Average's division around the sum (Average only).
      average_aggregated_gradients: divide the ``backward_passes_per_step`` accumulated
        gradients by their number (Horovod TensorFlow's flag, default False: the sum).
      num_groups: split the gradients, in tree order, into this many groups, each one fused
        all-reduce inside a program (Horovod's ``num_groups``; 0: by ``fusion_bytes``).
      groups: lists of parameter paths (``jax.tree_util.keystr``) reduced together; each
        other parameter is a group of its own (Horovod's ``groups``;
        :mod:`parallax.horovod.gradient_groups`). Eager and Adasum reductions ignore groups.
      process_set: the ranks whose gradients are averaged (Horovod >= 0.23); a rank
        outside it steps with its own gradient and makes no collective call, as in Horovod
        (inside ``@hvd.jit`` it runs the program but sits alone in the all-reduce's replica
        groups, so its parameters differ from the members': keep them in ``hvd.PerRank``).
        Average divides by the set's size. Not with ``op=hvd.Adasum`` nor a point-to-point
        ``algorithm`` (:mod:`parallax.horovod.optimizer_sets`).
      fusion_bytes: bucket capacity of the fused all-reduce (Horovod's fusion threshold).
      algorithm: how each bucket is summed inside a program: ``"xla"`` (XLA's all-reduce:
        NCCL on GPU, ICI on TPU, gloo on CPU) or ``"tree"``, ``"ring"``, ``"auto"``
        (``parallax.comm``'s point-to-point exchanges, which beat gloo's all-reduce on CPU
        clusters). Eager reductions (outside a program) are one XLA program whatever this
        says, and inside ``px.train_step`` the strategy's sync decides.
      axis_name: the mesh axis of the ranks inside a program (``@hvd.jit``'s ``"data"``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` (its ``update`` takes ``step=``; other
      extra arguments reach ``tx``).

    Example:
      >>> import jax.numpy as jnp, optax, parallax.horovod as hvd
      >>> tx = hvd.DistributedOptimizer(optax.sgd(0.1), backward_passes_per_step=2)
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.ones(2)}, state, params)   # accumulated
      >>> updates["w"].tolist(), int(state.count)
      ([0.0, 0.0], 1)
      >>> updates, state = tx.update({"w": jnp.ones(2)}, state, params)   # synced, applied
      >>> [round(u, 6) for u in updates["w"].tolist()], int(state.count)   # the sum, as Horovod
      ([-0.2, -0.2], 0)
      >>> updates, state = tx.update({"w": jnp.ones(2)}, state, params, step=True)  # torch's
      >>> [round(u, 6) for u in updates["w"].tolist()]          # early step(): one pass's sum
      [-0.1, -0.1]

    References:
      Sergeev & Del Balso 2018, "Horovod" (DistributedOptimizer, tensor fusion); Horovod's
      horovod/torch/optimizer.py (``step()`` after any number of passes) and
      horovod/tensorflow/gradient_aggregation.py (``backward_passes_per_step``,
      ``average_aggregated_gradients``); Li et al. 2020,
      "PyTorch Distributed" (``no_sync``); Maleki et al. 2020 (Adasum).
    """
    del named_parameters
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(f"{API}: tx must be an optax.GradientTransformation (optax.adam(...)), "
                        f"got {type(tx).__name__}.")
    op = check_op(API, op)
    if op not in (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum):
        raise ValueError(f"{API}: op={op} reduces gradients with hvd.Average, hvd.Sum or "
                         "hvd.Adasum only.")
    wire = check_compression(API, compression)
    if algorithm not in SYNC_ALGORITHMS:  # a bucket sum over one axis, as px.BucketedSync's
        raise ValueError(
            f"{API}: algorithm={algorithm!r} must be one of "
            f"{', '.join(map(repr, SYNC_ALGORITHMS))}: "
            "XLA's all-reduce, or a point-to-point algorithm of parallax.comm.")
    if algorithm != "xla" and op is ReduceOp.Adasum:
        raise ValueError(f"{API}: algorithm={algorithm!r} sums buckets; op=hvd.Adasum has its "
                         "own pairwise rounds. Pass algorithm='xla' (the default) with Adasum.")
    k = backward_passes_per_step
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"{API}: backward_passes_per_step={k!r} must be an int >= 1.")
    if not isinstance(average_aggregated_gradients, bool):
        raise TypeError(f"{API}: average_aggregated_gradients must be a bool, got "
                        f"{type(average_aggregated_gradients).__name__}.")
    divisor = k if average_aggregated_gradients else 1
    factor = float(gradient_predivide_factor)
    if factor <= 0 or (factor != 1.0 and op is not ReduceOp.Average):
        raise ValueError(f"{API}: gradient_predivide_factor={gradient_predivide_factor!r} must "
                         "be > 0, and other than 1 only with op=hvd.Average.")

    gradient_groups.check(num_groups, groups)
    optimizer_sets.check(API, process_set, op, algorithm)

    def reduce(grads):
        return _reduce(grads, _mode(grads, axis_name), op, wire, factor, fusion_bytes,
                       axis_name, algorithm, gradient_groups.assign(grads, num_groups, groups),
                       sets.members(API, process_set))

    def init_fn(params):
        accumulated = PerRank(jax.tree.map(jnp.zeros_like, params)) if k > 1 else ()
        return DistributedOptimizerState(tx.init(params), accumulated, jnp.zeros((), jnp.int32))

    inner_tx = optax.with_extra_args_support(tx)

    def update_fn(grads, state, params=None, *, step=None, **extra_args):
        passes.check_step(API, step, k)
        if k == 1:
            updates, inner = inner_tx.update(reduce(grads), state.inner, params, **extra_args)
            return updates, DistributedOptimizerState(inner, (), state.count)

        def apply(total):
            total = jax.tree.map(lambda a: a / divisor, total) if divisor > 1 else total
            return inner_tx.update(reduce(total), state.inner, params, **extra_args)

        updates, inner, accumulated, count = passes.accumulate(
            API, grads, state.accumulated.value, state.count, state.inner, apply, k=k,
            step=step, eager=_mode(grads, axis_name) == "eager")
        return updates, DistributedOptimizerState(inner, PerRank(accumulated), count)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

