"""What a train step is, read once for the formulas: mesh, strategy, state, batch, model.

:func:`read_setting` turns ``(mesh, strategy, state, batch)`` into a :class:`StepSetting`:
the sizes of the data, ZeRO, tensor and pipeline parts, every state leaf with its role
(parameter, optimizer state, other) and the mesh axes the strategy's rules split it over,
the batch's leaves, and the model's configuration when it is ``px.models.GPT`` (or
``px.nn.ParallelGPT``) or ``px.models.Llama`` (whose sizes the GPT's activation and
Megatron formulas read as they are: SwiGLU's third matrix and GQA's smaller k/v are not in
them), and the context-parallel and expert axes when the strategy has them.
:mod:`parallax.planner.predicted` (memory, traffic, compute, and each parallelism's own
file) computes the formulas from it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from parallax import layout
from parallax.analysis.program import PipelineBranches
from parallax.models.gpt_config import GPTConfig
from parallax.models.llama_config import LlamaConfig
from parallax.pipeline import Schedule
from parallax.pipeline.producer import PipelineProducer
from parallax.planner.schedule_facts import ScheduleFacts, facts, of_table
from parallax.rules import LAYERS, as_tuple
from parallax.strategy import Strategy


@dataclasses.dataclass(frozen=True)
class PipelineSetting:
    """A ``px.Pipeline`` part: its axis, sizes, schedule and rematerialisation option.

    ``schedule`` holds the schedule's facts (ticks, bubble, peak in flight, ring rows:
    :mod:`parallax.planner.schedule_facts`), read from its table or, for the
    published schedules at sizes whose tables take seconds to build, from closed forms."""

    axis: str
    stages: int
    microbatches: int
    virtual_stages: int
    schedule: ScheduleFacts
    remat: str
    policy: object = None  # the checkpoint policy applied inside every layer (or None)
    policy_name: str = ""  # its jax.checkpoint_policies name, when given by name

    @property
    def remat_fraction(self) -> float:
        """Fraction of micro-batches whose forward is recomputed: torchgpipe's options, and
        ``"nothing_saveable"`` (every layer keeps only its input and recomputes its forward
        in its backward: Megatron's full recomputation). Other policies recompute part of
        a layer, which is not counted."""
        m = self.microbatches
        if self.remat == "policy":
            return 1.0 if self.policy_name == "nothing_saveable" else 0.0
        return {"always": 1.0, "except_last": (m - 1) / m}.get(self.remat, 0.0)

    def branches(self) -> PipelineBranches:
        return PipelineBranches(self.schedule.ticks, self.stages, self.microbatches,
                                self.virtual_stages, self.remat_fraction,
                                fused=not self.schedule.split_backward)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One state leaf: ``role`` is ``"param"``, ``"opt"`` or ``"other"``; ``rule_ways`` the
    devices the strategy's rules (tensor, pipeline) split it over; ``zero_split`` whether
    the layout really shards it over ZeRO's axis (a leaf with no divisible dimension is not)."""

    path: str
    role: str
    nbytes: int
    itemsize: int
    rule_ways: int
    stacked: bool
    zero_split: bool
    axes: tuple[str, ...] = ()  # the mesh axes the rules split it over (ZeRO's left out)
    expert: bool = False  # an MoE layer's stacked experts (logical axis "expert")


@dataclasses.dataclass(frozen=True)
class StepSetting:
    """The sizes and leaves the formulas need (see the module docstring)."""

    mesh_shape: dict
    backend: str
    strategy: Strategy
    leaves: tuple[Leaf, ...]
    batch_bytes: int
    batch_rows: int
    seq_len: int | None
    config: GPTConfig | LlamaConfig | None
    pipeline: PipelineSetting | None
    accumulation: int

    def size(self, axes) -> int:
        return math.prod(self.mesh_shape.get(a, 1) for a in as_tuple(axes))

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The batch axes of size > 1 (a collective over a size-1 axis does not exist)."""
        return tuple(a for a in self.strategy.batch_axes if self.mesh_shape.get(a, 1) > 1)

    @property
    def zero_axis(self) -> str | None:
        axis = self.strategy.shard_axis
        return axis if axis and self.mesh_shape.get(axis, 1) > 1 else None

    @property
    def zero_stage(self) -> int:
        return self.strategy.zero_stage if self.zero_axis else 0

    @property
    def tensor_axis(self) -> str | None:
        table = self.strategy.rule_table
        axes = as_tuple(table.get("heads") or table.get("mlp"))
        return axes[0] if axes and self.mesh_shape.get(axes[0], 1) > 1 else None

    @property
    def tensor(self) -> int:
        return self.size(self.tensor_axis) if self.tensor_axis else 1

    @property
    def sequence_parallel(self) -> bool:
        # Megatron's sequence parallelism maps "sequence" to the tensor axis (context
        # parallelism maps it to its own axis: no Megatron all-gathers then).
        return (self.tensor_axis is not None
                and self.tensor_axis in as_tuple(self.strategy.rule_table.get("sequence")))

    @property
    def context_axis(self) -> str | None:
        """``px.ContextParallel``'s axis when it has more than one device (else None)."""
        split = self.strategy.sequence_split
        axis = getattr(split, "axis", None)
        return axis if axis and self.mesh_shape.get(axis, 1) > 1 else None

    @property
    def context(self) -> int:
        return self.size(self.context_axis) if self.context_axis else 1

    @property
    def context_method(self) -> str | None:
        return self.strategy.sequence_split.method if self.context_axis else None

    @property
    def expert_axis(self) -> str | None:
        """``px.ExpertParallel``'s axis when it has more than one device (else None)."""
        axis = getattr(self.strategy.experts, "axis", None)
        return axis if axis and self.mesh_shape.get(axis, 1) > 1 else None

    @property
    def moe(self):
        """The model's ``MoEConfig`` (a GPT with MoE blocks), else None."""
        return getattr(self.config, "moe", None)

    @property
    def local_seq_len(self) -> int | None:
        """Positions of a sequence on one device (``T / CP``)."""
        return None if self.seq_len is None else self.seq_len // self.context

    @property
    def stages(self) -> int:
        return self.pipeline.stages if self.pipeline else 1

    @property
    def rows_per_device(self) -> int:
        """Examples of the batch each device computes (the batch over the batch axes)."""
        return self.batch_rows // self.size(self.batch_axes)


def _pipeline(strategy: Strategy, mesh_shape: dict) -> PipelineSetting | None:
    """The pipeline's settings: ``px.Pipeline``'s gradient producer is a
    :class:`~parallax.pipeline.producer.PipelineProducer` value that holds them
    (``producer.settings``)."""
    producer = strategy.grad_fn
    if not isinstance(producer, PipelineProducer):
        return None
    settings = producer.settings
    stages = mesh_shape.get(settings.axis, 1)
    micro = int(settings.microbatches)
    sched = settings.schedule
    if isinstance(sched, Schedule):
        sched = of_table(sched)
    else:
        split = settings.split_backward
        sched = facts(sched, stages, micro, settings.virtual_stages,
                      None if split is None else bool(split))
    remat = settings.remat
    mode = remat if remat in ("always", "except_last", "never") else "policy"
    return PipelineSetting(settings.axis, stages, micro, sched.virtual_stages, sched, mode,
                           settings.policy, remat if isinstance(remat, str) else "")


def model_config(state) -> GPTConfig | LlamaConfig | None:
    """The config of a ``px.TrainState`` holding a ``px.models.GPT`` or ``Llama`` (else None)."""
    graphdef = getattr(state, "graphdef", None)
    if graphdef is None:
        return None
    try:
        model = nnx.merge(graphdef, state.params, state.rest)
    except Exception:  # noqa: BLE001 (a model that cannot be rebuilt has no config to read)
        return None
    config = getattr(model, "config", None)
    return config if isinstance(config, (GPTConfig, LlamaConfig)) else None


def read_setting(mesh, strategy: Strategy, state, batch, config: GPTConfig | None = None,
                 api: str = "px.explain", backend: str | None = None) -> StepSetting:
    """Reads a step's :class:`StepSetting` (``state`` and ``batch`` may be abstract; ``mesh``
    may be a ``jax.sharding.AbstractMesh`` when ``backend`` is given).

    Args:
      mesh: the step's mesh.
      strategy: its strategy.
      state, batch: the step's arguments (arrays or ``jax.ShapeDtypeStruct``).
      config: the ``GPTConfig`` (read from a GPT state when omitted).
      api: the name used in error messages.
      backend: the platform, when ``mesh`` has no devices.

    Returns:
      A :class:`StepSetting`.

    Example:
      >>> import jax.numpy as jnp, parallax as px
      >>> s = read_setting(px.make_mesh(data=2, tensor=4), px.compose(
      ...     px.DataParallel("data"), px.TensorParallel("tensor")),
      ...     {"w": jnp.ones((8, 8))}, {"x": jnp.ones((4, 8))})
      >>> s.batch_axes, s.tensor_axis, s.rows_per_device, [x.role for x in s.leaves]
      (('data',), 'tensor', 2, ['param'])
    """
    shape = dict(mesh.shape)
    lay = layout.state_layout(state, strategy, mesh, api)
    zero_axis = strategy.shard_axis
    layers_axis = next((as_tuple(a)[0] for name, a in strategy.rules if name == LAYERS), None)
    expert_axis = getattr(strategy.experts, "axis", None)
    leaves = []
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    params = iter(lay.params)
    for (path, leaf), spec, role in zip(paths, lay.specs, lay.roles):
        axes = [a for entry in spec for a in as_tuple(entry)]
        # A parameter's own spec holds ZeRO's axis only at stage 3; its layout says whether
        # ZeRO can split it at all (the same dimension serves gradients and moments).
        zero_split = (next(params).shard_dim is not None if role == "param"
                      else zero_axis in axes)
        split = tuple(a for a in axes if a != zero_axis)
        rule_ways = math.prod(shape[a] for a in split)
        itemsize = jnp.dtype(leaf.dtype).itemsize
        nbytes = math.prod(leaf.shape) * itemsize
        leaves.append(Leaf(jax.tree_util.keystr(path), role, nbytes, itemsize, rule_ways,
                           layers_axis is not None and layers_axis in axes, zero_split,
                           split, role == "param" and expert_axis is not None
                           and expert_axis in axes))
    batch_leaves = jax.tree.leaves(batch)
    rows = int(batch_leaves[0].shape[0]) if batch_leaves and batch_leaves[0].ndim else 0
    tokens = batch.get("tokens") if isinstance(batch, dict) else None
    seq = int(tokens.shape[1]) - 1 if tokens is not None and tokens.ndim == 2 else None
    pipeline = _pipeline(strategy, shape)
    accumulation = 1 if pipeline else max(int(strategy.microbatches), 1)
    return StepSetting(
        mesh_shape=shape,
        backend=backend or mesh.devices.flat[0].platform,
        strategy=strategy,
        leaves=tuple(leaves),
        batch_bytes=sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in batch_leaves),
        batch_rows=rows,
        seq_len=seq,
        config=config if config is not None else model_config(state),
        pipeline=pipeline,
        accumulation=accumulation,
    )


def reread(base: StepSetting, strategy: Strategy) -> StepSetting:
    """``base`` with another strategy that splits the state as ``base``'s does (the same
    rules and ZeRO: only its pipeline part or micro-batches differ), without reading the
    state's layout again (``px.plan`` compares thousands of such candidates)."""
    pipeline = _pipeline(strategy, base.mesh_shape)
    return dataclasses.replace(base, strategy=strategy, pipeline=pipeline,
                               accumulation=1 if pipeline else max(int(strategy.microbatches), 1))
