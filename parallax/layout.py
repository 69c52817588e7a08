"""Where every leaf of a training state lives: parameters, gradients, optimizer state.

A strategy's rules give each parameter a base ``PartitionSpec`` (tensor parallel shards
``"heads"``, ``"mlp"``, ``"vocab"``). ZeRO then picks one more dimension per leaf to shard
over its axis. The same choice applies to the parameter (stage 3), its gradient (stage 2+)
and its optimizer moments (stage 1+), so the three always line up.

Training states come in several shapes. The parameters are found at a known place:

- ``px.TrainState`` (and any object with a ``.params`` field, such as flax's
  ``train_state.TrainState``): ``state.params``;
- a mapping with a ``"params"`` key;
- a tuple or list: its first element (``(params, opt_state)``);
- anything else: the whole tree is parameters (``px.shard(params, ...)``).

Every other leaf is optimizer state when its path ends with a parameter's path and it has
that parameter's shape (optax's ``mu`` and ``nu`` mirror the parameter tree), and is
replicated otherwise (step counters, scalars).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
from jax.sharding import NamedSharding, PartitionSpec

from parallax import rules as rules_lib
from parallax.mesh import axes_text, axis_size, describe
from parallax.strategy import Strategy

LAYERS = "layers"


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How one parameter is laid out: its rule-table spec and the dimension ZeRO shards."""

    path: tuple
    shape: tuple[int, ...]
    base: PartitionSpec
    shard_dim: int | None

    def spec(self, sharded: bool, axis: str | None) -> PartitionSpec:
        """The base spec, with ``axis`` on the ZeRO dimension when ``sharded``."""
        if not sharded or axis is None or self.shard_dim is None:
            return self.base
        entries = list(self.base)
        entries[self.shard_dim] = axis
        return PartitionSpec(*entries)

    def manual_spec(self, sharded: bool, axis: str | None) -> PartitionSpec:
        """The spec restricted to the ZeRO axis (what ``shard_map`` over batch axes sees)."""
        entries = [None] * len(self.shape)
        if sharded and axis is not None and self.shard_dim is not None:
            entries[self.shard_dim] = axis
        return PartitionSpec(*entries)


def choose_shard_dim(base, shape, names, ways: int) -> int | None:
    """ZeRO's dimension: the largest free, divisible one, avoiding the stacked layer axis."""
    candidates = [
        d
        for d, size in enumerate(shape)
        if base[d] is None and size % ways == 0 and size >= ways
        and not (names is not None and names[d] == LAYERS)
    ]
    if not candidates:
        return None
    return max(candidates, key=lambda d: (shape[d], -d))


def param_layouts(params, strategy: Strategy, mesh, api: str, prefix: tuple = ()) -> list[LeafLayout]:
    """One :class:`LeafLayout` per array leaf of ``params``, in ``jax.tree.leaves`` order.

    ``prefix`` is where ``params`` sits in the tree the user passed, for error messages.
    """
    table = strategy.rule_table
    ways = mesh.shape[strategy.shard_axis] if strategy.shard_axis else 1
    layouts = []
    for leaf in rules_lib.annotated_leaves(params):
        shape = tuple(getattr(leaf.leaf, "shape", ()))
        if leaf.names is not None and not leaf.physical:
            for check in strategy.param_checks:  # strategy-specific messages come first
                check(leaf.names, shape, mesh, path=prefix + leaf.path, api=api)
        base = rules_lib.resolve_spec(
            leaf.names, shape, table, mesh, api=api, physical=leaf.physical,
            path=jax.tree_util.keystr(prefix + leaf.path),
        )
        dim = choose_shard_dim(base, shape, leaf.names, ways) if ways > 1 else None
        layouts.append(LeafLayout(leaf.path, shape, base, dim))
    return layouts


