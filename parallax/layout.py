"""Where every leaf of a training state lives: parameters, gradients, optimizer state.

A strategy's rules give each parameter a base ``PartitionSpec`` (tensor parallel shards
``"heads"``, ``"mlp"``, ``"vocab"``). ZeRO (the strategy's ``zero``, see
``parallax.strategies.zero``) then picks one more dimension per leaf to shard over its axis.
The same choice applies to the parameter (stage 3), its gradient (stage 2+) and its
optimizer moments (stage 1+), so the three always line up. The batch's layout is
:mod:`parallax.step.batch`.

Training states come in several shapes. The parameters are found at a known place:

- ``px.TrainState`` (and any object with a ``.params`` field, such as flax's
  ``train_state.TrainState``): ``state.params``;
- a mapping with a ``"params"`` key;
- a tuple or list: its first element (``(params, opt_state)``);
- anything else: the whole tree is parameters (``px.shard(params, ...)``).

Every other leaf is optimizer state when its path ends with a parameter's path and it has
that parameter's shape (optax's ``mu`` and ``nu`` mirror the parameter tree), and is
replicated otherwise (step counters, scalars).

A leaf also has a memory kind: the devices' own memory, or ``"pinned_host"`` for a role
ZeRO-Offload keeps in host memory between steps (``px.ZeRO(..., offload=...)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from parallax import rules as rules_lib
from parallax.strategy import Strategy
from parallax.strategy_hooks import StateSharding


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How one parameter is laid out: its rule-table spec and the dimension ZeRO shards.

    Attributes:
      path: the parameter's path in the parameter tree.
      shape: its shape.
      base: the ``PartitionSpec`` the strategy's rules give it.
      shard_dim: the dimension ZeRO shards over its axis (None: replicated over it).
      zero: the strategy's ZeRO sharding (None without ZeRO).
    """

    path: tuple
    shape: tuple[int, ...]
    base: PartitionSpec
    shard_dim: int | None
    zero: StateSharding | None = None

    def is_sharded(self, role: str) -> bool:
        """Whether ZeRO shards this leaf's ``role`` (``"param"``, ``"grad"``, ``"opt"``)."""
        return self.zero is not None and self.shard_dim is not None and self.zero.shards(role)

    def spec(self, role: str) -> PartitionSpec:
        """The base spec, with ZeRO's axis on its dimension when ``role`` is sharded."""
        if not self.is_sharded(role):
            return self.base
        entries = list(self.base)
        entries[self.shard_dim] = self.zero.axis
        return PartitionSpec(*entries)

    def manual_spec(self, role: str, manual_axes=()) -> PartitionSpec:
        """The spec restricted to ZeRO's axis and ``manual_axes`` (what ``shard_map`` over
        the batch axes sees): a leaf the rules shard over a batch axis (MoE experts over
        expert parallelism's axis) stays split over it inside the map."""
        entries = [None] * len(self.shape)
        for dim, entry in enumerate(self.base):
            kept = tuple(a for a in rules_lib.as_tuple(entry) if a in manual_axes)
            entries[dim] = (kept[0] if len(kept) == 1 else kept) if kept else None
        if self.is_sharded(role):
            entries[self.shard_dim] = self.zero.axis
        return PartitionSpec(*entries)

    def memory_kind(self, role: str) -> str | None:
        """Where this leaf's ``role`` lives between steps: ``"pinned_host"`` when ZeRO
        offloads the role, None for the devices' own memory."""
        return self.zero.memory_kind(role) if self.zero is not None else None

    def split_over(self, axes) -> tuple[str, ...]:
        """The ``axes`` the rules shard this leaf over (its shards are different values)."""
        mine = {a for e in self.base for a in rules_lib.as_tuple(e)}
        return tuple(a for a in axes if a in mine)


def param_layouts(params, strategy: Strategy, mesh, api: str,
                  prefix: tuple = (), source=None) -> list[LeafLayout]:
    """One :class:`LeafLayout` per array leaf of ``params``, in ``jax.tree.leaves`` order.

    ``prefix`` is where ``params`` sits in the tree the user passed, for error messages;
    ``source`` is the state or module they come from, from which a strategy's
    ``model_hooks.param_names`` (a tensor-parallel plan) names the parameters the model left unnamed.
    """
    table, zero, hooks = strategy.rule_table, strategy.zero, strategy.model_hooks
    planned = planned_names(source, strategy, api)
    layouts = []
    for leaf in rules_lib.annotated_leaves(params):
        shape = tuple(getattr(leaf.leaf, "shape", ()))
        names = leaf.names
        if names is None and planned:
            names = planned.get(dotted_key(leaf.path))
        if names is not None and not leaf.physical:
            for check in hooks.param_checks:  # strategy-specific messages come first
                check(names, shape, mesh, path=prefix + leaf.path, api=api)
            names = hooks.choose_names(names, shape, mesh)
        base = rules_lib.resolve_spec(
            names, shape, table, mesh, api=api, physical=leaf.physical,
            path=jax.tree_util.keystr(prefix + leaf.path),
        )
        dim = zero.shard_dim(base, shape, names, mesh) if zero is not None else None
        layouts.append(LeafLayout(leaf.path, shape, base, dim, zero))
    if hooks.layout_checks:
        model = module_of(source)
        for check in hooks.layout_checks:
            check(layouts, mesh, api=api, prefix=prefix, model=model)
    return layouts


