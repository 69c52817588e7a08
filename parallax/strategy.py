"""A strategy is a small immutable value; ``compose`` merges several, like ``optax.chain``.

A :class:`Strategy`'s fields are of three kinds, and ``compose`` merges each kind one way:

- the rule table (``rules``: logical axis -> mesh axes; tensor parallel maps ``"heads"``,
  ``"mlp"``, ``"vocab"`` to ``"tensor"``) and the batch axes (``batch_axes``: data parallel,
  and ZeRO's axis, since every ZeRO rank sees its own slice of the batch) are joined: a
  logical axis mapped two ways or a mesh axis claimed twice is an error;
- the single-valued fields, one row each of :data:`SINGLE_VALUED` (ZeRO's sharding, the sync
  style, the gradient producer and sync, the precision policy, the context and expert
  parallelisms' mechanisms): strategies may agree on a value, never differ;
- ``model_hooks``, a :class:`parallax.strategy_hooks.ModelHooks` (checks and preparations of
  the model), concatenated.

The few rules that tie fields together stay explicit in ``compose``: a mesh axis splits the
batch or shards a rule, not both, except expert parallelism's (GShard's layout); a gradient
sync needs the explicit style; context parallelism's mechanism vetoes what it cannot run with.
The core calls each mechanism through a protocol of :mod:`parallax.strategy_hooks` and never
imports ``parallax.strategies``, so a new parallelism adds a field, a row of
:data:`SINGLE_VALUED` and its own folder, not a branch of ``compose``.

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

from jax.sharding import Mesh

from parallax.mesh import AXIS_ORDER, describe
from parallax.rules import MeshAxes, Rules, as_tuple
from parallax.strategy_hooks import ExpertSharding as ExpertSharding
from parallax.strategy_hooks import Float8Weights as Float8Weights
from parallax.strategy_hooks import ModelHooks as ModelHooks
from parallax.strategy_hooks import SequenceSplit as SequenceSplit
from parallax.strategy_hooks import StateSharding as StateSharding

STYLES = ("explicit", "gspmd")
ROLES = ("opt", "grad", "param")  # the parts of a training state a strategy may shard


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How a train step is laid out on a mesh. Build with the factories, merge with compose.

    Attributes:
      name: a readable description (``"DataParallel('data') + ZeRO(3, 'fsdp')"``).
      rules: logical axis -> mesh axes, as a tuple of pairs (immutable, ordered).
      batch_axes: mesh axes that split the batch's leading dimension, in mesh order.
      zero: what ZeRO shards over its axis (1: optimizer state, 2: + gradients,
        3: + parameters) and its mechanism (None: nothing sharded); ``zero_stage`` and
        ``shard_axis`` read it.
      style: how gradients are synchronised over the batch axes; None = no preference.
        ``"explicit"`` (the default) computes local gradients inside ``shard_map`` and issues
        the collectives itself (``psum`` for data parallel, ``psum_scatter`` for ZeRO 2/3,
        ``all_gather`` of parameters for ZeRO 3), so the compiled program holds exactly
        those collectives on every backend; ``"gspmd"`` leaves the batch axes to XLA.
      grad_fn: optional replacement of how gradients are produced on each device's slice of
        the batch (gradient accumulation; pipeline schedules), called as
        ``grad_fn(request, params, batch)`` with a ``parallax.grad.GradRequest``.
      microbatches: micro-batches per device slice that ``grad_fn`` uses (1 without one;
        checked against the batch up front).
      grad_sync: optional ``grad_sync(grads, axes) -> grads`` that sums gradients over the
        batch axes in the explicit style, inside the step's ``shard_map`` (None: one
        ``psum`` per leaf; ``px.BucketedSync``: DDP's buckets, Horovod's fusion).
      model_hooks: checks and preparations of the model (parameter checks, names for
        unannotated parameters, layout checks, module preparations before the loss).
      precision: a ``parallax.precision.Policy`` (None: every dtype as the model has it),
        applied by ``px.value_and_grad``.
      sequence_split: context parallelism's split of the sequence, which
        ``parallax.attention`` calls (None: whole).
      experts: expert parallelism's token exchange: its axis splits both the batch and the
        ``"expert"`` dimension of MoE weights (None: experts run where the tokens are).
      float8: ``px.Float8``'s recipe as the core sees it (which weights ZeRO 3 gathers in
        float8); the matmuls themselves are switched by its model hook (None: no float8).
    """

    name: str = "Replicated()"
    rules: Rules = ()
    batch_axes: tuple[str, ...] = ()
    zero: StateSharding | None = None
    style: str | None = None
    grad_fn: Callable | None = None
    microbatches: int = 1
    grad_sync: Callable | None = None
    model_hooks: ModelHooks = ModelHooks()
    precision: object | None = None
    sequence_split: SequenceSplit | None = None
    experts: ExpertSharding | None = None
    float8: Float8Weights | None = None

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


@dataclasses.dataclass(frozen=True)
class SingleValued:
    """A field of which a composition holds one value: a row of :data:`SINGLE_VALUED`.

    Attributes:
      field: the :class:`Strategy` field.
      clash: what two holders are, for the error; formatted with ``a``, ``b`` (the two
        strategies' names), ``va``, ``vb`` (their values) and ``values`` (both, sorted).
      fix: what to do about it.
      shared: several strategies may hold one value (one sync for every batch axis); when
        False, one strategy owns the field and a second is an error even with an equal value.
    """

    field: str
    clash: str
    fix: str
    shared: bool = True


