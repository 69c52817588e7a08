"""``@hvd.jit``: a Horovod-style training step as one SPMD program over every device.

In Horovod each process runs its own step and the ops talk to the other processes. In JAX a
collective between processes lives inside one program that spans them, so the step is
written per rank (plain ``jax.value_and_grad`` on this rank's rows, the optimizer's
``update``) and ``@hvd.jit`` runs it on every device of every process as a ``shard_map``
over the Horovod axis ``"data"``: the batch argument is split over the devices, the other
arguments (parameters, optimizer state) are replicated (values wrapped in ``hvd.PerRank``
keep one copy per rank), and inside it
``hvd.DistributedOptimizer`` and ``hvd.allreduce`` reduce over that axis. This is what
``tf.function`` is to a Horovod TensorFlow script.

Arguments may be process-local (numpy, arrays on this process's devices: each process
passes its copy of the replicated arguments and *its own rows* of the batch) or the global
arrays a previous call returned. Results are global, replicated arrays (``float(loss)`` and
``np.asarray`` read them on any process).

In Horovod every rank returns its own value; here a result is one replicated array. A result
the ranks computed differently (a step that applied its own gradients without
``DistributedOptimizer`` or ``hvd.allreduce``) would silently read as device 0's value, so
the first call of each compiled program compares every result across the ranks (each rank
returns an exact hash of the result's first elements, compared on the host:
:mod:`parallax.comm.replication`; the program holds no extra collective) and raises, naming
the result and the fix: reduce it, or return it as ``hvd.PerRank`` to keep one value per
rank. ``check_outputs="always"`` checks every call (a host read of the hashes),
``"never"`` builds the program without them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from parallax.comm import replication
from parallax.distributed import batches as batches_lib
from parallax.horovod.collectives import AXIS
from parallax.horovod.per_rank import PerRank, is_per_rank
from parallax.strategies import DataParallel


def mesh() -> Mesh:
    """The Horovod mesh: one axis ``"data"`` over every device, in process order.

    Example:
      >>> import parallax.horovod as hvd
      >>> dict(hvd.mesh().shape)
      {'data': 8}
    """
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices, dtype=object), (AXIS,), axis_types=(AxisType.Auto,))


def _on_mesh(x, where: Mesh, per_rank: bool):
    """A replicated (or, per rank, ``[devices, ...]``) global array from a local value."""
    if isinstance(x, jax.Array) and getattr(x.sharding, "mesh", None) == where:
        return x  # a global array a previous call returned
    x = np.asarray(x)
    if not per_rank:
        return jax.make_array_from_process_local_data(NamedSharding(where, PartitionSpec()), x)
    copies = np.broadcast_to(x, (jax.local_device_count(),) + x.shape)
    return jax.make_array_from_process_local_data(NamedSharding(where, PartitionSpec(AXIS)),
                                                  np.ascontiguousarray(copies))


def _map_nodes(fn_per_rank, fn_leaf, tree):
    """Maps PerRank nodes' leaves with ``fn_per_rank`` and the other leaves with ``fn_leaf``."""
    def one(node):
        if is_per_rank(node):
            return PerRank(jax.tree.map(fn_per_rank, node.value))
        return fn_leaf(node)

    return jax.tree.map(one, tree, is_leaf=is_per_rank)


def _specs(tree, batch: bool):
    spec = PartitionSpec(AXIS) if batch else PartitionSpec()
    return _map_nodes(lambda _: PartitionSpec(AXIS), lambda _: spec, tree)


CHECKS = ("first", "always", "never")
SAMPLE = 1024  # elements of each result hashed by the replication check


def jit(fn: Callable | None = None, *, batch_argnums: int | Sequence[int] = -1,
        donate_argnums: Sequence[int] = (), check_outputs: str = "first"):
    """Runs ``fn(*args)`` on every device of every process, per rank (Horovod's model).

    Args:
      fn: the step, written for one rank: it sees the whole replicated arguments and this
        device's rows of the batch arguments.
      batch_argnums: which positional arguments are batches (this process's rows, split over
        its devices); the last one by default. The others are replicated.
      donate_argnums: arguments whose buffers the result may reuse.
      check_outputs: when to check that every replicated result is the same on every rank:
        ``"first"`` call of each compiled program (default), ``"always"``, or ``"never"``.

    Returns:
      The wrapped step; its results are replicated global arrays.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, parallax.horovod as hvd
      >>> tx = hvd.DistributedOptimizer(optax.sgd(0.1))
      >>> @hvd.jit
      ... def step(w, opt_state, batch):
      ...     loss, grads = jax.value_and_grad(lambda w: jnp.mean((batch @ w) ** 2))(w)
      ...     updates, opt_state = tx.update(grads, opt_state, w)
      ...     return optax.apply_updates(w, updates), opt_state, hvd.allreduce(loss)
      >>> w = jnp.ones(2)
      >>> w, opt_state, loss = step(w, tx.init(w), np.ones((8, 2)))
      >>> float(loss)
      4.0

    References:
      Horovod with ``tf.function``; ``jax.shard_map``.
    """
    if check_outputs not in CHECKS:
        raise ValueError(f"hvd.jit: check_outputs={check_outputs!r} is not one of {CHECKS}.")
    if fn is None:
        return functools.partial(jit, batch_argnums=batch_argnums, donate_argnums=donate_argnums,
                                 check_outputs=check_outputs)
    return HorovodStep(fn, batch_argnums, tuple(donate_argnums), check_outputs)