def dotted_key(path: tuple) -> str:
    """A parameter's pytree path as a dotted module path (``blocks.0.mlp.up.kernel``)."""
    parts = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
    if parts and parts[-1] == "value":
        parts.pop()
    return ".".join(parts)


def module_of(source) -> nnx.Module | None:
    """The NNX module a state describes (a module, or a state with ``graphdef``)."""
    if isinstance(source, nnx.Module):
        return source
    graphdef = getattr(source, "graphdef", None)
    if graphdef is not None and hasattr(source, "params"):
        return nnx.merge(graphdef, source.params, getattr(source, "rest", nnx.State({})))
    return None


def planned_names(source, strategy: Strategy, api: str) -> dict:
    """``{dotted parameter path: names}`` from the strategy's ``param_names`` sources."""
    sources = strategy.model_hooks.param_names
    if not sources:
        return {}
    model = module_of(source)
    names: dict = {}
    for names_of in sources:
        names.update(names_of(model, api))
    return names


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
      specs: a ``PartitionSpec`` per leaf of the whole state (leaf order of the state), in
        :func:`canonical` form.
      roles: ``"param"``, ``"opt"`` or ``"other"`` per leaf of the state.
      memory_kinds: per leaf of the state, ``"pinned_host"`` when it lives in host memory
        between steps (ZeRO-Offload), None for the devices' memory.
    """

    params: list[LeafLayout]
    specs: list[PartitionSpec]
    roles: list[str]
    memory_kinds: list[str | None] = dataclasses.field(default_factory=list)

    def shardings(self, mesh) -> list[NamedSharding]:
        """One ``NamedSharding`` per leaf of the state, with its memory kind."""
        return [NamedSharding(mesh, spec, memory_kind=kind)
                for spec, kind in zip(self.specs, self.memory_kinds, strict=True)]


def state_layout(state, strategy: Strategy, mesh, api: str) -> StateLayout:
    """Lays out a whole training state (concrete or abstract) under ``strategy``."""
    prefix = params_prefix(state)
    layouts = param_layouts(_params_of(state, prefix), strategy, mesh, api, prefix, state)
    by_path = {lay.path: lay for lay in layouts}
    longest = max((len(p) for p in by_path), default=0)
    specs, roles, kinds = [], [], []
    # Leaves are visited in the same order as annotated_leaves visits the parameters.
    param_iter = iter(layouts)
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        shape = tuple(getattr(leaf, "shape", ()))
        if path[: len(prefix)] == prefix:
            lay = next(param_iter)
            specs.append(lay.spec("param"))
            roles.append("param")
            kinds.append(lay.memory_kind("param"))
            continue
        match = None
        for n in range(min(longest, len(path)), 0, -1):
            cand = by_path.get(path[-n:])
            if cand is not None and cand.shape == shape:
                match = cand
                break
        if match is not None:
            specs.append(match.spec("opt"))
            roles.append("opt")
            kinds.append(match.memory_kind("opt"))
        else:
            specs.append(PartitionSpec())
            roles.append("other")
            kinds.append(None)
    return StateLayout(layouts, [canonical(spec, mesh) for spec in specs], roles, kinds)


def canonical(spec: PartitionSpec, mesh) -> PartitionSpec:
    """``spec`` as XLA hands shardings back: size-1 mesh axes dropped, trailing Nones trimmed.

    A step's output state is constrained to its layout and comes back in this form; giving
    the state this form from the start (``px.init``, ``px.shard``) makes every call's input
    shardings equal to the last call's output, so ``jax.jit`` never retraces for a spelling.

    Example:
      >>> import jax, parallax as px
      >>> canonical(jax.P("data", None, "tensor"), px.make_mesh(data=8, tensor=1))
      P('data',)
    """
    entries = []
    for entry in spec:
        axes = tuple(a for a in rules_lib.as_tuple(entry) if mesh.shape[a] > 1)
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def state_shardings(state, strategy: Strategy, mesh, api: str = "px.init"):
    """``NamedSharding`` per leaf of a training state (with its memory kind), for ``jit``
    or ``device_put``."""
    shardings = state_layout(state, strategy, mesh, api).shardings(mesh)
    return jax.tree.unflatten(jax.tree.structure(state), shardings)
