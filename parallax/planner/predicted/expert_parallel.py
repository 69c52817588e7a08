"""Predicted messages and memory of expert parallelism (``px.ExpertParallel``) and MoE.

An MoE block (``GPTConfig(moe=...)``) with a capacity turns each of a device's ``G``
sequences into ``[E, C]`` slots of width ``D`` (``C`` the capacity per sequence). With the
``E`` experts split over the expert axis (``E / n`` per device), per MoE layer and step:

- forward: two all-to-alls over the expert axis (dispatch and combine), each of the
  device's ``G E C D`` slots (the model's dtype); backward: the same two, transposed
  (GShard, sec. 2.2 and 3.2);
- dropless in the explicit style (``parallax.nn.moe_dropless``): the same four per round
  of ``E c D`` slots, ``c = ceil(N k / E)`` for the device's ``N = G S`` tokens; the
  program holds ``ceil(N / c)`` rounds (the most dropless can need, about the padded
  ``G E S D``) and runs ``ceil(busiest expert's choices / c)`` of them, one at an even
  load. The prediction is the program's count, like the compiled reading, which counts a
  conditional's collectives once; the report's note says what runs. The GSPMD style runs
  the same rounds (``parallax.nn.moe_gspmd``);
- dropless with ragged all-to-alls (``dropless_exchange`` resolving to ``"ragged"``, GPUs
  and TPUs: ``parallax.nn.moe_ragged``): per MoE layer two forward and two backward, whose
  sizes follow the routing; predicted at an even load, ``N k D`` each. The compiled
  reading (``parallax.analysis.hlo``) does not count ragged all-to-alls, so that row has no
  measured value;
- the router statistics averaged over every batch shard: an all-reduce over the batch axes
  of the load ``f_e`` and importance ``P_e`` (``E`` each) and the z-loss (float32), which
  XLA merges with the gradients' sync, and one scalar in the backward (the z-loss's
  cotangent, the same for every layer: XLA sums it once; XLA 0.12.1 compiles that sum
  away, so it is counted on earlier versions only);
- gradients: each parameter's summed over the batch axes that replicate it; the experts,
  split over the expert axis, only over the others (``data``, not ``expert``: the
  all-to-alls' transposes already brought every device's tokens to them).

The experts' weights take ``1 / n`` of their bytes per device. Without an expert axis the
layer runs replicated: every device holds and runs all ``E`` experts on its own tokens.

References:
  Lepikhin et al., "GShard", 2020; Fedus et al., "Switch Transformers", 2021;
  Rajbhandari et al., "DeepSpeed-MoE", 2022.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from parallax.nn.moe_dropless import most_rounds, round_slots
from parallax.planner.setting import StepSetting

F32 = 4


def slot_bytes(s: StepSetting) -> float:
    """One device's ``[G, E, C, D]`` slots of one MoE layer (one round's ``[E, c, D]``
    when dropless in rounds)."""
    c, moe = s.config, s.moe
    if in_rounds(s):
        tokens = s.rows_per_device * s.seq_len
        return (moe.num_experts * round_slots(tokens, moe.top_k, moe.num_experts)
                * c.embed_dim * jnp.dtype(c.dtype).itemsize)
    capacity = moe.capacity(s.seq_len)
    return (s.rows_per_device * moe.num_experts * capacity * c.embed_dim
            * jnp.dtype(c.dtype).itemsize)


def dropless_exchange(s: StepSetting) -> str | None:
    """``"rounds"`` or ``"ragged"`` for dropless MoE under an expert axis, else None."""
    if s.moe is None or not s.moe.dropless or s.expert_axis is None:
        return None
    resolve = getattr(s.strategy.experts, "resolve", None)
    return resolve(s.backend) if resolve else "rounds"


def in_rounds(s: StepSetting) -> bool:
    """Dropless under an expert axis on a backend that runs the exchange in rounds."""
    return dropless_exchange(s) == "rounds"


def rounds_in_program(s: StepSetting) -> int:
    """Rounds the compiled program holds per exchange (1 unless dropless in rounds)."""
    if not in_rounds(s):
        return 1
    moe = s.moe
    return most_rounds(s.rows_per_device * s.seq_len, moe.top_k, moe.num_experts)


def exchange_messages(s: StepSetting, add) -> None:
    """The all-to-alls and router statistics of the MoE layers, through ``add``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, parallax as px
      >>> from flax import nnx
      >>> from parallax.planner.setting import read_setting
      >>> moe = px.models.MoEConfig(num_experts=8, top_k=2, capacity_factor=1.0)
      >>> config = px.models.GPTConfig.tiny(max_seq_len=16, moe=moe)
      >>> state = jax.eval_shape(lambda: px.TrainState.create(
      ...     px.models.GPT(config, rngs=nnx.Rngs(0)), optax.sgd(0.1)))
      >>> s = read_setting(px.make_mesh(data=2, expert=4), px.compose(
      ...     px.DataParallel("data"), px.ExpertParallel("expert")), state,
      ...     {"tokens": jax.ShapeDtypeStruct((16, 17), jnp.int32)})
      >>> found = {}
      >>> exchange_messages(s, lambda kind, axes, nbytes, n, how: found.update({kind: nbytes}))
      >>> found["all-to-all"] == 4 * 2 * slot_bytes(s)   # 4 per layer, 2 layers
      True
    """
    axis, moe = s.expert_axis, s.moe
    if axis is None or moe is None or s.seq_len is None:
        return
    layers, rounds = s.config.num_layers, rounds_in_program(s)
    if dropless_exchange(s) == "ragged":
        routed = (s.rows_per_device * s.seq_len * moe.top_k * s.config.embed_dim
                  * jnp.dtype(s.config.dtype).itemsize)
        add("ragged-all-to-all", (axis,), 4 * layers * routed, 4 * layers,
            "dropless ragged: per MoE layer 2 ragged all-to-alls forward, 2 backward; their "
            "sizes follow the routing: N k D each at an even load (not read from the "
            "compiled program)")
        add("all-gather", (axis,), layers * s.size(axis) * moe.num_experts * 4, layers,
            "dropless ragged: per MoE layer every device's choices per expert ([E] int32)")
        router_stats(s, add)
        return
    how = ("GShard: per MoE layer 2 all-to-alls forward, 2 backward, of G E C D"
           if rounds == 1 and not in_rounds(s) else
           f"dropless in rounds: per MoE layer and round 2 all-to-alls forward, 2 backward, "
           f"of E c D; the program holds {rounds} rounds, a step runs ceil(busiest expert's "
           "choices / c) of them (1 at an even load: N k D, the routed tokens)")
    add("all-to-all", (axis,), 4 * layers * rounds * slot_bytes(s), 4 * layers * rounds, how)
    router_stats(s, add)


# The z-loss cotangent's all-reduce in the backward (one scalar): in jax 0.10.2's compiled
# program, not in 0.12.1's (measured on the data=2 x expert=4 MoE GPT of
# tests/planner/test_explain_context_expert.py; the forward's statistics are unchanged).
BACKWARD_SCALAR = 0 if jax.__version_info__[:3] >= (0, 12, 1) else 1


def router_stats(s: StepSetting, add) -> None:
    """The router's load and importance ``[E]`` and z-loss averaged over the batch shards."""
    moe = s.moe
    if moe is None or not s.batch_axes:
        return
    layers = s.config.num_layers
    backward = (", and in the backward the z-loss's cotangent (one scalar for all layers)"
                if BACKWARD_SCALAR else "")
    add("all-reduce", s.batch_axes, (layers * (2 * moe.num_experts + 1) + BACKWARD_SCALAR) * F32,
        layers + BACKWARD_SCALAR, "router statistics per MoE layer: f_e, P_e [E] and z "
        f"(float32){backward}")
    if in_rounds(s):
        add("all-reduce", s.batch_axes, layers * 4, layers,
            "dropless rounds: per MoE layer, the most rounds any device needs (int32 max)")


def sum_axes(s: StepSetting, leaf) -> tuple[str, ...]:
    """The batch axes a parameter's gradient is summed over: those that do not split it."""
    return tuple(a for a in s.batch_axes if a not in leaf.axes)


def expert_weight_bytes(s: StepSetting) -> float:
    """The experts' weights one device holds (``1 / n`` of them over the expert axis)."""
    return sum(x.nbytes / x.rule_ways for x in s.leaves if x.expert)


def replicated_note(s: StepSetting, devices: int) -> str | None:
    """The report's note when an MoE model runs with no expert axis, else None."""
    moe = s.moe
    if moe is None or s.expert_axis is not None or devices < 2:
        return None
    return (f"MoE without an expert axis: all {moe.num_experts} experts are replicated on "
            f"each of the {devices} devices (no expert parallelism, no all-to-all); compose "
            "px.ExpertParallel('expert') with a mesh axis expert=N to split them")
