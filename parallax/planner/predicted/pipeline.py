"""A pipeline stage's buffers, counted from the runtime's own plan rather than re-derived.

The SPMD pipeline runtime (:mod:`parallax.pipeline.runtime.ticks`) carries, through its tick
loop, rings of slots and float32 accumulators (:mod:`parallax.pipeline.runtime.rings`). How
many slots each ring has is the lowered schedule's (:func:`lower_schedule` and
:meth:`LoweredSchedule.rows`: the schedule's peak in flight, plus a spare row where a write
may go nowhere); what one slot holds is the runtime's own template of a layer
(:func:`parallax.pipeline.runtime.chunk.template`: the residuals ``F`` stashes for ``B``
and ``W``, the gradients at each use ``B`` hands to ``W``), traced here abstractly
(``jax.eval_shape``: nothing is allocated) on one micro-batch's rows per device:

==============  =============================================================
inbox, inputs   ``rows x [b, s, D]`` (the stage's input activation)
stash           ``rows x L_c x`` one layer's stashed residuals
uses            ``rows x L_c x`` one layer's use gradients (split backward)
payload, sends  ``3 x [b, s, D]`` (what the stage sends up and down)
d_stacked       the stage's layer parameters in float32 (``[v, L_c, ...]``)
d_others        the other parameters in float32
==============  =============================================================

``L_c`` is the layers of one chunk (``L / (p v)``). Under tensor parallelism the template's
leaves with a head or MLP-width dimension are split ``t`` ways (GSPMD shards them inside the
stage), the others are whole (split ``t`` ways too under sequence parallelism).

References:
  Huang et al., "GPipe", 2019; Narayanan et al., "PipeDream-Flush" (1F1B), SC 2021; Qi et
  al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (the split backward's use gradients).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from parallax.models.gpt_pipeline import next_token_stages
from parallax.models.llama import llama_stages
from parallax.models.llama_config import LlamaConfig
from parallax.pipeline.runtime.chunk import template
from parallax.pipeline.runtime.program import program
from parallax.pipeline.stages import Stages
from parallax.planner.predicted.memory import Estimate, local_param_bytes
from parallax.planner.setting import StepSetting


@dataclasses.dataclass(frozen=True)
class LayerSlots:
    """Bytes of one slot per device: the activation ``x``, one layer's stash and use
    gradients (``stash``, ``uses``), and the largest single stashed leaf (``widest``)."""

    x: float
    stash: float
    uses: float
    widest: float


def _nbytes(leaf) -> float:
    return float(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize)


def _split(leaf, s: StepSetting) -> float:
    """A template leaf's bytes on one device: heads / MLP-width leaves split ``t`` ways."""
    t = s.tensor
    c = s.config
    wide = c is not None and (c.num_heads in leaf.shape[1:] or c.mlp_dim in leaf.shape[1:])
    return _nbytes(leaf) / (t if t > 1 and (wide or s.sequence_parallel) else 1)