def params_prefix(state) -> tuple:
    """The path of the parameters inside a training state (see the module docstring)."""
    if hasattr(state, "params") and not isinstance(state, Mapping):
        return (jax.tree_util.GetAttrKey("params"),)
    if isinstance(state, Mapping) and "params" in state:
        return (jax.tree_util.DictKey("params"),)
    if isinstance(state, (tuple, list)) and state and not hasattr(state, "_fields"):
        return (jax.tree_util.SequenceKey(0),)
    return ()


def _params_of(state, prefix):
    node = state
    for key in prefix:
        if isinstance(key, jax.tree_util.GetAttrKey):
            node = getattr(node, key.name)
        elif isinstance(key, jax.tree_util.DictKey):
            node = node[key.key]
        else:
            node = node[key.idx]
    return node


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Specs for every leaf of a training state, by role.

    Attributes:
      params: the parameters' layouts (in leaf order of the parameter tree).
      specs: a ``PartitionSpec`` per leaf of the whole state (leaf order of the state).
      roles: ``"param"``, ``"opt"`` or ``"other"`` per leaf of the state.
    """

    params: list[LeafLayout]
    specs: list[PartitionSpec]
    roles: list[str]


def state_layout(state, strategy: Strategy, mesh, api: str) -> StateLayout:
    """Lays out a whole training state (concrete or abstract) under ``strategy``."""
    prefix = params_prefix(state)
    layouts = param_layouts(_params_of(state, prefix), strategy, mesh, api, prefix)
    by_path = {lay.path: lay for lay in layouts}
    longest = max((len(p) for p in by_path), default=0)
    stage, axis = strategy.zero_stage, strategy.shard_axis
    specs, roles = [], []
    # Leaves are visited in the same order as annotated_leaves visits the parameters.
    param_iter = iter(layouts)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        if path[: len(prefix)] == prefix:
            lay = next(param_iter)
            specs.append(lay.spec(stage >= 3, axis))
            roles.append("param")
            continue
        match = None
        for n in range(min(longest, len(path)), 0, -1):
            cand = by_path.get(path[-n:])
            if cand is not None and cand.shape == shape:
                match = cand
                break
        if match is not None:
            specs.append(match.spec(stage >= 1, axis))
            roles.append("opt")
        else:
            specs.append(PartitionSpec())
            roles.append("other")
    return StateLayout(layouts, specs, roles)


def to_shardings(tree, specs, mesh):
    """A tree like ``tree`` with a ``NamedSharding`` per leaf, from a flat list of specs."""
    treedef = jax.tree.structure(tree)
    return jax.tree.unflatten(treedef, [NamedSharding(mesh, s) for s in specs])


def state_shardings(state, strategy: Strategy, mesh, api: str = "px.init"):
    """``NamedSharding`` per leaf of a training state, for ``jit`` or ``device_put``."""
    return to_shardings(state, state_layout(state, strategy, mesh, api).specs, mesh)


def batch_spec(strategy: Strategy) -> PartitionSpec:
    axes = strategy.batch_axes
    if not axes:
        return PartitionSpec()
    return PartitionSpec(axes[0] if len(axes) == 1 else axes)


def check_batch(batch, strategy: Strategy, mesh, api: str) -> None:
    """Every batch leaf needs a leading dimension divisible by the batch shards."""
    axes = strategy.batch_axes
    ways = axis_size(mesh, axes)
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        where = jax.tree_util.keystr(path) or "batch"
        if not shape:
            raise ValueError(
                f"{api}: the batch leaf {where} is a scalar; every batch leaf needs a "
                "leading batch dimension. Pass constants as extra arguments to the step."
            )
        if shape[0] % ways:
            raise ValueError(
                f"{api}: the batch leaf {where} has shape {shape}: its leading (batch) "
                f"dimension {shape[0]} is not divisible by the {ways} batch shards "
                f"({axes_text(mesh, axes)}) of {strategy.name} on the mesh {describe(mesh)}; use a batch "
                f"size that is a multiple of {ways}."
            )


def batch_shardings(batch, strategy: Strategy, mesh):
    spec = batch_spec(strategy)
    return jax.tree.map(lambda _: NamedSharding(mesh, spec), batch)
