"""The one compiled program behind ``strategy.run``: the replica function in ``shard_map``.

TensorFlow's ``MirroredStrategy`` runs the replica function in one thread per device and
joins them at every all-reduce (its best-known failure: NCCL calls deadlocking across
replica threads). Here the function is traced once and runs as one SPMD program, a
``shard_map`` over the strategy's replica axes, compiled once per input signature (``jax.jit``
keyed by :class:`Signature` and the shapes and dtypes of the arrays).

What crosses into the replicas:

* ``PerReplica`` inputs: sharded over the replica axes, each replica sees its component;
  a partial last batch that TensorFlow splits unevenly arrives padded with zero rows, and
  the replica context knows each replica's real rows (``ReplicaContext.example_mask``,
  used by ``compute_average_loss``); a padded batch that the replica function never masks
  is refused (:func:`parallax.tf.input.partial_batches.refuse_unmasked`);
* arrays, ``Mirrored`` values and NNX objects (modules, optimizers, metrics): replicated,
  each replica sees the whole value. NNX objects are split outside and merged inside the
  traced function, and their new state is written back after the call, as ``nnx.jit``
  does. Sync-on-read variables (:func:`parallax.tf.values.aggregation_of`) are aggregated
  when they leave the replicas; a SUM variable enters with its value on the first replica
  and zeros elsewhere, so that every linear update (``+=``, moving averages) gives what
  TensorFlow's separately kept components would read;
* anything else (Python numbers, strings): static, part of the signature.

The ``shard_map`` runs with ``check_vma=False``: a point-to-point all-reduce (ring,
reduce-to-one) gives every replica the same sum but JAX types it *varying*, and mirrored
state written from it must still leave as one replicated value. Aggregating the gradients
(``ReplicaContext.all_reduce``) is the replica function's job, as in TensorFlow; a mirrored
variable written differently on the replicas is detected by exact hashes and refused
(:mod:`parallax.tf.mirrored.divergence`).

(A little over 300 lines: the one program behind ``run``, what enters it, what leaves it
and the static facts its trace records; the partial batches' rules live in
:mod:`parallax.tf.input.partial_batches`.)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import flax.errors
import jax
import jax.numpy as jnp
from flax import nnx

from parallax import comm
from parallax.comm import replication
from parallax.tf.reduce_op import ReduceOp
from parallax.tf.replica_context import ReplicaContext, replica
from parallax.tf.values import Mirrored, PerReplica, VariableAggregation, aggregation_of

PER_REPLICA, BROADCAST, NODE, STATIC = "per_replica", "broadcast", "node", "static"


@dataclasses.dataclass(frozen=True)
class Signature:
    """The static part of one ``run`` call (a ``jax.jit`` static argument).

    Attributes:
      strategy: the strategy (its mesh and cross-device op).
      fn: the replica function.
      treedef: structure of ``(args, kwargs)``, NNX objects and distributed values as leaves.
      kinds: per leaf, ``"per_replica"``, ``"broadcast"``, ``"node"`` or ``"static"``.
      statics: the static leaves' values (``None`` for the others).
      graphdef: the NNX graph of the objects passed (``None`` when there are none).
      state_treedef: structure of their state's arrays.
      aggregations: per state array, its :class:`VariableAggregation`.
      batch_rows: the real rows per replica of a padded partial batch among the
        ``PerReplica`` inputs (:mod:`parallax.tf.input.partial_batches`), else ``None``.
    """

    strategy: Any
    fn: Callable
    treedef: Any
    kinds: tuple[str, ...]
    statics: tuple
    graphdef: Any
    state_treedef: Any
    aggregations: tuple[VariableAggregation, ...]
    batch_rows: tuple[int, ...] | None = None


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class TraceFacts:
    """What tracing the replica function found, returned as static data of ``jit``'s output.

    A pytree node without leaves: ``jit`` keeps it with the output's structure in its cache,
    so every call (and a call inside the caller's own ``jit``) reads it without a transfer.

    Attributes:
      masked: the replica function asked which rows of a padded batch are real.
    """

    masked: bool


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class _MirroredSlot:
    """Stands in the per-replica output tree where a ``Mirrored`` output goes."""

    index: int


def _is_special(x) -> bool:
    return isinstance(x, (PerReplica, Mirrored, nnx.Pytree, nnx.Variable))


def _enter(x, aggregation, replica_id):
    if aggregation is VariableAggregation.SUM:
        return jnp.where(replica_id == 0, x, jnp.zeros_like(x))
    return x


def _leave(strategy, leaves, aggregations):
    """Aggregates the sync-on-read state leaves over the replicas."""
    axes, out = strategy.replica_axes, list(leaves)
    for aggregation, op in ((VariableAggregation.SUM, ReduceOp.SUM),
                            (VariableAggregation.MEAN, ReduceOp.MEAN)):
        idx = [i for i, a in enumerate(aggregations) if a is aggregation]
        if idx:
            values = [out[i] for i in idx]
            reduced = strategy.cross_device_ops.all_reduce(values, axes, op, strategy.mesh)
            for i, v, r in zip(idx, values, reduced):
                out[i] = r.astype(v.dtype)
    for i, aggregation in enumerate(aggregations):
        if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            out[i] = comm.broadcast(out[i], axes if len(axes) > 1 else axes[0], root=0)
    return out


def _outputs(strategy, result):
    """Wraps each output leaf: PerReplica (stacked) or a slot for a Mirrored value."""
    mirrored = []

    def wrap(x):
        if isinstance(x, Mirrored):
            mirrored.append(jnp.asarray(x.value))
            return _MirroredSlot(len(mirrored) - 1)
        try:
            x = jnp.asarray(x)
        except TypeError:
            raise TypeError(
                f"px.tf.MirroredStrategy.run: the replica function returned a "
                f"{type(x).__name__} ({x!r}); return arrays (or pytrees of them), e.g. the "
                "loss, and read Python values outside run.") from None
        return PerReplica(x[None], strategy)

    tree = jax.tree.map(wrap, result, is_leaf=lambda x: isinstance(x, Mirrored))
    return tree, mirrored


def _body(sig: Signature, reads: list, per_replica, broadcast, state):
    strategy = sig.strategy
    ctx = ReplicaContext(strategy, strategy.num_replicas_in_sync, strategy.replica_axes,
                         sig.batch_rows, reads)
    replica_id = ctx.replica_id_in_sync_group
    nodes = ()
    if sig.graphdef is not None:
        state = [_enter(x, a, replica_id) for x, a in zip(state, sig.aggregations)]
        nodes = nnx.merge(sig.graphdef, jax.tree.unflatten(sig.state_treedef, state))
    per_replica, broadcast, node_iter = iter(per_replica), iter(broadcast), iter(nodes)
    leaves = []
    for kind, static in zip(sig.kinds, sig.statics):
        if kind == PER_REPLICA:
            leaves.append(next(per_replica)[0])
        elif kind == BROADCAST:
            leaves.append(next(broadcast))
        elif kind == NODE:
            leaves.append(next(node_iter))
        else:
            leaves.append(static)
    args, kwargs = jax.tree.unflatten(sig.treedef, leaves)
    try:
        with replica(ctx):
            result = sig.fn(*args, **kwargs)
    except flax.errors.TraceContextError as error:
        raise ValueError(
            "px.tf.MirroredStrategy.run: the replica function changed an NNX object it did "
            "not receive as an argument (a module captured by closure?). JAX traces pure "
            "functions: pass every module, optimizer and metric the function updates in "
            "args, e.g. strategy.run(train_step, args=(model, optimizer, batch)).") from error
    new_state = []
    if sig.graphdef is not None:
        graphdef, state_out = nnx.split(nodes)
        if graphdef != sig.graphdef:
            raise ValueError(
                "px.tf.MirroredStrategy.run: the replica function changed the structure of "
                "the NNX objects it received (added or removed a variable or submodule). "
                "Create variables before run, under strategy.scope(): TensorFlow likewise "
                "refuses variables created inside a replica function after its first call.")
        new_state = _leave(strategy, jax.tree.leaves(state_out), sig.aggregations)
    flags = replication.differs([new_state[i] for i in mirrored_leaves(sig)],
                                   strategy.replica_axes)
    tree, mirrored = _outputs(strategy, result)
    return tree, mirrored, new_state, flags


def mirrored_leaves(sig: Signature) -> list[int]:
    """Positions of the state leaves that are mirrored (aggregation ``NONE``)."""
    return [i for i, a in enumerate(sig.aggregations) if a is VariableAggregation.NONE]


def _fill(tree, mirrored, strategy):
    return jax.tree.map(
        lambda x: Mirrored(mirrored[x.index], strategy) if isinstance(x, _MirroredSlot) else x,
        tree, is_leaf=lambda x: isinstance(x, (_MirroredSlot, PerReplica)))


@functools.partial(jax.jit, static_argnums=0)
def replica_program(sig: Signature, per_replica: list, broadcast: list, state: list):
    """Runs ``sig.fn`` on every replica.

    Returns:
      ``(outputs, new NNX state leaves, flags, facts)``: ``flags[k]`` is True when the
      replicas wrote the ``k``-th mirrored leaf (:func:`mirrored_leaves`) differently;
      ``facts`` is the :class:`TraceFacts` of the trace.
    """
    strategy = sig.strategy
    spec = strategy.batch_spec
    reads = []  # filled while the shard_map below traces the replica function
    mapped = jax.shard_map(
        functools.partial(_body, sig, reads), mesh=strategy.mesh,
        in_specs=(spec, jax.P(), jax.P()), out_specs=(spec, jax.P(), jax.P(), jax.P()),
        check_vma=False)
    tree, mirrored, new_state, flags = mapped(per_replica, broadcast, state)
    return _fill(tree, mirrored, strategy), new_state, flags, TraceFacts(bool(reads))


def check_no_captured_objects(fn, nodes) -> None:
    """Refuses NNX objects the replica function reads from its closure or globals.

    ``jit`` would bake their current values into the compiled program as constants, and
    their updates inside the function would be lost; TensorFlow code captures the model by
    closure, so this is the first thing a port runs into.
    """
    given = {id(n) for n in nodes}
    inner = fn.func if isinstance(fn, functools.partial) else fn
    try:
        captured = inspect.getclosurevars(inner)
    except TypeError:  # builtins, callable objects: nothing to inspect
        return
    found = {**captured.globals, **captured.nonlocals}
    if getattr(inner, "__self__", None) is not None:  # a bound method of a module
        found["self"] = inner.__self__
    if isinstance(fn, functools.partial):
        found.update({f"partial argument {i}": a for i, a in enumerate(fn.args)})
        found.update({f"partial argument {k!r}": a for k, a in fn.keywords.items()})
    for name, value in found.items():
        if isinstance(value, (nnx.Pytree, nnx.Variable)) and id(value) not in given:
            raise ValueError(
                f"px.tf.MirroredStrategy.run: the replica function reads {name!r} (an NNX "
                f"{type(value).__name__}) from its closure or globals; jit would bake its "
                "current values into the compiled program and lose its updates. Pass it in "
                "args: strategy.run(train_step, args=(model, optimizer, batch)).")


def signature_of(strategy, fn, args, kwargs, place):
    """Splits ``run``'s arguments into its :class:`Signature` and three lists of arrays.

    ``place(x, where)`` checks a leaf belongs to ``strategy`` and returns its array.
    Returns ``(signature, per_replica, broadcast, state, nodes)``.
    """
    api = "px.tf.MirroredStrategy.run"
    flat, treedef = jax.tree_util.tree_flatten_with_path((tuple(args), dict(kwargs)),
                                                         is_leaf=_is_special)
    kinds, statics, per_replica, broadcast, nodes = [], [], [], [], []
    rows_seen = {}
    for path, leaf in flat:
        where = _describe(path)
        if isinstance(leaf, (nnx.Pytree, nnx.Variable)):
            kinds.append(NODE), statics.append(None), nodes.append(leaf)
        elif isinstance(leaf, PerReplica):
            kinds.append(PER_REPLICA), statics.append(None)
            per_replica.append(place(leaf, where))
            if leaf.rows is not None:
                rows_seen.setdefault(leaf.rows, where)
        elif isinstance(leaf, Mirrored) or _is_array(leaf):
            kinds.append(BROADCAST), statics.append(None)
            broadcast.append(place(leaf, where))
        else:
            try:
                hash(leaf)
            except TypeError:
                raise TypeError(
                    f"{api}: {where} is a {type(leaf).__name__}, which is neither an array "
                    "nor hashable; pass arrays, NNX objects, distributed values, or hashable "
                    "Python values (they become part of the compiled signature).") from None
            kinds.append(STATIC), statics.append(leaf)
    check_no_captured_objects(fn, nodes)
    if len(rows_seen) > 1:
        (a, where_a), (b, where_b) = list(rows_seen.items())[:2]
        raise ValueError(
            f"{api}: {where_a} and {where_b} are batches padded for different splits over "
            f"the replicas (real rows {list(a)} and {list(b)}); pass the leaves of one "
            "distributed batch together, each run takes one step's batch.")
    batch_rows = next(iter(rows_seen), None)
    graphdef = state_treedef = None
    state, aggregations = [], ()
    if nodes:
        graphdef, state_tree = nnx.split(tuple(nodes))
        variables = jax.tree.leaves(state_tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
        arrays, state_treedef = jax.tree.flatten(state_tree)
        aggregations = tuple(aggregation_of(v) for v in variables)
        state = [place(x, "the state of the NNX objects in args") for x in arrays]
    sig = Signature(strategy, fn, treedef, tuple(kinds), tuple(statics), graphdef,
                    state_treedef, aggregations, batch_rows)
    return sig, per_replica, broadcast, state, tuple(nodes)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, jnp.ndarray)) or hasattr(x, "__array__") and not isinstance(
        x, (str, bytes))


def _describe(path) -> str:
    """``args[1]['x']`` for a path into ``(args, kwargs)``."""
    top, first, *more = path
    head = f"args[{first.idx}]" if top.idx == 0 else f"kwargs[{first.key!r}]"
    return head + jax.tree_util.keystr(tuple(more))
