"""A strategy is a small immutable value; ``compose`` merges several, like ``optax.chain``.

A :class:`Strategy` holds data, and at most a few pure functions:

- ``rules``: logical axis -> mesh axes, for parameters and activations (tensor parallel maps
  ``"heads"``, ``"mlp"``, ``"vocab"`` to ``"tensor"``);
- ``batch_axes``: the mesh axes that split the batch (data parallel, and ZeRO's axis, since
  every ZeRO rank sees its own slice of the batch);
- ``zero``: what ZeRO shards over its axis (1: optimizer state, 2: + gradients,
  3: + parameters), as a :class:`StateSharding` value that also carries ZeRO's mechanism
  (which dimension of a leaf to shard, the all-gather and the reduce-scatter); the core
  calls it and never imports ``parallax.strategies``. ``zero_stage`` and ``shard_axis``
  read it;
- ``style``: how gradients are synchronised over the batch axes. ``"explicit"`` (the default)
  computes local gradients inside ``shard_map`` and issues the collectives itself
  (``psum`` for data parallel, ``psum_scatter`` for ZeRO 2/3, ``all_gather`` of parameters for
  ZeRO 3), so the compiled program holds exactly those collectives on every backend.
  ``"gspmd"`` leaves the batch axes to XLA's partitioner;
- ``grad_fn``: an optional hook that replaces how gradients are produced on each device's
  slice of the batch (gradient accumulation; pipeline schedules), called as
  ``grad_fn(request, params, batch)`` with a ``parallax.grad.GradRequest``; ``microbatches``
  is how many micro-batches it splits each slice into (checked against the batch up front);
- ``grad_sync``: an optional hook that replaces how the explicit style sums gradients over
  the batch axes, called as ``grad_sync(grads, axes)`` inside the step's ``shard_map``
  (``px.BucketedSync``: DDP's buckets, Horovod's fusion, XLA's all-reduce or point-to-point
  algorithms; see ``parallax.strategies.sync``);
- ``param_checks``: checks a strategy adds for every annotated parameter before it is laid
  out, called as ``check(names, shape, mesh, path=..., api=...)``; they raise with a fix
  specific to the strategy (tensor parallel: pad the vocabulary, change the head count);
- ``param_names``: sources of logical names for parameters the model did not annotate,
  called as ``names(model, api) -> {dotted parameter path: names}`` with the NNX module
  (``TensorParallel(plan=...)``: Megatron's styles by module path);
- ``layout_checks``: checks of the whole layout, called as ``check(layouts, mesh, api=,
  prefix=, model=)`` with the NNX module when there is one (``TensorParallel``: something
  must be split over its axis);
- ``module_hooks``: called as ``hook(model)`` on the NNX module ``px.value_and_grad``
  rebuilds inside the traced loss, before the loss runs (a tensor-parallel plan with
  sequence parallelism pins activation layouts on the stock modules it styles);
- ``precision``: a mixed-precision policy (``px.MixedPrecision``: the dtypes of the
  forward pass, the gradients and their reduction), applied by ``px.value_and_grad``.
- ``sequence_split``: context parallelism's mechanism, a :class:`SequenceSplit` (the order
  in which a device holds its part of the sequence, and the attention over the split
  sequence) that ``parallax.attention`` calls; the core never imports
  ``parallax.strategies``.
- ``experts``: expert parallelism's token exchange, an :class:`ExpertSharding` value
  (``px.ExpertParallel``): its axis splits both the batch and the ``"expert"`` dimension
  of MoE weights, and an MoE layer hands it its tokens (read from the step context).

Example:
  >>> import parallax as px
  >>> s = px.compose(px.DataParallel("data"), px.ZeRO(stage=3, axis="fsdp"),
  ...                px.TensorParallel("tensor"))
  >>> s.batch_axes, s.zero_stage
  (('data', 'fsdp'), 3)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import jax
from jax.sharding import Mesh

from parallax.mesh import AXIS_ORDER, describe
from parallax.rules import MeshAxes, Rules, as_tuple

STYLES = ("explicit", "gspmd")
ROLES = ("opt", "grad", "param")  # the parts of a training state a strategy may shard


class StateSharding(Protocol):
    """How a ZeRO-like strategy shards training state over one batch axis.

    ``parallax.strategies.zero.ZeroSharding`` implements it. The layout asks it which
    dimension of each leaf to shard and which roles are sharded; the explicit gradient
    sync calls ``gather`` (inside ``shard_map``, before the forward pass) and ``scatter``
    (after the backward pass) on leaves whose role it shards.
    """

    stage: int
    axis: str

    def shards(self, role: str) -> bool:
        """Whether leaves of ``role`` (``"opt"``, ``"grad"``, ``"param"``) are sharded."""

    def shard_dim(self, base, shape, names, mesh: Mesh) -> int | None:
        """The dimension to shard over ``axis`` (None: keep the leaf replicated)."""

    def gather(self, x: jax.Array, dim: int) -> jax.Array:
        """A parameter's full value from its shards (inside ``shard_map`` over ``axis``)."""

    def scatter(self, g: jax.Array, dim: int) -> jax.Array:
        """The summed shard of a gradient this device keeps (inside ``shard_map``)."""


