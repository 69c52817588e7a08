"""ZeRO stages 1, 2, 3 (FSDP) and HSDP: shard training state over a batch axis.

The strategy (:func:`ZeRO`) and its mechanism (:class:`ZeroSharding`) live here together:
which dimension of each leaf is sharded, which parts of the state (optimizer state,
gradients, parameters) are, and the two collectives of the explicit style, the all-gather
of a parameter before use and the reduce-scatter of its gradient. ``parallax.layout`` and
``parallax.grad`` call them through the strategy's ``zero`` field.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax

from parallax.rules import LAYERS
from parallax.strategies.data import DataParallel
from parallax.strategy import Strategy, check_style, compose

_WHAT = {
    1: "optimizer state",
    2: "optimizer state and gradients",
    3: "optimizer state, gradients and parameters",
}
_FIRST_STAGE = {"opt": 1, "grad": 2, "param": 3}  # the stage from which a role is sharded


@dataclasses.dataclass(frozen=True)
class ZeroSharding:
    """ZeRO's sharding of the training state over ``axis`` (a ``StateSharding``).

    Attributes:
      stage: 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters).
      axis: the mesh axis the state is sharded over (it also splits the batch).

    Example:
      >>> import jax, parallax as px
      >>> zero = px.ZeRO(2, "fsdp").zero
      >>> zero.shards("grad"), zero.shards("param")
      (True, False)
      >>> zero.shard_dim(jax.P(None, None), (64, 256), ("embed", "mlp"),
      ...                px.make_mesh(fsdp=-1))
      1
    """

    stage: int
    axis: str

    def shards(self, role: str) -> bool:
        return self.stage >= _FIRST_STAGE[role]

    def shard_dim(self, base, shape, names, mesh) -> int | None:
        """The largest dimension that is free, divisible, and not the stacked layer axis.

        Free: no rule shards it already (tensor parallelism keeps its dimension). Not
        ``"layers"``: slicing one layer per scan iteration must not move data.
        """
        ways = mesh.shape[self.axis]
        if ways == 1:
            return None
        candidates = [
            d for d, size in enumerate(shape)
            if base[d] is None and size % ways == 0 and size >= ways
            and not (names is not None and names[d] == LAYERS)
        ]
        return max(candidates, key=lambda d: (shape[d], -d)) if candidates else None

    def gather(self, x: jax.Array, dim: int) -> jax.Array:
        return lax.all_gather(x, self.axis, axis=dim, tiled=True)

    def scatter(self, g: jax.Array, dim: int) -> jax.Array:
        return lax.psum_scatter(g, self.axis, scatter_dimension=dim, tiled=True)


def ZeRO(stage: int, axis: str = "fsdp", *, style: str | None = None) -> Strategy:
    """Zero Redundancy Optimizer: data parallel over ``axis`` with sharded training state.

    Every device on ``axis`` sees its own slice of the batch, as in data parallelism, but
    keeps only 1/N of:

    - stage 1: the optimizer state (each device updates its slice of the parameters, then the
      slices are all-gathered);
    - stage 2: also the gradients (reduce-scattered instead of all-reduced);
    - stage 3: also the parameters (all-gathered before use; ``FSDP`` is this stage).

    Each leaf is sharded along one dimension: the largest one that is not already sharded by
    another rule (tensor parallel), not the stacked ``"layers"`` axis, and divisible by the
    axis size. A leaf with no such dimension stays replicated (small biases, odd shapes).

    In the default ``"explicit"`` style the gradient synchronisation is written with
    ``shard_map`` collectives (``all_gather`` of parameters for stage 3, ``psum_scatter`` of
    gradients for stages 2 and 3), so the compiled program reduce-scatters on every backend,
    CPU included, where XLA would otherwise all-reduce and slice.

    Args:
      stage: 1, 2 or 3.
      axis: the mesh axis to shard over (it also splits the batch).
      style: ``"explicit"`` (default) or ``"gspmd"``.

    Returns:
      A :class:`parallax.Strategy`.

    Example:
      >>> import parallax as px
      >>> px.ZeRO(stage=2, axis="fsdp").zero_stage
      2

    References:
      Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
      Models", SC 2020. Zhao et al., "PyTorch FSDP", VLDB 2023.
    """
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise ValueError(
            f"px.ZeRO: stage={stage!r} must be 1 (optimizer state), 2 (+ gradients) or "
            "3 (+ parameters)."
        )
    style = check_style("px.ZeRO", style)
    return Strategy(
        name=f"ZeRO({stage}, {axis!r})",
        batch_axes=(axis,),
        zero=ZeroSharding(stage, axis),
        style=style,
    )


def FSDP(axis: str = "fsdp", *, style: str | None = None) -> Strategy:
    """Fully sharded data parallel: ``ZeRO(stage=3, axis)``.

    Example:
      >>> import parallax as px
      >>> px.FSDP("fsdp").zero_stage
      3
    """
    return ZeRO(3, axis, style=style)


def HSDP(data_axis: str = "data", shard_axis: str = "fsdp", *, style: str | None = None):
    """Hybrid sharded data parallel: replicate over ``data_axis``, shard over ``shard_axis``.

    It is the composition ``compose(DataParallel(data_axis), ZeRO(3, shard_axis))``: inside a
    group of ``shard_axis`` devices (a host, or a slice) the state is fully sharded; across
    groups it is replicated and gradients are all-reduced, so the slow network carries only
    one all-reduce of 1/N of the gradients.

    Example:
      >>> import parallax as px
      >>> px.HSDP().batch_axes
      ('data', 'fsdp')
    """
    return compose(DataParallel(data_axis, style=style), ZeRO(3, shard_axis, style=style))


def describe_stage(stage: int) -> str:
    return _WHAT.get(stage, "nothing")
