"""Predicted collectives of a training step, from the published formulas.

Collectives are keyed like the measured ones, ``(kind, mesh axes)``, with message bytes per
step (nccl-tests' size ``S``: an all-gather's result, a reduce-scatter's input). ``Ψ`` below
is the parameters' bytes on one device after the rules' split (tensor, pipeline):

===========================  ===========================================================
data parallel                all-reduce of the gradients ``Ψ`` over the batch axes, and of
                             the loss (4 bytes); with a point-to-point sync, collective-
                             permutes: ``log2 n`` exchanges of ``Ψ`` (tree), ``2(n-1)``
                             messages of ``Ψ/n`` (ring)
ZeRO 1 / 2 / 3 over ``N``    2, 3: reduce-scatter ``Ψ`` over ZeRO's axis, all-reduce
                             ``Ψ / N`` over the other batch axes; 1, 2: all-gather of the
                             updated parameters ``Ψ``; 3: all-gather ``Ψ`` before use
Megatron (``t`` ways)        ``parallax.analysis.tensor_traffic.megatron_traffic`` over the
                             tensor axis (``(4L + 2)`` all-reduces of ``[B, T, D]``; with SP
                             all-gather / reduce-scatter pairs); on average over a pipeline's
                             stages, its ``L / p`` layers, plus the forwards recomputed
context (``n`` ways)         :mod:`parallax.planner.predicted.context_parallel`: the ring's
                             ``3n - 2`` collective-permutes of K/V per layer, or the
                             all-gather's K/V gathers and dK/dV reduce-scatter; GSPMD's
                             all-reduce of ``Ψ`` over the context axis; Megatron's and
                             the activations' ``T`` read as ``T / n``
expert (``n`` ways)          :mod:`parallax.planner.predicted.expert_parallel`: 4 all-to-alls of
                             ``G E C D`` per MoE layer; the experts' gradients summed
                             only over the batch axes that replicate them
pipeline (``p`` stages)      each tick's payload, a micro-batch's ``[b, T, D]``, to both
                             neighbours (one collective-permute when ``p = 2``);
                             an all-reduce over the stages of the unstacked parameters'
                             gradients (float32) and the loss; interleaved: each stage's
                             blocks moved to the stages that run them and the gradients back
===========================  ===========================================================

The CPU compiler does not form reduce-scatters from GSPMD's all-reduce + slice (see
JAX_NOTES.md), so on CPU the reduce-scatters that GSPMD would make (sequence parallelism)
are predicted as all-reduces of the same bytes. A step's FLOPs, bytes through memory and
bubble are :mod:`parallax.planner.predicted.compute`'s.

References:
  Rajbhandari et al., "ZeRO", SC 2020; Shoeybi et al., "Megatron-LM", 2019; Korthikanti et
  al. 2022; Narayanan et al., SC 2021.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from parallax.planner.predicted.memory import local_param_bytes, microbatch_rows
from parallax.planner.predicted import context_parallel, expert_parallel
from parallax.planner.setting import StepSetting
from parallax.analysis.tensor_traffic import megatron_traffic
from parallax.comm import cost
from parallax.mesh import AXIS_ORDER
from parallax.old_import_paths import renamed_names


@dataclasses.dataclass
class PredictedCollective:
    """Predicted collectives of one kind over one set of mesh axes, per step."""

    message_bytes: float = 0.0
    count: int = 0
    how: list[str] = dataclasses.field(default_factory=list)

    def add(self, nbytes: float, count: int, how: str) -> None:
        if nbytes > 0:
            self.message_bytes += nbytes
            self.count += count
            if how not in self.how:
                self.how.append(how)


def _ordered(axes) -> tuple[str, ...]:
    return tuple(a for a in AXIS_ORDER if a in axes)


def collectives(s: StepSetting, context_attention: bool = True
                ) -> dict[tuple[str, tuple[str, ...]], PredictedCollective]:
    """``{(kind, axes): PredictedCollective}`` predicted for one step (see the module docstring).

    ``context_attention=False`` leaves out context parallelism's own attention messages
    (:func:`context_attention_collectives` has them).

    Example:
      >>> import jax.numpy as jnp, parallax as px
      >>> from parallax.planner.setting import read_setting
      >>> s = read_setting(px.make_mesh(fsdp=8), px.ZeRO(3, "fsdp"), {"w": jnp.ones((8, 8))},
      ...                  {"x": jnp.ones((8, 2))})
      >>> {key: t.message_bytes for key, t in collectives(s).items()}
      {('all-gather', ('fsdp',)): 256.0, ('reduce-scatter', ('fsdp',)): 256.0,
       ('all-reduce', ('fsdp',)): 4.0}
    """
    out: dict[tuple, PredictedCollective] = {}

    def add(kind, axes, nbytes, count, how):
        out.setdefault((kind, _ordered(axes)), PredictedCollective()).add(nbytes, count, how)

    _data_parallel(s, add)
    _tensor_parallel(s, add)
    _pipeline(s, add)
    if context_attention:
        context_parallel.attention_messages(s, add)
    context_parallel.gradient_sum(s, add)
    expert_parallel.exchange_messages(s, add)
    return {key: t for key, t in out.items() if t.message_bytes > 0}


def context_attention_collectives(s: StepSetting) -> dict[tuple, PredictedCollective]:
    """Context parallelism's own messages (its attention and the zigzag's way back), keyed
    like :func:`collectives` (:mod:`parallax.planner.predicted.context_parallel`)."""
    out: dict[tuple, PredictedCollective] = {}

    def add(kind, axes, nbytes, count, how):
        out.setdefault((kind, _ordered(axes)), PredictedCollective()).add(nbytes, count, how)

    context_parallel.attention_messages(s, add)
    return out


def _gradient_sum(s: StepSetting, add, axes, nbytes: float, how: str) -> None:
    """The sum of one gradient over ``axes``: XLA's all-reduce, or the point-to-point
    messages of a sync like ``px.BucketedSync(algorithm="tree" | "ring" | "auto")``."""
    if not axes:
        return
    algorithm = getattr(s.strategy.grad_sync, "algorithm", "xla")
    if algorithm == "xla" or not getattr(s.strategy.grad_sync, "varying_results", False):
        add("all-reduce", axes, nbytes, 0, how)
        return
    n = s.size(axes)
    if algorithm == "auto":
        algorithm = cost.choose_algorithm(nbytes, n, cost.default_link(s.backend))
    if algorithm == "tree":
        rounds = cost.tree_rounds_count(n)
        add("collective-permute", axes, rounds * nbytes, rounds,
            f"{how} by recursive doubling: {rounds} exchanges of the gradient")
    else:
        add("collective-permute", axes, 2 * (n - 1) / n * nbytes, 2 * (n - 1),
            f"{how} by a ring of collective-permutes: 2(n-1) messages of Ψ/n")


def _data_parallel(s: StepSetting, add) -> None:
    batch, z, stage = s.batch_axes, s.zero_axis, s.zero_stage
    if not batch:
        return
    n = s.size(z) if z else 1
    rest = tuple(a for a in batch if a != z)
    for leaf in (x for x in s.leaves if x.role == "param"):
        psi = leaf.nbytes / leaf.rule_ways
        if leaf.expert:  # split over the expert axis: summed over the other batch axes
            _gradient_sum(s, add, expert_parallel.sum_axes(s, leaf), psi,
                          "experts: all-reduce Ψ_e / EP over the batch axes that replicate them")
            continue
        if not (stage and leaf.zero_split):  # ZeRO keeps a leaf with no divisible dim whole
            _gradient_sum(s, add, batch, psi, "data parallel: all-reduce Ψ")
            continue
        if stage == 3:
            add("all-gather", (z,), psi, 1, "ZeRO 3: all-gather Ψ before use")
        else:  # GSPMD gathers the updated slices over every batch axis
            add("all-gather", batch, psi, 1, f"ZeRO {stage}: all-gather of the updated Ψ")
        if stage >= 2:
            add("reduce-scatter", (z,), psi, 1, f"ZeRO {stage}: reduce-scatter Ψ")
            if rest:
                _gradient_sum(s, add, rest, psi / n, "all-reduce Ψ/N over the other batch axes")
        else:
            _gradient_sum(s, add, batch, psi, "ZeRO 1: all-reduce Ψ")
    add("all-reduce", batch, 4, 1, "the loss (float32); XLA combines the all-reduces")


def _megatron(s: StepSetting, layers: int):
    c = dataclasses.replace(s.config, num_layers=layers)
    return megatron_traffic(c, s.batch_rows // s.size(s.batch_axes), s.local_seq_len,
                            sequence_parallel=s.sequence_parallel)


def _tensor_parallel(s: StepSetting, add) -> None:
    axis = s.tensor_axis
    if axis is None or s.config is None or s.seq_len is None:
        return
    one, two = _megatron(s, 1), _megatron(s, 2)
    kinds = ("all_reduce", "all_gather", "reduce_scatter")
    per_layer = {k: getattr(two, k) - getattr(one, k) for k in kinds}
    fixed = {k: getattr(one, k) - per_layer[k] for k in kinds}
    p = s.pipeline
    stages = p.stages if p else 1
    layers = s.config.num_layers / stages
    # The forward half of each layer's traffic again for every recomputed micro-batch.
    again = (p.remat_fraction if p else 0.0) / 2
    total = {k: per_layer[k] * layers * (1 + again) + fixed[k] / stages for k in kinds}
    if s.backend == "cpu":
        total["all_reduce"] += total.pop("reduce_scatter")
    # How many collectives (for their latencies): per layer 4 all-reduces, or with SP 4
    # all-gathers and 4 reduce-scatters; the embedding, the output layer and the loss's 3.
    sp = s.sequence_parallel
    counts = {"all_reduce": (0 if sp else 4) * layers * (1 + again) + (4 if sp else 5) / stages,
              "all_gather": (4 * layers * (1 + again) + 2 / stages) if sp else 0,
              "reduce_scatter": (4 * layers * (1 + again) + 1 / stages) if sp else 0}
    if s.backend == "cpu":
        counts["all_reduce"] += counts.pop("reduce_scatter")
    how = "Megatron: (4L + 2) [B, T, D]" + (f", L/p on average over {stages} stages"
                                             if stages > 1 else "")
    for k, nbytes in total.items():
        add(k.replace("_", "-"), (axis,), nbytes, round(counts[k]), how
            + (" (reduce-scatters: all-reduce on CPU)" if k == "all_reduce"
               and s.sequence_parallel and s.backend == "cpu" else ""))


def _pipeline(s: StepSetting, add) -> None:
    p, c = s.pipeline, s.config
    if p is None or p.stages < 2:
        return
    others = sum(x.nbytes / x.rule_ways / x.itemsize * 4 for x in s.leaves
                 if x.role == "param" and not x.stacked)
    add("all-reduce", (p.axis,), others + 4, 1,
        "unstacked parameters' gradients (float32) and the loss, summed over the stages")
    if c is not None and s.seq_len is not None:
        x = microbatch_rows(s) * s.seq_len * c.embed_dim * jnp.dtype(c.dtype).itemsize
        # Under sequence parallelism each device holds and sends [b, T/t, D] (Megatron's
        # scatter/gather optimisation, in effect).
        x /= s.tensor if s.sequence_parallel else 1
        sends = 1 if p.stages == 2 else 2  # both neighbours are one stage when there are two
        add("collective-permute", (p.axis,), sends * p.schedule.ticks * x,
            sends * p.schedule.ticks,
            f"{sends} x {p.schedule.ticks} ticks x a micro-batch's [b, T, D]"
            + (f" / t={s.tensor}" if s.sequence_parallel else ""))
    v, S = p.virtual_stages, p.stages
    if v > 1:
        # Block i (of v) stored on stage st is chunk (st v + i) // S of stage (st v + i) % S.
        # One permute per (block, chunk) moves that block on every stage at once (a message
        # of one block per device); blocks already on their stage do not move.
        moves = sum(1 for i in range(v) for chunk in range(v)
                    if any((st * v + i) // S == chunk and (st * v + i) % S != st
                           for st in range(S)))
        block = local_param_bytes(s, stacked=True) / v
        add("collective-permute", (p.axis,), 2 * moves * block, 2 * moves,
            f"interleaved: {moves} block moves to the stages that run them, and back")


__getattr__ = renamed_names(__name__, globals())  # flops, bubble, hbm_bytes: now compute's
