"""Expert parallelism: MoE experts split over a mesh axis that also splits the batch.

``px.ExpertParallel(axis)`` is GShard's layout: every layer but the experts is data
parallel over ``axis`` (each device has its own tokens), and the stacked expert weights
(logical axis ``"expert"``) are split over it, ``E / n`` experts per device. An MoE layer's
tokens reach their experts through two all-to-alls (:mod:`.expert_dispatch`). Gradients of
the experts are summed only over the batch axes that replicate them (``data``, not
``axis``: the all-to-alls already brought every device's tokens to them).

What it composes with (tested in ``tests/strategies/test_expert.py``): ``DataParallel`` on
another axis, ``FSDP``/``ZeRO`` (the experts' other dimensions sharded over ``fsdp``), and
``TensorParallel`` (Megatron inside each expert: ``w_gate``/``w_up`` split by columns and
``w_down`` by rows over ``tensor``, one all-reduce of the experts' output per layer).
The exchange runs in the explicit style (``shard_map``, ``lax.all_to_all``); under
``style="gspmd"`` the MoE layer runs on the global arrays and pins its slots' layout with
sharding constraints (by group, then by expert, then back), which XLA's partitioner turns
into the same two all-to-alls per layer forward. ``px.Pipeline`` composes too (the GPT's
pipeline stages carry the router losses; ``parallax.models.gpt_pipeline``).

Dropless MoE layers (``capacity_factor=None``) do not pad every expert to the sequence
length: ``dropless_exchange`` picks ragged all-to-alls (``jax.lax.ragged_all_to_all``,
exactly the routed tokens, GPU/TPU: ``parallax.nn.moe_ragged``) or fixed-size all-to-alls
in rounds sized by the busiest expert (every backend: ``parallax.nn.moe_dropless``); in
the GSPMD style that exchange runs in a ``shard_map`` of its own (``parallax.nn.moe_gspmd``).

References:
  Lepikhin et al. 2020, "GShard"; Fedus et al. 2021, "Switch Transformers";
  Rajbhandari et al. 2022, "DeepSpeed-MoE".
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

from parallax.mesh import describe
from parallax.strategies.expert_dispatch import DROPLESS_EXCHANGES, ExpertExchange
from parallax.strategy import ModelHooks, Strategy, check_style


@dataclasses.dataclass(frozen=True)
class ExpertDivisibility:
    """A ``ModelHooks.param_checks`` entry: the expert count must split evenly over the axis."""

    axis: str

    def __call__(self, names, shape, mesh: Mesh, *, path, api: str) -> None:
        if "expert" not in names or self.axis not in mesh.shape:
            return
        dim, n = list(names).index("expert"), mesh.shape[self.axis]
        if shape[dim] % n:
            experts = shape[dim]
            raise ValueError(
                f"{api}: px.ExpertParallel({self.axis!r}) splits the experts of parameter "
                f"{_path_text(path)} (shape {list(shape)}, {experts} experts on dimension "
                f"{dim}) over mesh axis {self.axis}={n} of {describe(mesh)}, and {n} does not "
                f"divide {experts}; use a number of experts that is a multiple of {n} "
                f"(MoEConfig(num_experts={experts + n - experts % n})) or {self.axis}= a "
                f"divisor of {experts}.")


def _path_text(path) -> str:
    return jax.tree_util.keystr(tuple(path))


def ExpertParallel(axis: str = "expert", *, style: str | None = None,
                   dropless_exchange: str = "auto") -> Strategy:
    """Splits MoE experts over ``axis`` and the batch over it too (GShard's layout).

    Args:
      axis: the mesh axis (``px.make_mesh(expert=n)``).
      style: ``"explicit"`` (default: two all-to-alls per MoE layer forward, in the
        step's ``shard_map``) or ``"gspmd"`` (sharding constraints on the slots, from which
        XLA emits the same all-to-alls).
      dropless_exchange: how dropless MoE layers (``capacity_factor=None``) exchange
        their tokens (either style): ``"auto"`` (default: ``"ragged"`` where the
        mesh's devices are GPUs or TPUs, ``"rounds"`` elsewhere), ``"ragged"``
        (``jax.lax.ragged_all_to_all``: each device sends each expert exactly its routed
        tokens; XLA:CPU cannot run it) or ``"rounds"`` (fixed-size all-to-alls in rounds
        sized by the busiest expert; every backend). See docs/moe.md.

    Returns:
      A :class:`parallax.Strategy` with the rule ``"expert" -> axis``, ``axis`` as a batch
      axis, and ``experts`` set to the exchange.

    Example:
      >>> import parallax as px
      >>> s = px.compose(px.DataParallel("data"), px.ExpertParallel("expert"))
      >>> s.batch_axes, s.rule_table["expert"], s.experts
      (('data', 'expert'), 'expert', ExpertExchange('expert'))

    References:
      Lepikhin et al. 2020, "GShard"; Fedus et al. 2021, "Switch Transformers".
    """
    if not isinstance(axis, str):
        raise TypeError(f"px.ExpertParallel: axis must be a mesh axis name (str), got "
                        f"{type(axis).__name__}: {axis!r}.")
    style = check_style("px.ExpertParallel", style)
    if dropless_exchange not in DROPLESS_EXCHANGES:
        raise ValueError(
            f"px.ExpertParallel: dropless_exchange={dropless_exchange!r} must be one of "
            f"{DROPLESS_EXCHANGES}: 'ragged' (jax.lax.ragged_all_to_all, GPU/TPU), 'rounds' "
            "(fixed-size all-to-alls, every backend) or 'auto' (ragged on GPU/TPU, rounds "
            "elsewhere); leave it out for 'auto'.")
    return Strategy(name=f"ExpertParallel({axis!r})", rules=(("expert", axis),),
                    batch_axes=(axis,), style=style,
                    experts=ExpertExchange(axis, dropless_exchange),
                    model_hooks=ModelHooks(param_checks=(ExpertDivisibility(axis),)))