# One row per single-valued field, keyed by it; a new parallelism's mechanism adds its row
# here. The order is the order in which clashes are reported.
SINGLE_VALUED = {row.field: row for row in (
    SingleValued("sequence_split", "{a} and {b} both split the sequence's attention",
                 "keep one (one ContextParallel over one mesh axis).", shared=False),
    SingleValued("zero", "two ZeRO strategies ({a}, {b})",
                 "keep one (HSDP is compose(DataParallel('data'), ZeRO(3, 'fsdp'))).",
                 shared=False),
    # Not shared: micro-batch counts travel with their producer.
    SingleValued("grad_fn", "{a} and {b} both decide how gradients are produced", "keep one.",
                 shared=False),
    SingleValued("grad_sync", "two different gradient syncs ({va!r} and {vb!r})",
                 "one sync sums the gradients over all batch axes, so pass sync= to one "
                 "strategy."),
    SingleValued("style", "the strategies ask for different sync styles {values}",
                 "pass the same style= to each."),
    SingleValued("precision", "two different precision policies ({va!r} and {vb!r})",
                 "a step computes in one set of dtypes, so keep one px.MixedPrecision."),
    SingleValued("experts", "two expert exchanges ({va!r}, {vb!r})",
                 "experts are split over one mesh axis: keep one px.ExpertParallel."),
    SingleValued("float8", "two different float8 recipes ({va!r} and {vb!r})",
                 "a step's matmuls follow one recipe: keep one px.Float8."),
)}


def compose(*strategies: Strategy) -> Strategy:
    """Merges strategies into one, as ``optax.chain`` chains transformations.

    Rule tables are merged; batch axes are joined (in mesh order); each single-valued field
    (:data:`SINGLE_VALUED`) takes the one value its strategies give it; model hooks are
    concatenated. Anything two strategies claim differently is an error, never a silent
    override.

    Raises:
      TypeError: an argument is not a Strategy.
      ValueError: a logical axis mapped to two different mesh axes, a mesh axis claimed
        twice or used both for the batch and for a parameter rule, two values of a
        single-valued field (two ZeRO stages, gradient producers, syncs, sync styles,
        precision policies, context or expert parallelisms), a gradient sync with
        style='gspmd', or a context parallelism the others cannot run with.

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
    # Before the rules: context parallelism names the fix for a clash over "sequence" (a
    # second split, Megatron's sequence parallelism) that the rules would call a conflict.
    split = _holder(strategies, SINGLE_VALUED["sequence_split"])
    if split is not None:
        split.sequence_split.check(strategies)
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
    holders = {field: _holder(strategies, row) for field, row in SINGLE_VALUED.items()}
    one = {field: getattr(s, field) if s else None for field, s in holders.items()}
    # Expert parallelism's axis splits the batch AND the experts (GShard): not a conflict.
    gshard = {("expert", one["experts"].axis)} if one["experts"] else set()
    for logical, axes in rules.items():
        for axis in as_tuple(axes):
            if axis in batch and (logical, axis) not in gshard:
                raise ValueError(
                    f"px.compose: mesh axis {axis!r} splits the batch in {batch[axis].name} "
                    f"and shards logical axis {logical!r} in {owner[logical].name}; use a "
                    "different mesh axis for one of them."
                )
    name = " + ".join(s.name for s in strategies)
    if one["grad_sync"] is not None and one["style"] == "gspmd":
        raise ValueError(
            f"px.compose: {name} has a gradient sync ({one['grad_sync']!r}) and style='gspmd', "
            "which leaves the gradient sum to XLA; use the explicit style (the default) with "
            "sync=."
        )
    producer = holders["grad_fn"]
    return Strategy(name=name, rules=tuple(rules.items()), batch_axes=_order(batch),
                    microbatches=producer.microbatches if producer else 1,
                    model_hooks=sum((s.model_hooks for s in strategies), ModelHooks()), **one)


def _holder(strategies: tuple[Strategy, ...], row: SingleValued) -> Strategy | None:
    """The first strategy holding a value of ``row.field`` (None: none does).

    Raises:
      ValueError: a second strategy holds a different value (any value, unless shared).
    """
    held: list[Strategy] = []
    for s in strategies:
        value = getattr(s, row.field)
        if value is not None and not (
                row.shared and any(value == getattr(h, row.field) for h in held)):
            held.append(s)
    if len(held) > 1:
        (a, b), (va, vb) = held[:2], (getattr(s, row.field) for s in held[:2])
        clash = row.clash.format(a=a.name, b=b.name, va=va, vb=vb,
                                 values=sorted([va, vb], key=repr))
        raise ValueError(f"px.compose: {clash}; {row.fix}")
    return held[0] if held else None


def _order(axes) -> tuple[str, ...]:
    known = [a for a in AXIS_ORDER if a in axes]
    return tuple(known + [a for a in axes if a not in known])


def check_style(api: str, style: str | None) -> str | None:
    if style is not None and style not in STYLES:
        raise ValueError(f"{api}: style={style!r} must be one of {STYLES} (or None).")
    return style