class HorovodStep:
    """A step written per rank, run as one program over the Horovod mesh (see :func:`jit`)."""

    def __init__(self, fn: Callable, batch_argnums, donate_argnums: tuple[int, ...],
                 check_outputs: str = "first"):
        self.fn, self.donate_argnums, self.check_outputs = fn, donate_argnums, check_outputs
        self._checked: set = set()  # programs whose results were found replicated
        self.batch_argnums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(
            batch_argnums)
        self._programs: dict = {}
        functools.update_wrapper(self, fn)

    def _prepare(self, args):
        count = len(args)
        is_batch = {i % count for i in self.batch_argnums}
        where = mesh()
        placed = [batches_lib.global_batch(a, where, DataParallel(AXIS)) if i in is_batch
                  else _map_nodes(lambda x: _on_mesh(x, where, True),
                                  lambda x: _on_mesh(x, where, False), a)
                  for i, a in enumerate(args)]
        key = (jax.tree.structure(placed), tuple(sorted(is_batch)))
        if key not in self._programs:
            self._programs[key] = self._build(placed, is_batch, where)
        return key, placed, where

    def _build(self, placed, is_batch, where):
        """The jitted shard_map; PerRank values travel with a leading axis over the ranks."""
        in_specs = tuple(_specs(a, i in is_batch) for i, a in enumerate(placed))

        check = self.check_outputs != "never"

        def body(*args):
            args = [_map_nodes(lambda x: x[0], lambda x: x, a) for a in args]
            out = self.fn(*args)
            # each rank's hashes of its replicated results, compared on the host when checked
            # (no collective in the program for the check)
            own = replication.hashes(_replicated_leaves(out), SAMPLE)[None] if check else None
            return _map_nodes(lambda x: x[None], lambda x: x, out), own

        def program(out_specs):
            return jax.shard_map(body, mesh=where, in_specs=in_specs,
                                 out_specs=(out_specs, PartitionSpec(AXIS)), check_vma=False)

        with jax.set_mesh(where):  # the results' structure, to place PerRank ones per rank
            shapes, _ = jax.eval_shape(program(PartitionSpec()), *placed)
        return jax.jit(program(_specs(shapes, False)), donate_argnums=self.donate_argnums)

    def __call__(self, *args):
        key, placed, where = self._prepare(args)
        with jax.set_mesh(where):
            out, own = self._programs[key](*placed)
        if own is not None and own.size and (self.check_outputs == "always" or (
                self.check_outputs == "first" and key not in self._checked)):
            _raise_if_differ(out, replication.differs_on_host(own))  # (size 0: all PerRank)
            self._checked.add(key)
        return out

    def lower(self, *args):
        """``jax.jit(...).lower``: the program a call with ``args`` runs."""
        key, placed, where = self._prepare(args)
        with jax.set_mesh(where):
            return self._programs[key].lower(*placed)


def _replicated_leaves(tree) -> list:
    """The results ``@hvd.jit`` returns as one replicated array (not in ``hvd.PerRank``)."""
    return [leaf for leaf in jax.tree.leaves(tree, is_leaf=is_per_rank) if not is_per_rank(leaf)]


def _raise_if_differ(out, flags) -> None:
    """Raises ``ValueError`` naming every replicated result the ranks computed differently."""
    if not flags.any():
        return
    paths = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(out, is_leaf=is_per_rank)[0]
             if not is_per_rank(x)]
    named = [f"result{jax.tree_util.keystr(p)} {x.dtype}{list(x.shape)}"
             for (p, x), bad in zip(paths, flags) if bad]
    raise ValueError(
        f"hvd.jit: the step returned a different value on each rank for {', '.join(named)}; "
        "@hvd.jit returns one replicated array per result, so this would silently be one "
        "rank's value (in Horovod each rank keeps its own). Reduce it over the ranks "
        "(hvd.allreduce(x), or apply the gradients through hvd.DistributedOptimizer), or "
        "return it as hvd.PerRank(x) to keep one value per rank; check_outputs='never' "
        "skips this check.")
