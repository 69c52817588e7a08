"""``px.explain``: what a train step will hold, send, compute and cost, predicted and measured.

The prediction comes from the published formulas (ZeRO's memory, Megatron's traffic, the
pipeline schedule's bubble and peak in flight: :mod:`parallax.planner.predicted`) applied to
the step's mesh, strategy, state and batch; the measurement from the compiled program (the
shardings XLA gave every argument, ``memory_analysis()``, the collectives and matmuls of the
partitioned HLO with their loop counts: :mod:`parallax.analysis.program`). The estimated
step time is a roofline (:mod:`parallax.planner.roofline`) with the links of
``parallax.comm.cost``. Each row shows both values and their ratio, and is flagged when they
differ by more than 10%, with the reason when it is known. See ``docs/explain.md``.

Given ``(mesh, strategy)`` instead of a step, it predicts without compiling
(:mod:`parallax.planner.explain_predicted`), at any device count.

(Over 300 lines: one report, whose three groups of rows (memory, collectives, time) read the
same setting and compiled program and share its reasons; each group is one function here,
the formulas they print are :mod:`parallax.planner.predicted`'s.)
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp

from parallax.analysis import hlo, program
from parallax.analysis.kernels import attention_kernels
from parallax.planner import roofline
from parallax.planner.predicted import compute as pc
from parallax.planner.predicted import expert_parallel as pe
from parallax.planner.predicted import memory as pm
from parallax.planner.predicted import traffic as pt
from parallax.planner.explain_predicted import explain_predicted, split_rows, working_rows
from parallax.planner.predicted import step_time
from parallax.planner.report import Report, Row
from parallax.planner.topology import Topology
from parallax.planner.topology import cluster as find_cluster
from parallax.planner.setting import StepSetting, read_setting
from parallax.comm import cost
from parallax.grad.default_sync import describe_sync
from parallax.mesh import describe
from parallax.models.gpt_config import GPTConfig
from parallax.pipeline.stages import Stages
from parallax.step.spmd_step import TrainStep

API = "px.explain"
MEMORY, TRAFFIC, COMPUTE, TIME = ("memory per device", "collectives per step", "compute",
                                  "time per step")
REASONS = {
    "temporaries": "XLA's buffer assignment: fused or recomputed intermediates, optimizer "
                   "temporaries and copies; the formula counts only what autodiff saves",
    "peak": "the temporaries' disagreement (above)",
    "matmul flops": "XLA recomputes or simplifies some matmuls (rematerialisation, "
                    "constant folding); the formula counts 6 N + 12 L T D per token",
    "pipeline W": "the pipeline runtime's weight-gradient action (W) recomputes each layer's "
                  "internal backward that B computed (attention, inner input gradients and "
                  "their tensor-parallel all-reduces); the formula counts one backward",
    "pipeline buffers": "the pipeline runtime's rings (received activations and gradients, "
                        "stashed residuals: their slots, plus a spare row where a write may "
                        "go nowhere) and accumulators",
    "context gspmd": "GSPMD, not ContextParallel, once per step: the vocabulary-parallel "
                     "logits' constraint keeps the sequence whole (gathered over the context "
                     "axis), and a weight next to a gathered activation (embedding, output "
                     "layer) gets its gradient whole; the labels' shift moves a few token ids",
    "context gradients": "GSPMD sums the gradients over the context axis itself: it may "
                         "gather an activation instead (embedding, output layer: then "
                         "that gradient is not all-reduced) or sum a leaf in several parts (a tied or "
                         "chunked-loss output matrix: its lookup and each chunk's part)",
    "moe flops": "MoE: the experts compute E C slots per sequence (capacity_factor S k, "
                 "not S k; dropless in rounds, E c per round and device) and GShard's "
                 "dispatch and combine einsums are matmuls too; the formula counts the k "
                 "active experts per token",
    "ring flops": "ring attention computes (n+1)/2n of the T x T scores (causal zigzag "
                  "blocks) and its backward recomputes the scores (7 attention matmuls to "
                  "the formula's 6)",
    "cpu bf16": "the CPU compiler sends bfloat16 as float32 (the program as lowered sends "
                "bfloat16; XLA's CPU float normalisation widens it): the prediction is the "
                "target chip's, which sends bfloat16",
    "cpu bf16 rings": "jax 0.10's CPU compiler writes into a bfloat16 ring (the pipeline's "
                      "stash and inputs) in float32: each write converts the whole ring to a "
                      "float32 temporary and back; the prediction is the target chip's, "
                      "which writes bfloat16 in place",
    "step time": "a roofline is a lower bound: kernels reach a fraction of peak (the MFU), "
                 "dispatch and synchronisation add time; on simulated CPU devices 8 devices "
                 "share the host's cores",
}


def _measured_gradients(found, counts, setting: StepSetting) -> float | None:
    """Bytes of gradients a device holds after the sync: the largest total result of the
    reducing collectives over one group of batch axes (scalars left out). None when no
    collective reduces them (one device, or a point-to-point sync's exchanges)."""
    batch = set(setting.batch_axes or (setting.context_axis,))
    groups: dict[tuple, float] = {}
    for c in found:
        if (c.kind in ("all-reduce", "reduce-scatter") and c.axes and set(c.axes) <= batch
                and c.result_bytes > 8):
            runs = counts.get(c.computation, c.count)
            groups[c.axes] = groups.get(c.axes, 0.0) + runs * (c.result_bytes - 8)
    if not groups:
        return None
    # Expert parallelism: the experts' gradients and the rest are summed over different
    # axes (a device holds both); otherwise each group is the same gradients' sum.
    return sum(groups.values()) if setting.expert_axis else max(groups.values())


def _context_own(found, counts, s: StepSetting) -> dict:
    """``{(kind, axes): (count, bytes)}`` of ContextParallel's own ``shard_map`` s (its
    attention and the zigzag's way back, each wrapped in ``jax.checkpoint``)."""
    own: dict[tuple, list[float]] = {}
    for c in found:
        if c.axes == (s.context_axis,) and "checkpoint/shard_map/" in c.op_name:
            runs = counts.get(c.computation, c.count)
            entry = own.setdefault((c.kind, c.axes), [0.0, 0.0])
            entry[0] += runs
            entry[1] += runs * c.message_bytes
    return {k: tuple(v) for k, v in own.items()}


def _memory_rows(s: StepSetting, compiled, state, batch, found, counts,
                 stages=None) -> list[Row]:
    predicted = pm.state_bytes(s)
    state_bytes, batch_bytes = program.argument_bytes(compiled, (state, batch))
    measured = {"param": 0, "opt": 0, "other": 0}
    for leaf, nbytes in zip(s.leaves, state_bytes):
        measured[leaf.role] += nbytes
    whole = [x.path for x in s.leaves if x.role == "param" and not x.zero_split]
    zero_reason = (f"ZeRO keeps {len(whole)} leaves whole (no dimension divisible by "
                   f"N): {', '.join(whole[:3])}{' ...' if len(whole) > 3 else ''}"
                   if s.zero_axis and whole else "")
    mem = program.device_memory(compiled, (state, batch))  # ZeRO-Offload's state left out
    host = pm.offloaded_bytes(s)
    rows = [
        Row(MEMORY, "parameters", predicted["parameters"].value, measured["param"],
            how=predicted["parameters"].how, reason=zero_reason),
        Row(MEMORY, "optimizer state", predicted["optimizer state"].value
            + predicted["other state"].value, measured["opt"] + measured["other"],
            how=predicted["optimizer state"].how + " + counters",
            reason=zero_reason),
        Row(MEMORY, "gradients", predicted["gradients"].value,
            _measured_gradients(found, counts, s), how=predicted["gradients"].how,
            reason="measured as the synchronised gradients' collectives" + (
                "; GSPMD sums the embedding's and output matrix's gradients over the "
                "context axis in several parts (the lookup's, the chunked loss's)"
                if s.context_axis else "")),
    ]
    args = (predicted["parameters"].value + predicted["optimizer state"].value
            + predicted["other state"].value + s.batch_bytes / max(s.size(s.batch_axes), 1)
            - host.value)
    if host.value:
        rows.append(Row(MEMORY, "host memory (offloaded)", host.value,
                        program.host_argument_bytes(compiled, (state, batch)), how=host.how))
    rows.append(Row(MEMORY, "arguments (state + batch)", args, mem.argument_bytes,
                    how="state + the batch's share" + (" - offloaded" if host.value else ""),
                    reason=zero_reason))
    if s.expert_axis or s.moe is not None:
        experts = [(x, n) for x, n in zip(s.leaves, state_bytes) if x.expert]
        rows.insert(1, Row(MEMORY, "expert weights", pe.expert_weight_bytes(s) if experts
                           else None, sum(n for _, n in experts) if experts else None,
                           how=f"Σ experts / EP={s.size(s.expert_axis)}" if experts
                           else "replicated: no expert axis"))
    temps = working_rows(s, state, batch, stages, rows)
    why = REASONS["temporaries"] + ("; " + REASONS["pipeline buffers"] if s.pipeline else "")
    if s.pipeline and _bf16_on_cpu(s) and jax.__version_info__ < (0, 12):
        why += "; " + REASONS["cpu bf16 rings"]
    rows.append(Row(MEMORY, "temporaries", temps.value if temps else None, mem.temp_bytes,
                    how=temps.how if temps else "memory_analysis", reason=why))
    update = pm.update_bytes(s)
    if update.value:
        rows.append(Row(MEMORY, "update (offloaded state on the device)", update.value, None,
                        how=update.how))
    peak = args + max(temps.value, update.value) if temps else None
    rows.append(Row(MEMORY, "peak", peak, mem.peak_bytes,
                    how="arguments + " + ("max(temporaries, update)" if update.value
                                          else "temporaries"), reason=REASONS["peak"]))
    return rows


def _bf16_on_cpu(s: StepSetting) -> bool:
    return (s.backend == "cpu" and s.config is not None
            and jnp.dtype(s.config.dtype) == jnp.bfloat16)


def _widened_on_cpu(s: StepSetting, predicted: float, measured: float) -> bool:
    """Whether a bfloat16 step's collective measured twice its prediction on the CPU."""
    return _bf16_on_cpu(s) and abs(measured / max(predicted, 1.0) - 2) < 0.05


def _axes_text(axes) -> str:
    return "+".join(axes) if axes else "()"


def _traffic_rows(s: StepSetting, measured: dict, context_own: dict | None = None
                  ) -> list[Row]:
    predicted = pt.collectives(s, context_attention=False)
    measured = dict(measured)
    for key, (n, size) in (context_own or {}).items():  # shown in their own rows (below)
        left = (measured[key][0] - n, measured[key][1] - size)
        if left[1] > 0:
            measured[key] = left
        else:
            measured.pop(key)
    keys = sorted(set(predicted) | {k for k in measured if k[1] is not None},
                  key=lambda k: (k[0], _axes_text(k[1])))
    rows = []
    for kind, axes in keys:
        p, m = predicted.get((kind, axes)), measured.get((kind, axes))
        reason = ("not in the formulas" if p is None else
                  "not in the compiled program (XLA removed or merged it)" if m is None else "")
        if s.pipeline and axes == (s.tensor_axis,):
            reason = REASONS["pipeline W"]
        if s.strategy.sync_style == "gspmd" and s.batch_axes and set(axes) & set(s.batch_axes):
            reason = "style='gspmd': XLA's partitioner schedules these (per-layer gathers)"
        if s.context_axis and axes == (s.context_axis,):
            reason = REASONS["context gradients" if kind == "all-reduce" else "context gspmd"]
        if p and m and _widened_on_cpu(s, p.message_bytes, m[1]):
            reason = REASONS["cpu bf16"]
        rows.append(Row(TRAFFIC, f"{kind} over {_axes_text(axes)}",
                        p.message_bytes if p else None, m[1] if m else None,
                        how="; ".join(p.how) if p else "compiled program", reason=reason))
    if s.context_axis:
        own, context_own = pt.context_attention_collectives(s), context_own or {}
        for kind, axes in sorted(set(own) | set(context_own)):
            p, m = own.get((kind, axes)), context_own.get((kind, axes))
            rows.append(Row(TRAFFIC, f"{kind} over {_axes_text(axes)} (ContextParallel)",
                            p.message_bytes if p else None, m[1] if m else None,
                            how="; ".join(p.how) if p else "compiled program",
                            reason="" if p and m else "not in the formulas" if m else
                            "not in the compiled program"))
    return rows


def _time(step: TrainStep, state, batch, steps: int) -> float | None:
    """The median wall time of ``steps`` calls on a copy of ``state`` (None if abstract)."""
    leaves = jax.tree.leaves(state)
    if steps <= 0 or not all(isinstance(x, jax.Array) for x in leaves):
        return None
    current = jax.tree.map(jnp.copy, state)
    current, _ = step(current, batch)  # compiles
    jax.block_until_ready(current)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        current, metrics = step(current, batch)
        jax.block_until_ready((current, metrics))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def explain(step: TrainStep, state, batch, *, config: GPTConfig | None = None,
            chip: roofline.Chip | str | None = None, link: cost.Link | str | None = None,
            timing_steps: int = 0, stages: Stages | None = None, devices: int | None = None,
            cluster: Topology | str | None = None) -> Report:
    """Predicted next to measured memory, collectives, flops, bubble and time of a step.

    Args:
      step: a ``px.train_step``-decorated step; or, to predict without compiling at any
        device count, ``(mesh, strategy)`` with the mesh as axis sizes (``{"stage": 8,
        "data": 8, "tensor": 8}``; one may be ``-1`` with ``devices``), a
        ``jax.sharding.AbstractMesh`` or a ``Mesh``, or a ``px.plan`` result
        (:mod:`parallax.planner.explain_predicted`: the measured column stays empty).
      state: its state (arrays, or ``jax.ShapeDtypeStruct`` leaves: nothing is allocated).
      batch: a batch (arrays or ``jax.ShapeDtypeStruct`` leaves).
      config: the ``GPTConfig`` (read from a ``px.models.GPT`` state when omitted); the
        activation, Megatron and flop formulas need it.
      chip: a :class:`parallax.planner.roofline.Chip` or preset name (default: the
        devices' own, ``"cpu-sim"`` on CPU).
      link: a ``parallax.comm.cost`` link or preset (default: the chip's own, e.g.
        ``"nvlink-h100"`` for ``chip="h100"``; see ``roofline.link_for``).
      timing_steps: also run the step this many times on a copy of ``state`` and report the
        median time (0: do not run; an abstract state is never run).
      stages: the pipelined loss (a ``px.pipeline.Stages``), whose layer template sizes the
        pipeline runtime's rings (default: the GPT's ``next_token_stages`` for a GPT).
      devices: the device count of a predicted ``(mesh, strategy)`` (fills a ``-1`` axis).
      cluster: a :class:`parallax.planner.topology.Topology` or preset name
        (``"dgx-h100"``, ``"dgx-a100"``): adds the step's time split on it (matmuls,
        memory-bound work, bubble, communication inside and across nodes) and its MFU, and
        says where each collective runs.

    Returns:
      A :class:`parallax.planner.report.Report`: ``print(report)`` for text,
      ``report.print()`` for a rich table, ``report.as_dict()`` for code.

    Raises:
      TypeError: ``step`` is not a ``px.train_step``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, parallax as px
      >>> from flax import nnx
      >>> mesh, strategy = px.make_mesh(fsdp=-1), px.ZeRO(3, "fsdp")
      >>> @px.train_step(mesh, strategy)
      ... def step(state, batch):
      ...     loss, grads = px.value_and_grad(px.models.mse_loss)(state.model, batch)
      ...     return state.apply_gradients(grads), {"loss": loss}
      >>> state = jax.eval_shape(lambda: px.TrainState.create(
      ...     px.models.MLP(16, [64], 16, rngs=nnx.Rngs(0)), optax.adam(1e-3)))
      >>> batch = {"x": jnp.ones((16, 16)), "y": jnp.ones((16, 16))}
      >>> report = px.explain(step, state, batch)
      >>> row = report.row("parameters")
      >>> row.predicted == row.measured
      True

    References:
      Rajbhandari et al., "ZeRO", SC 2020; Shoeybi et al., "Megatron-LM", 2019; Narayanan
      et al., SC 2021; Williams et al., "Roofline", CACM 2009.
    """
    if isinstance(step, tuple):
        return explain_predicted(step, state, batch, devices=devices, cluster_name=cluster,
                                 chip=chip, link=link, config=config, stages=stages)
    if not isinstance(step, TrainStep):
        raise TypeError(f"{API}: step must be a px.train_step-decorated function (a "
                        f"px.TrainStep), got {type(step).__name__}; decorate it with "
                        "@px.train_step(mesh, strategy), or pass (mesh, strategy) to predict "
                        "without compiling.")
    mesh, strategy = step.mesh, step.strategy
    setting = read_setting(mesh, strategy, state, batch, config, API)
    compiled = step.lower(state, batch).compile()
    text = compiled.as_text()
    branches = setting.pipeline.branches() if setting.pipeline else None
    counts = program.computation_counts(text, branches)
    found = hlo.collectives(text, mesh)
    measured_traffic = program.collective_totals(text, mesh, branches)
    device = roofline.chip(chip) if chip is not None else roofline.chip_for(mesh.devices.flat[0])
    link = roofline.link_for(device, link, setting.backend)

    rows = _memory_rows(setting, compiled, state, batch, found, counts, stages)
    context_own = _context_own(found, counts, setting) if setting.context_axis else None
    rows += _traffic_rows(setting, measured_traffic, context_own)
    flops = pc.flops(setting)
    measured_flops = program.matmul_flops(text, branches)
    flops_reason = ("pipeline W" if setting.pipeline else "moe flops" if setting.moe
                    else "ring flops" if setting.context_method == "ring" else "matmul flops")
    rows.append(Row(COMPUTE, "matmul flops", flops.value if flops else None, measured_flops,
                    unit="flop", how=flops.how if flops else "compiled program",
                    reason=REASONS[flops_reason]))
    model = pc.model_flops(setting)
    if model:  # the remat policy's cost: 1 without recomputation
        policy = getattr(setting.config, "remat", "none")
        rows.append(Row(COMPUTE, f"compiled / model flops (remat={policy!r})",
                        flops.value / model, measured_flops / model, unit="x",
                        how="matmul flops / (6 N + 12 L T D) x tokens (parallax.models.remat)",
                        reason=REASONS[flops_reason]))
    bub = pc.bubble(setting)
    if bub is not None:
        ticks = program.pipeline_ticks(text)
        p = setting.pipeline
        useful = 3 * p.microbatches * p.virtual_stages
        rows.append(Row(COMPUTE, "pipeline bubble", bub.value,
                        1 - useful / ticks if ticks else None, unit="fraction", how=bub.how,
                        reason="the compiled tick loop runs another number of ticks"))
    accessed = float((compiled.cost_analysis() or {}).get("bytes accessed", 0.0))
    rows += _time_rows(setting, step, state, batch, device, link, flops, measured_flops,
                       measured_traffic, timing_steps, accessed)
    facts = {"strategy": strategy.name, "mesh": describe(mesh), "chip": device.name,
             "link": link.name, "batch": f"{setting.batch_rows} examples",
             "attention": attention_kernels(text).summary() + (
                 f" (asked: {step.attention})" if step.attention != "auto" else ""),
             "gradient sync": describe_sync(strategy.grad_sync, mesh, setting.batch_axes,
                                            strategy.sync_style)}
    note = pe.replicated_note(setting, mesh.size)
    if note:
        facts["note"] = note
    if cluster is not None:  # the same step on a cluster's nodes: its time split
        topology = find_cluster(cluster)
        split = step_time.estimate(setting, topology, chip)
        rows += split_rows(split, topology, setting)
        facts["cluster"] = f"{topology.name}: {topology.describe(dict(mesh.shape))}"
    return Report(f"px.explain: {getattr(step.fn, '__name__', 'step')}", rows, facts)


def _dtype(s: StepSetting) -> str:
    return jnp.dtype(s.config.dtype).name if s.config is not None else "float32"


def _time_rows(s, step, state, batch, device, link, flops, measured_flops, traffic,
               timing_steps, accessed) -> list[Row]:
    precision = jax.config.jax_default_matmul_precision
    bubble = pc.bubble(s).value if s.pipeline else 0.0
    hbm = pc.hbm_bytes(s).value
    predicted_traffic = [(kind, s.size(axes), t.message_bytes, max(t.count, 1))
                         for (kind, axes), t in pt.collectives(s).items()]
    measured = [(kind, s.size(axes), size, max(int(round(n)), 1))
                for (kind, axes), (n, size) in traffic.items() if axes]
    predicted = roofline.step_time(flops.value if flops else measured_flops, hbm,
                                   predicted_traffic, device, link, dtype=_dtype(s),
                                   precision=precision, bubble=bubble)
    compiled = roofline.step_time(measured_flops, max(hbm, accessed), measured, device, link,
                                  dtype=_dtype(s),
                                  precision=precision, bubble=bubble)
    wall = _time(step, state, batch, timing_steps)
    how = (f"roofline: compute {predicted.compute * 1e3:.3g} ms / (1 - bubble) + "
           f"collectives {predicted.communication * 1e3:.3g} ms")
    return [
        Row(TIME, "step time", predicted.total, wall, unit="s", how=how,
            reason=REASONS["step time"]),
        Row(TIME, "step time (roofline of the compiled program)", compiled.total, wall,
            unit="s", how="measured flops and collectives through the same roofline",
            reason=REASONS["step time"]),
    ]

