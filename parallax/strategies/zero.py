"""ZeRO stages 1, 2, 3 (FSDP) and HSDP: shard training state over a batch axis.

The strategy (:func:`ZeRO`) and its mechanism (:class:`ZeroSharding`) live here together:
which dimension of each leaf is sharded, which parts of the state (optimizer state,
gradients, parameters) are, which of them live in host memory between steps (ZeRO-Offload),
and the two collectives of the explicit style, the all-gather of a parameter before use and
the reduce-scatter of its gradient. ``parallax.layout`` and ``parallax.grad`` call them
through the strategy's ``zero`` field.
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax

from parallax.rules import LAYERS
from parallax.strategies.data import DataParallel
from parallax.strategy import ModelHooks, Strategy, check_style, compose

_WHAT = {
    1: "optimizer state",
    2: "optimizer state and gradients",
    3: "optimizer state, gradients and parameters",
}
_FIRST_STAGE = {"opt": 1, "grad": 2, "param": 3}  # the stage from which a role is sharded
# What each offload keeps in host memory between steps (gradients exist only inside a step).
OFFLOADED = {None: (), "optimizer": ("opt",), "params": ("opt", "param")}
HOST_MEMORY = "pinned_host"


@dataclasses.dataclass(frozen=True)
class ZeroSharding:
    """ZeRO's sharding of the training state over ``axis`` (a ``StateSharding``).

    Attributes:
      stage: 1 (optimizer state), 2 (+ gradients) or 3 (+ parameters).
      axis: the mesh axis the state is sharded over (it also splits the batch).
      offload: None, ``"optimizer"`` (the optimizer state lives in host memory between
        steps) or ``"params"`` (the parameters too).

    Example:
      >>> import jax, parallax as px
      >>> zero = px.ZeRO(2, "fsdp").zero
      >>> zero.shards("grad"), zero.shards("param")
      (True, False)
      >>> px.ZeRO(2, "fsdp", offload="optimizer").zero.memory_kind("opt")
      'pinned_host'
      >>> zero.shard_dim(jax.P(None, None), (64, 256), ("embed", "mlp"),
      ...                px.make_mesh(fsdp=-1))
      1
    """

    stage: int
    axis: str
    offload: str | None = None

    def shards(self, role: str) -> bool:
        return self.stage >= _FIRST_STAGE[role]

    def memory_kind(self, role: str) -> str | None:
        """``"pinned_host"`` for a role this offload keeps in host memory, else None."""
        return HOST_MEMORY if role in OFFLOADED[self.offload] else None

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


def ZeRO(stage: int, axis: str = "fsdp", *, style: str | None = None,
         offload: str | None = None) -> Strategy:
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

    With ``offload``, each device's shard of the optimizer state (``"optimizer"``), and of
    the parameters (``"params"``), lives in the host's pinned memory between steps
    (``memory_kind="pinned_host"``: ``px.init`` creates it there, ``px.train_step`` hands it
    back there, ``px.checkpoint`` restores it there). Inside the step each offloaded leaf is
    copied to device memory, the update runs on the device as without offload, and the new
    values are copied back: one host-to-device and one device-to-host transfer per leaf in
    the compiled program, which XLA schedules (see ``docs/offload.md`` for why the update
    runs on the device and not on the host, and what differs from DeepSpeed).

    Args:
      stage: 1, 2 or 3.
      axis: the mesh axis to shard over (it also splits the batch).
      style: ``"explicit"`` (default) or ``"gspmd"``.
      offload: None (default), ``"optimizer"`` or ``"params"`` (optimizer state and
        parameters).

    Returns:
      A :class:`parallax.Strategy`.

    Example:
      >>> import parallax as px
      >>> px.ZeRO(stage=2, axis="fsdp").zero_stage
      2
      >>> px.ZeRO(2, "fsdp", offload="optimizer").name
      "ZeRO(2, 'fsdp', offload='optimizer')"

    References:
      Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
      Models", SC 2020. Zhao et al., "PyTorch FSDP", VLDB 2023. Ren et al., "ZeRO-Offload:
      Democratizing Billion-Scale Model Training", USENIX ATC 2021. Rajbhandari et al.,
      "ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme Scale Deep Learning", SC 2021.
    """
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise ValueError(
            f"px.ZeRO: stage={stage!r} must be 1 (optimizer state), 2 (+ gradients) or "
            "3 (+ parameters)."
        )
    style = check_style("px.ZeRO", style)
    check_offload("px.ZeRO", offload)
    return Strategy(
        name=f"ZeRO({stage}, {axis!r}" + (f", offload={offload!r})" if offload else ")"),
        batch_axes=(axis,),
        zero=ZeroSharding(stage, axis, offload),
        style=style,
        model_hooks=ModelHooks(layout_checks=(HostMemoryCheck(offload),)) if offload
        else ModelHooks(),
    )


def check_offload(api: str, offload) -> None:
    """Raises unless ``offload`` is None, ``"optimizer"`` or ``"params"``."""
    choices = tuple(k for k in OFFLOADED if k)
    if offload is not None and not isinstance(offload, str):
        raise TypeError(f"{api}: offload must be one of {choices} or None, got "
                        f"{type(offload).__name__} {offload!r}.")
    if offload not in OFFLOADED:
        raise ValueError(f"{api}: offload={offload!r} must be one of {choices} (host memory "
                         "for the optimizer state, or for it and the parameters) or None.")


@dataclasses.dataclass(frozen=True)
class HostMemoryCheck:
    """ZeRO-Offload's check of the mesh: its devices must have a pinned host memory.

    A :class:`parallax.strategy_hooks.ModelHooks` layout check, run wherever the state is
    laid out (``px.init``, ``px.shard``, ``px.train_step``, ``px.checkpoint.restore``).
    """

    offload: str

    def __call__(self, layouts, mesh, *, api, prefix, model) -> None:
        del layouts, prefix, model
        local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        device = local[0] if local else mesh.devices.flat[0]
        kinds = [m.kind for m in device.addressable_memories()]
        if HOST_MEMORY not in kinds:
            raise ValueError(
                f"{api}: px.ZeRO(offload={self.offload!r}) keeps state in {HOST_MEMORY!r} "
                f"memory, but the mesh's {device.platform} devices have only {kinds}; "
                "drop offload= on this backend (jax exposes pinned host memory on CPU, GPU "
                "and TPU).")


def FSDP(axis: str = "fsdp", *, style: str | None = None,
         offload: str | None = None) -> Strategy:
    """Fully sharded data parallel: ``ZeRO(stage=3, axis)`` (``offload`` as there).

    Example:
      >>> import parallax as px
      >>> px.FSDP("fsdp").zero_stage
      3
    """
    return ZeRO(3, axis, style=style, offload=offload)


def HSDP(data_axis: str = "data", shard_axis: str = "fsdp", *, style: str | None = None,
         offload: str | None = None):
    """Hybrid sharded data parallel: replicate over ``data_axis``, shard over ``shard_axis``.

    It is the composition ``compose(DataParallel(data_axis), ZeRO(3, shard_axis))``: inside a
    group of ``shard_axis`` devices (a host, or a slice) the state is fully sharded; across
    groups it is replicated and gradients are all-reduced, so the slow network carries only
    one all-reduce of 1/N of the gradients. ``offload`` is ``ZeRO``'s.

    Example:
      >>> import parallax as px
      >>> px.HSDP().batch_axes
      ('data', 'fsdp')
    """
    return compose(DataParallel(data_axis, style=style),
                   ZeRO(3, shard_axis, style=style, offload=offload))


def describe_stage(stage: int) -> str:
    return _WHAT.get(stage, "nothing")