class SequenceSplit(Protocol):
    """How context parallelism splits a sequence's attention over one mesh axis.

    ``parallax.strategies.context_parallel.ContextSplit`` implements it; ``parallax.attention``
    calls it while a step is traced (outside a step nothing calls it).
    """

    axis: str

    def order(self, length: int, mesh: Mesh, api: str):
        """The global position held by each slot of a length-``length`` sequence (a numpy
        int array), or None when the sequence stays in its natural order."""

    def attention(self, query, key, value, *, causal: bool, scale: float | None, mesh: Mesh):
        """Attention over ``[B, T, H, K]`` arrays whose sequence is split over ``axis``."""

    def natural(self, x, mesh: Mesh, api: str):
        """``x`` (sequence on axis 1, in the split order) back in natural order."""

    def check(self, strategies: tuple["Strategy", ...]) -> None:
        """Raises ``ValueError`` when ``strategies`` (being composed) cannot run with it."""


class ExpertSharding(Protocol):
    """How expert parallelism moves an MoE layer's tokens to its experts and back.

    ``parallax.strategies.expert_dispatch.ExpertExchange`` implements it. Its axis is a
    batch axis for every other layer and shards the ``"expert"`` logical axis of the MoE
    weights; inside the explicit step's ``shard_map`` (the axis manual) an MoE layer calls
    ``exchange(slots, run)`` with its ``[G, E, C, D]`` slots and ``run``, its local
    experts.
    """

    axis: str

    def exchange(self, slots: jax.Array, run: Callable) -> jax.Array:
        """``run`` applied to every slot by the device holding its expert, back in place."""


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How a train step is laid out on a mesh. Build with the factories, merge with compose.

    Attributes:
      name: a readable description (``"DataParallel('data') + ZeRO(3, 'fsdp')"``).
      rules: logical axis -> mesh axes, as a tuple of pairs (immutable, ordered).
      batch_axes: mesh axes that split the batch's leading dimension, in mesh order.
      zero: ZeRO's sharding of the training state (None: nothing sharded).
      style: ``"explicit"`` or ``"gspmd"`` (see the module docstring); None = no preference.
      grad_fn: optional gradient producer ``grad_fn(request, params, batch)``.
      microbatches: micro-batches per device slice that ``grad_fn`` uses (1 without one).
      grad_sync: optional ``grad_sync(grads, axes) -> grads`` that sums gradients over the
        batch axes in the explicit style (None: one ``psum`` per leaf).
      param_checks: per-parameter checks run by ``px.init``, ``px.shard`` and
        ``px.train_step`` before the generic divisibility check of the rules.
      param_names: sources of names for unannotated parameters (tensor-parallel plans).
      layout_checks: checks of the whole parameter layout.
      module_hooks: preparations of the module rebuilt inside ``px.value_and_grad``.
      precision: a ``parallax.precision.Policy`` (None: every dtype as the model has it).
      sequence_split: context parallelism's split of the sequence (None: whole).
      experts: expert parallelism's token exchange (None: experts run where the tokens are).
    """

    name: str = "Replicated()"
    rules: Rules = ()
    batch_axes: tuple[str, ...] = ()
    zero: StateSharding | None = None
    style: str | None = None
    grad_fn: Callable | None = None
    microbatches: int = 1
    grad_sync: Callable | None = None
    param_checks: tuple[Callable, ...] = ()
    param_names: tuple[Callable, ...] = ()
    layout_checks: tuple[Callable, ...] = ()
    module_hooks: tuple[Callable, ...] = ()
    precision: object | None = None
    sequence_split: SequenceSplit | None = None
    experts: ExpertSharding | None = None

    @property
    def rule_table(self) -> dict[str, MeshAxes]:
        return dict(self.rules)

    @property
    def activation_rules(self) -> dict[str, MeshAxes]:
        """The rules, plus ``"batch"`` -> the batch axes."""
        table = self.rule_table
        table.setdefault("batch", self.batch_axes or None)
        return table

    @property
    def zero_stage(self) -> int:
        """0 (nothing sharded), 1, 2 or 3."""
        return self.zero.stage if self.zero is not None else 0

    @property
    def shard_axis(self) -> str | None:
        """The mesh axis ZeRO shards over (None without ZeRO)."""
        return self.zero.axis if self.zero is not None else None

    @property
    def sync_style(self) -> str:
        return self.style or "explicit"

    def mesh_axes(self) -> tuple[str, ...]:
        """Every mesh axis the strategy names."""
        named = list(self.batch_axes)
        if self.shard_axis:
            named.append(self.shard_axis)
        for _, axes in self.rules:
            named.extend(as_tuple(axes))
        return tuple(dict.fromkeys(named))

    def validate(self, mesh: Mesh, api: str) -> None:
        """Checks that every mesh axis the strategy names exists in ``mesh``."""
        for axis in self.mesh_axes():
            if axis not in mesh.shape:
                raise ValueError(
                    f"{api}: the strategy {self.name} uses mesh axis {axis!r}, but the mesh "
                    f"is {describe(mesh)}; add {axis}=N (or {axis}=1) to px.make_mesh, or "
                    "name an axis the mesh has."
                )

    def __repr__(self) -> str:
        return self.name


def _order(axes) -> tuple[str, ...]:
    known = [a for a in AXIS_ORDER if a in axes]
    return tuple(known + [a for a in axes if a not in known])


def compose(*strategies: Strategy) -> Strategy:
    """Merges strategies into one, as ``optax.chain`` chains transformations.

    Rule tables are merged; batch axes are joined (in mesh order); at most one ZeRO and one
    gradient producer may be present. Anything two strategies claim differently is an error,
    never a silent override.

    Raises:
      TypeError: an argument is not a Strategy.
      ValueError: a logical axis mapped to two different mesh axes, a mesh axis claimed
        twice or used both for the batch and for a parameter rule, two ZeRO stages, two
        gradient producers, two sync styles, two precision policies, two context
        parallelisms, or one that the others cannot run with (its ``check`` says why).

    Example:
      >>> import parallax as px
      >>> hsdp = px.compose(px.DataParallel("data"), px.FSDP("fsdp"))
      >>> hsdp.batch_axes
      ('data', 'fsdp')
    """
    for s in strategies:
        if not isinstance(s, Strategy):
            raise TypeError(
                f"px.compose: expected Strategy values (px.DataParallel, px.ZeRO, ...), got "
                f"{type(s).__name__}: {s!r}."
            )
    if not strategies:
        return Strategy()
    name = " + ".join(s.name for s in strategies)
    splits = [s for s in strategies if s.sequence_split is not None]
    if len(splits) > 1:
        raise ValueError(
            f"px.compose: {splits[0].name} and {splits[1].name} both split the sequence's "
            "attention; keep one (one ContextParallel over one mesh axis).")
    if splits:  # before the rules: it names the fix for a clash over "sequence"
        splits[0].sequence_split.check(strategies)
    rules: dict[str, MeshAxes] = {}
    owner: dict[str, Strategy] = {}
    for s in strategies:
        for logical, axes in s.rules:
            if logical in rules and as_tuple(rules[logical]) != as_tuple(axes):
                raise ValueError(
                    f"px.compose: conflicting rules for logical axis {logical!r}: "
                    f"{owner[logical].name} maps it to {rules[logical]!r} and {s.name} maps it "
                    f"to {axes!r}. A logical axis can be sharded one way; drop one of the "
                    "strategies or give one of them another mesh axis."
                )
            rules[logical], owner[logical] = axes, s
    batch: dict[str, Strategy] = {}
    for s in strategies:
        for axis in s.batch_axes:
            if axis in batch:
                raise ValueError(
                    f"px.compose: mesh axis {axis!r} splits the batch in both "
                    f"{batch[axis].name} and {s.name}; each mesh axis can be claimed once."
                )
            batch[axis] = s
    experts = list(dict.fromkeys(s.experts for s in strategies if s.experts is not None))
    if len(experts) > 1:
        raise ValueError(
            f"px.compose: two expert exchanges ({experts[0]!r}, {experts[1]!r}); experts are "
            "split over one mesh axis: keep one px.ExpertParallel.")
    # Expert parallelism's axis splits the batch AND the experts (GShard): not a conflict.
    shared = {("expert", experts[0].axis)} if experts else set()
    for logical, axes in rules.items():
        for axis in as_tuple(axes):
            if axis in batch and (logical, axis) not in shared:
                raise ValueError(
                    f"px.compose: mesh axis {axis!r} splits the batch in {batch[axis].name} "
                    f"and shards logical axis {logical!r} in {owner[logical].name}; use a "
                    "different mesh axis for one of them."
                )
    zeros = [s for s in strategies if s.zero is not None]
    if len(zeros) > 1:
        raise ValueError(
            f"px.compose: two ZeRO strategies ({zeros[0].name}, {zeros[1].name}); keep one "
            "(HSDP is compose(DataParallel('data'), ZeRO(3, 'fsdp')))."
        )
    producers = [s for s in strategies if s.grad_fn is not None]
    if len(producers) > 1:
        raise ValueError(
            f"px.compose: {producers[0].name} and {producers[1].name} both decide how "
            "gradients are produced; keep one."
        )
    syncs = list(dict.fromkeys(s.grad_sync for s in strategies if s.grad_sync is not None))
    if len(syncs) > 1:
        raise ValueError(
            f"px.compose: two different gradient syncs ({syncs[0]!r} and {syncs[1]!r}); one "
            "sync sums the gradients over all batch axes, so pass sync= to one strategy."
        )
    styles = {s.style for s in strategies if s.style}
    if len(styles) > 1:
        raise ValueError(
            f"px.compose: the strategies ask for different sync styles {sorted(styles)}; "
            "pass the same style= to each."
        )
    if syncs and "gspmd" in styles:
        raise ValueError(
            f"px.compose: {name} has a gradient sync ({syncs[0]!r}) and style='gspmd', which "
            "leaves the gradient sum to XLA; use the explicit style (the default) with sync=."
        )
    policies = list(dict.fromkeys(s.precision for s in strategies if s.precision is not None))
    if len(policies) > 1:
        raise ValueError(
            f"px.compose: two different precision policies ({policies[0]!r} and "
            f"{policies[1]!r}); a step computes in one set of dtypes, so keep one "
            "px.MixedPrecision.")
    return Strategy(
        name=name,
        rules=tuple(rules.items()),
        batch_axes=_order(batch),
        zero=zeros[0].zero if zeros else None,
        style=styles.pop() if styles else None,
        grad_fn=producers[0].grad_fn if producers else None,
        microbatches=producers[0].microbatches if producers else 1,
        grad_sync=syncs[0] if syncs else None,
        param_checks=tuple(dict.fromkeys(c for s in strategies for c in s.param_checks)),
        param_names=tuple(dict.fromkeys(c for s in strategies for c in s.param_names)),
        layout_checks=tuple(dict.fromkeys(c for s in strategies for c in s.layout_checks)),
        module_hooks=tuple(dict.fromkeys(c for s in strategies for c in s.module_hooks)),
        precision=policies[0] if policies else None,
        sequence_split=splits[0].sequence_split if splits else None,
        experts=experts[0] if experts else None,
    )


def check_style(api: str, style: str | None) -> str | None:
    if style is not None and style not in STYLES:
        raise ValueError(f"{api}: style={style!r} must be one of {STYLES} (or None).")
    return style
