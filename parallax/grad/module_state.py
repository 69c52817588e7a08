"""How an NNX module's non-parameter state flows through ``px.value_and_grad``.

A forward pass in training mode writes state: ``nnx.BatchNorm`` its running statistics
(``BatchStat``), ``nnx.Dropout`` and every ``rngs.<stream>()`` draw their counters
(``RngCount``), user ``nnx.Variable`` counters, ``sow``ed intermediates. As
``nnx.value_and_grad`` does, ``px.value_and_grad`` splits the module into its parameters
(differentiated) and the rest, rebuilds the module *inside* the traced loss (a module
rebuilt outside the trace cannot be written to from inside it: ``TraceContextError``),
returns the rest as it is after the forward pass, and writes it back into the module it
was given. ``px.TrainState.apply_gradients`` then stores it with the new parameters.

What the rest must equal is one device's run over the whole batch. The options that
decide it (:class:`StateOptions`) are:

- ``batch_stats``, which examples a batch statistic covers:

  - ``"global"`` (default): the whole batch of the step, as on one device and as
    ``SyncBatchNorm`` / ``SyncBatchNormalization``. Every ``nnx.BatchNorm`` reduces its
    statistics over the batch axes (its ``axis_name``; cost: one all-reduce of
    ``2 x features`` floats per layer forward, and one backward). Micro-batches cannot run
    one after another here (each layer's statistics need every example before the next
    layer runs), so with a BatchNorm in training mode they run as one computation:
    accumulation then saves no activation memory.
  - ``"per_replica"``: each batch shard's own statistics (PyTorch DDP's and TF
    ``MirroredStrategy``'s default): no communication in the forward pass; the running
    averages are averaged over shards at the end of the step (TF's ``MEAN`` aggregation).
  - ``"per_microbatch"``: each micro-batch of each shard (GPipe's): micro-batches run one
    after another with the state threaded through them, as a plain loop over them would
    (running averages and RNG counters advance once per micro-batch); accumulation keeps
    its memory saving.

- ``rng``, what a draw from the module's RNG streams gives:

  - ``"global"`` (default): one device's values over the whole batch, sliced for each
    shard and micro-batch (see :mod:`parallax.grad.sliced_rng`), at the cost of a local draw.
  - ``"per_shard"``: the key folded with the slice's index: independent streams, any
    draw shape, any PRNG implementation (``rbg``); the values differ from one device's.

In the GSPMD style (``style="gspmd"``) the forward pass runs on global shapes and both
defaults hold by construction (XLA reduces the statistics; threefry draws are
partitionable); ``"per_microbatch"`` statistics there cover each micro-batch of the whole
batch (no shard is seen), and ``"per_replica"`` needs the explicit style.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

BATCH_STATS = ("global", "per_replica", "per_microbatch")
RNG_MODES = ("global", "per_shard")


@dataclasses.dataclass(frozen=True)
class StateOptions:
    """How a module's batch statistics and random draws relate to one device's.

    Attributes:
      batch_stats: ``"global"``, ``"per_replica"`` or ``"per_microbatch"``.
      rng: ``"global"`` or ``"per_shard"``.

    Example:
      >>> StateOptions(batch_stats="per_replica")
      StateOptions(batch_stats='per_replica', rng='global')
    """

    batch_stats: str = "global"
    rng: str = "global"

    def __post_init__(self):
        if self.batch_stats not in BATCH_STATS:
            raise ValueError(
                f"px.value_and_grad: batch_stats={self.batch_stats!r} must be one of "
                f"{BATCH_STATS}: statistics over the whole batch (one device's, the default), "
                "over each batch shard (DDP's), or over each micro-batch (GPipe's).")
        if self.rng not in RNG_MODES:
            raise ValueError(
                f"px.value_and_grad: rng={self.rng!r} must be one of {RNG_MODES}: one "
                "device's draws on every shard (the default), or an independent stream per "
                "shard.")


def batch_norms(module: nnx.Module) -> list[nnx.BatchNorm]:
    """Every ``nnx.BatchNorm`` inside ``module``."""
    return [m for _, m in nnx.iter_modules(module) if isinstance(m, nnx.BatchNorm)]


def prepare(module: nnx.Module, options: StateOptions, axes: tuple[str, ...]) -> None:
    """Points every BatchNorm's ``axis_name`` at the axes its statistics cover.

    ``axes`` are the manual batch axes of the computation (none outside ``shard_map``).
    A user's own ``axis_name`` (written for ``pmap``) is replaced: inside a parallax step
    the batch axes are the only ones that split examples.
    """
    reduce_over = axes if options.batch_stats == "global" and axes else None
    if reduce_over is not None and len(reduce_over) == 1:
        reduce_over = reduce_over[0]
    for bn in batch_norms(module):
        bn.axis_name = reduce_over


def computes_statistics(module: nnx.Module | None) -> bool:
    """Whether a forward pass of ``module`` computes batch statistics (a BatchNorm in
    training mode)."""
    if module is None:
        return False
    return any(bn.use_running_average is not True for bn in batch_norms(module))


STATEFUL = (nnx.BatchStat, nnx.RngState)


@dataclasses.dataclass(frozen=True)
class Target:
    """What ``px.value_and_grad`` differentiates, split into parameters and the rest.

    Attributes:
      graphdef: the module's structure (None for a plain pytree of parameters).
      params: the ``nnx.Param`` state (or the pytree itself).
      state: the module's other state (None for a plain pytree).
      trains_statistics: a forward pass computes batch statistics (BatchNorm in training
        mode), so micro-batches under ``"global"`` / ``"per_replica"`` statistics run as
        one computation.
    """

    graphdef: Any
    params: Any
    state: Any
    trains_statistics: bool

    @classmethod
    def of(cls, target) -> Target:
        if isinstance(target, nnx.Module):
            graphdef, params, state = nnx.split(target, nnx.Param, ...)
            return cls(graphdef, params, state, computes_statistics(target))
        return cls(None, target, None, False)

    @property
    def is_module(self) -> bool:
        return self.graphdef is not None

    def stateful_paths(self) -> list[str]:
        """The paths of state a forward pass writes (``BatchStat``, RNG streams)."""
        if self.state is None:
            return []
        return ["/".join(map(str, path)) for path, v in nnx.to_flat_state(self.state)
                if isinstance(v, STATEFUL)]

    def has_stateful(self) -> bool:
        """Whether the module holds state a forward pass writes (BatchStat, RNG streams)."""
        return bool(self.stateful_paths())

    def module(self, params, state) -> nnx.Module:
        """The module rebuilt from ``params`` and ``state`` (inside the traced loss)."""
        return nnx.merge(self.graphdef, params, state)

    def rebuild(self, params):
        """What ``loss_fn`` takes, for producers that do not carry state (pipelines)."""
        if not self.is_module:
            return params
        return nnx.merge(self.graphdef, params, self.state)

    def state_after(self, module: nnx.Module):
        """``(carried, new)``: the module's non-parameter state after a forward pass, as
        the incoming state's structure plus the variables it created (``sow``)."""
        after = nnx.to_flat_state(nnx.state(module, nnx.Not(nnx.Param)))
        before = [path for path, _ in nnx.to_flat_state(self.state)]
        by_path = dict(after)
        missing = [p for p in before if p not in by_path]
        if missing:
            raise ValueError(
                f"px.value_and_grad: the forward pass removed the module variable "
                f"{'.'.join(map(str, missing[0]))}; a loss may change variables' values, "
                "not delete them.")
        carried = nnx.from_flat_state([(p, by_path[p]) for p in before])
        known = set(before)
        new = nnx.from_flat_state([(p, v) for p, v in after if p not in known])
        return carried, new

    def write_back(self, target, carried, new) -> None:
        """The state after the forward pass, written into the module the user passed."""
        if not self.is_module:
            return
        nnx.update(target, carried)
        if jax.tree.leaves(new):
            nnx.update(target, new)