def layer_slots(s: StepSetting, state, batch, stages: Stages) -> LayerSlots:
    """Traces the runtime's template of one layer on one micro-batch's rows per device.

    Args:
      s: the step's setting (a pipeline's).
      state: the ``px.TrainState`` (abstract is fine).
      batch: the global batch (arrays or ``jax.ShapeDtypeStruct``).
      stages: the pipelined loss (a ``px.pipeline.Stages``).

    Returns:
      A :class:`LayerSlots`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, parallax as px
      >>> from flax import nnx
      >>> from parallax.planner.setting import read_setting
      >>> cfg = px.models.GPTConfig.tiny()
      >>> state = jax.eval_shape(lambda: px.TrainState.create(
      ...     px.models.GPT(cfg, rngs=nnx.Rngs(0)), optax.adam(1e-3)))
      >>> batch = {"tokens": jax.ShapeDtypeStruct((8, 65), jnp.int32)}
      >>> s = read_setting(px.make_mesh(stage=2, data=4), px.Pipeline(microbatches=2), state, batch)
      >>> layer_slots(s, state, batch, px.models.next_token_stages).x   # [4, 64, 64] float32
      65536.0
    """
    rows = max(int(s.rows_per_device // s.pipeline.microbatches), 1)
    tokens = jax.tree.map(lambda a: jax.ShapeDtypeStruct((rows, *a.shape[1:]), a.dtype),
                          batch)
    found = {}

    def trace(params, micro):
        prog = program(stages, params, lambda p: nnx.merge(state.graphdef, p, state.rest),
                       "px.plan")
        x = prog.first(prog.others, [], micro)[0]
        tmpl = template(prog.layer, [p[0] for p in prog.stacked], x, lambda v: v,
                        s.pipeline.policy, "px.plan")
        found["x"], found["stash"], found["uses"] = x, tmpl.stashed, tmpl.uses
        return jnp.zeros(())

    jax.eval_shape(trace, state.params, tokens)
    x = sum(_nbytes(a) for a in jax.tree.leaves(found["x"]))
    x = x / (s.tensor if s.sequence_parallel else 1)
    stash = [_split(a, s) for a in found["stash"]]
    return LayerSlots(x, sum(stash), sum(_split(a, s) for a in found["uses"]),
                      max(stash, default=0.0))


def buffers(s: StepSetting, slots: LayerSlots) -> dict[str, float]:
    """The runtime's rings and accumulators per device, by name (bytes).

    The slot counts are :func:`lower_schedule`'s for the setting's schedule and
    rematerialisation (a checkpoint policy lowers like ``"never"``; its effect is in the
    template's stash), read through
    :mod:`parallax.planner.schedule_facts`.
    """
    p = s.pipeline
    remat = p.remat if p.remat in ("always", "except_last", "never") else "never"
    rows = p.schedule.rows[remat]
    chunk_layers = s.config.num_layers / (p.stages * p.virtual_stages) if s.config else 1
    stacked = sum(x.nbytes / x.rule_ways * 4 / x.itemsize for x in s.leaves
                  if x.role == "param" and x.stacked)
    others = sum(x.nbytes / x.rule_ways * 4 / x.itemsize for x in s.leaves
                 if x.role == "param" and not x.stacked)
    return {
        "inbox": rows["inbox"] * slots.x,
        "inputs": rows["inputs"] * slots.x,
        "stash": rows["stash"] * chunk_layers * slots.stash,
        "uses": rows["uses"] * chunk_layers * slots.uses,
        "payload": 3 * slots.x,
        "d_stacked": stacked,
        "d_others": others,
    }


def temporaries(s: StepSetting, slots: LayerSlots) -> tuple[Estimate, dict[str, float]]:
    """A pipeline step's temporaries per device: the runtime's :func:`buffers`, plus one
    layer's stash being computed (the working set of the action in flight: ``F`` builds a
    layer's residuals before writing them into the ring, ``B`` rebuilds as much), plus under
    ZeRO 3 in the explicit style the gathered parameters.

    Args:
      s: the step's setting (a pipeline's).
      slots: :func:`layer_slots` of it.

    Returns:
      ``(estimate, parts)``: a :class:`parallax.planner.predicted.memory.Estimate` and the
      :func:`buffers` by name.

    Example:
      >>> import jax, jax.numpy as jnp, optax, parallax as px
      >>> from flax import nnx
      >>> from parallax.planner.setting import read_setting
      >>> state = jax.eval_shape(lambda: px.TrainState.create(
      ...     px.models.GPT(px.models.GPTConfig.tiny(), rngs=nnx.Rngs(0)), optax.adam(1e-3)))
      >>> batch = {"tokens": jax.ShapeDtypeStruct((8, 65), jnp.int32)}
      >>> s = read_setting(px.make_mesh(stage=2, data=4), px.Pipeline(microbatches=2, remat="never"),
      ...                  state, batch)
      >>> estimate, parts = temporaries(s, layer_slots(s, state, batch,
      ...                                              px.models.next_token_stages))
      >>> sorted(k for k, v in parts.items() if v)   # 1F1B without remat: no inputs, no uses
      ['d_others', 'd_stacked', 'inbox', 'payload', 'stash']
    """
    parts = buffers(s, slots)
    gathered = (local_param_bytes(s) if s.zero_stage == 3 and s.strategy.sync_style == "explicit"
                else 0.0)
    how = ("the runtime's rings (lowered schedule's rows x the layer template's slots) + "
           "float32 accumulators + one layer's stash in flight"
           + (" + gathered parameters" if gathered else ""))
    return Estimate(sum(parts.values()) + slots.stash + gathered, how), parts


def stage_temporaries(s: StepSetting, state, batch, stages: Stages | None = None
                      ) -> tuple[Estimate, dict[str, float]] | None:
    """:func:`temporaries` for a pipelined step whose ``Stages`` are known (given, or the
    reference models' own: ``next_token_stages`` for a GPT, ``llama_stages`` for a Llama);
    None without a pipeline or stages."""
    if s.pipeline is None:
        return None
    if stages is None and s.config is not None:
        stages = llama_stages if isinstance(s.config, LlamaConfig) else next_token_stages
    if not isinstance(stages, Stages):
        return None
    return temporaries(s, layer_slots(s, state, batch, stages))
