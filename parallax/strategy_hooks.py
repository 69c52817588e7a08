"""What a strategy hands the core to call: its mechanisms' protocols and its model hooks.

The core (``layout``, ``grad``, ``step``, ``attention``) never imports
``parallax.strategies``; a parallelism reaches it through values held in a
:class:`parallax.strategy.Strategy`. Each single-valued one is typed by a protocol here
(:class:`StateSharding` for ZeRO, :class:`SequenceSplit` for context parallelism,
:class:`ExpertSharding` for expert parallelism, :class:`Float8Weights` for float8); the many-valued ones, checks and
preparations of the model that every strategy of a composition adds, travel together as one
:class:`ModelHooks` value that ``compose`` concatenates.

Example:
  >>> from parallax.strategy_hooks import ModelHooks
  >>> check = lambda names, shape, mesh, *, path, api: None
  >>> hooks = ModelHooks(param_checks=(check,))
  >>> (hooks + hooks).param_checks == (check,)
  True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import jax
from jax.sharding import Mesh


class StateSharding(Protocol):
    """How a ZeRO-like strategy shards training state over one batch axis.

    ``parallax.strategies.zero.ZeroSharding`` implements it. The layout asks it which
    dimension of each leaf to shard, which roles are sharded and in which memory each role
    lives between steps (ZeRO-Offload); the explicit gradient sync calls ``gather`` (inside
    ``shard_map``, before the forward pass) and ``scatter`` (after the backward pass) on
    leaves whose role it shards.
    """

    stage: int
    axis: str

    def shards(self, role: str) -> bool:
        """Whether leaves of ``role`` (``"opt"``, ``"grad"``, ``"param"``) are sharded."""

    def memory_kind(self, role: str) -> str | None:
        """The memory kind leaves of ``role`` live in between steps (``"pinned_host"``),
        or None for the devices' own memory."""

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

    def check(self, strategies: tuple) -> None:
        """Raises ``ValueError`` when ``strategies`` (being composed) cannot run with it."""


class ExpertSharding(Protocol):
    """How expert parallelism moves an MoE layer's tokens to its experts and back.

    ``parallax.strategies.expert_dispatch.ExpertExchange`` implements it. Its axis is a
    batch axis for every other layer and shards the ``"expert"`` logical axis of the MoE
    weights; inside the explicit step's ``shard_map`` (the axis manual) an MoE layer calls
    ``exchange(slots, run)`` with its ``[G, E, C, D]`` slots and ``run``, its local
    experts. Dropless layers also read ``dropless_exchange(mesh)`` and
    ``ragged_all_to_all()`` where the value has them (ragged or rounds); without them they
    run in rounds through ``exchange``.
    """

    axis: str

    def exchange(self, slots: jax.Array, run: Callable) -> jax.Array:
        """``run`` applied to every slot by the device holding its expert, back in place."""


class Float8Weights(Protocol):
    """Which weights ZeRO 3 all-gathers in float8, and how (``px.Float8``).

    ``parallax.strategies.float8.Float8Matmuls`` implements it; the explicit style's
    parameter gather calls it inside its ``shard_map``.
    """

    def gathered_kernels(self, model) -> dict[str, int]:
        """``{dotted parameter path: leading stacked dims}`` of the weights to gather in
        float8 (empty: none)."""

    def gather(self, shard: jax.Array, gather: Callable, axis: str, stacked: int) -> jax.Array:
        """The full weight from ``shard``, ``gather`` (ZeRO's all-gather) moving float8."""


@dataclasses.dataclass(frozen=True)
class ModelHooks:
    """Checks and preparations a strategy adds to every model it lays out.

    Every strategy of a composition may add some; ``+`` concatenates them, keeping each
    distinct entry once (entries are values, e.g. ``MegatronCheck("tensor")``, so equal
    strategies compare equal and a check composed twice runs once).

    Attributes:
      param_checks: run by ``px.init``, ``px.shard`` and ``px.train_step`` on every annotated
        parameter before the rules' generic divisibility check, as ``check(names, shape,
        mesh, path=..., api=...)``; they raise with a fix specific to the strategy (tensor
        parallel: pad the vocabulary, change the head count).
      param_names: sources of logical names for parameters the model did not annotate,
        called as ``names(model, api) -> {dotted parameter path: names}`` with the NNX
        module (``TensorParallel(plan=...)``: Megatron's styles by module path).
      layout_checks: checks of the whole parameter layout, called as ``check(layouts, mesh,
        api=, prefix=, model=)`` with the NNX module when there is one (``TensorParallel``:
        something must be split over its axis).
      before_loss: called as ``hook(model)`` on the NNX module ``px.value_and_grad``
        rebuilds inside the traced loss, before the loss runs (a tensor-parallel plan with
        sequence parallelism pins activation layouts on the stock modules it styles).
      after_grad: called as ``hook(model)`` on the NNX module the user passed to
        ``px.value_and_grad``, once per call, after the state the forward and backward
        passes wrote is back in it (outside any ``shard_map``): state updates that need the
        whole step (``px.Float8(delayed=True)``: the amax histories roll and the scales of
        the next step are computed, as Transformer Engine does after a step).
      name_choices: per-array choices that need the sizes, called as ``choose(names,
        shape, mesh) -> names`` on every parameter (after ``param_checks``) and every
        activation ``px.constrain`` resolves, before the rules map the names
        (``TensorParallel``: key/value heads split when the tensor size divides them, kept
        whole when it does not).
    """

    param_checks: tuple[Callable, ...] = ()
    param_names: tuple[Callable, ...] = ()
    layout_checks: tuple[Callable, ...] = ()
    before_loss: tuple[Callable, ...] = ()
    after_grad: tuple[Callable, ...] = ()
    name_choices: tuple[Callable, ...] = ()

    def choose_names(self, names, shape, mesh):
        """``names`` after every ``name_choices`` entry (unchanged without any)."""
        if names is None:
            return names
        for choose in self.name_choices:
            names = choose(tuple(names), tuple(shape), mesh)
        return names

    def __add__(self, other: ModelHooks) -> ModelHooks:
        return ModelHooks(*(tuple(dict.fromkeys(getattr(self, f.name) + getattr(other, f.name)))
                            for f in dataclasses.fields(self)))
