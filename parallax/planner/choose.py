"""``px.plan``: choose a mesh and a strategy, by prediction first and compilation second.

1. **Enumerate** every factorization of the devices into ``stage x data x fsdp x tensor``
   with ZeRO 1-3, tensor parallelism with and without sequence parallelism, and each
   pipeline schedule with a few micro-batch counts
   (:mod:`parallax.planner.candidates`).
2. **Prune with the cost model**: the formulas of ``px.explain`` predict each candidate's
   peak memory and a roofline step time, with no compilation; candidates predicted not to
   fit are dropped, the rest ranked by predicted time.
3. **Compile the top candidates** on abstract state (``jax.ShapeDtypeStruct``: nothing is
   allocated) and read their real peak memory (``memory_analysis``), collectives and matmul
   flops; a candidate whose compiled peak exceeds the budget is refused. The compiled
   programs' rooflines rank the survivors (or, with ``measure_steps``, their timed steps).

The winner comes back as ``(mesh, strategy)``, ready for ``px.init`` and ``px.train_step``.

References:
  Zheng et al., "Alpa: Automating Inter- and Intra-Operator Parallelism for Distributed
  Deep Learning", OSDI 2022 (search over parallel plans with a cost model); Narayanan et
  al., SC 2021 (the 3D parallelism design space).

(A little over 300 lines: the planner's search, one loop over candidates and its report.)
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType
from tqdm.auto import tqdm

from parallax import rules
from parallax.analysis import hlo, program
from parallax.planner import roofline
from parallax.planner.predicted import compute as pc
from parallax.planner.predicted import memory as pm
from parallax.planner.predicted import pipeline as pp
from parallax.planner.predicted import step_time
from parallax.planner.predicted import traffic as pt
from parallax.planner.candidates import TP_NAMES, SearchSpace, enumerate_candidates
from parallax.planner.plan_result import Evaluation, Plan, table
from parallax.planner.setting import StepSetting, model_config, read_setting, reread
from parallax.planner.topology import Topology
from parallax.planner.topology import cluster as find_cluster
from parallax.comm import cost
from parallax.grad.gradients import value_and_grad
from parallax.pipeline.stages import Stages
from parallax.mesh import make_mesh
from parallax.state import TrainState
from parallax.step.placement import init
from parallax.step.spmd_step import train_step

API = "px.plan"


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), tree)


def _residual_bytes(state: TrainState, loss_fn, batch) -> float:
    """Bytes the plain step's autodiff keeps for the backward (the leaves of ``jax.vjp``'s
    closure), on the whole batch: the generic activation estimate."""
    def pullback(params, b):
        model = lambda p: loss_fn(nnx.merge(state.graphdef, p, state.rest), b)  # noqa: E731
        return jax.vjp(model, params)[1]

    leaves = jax.tree.leaves(jax.eval_shape(pullback, state.params, batch))
    return float(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in leaves))


def _plain_flops(state: TrainState, loss_fn, batch) -> float:
    """Matmul flops of the whole step as one device would run it (one compilation)."""
    def grads(params, b):
        return jax.grad(lambda p: loss_fn(nnx.merge(state.graphdef, p, state.rest), b))(params)

    with jax.default_device(jax.devices()[0]):
        return program.matmul_flops(jax.jit(grads).lower(state.params, batch).compile())


def _predict(e: Evaluation, s: StepSetting, generic: dict, device, link,
             slots: pp.LayerSlots | None = None, topology: Topology | None = None) -> None:
    state = pm.state_bytes(s)
    args = sum(state[k].value for k in ("parameters", "optimizer state", "other state"))
    args += s.batch_bytes / s.size(s.batch_axes)
    act = None
    temps = (pp.temporaries(s, slots)[0] if slots is not None
             else pm.temporary_bytes(s))
    if temps is None:  # no GPT formula: the plain step's residuals, split like the batch
        split = s.size(s.batch_axes) * (s.pipeline.microbatches if s.pipeline else 1)
        act = generic["residuals"] / split / s.tensor
        temps = pm.Estimate(act + pm.local_param_bytes(s), "residuals + gradients")
    e.predicted_peak = args + temps.value
    e.predicted_args, e.predicted_temps = args, temps.value
    flops = pc.flops(s)
    flops = flops.value if flops else generic["flops"] / (
        s.size(s.batch_axes) * s.tensor * s.stages)
    traffic = [(k, s.size(a), t.message_bytes, max(t.count, 1))
               for (k, a), t in pt.collectives(s).items()]
    bubble = pc.bubble(s).value if s.pipeline else 0.0
    dtype = jnp.dtype(s.config.dtype).name if s.config else "float32"
    e.predicted_hbm = pc.hbm_bytes(s, act).value
    if topology is not None:
        e.split = step_time.estimate(s, topology, device, flops=flops,
                                     activations=act if act is not None else None)
        e.predicted_time = e.split.total
        return
    e.predicted_time = roofline.step_time(flops, e.predicted_hbm, traffic, device, link,
                                          dtype=dtype, bubble=bubble).total


def _compile(e: Evaluation, abstract, loss_fn, batch, devices, device, link, budget,
             setting: StepSetting, topology: Topology | None = None):
    mesh = make_mesh(**e.candidate.axes, devices=devices[: math.prod(e.candidate.axes.values())])

    @train_step(mesh, e.candidate.strategy)
    def step(state, b):
        loss, grads = value_and_grad(loss_fn)(state.model, b)
        return state.apply_gradients(grads), {"loss": loss}

    try:
        compiled = step.lower(abstract, batch).compile()
    except (ValueError, TypeError) as error:
        e.fits, e.note = False, f"does not compile: {str(error).splitlines()[0][:80]}"
        return None
    text = compiled.as_text()
    branches = setting.pipeline.branches() if setting.pipeline else None
    e.compiled_peak = hlo.memory(compiled).peak_bytes
    traffic = [(k, setting.size(a), size, max(int(round(n)), 1)) for (k, a), (n, size)
               in program.collective_totals(text, mesh, branches).items() if a]
    bubble = pc.bubble(setting).value if setting.pipeline else 0.0
    dtype = jnp.dtype(setting.config.dtype).name if setting.config else "float32"
    accessed = float((compiled.cost_analysis() or {}).get("bytes accessed", 0.0))
    if topology is not None:  # the compiled flops and collectives, priced per level
        found = [(k, a, size, max(int(round(n)), 1)) for (k, a), (n, size)
                 in program.collective_totals(text, mesh, branches).items() if a]
        flops = program.matmul_flops(text, branches)
        model = pc.flops(setting, recomputed=False)
        e.compiled_time = step_time.price(setting, topology, device, flops, found,
                                          model.value if model else flops).total
    else:
        e.compiled_time = roofline.step_time(
            program.matmul_flops(text, branches), max(accessed, e.predicted_hbm), traffic,
            device, link, dtype=dtype, bubble=bubble).total
    e.fits = budget is None or e.compiled_peak <= budget
    e.note = "fits" if e.fits else "does not fit (compiled)"
    return mesh, step


def _diverse(ranked: list[Evaluation]) -> list[Evaluation]:
    """The ranking with each mesh shape's best candidate first: the shapes decide most of
    the communication, which the cost model knows least well for models it has no formula
    for, so the compiled top candidates should span several shapes."""
    firsts, seen = [], set()
    for e in ranked:
        shape = tuple(e.candidate.axes.items())
        if shape not in seen:
            seen.add(shape)
            firsts.append(e)
    return firsts + [e for e in ranked if e not in firsts]


def _measure(built: dict, state_fn, batch, steps: int) -> None:
    """Times the compiled candidates' steps, alternating between them, medians."""
    states = {id(e): init(state_fn, mesh, e.candidate.strategy) for e, (mesh, _) in built.items()}
    times = {id(e): [] for e in built}
    for round_ in range(steps + 1):
        for e, (_, step) in built.items():
            start = time.perf_counter()
            states[id(e)], metrics = step(states[id(e)], batch)
            jax.block_until_ready(metrics)
            if round_:  # the first round compiles
                times[id(e)].append(time.perf_counter() - start)
    for e in built:
        e.measured_time = statistics.median(times[id(e)])


def plan(state_fn: Callable[[], TrainState], loss_fn: Callable, batch, *,
         devices: int | Sequence[jax.Device] | None = None,
         memory_per_device: float | None = None, top_k: int = 4,
         space: SearchSpace | None = None, chip: roofline.Chip | str | None = None,
         link: cost.Link | str | None = None, measure_steps: int = 0,
         exhaustive: bool = False, cluster: Topology | str | None = None) -> Plan:
    """Proposes ``(mesh, strategy)`` for a model, a loss and a batch.

    Args:
      state_fn: builds the ``px.TrainState`` (traced abstractly: nothing is allocated).
      loss_fn: ``loss_fn(model, batch) -> scalar``; a ``px.pipeline.Stages`` also allows
        pipelines.
      batch: the global batch (arrays or ``jax.ShapeDtypeStruct`` leaves).
      devices: a device count (the first ones of ``jax.devices()``) or the devices; all by
        default. With more than are present, candidates are ranked by the cost model only:
        nothing is compiled and no device is simulated, so any count works (16 to 16,384).
      memory_per_device: bytes each device may use; default the devices' own limit
        (``memory_stats()``), none on CPU, the cluster chip's memory with ``cluster``.
      top_k: candidates compiled (more when none of them fits); also how many of those
        predicted not to fit are compiled before being rejected (the best predicted); the
        others' verdict says ``"rejected: predicted only"``.
      space: a :class:`parallax.planner.candidates.SearchSpace` (what may be chosen;
        ``SearchSpace.for_cluster`` with ``cluster``).
      chip, link: the roofline's device and link (default: the devices' own chip; a chip
        implies its link, ``"h100"`` -> ``"nvlink-h100"``, unless ``link`` is given).
      measure_steps: also run each compiled candidate this many steps, alternating, and
        rank by the median (needs the devices present).
      exhaustive: compile every valid candidate (brute force: what the cost model's pruning
        is validated against); no verdict then rests on a prediction.
      cluster: a :class:`parallax.planner.topology.Topology` or preset name
        (``"dgx-h100"``, ``"dgx-a100"``): its chip, and every collective priced per level
        (inside a node, across nodes; :mod:`parallax.planner.predicted.step_time`); each
        evaluation then has its time split (``Evaluation.split``) and MFU.

    Returns:
      A :class:`Plan`: ``mesh, strategy = plan``; ``plan.table()`` explains the choice.

    Raises:
      TypeError: ``state_fn`` does not build a ``px.TrainState``.
      ValueError: no candidate fits in ``memory_per_device``.

    Example:
      >>> import jax.numpy as jnp, optax, parallax as px
      >>> from flax import nnx
      >>> make = lambda: px.TrainState.create(px.models.MLP(16, [64], 16, rngs=nnx.Rngs(0)),
      ...                                     optax.adam(1e-3))
      >>> batch = {"x": jnp.ones((16, 16)), "y": jnp.ones((16, 16))}
      >>> mesh, strategy = px.plan(make, px.models.mse_loss, batch, devices=2, top_k=2)
      >>> mesh.size
      2

    References:
      Zheng et al., "Alpa", OSDI 2022; Narayanan et al., SC 2021.
    """
    present = list(jax.devices())
    count, devices = (devices, present[:devices]) if isinstance(devices, int) else (
        len(list(devices or present)), list(devices or present))
    with nnx.use_eager_sharding(False):
        abstract = jax.eval_shape(state_fn)
    if not isinstance(abstract, TrainState):
        raise TypeError(f"{API}: state_fn must return a px.TrainState (the planner builds the "
                        f"train step around it), got {type(abstract).__name__}; wrap the "
                        "model: lambda: px.TrainState.create(model, optimizer).")
    concrete, batch = batch, _abstract(batch)
    topology = find_cluster(cluster) if cluster is not None else None
    backend = devices[0].platform if count <= len(present) or topology is None else "gpu"
    device = (roofline.chip(chip) if chip else roofline.chip(topology.chip) if topology
              else roofline.chip_for(devices[0]))
    link = roofline.link_for(device, link if link or not topology else topology.intra, backend)
    if memory_per_device is None and topology is not None:
        memory_per_device = device.memory_bytes
    elif memory_per_device is None and backend != "cpu":
        memory_per_device = (devices[0].memory_stats() or {}).get("bytes_limit")
    if space is None:
        space = (SearchSpace.for_cluster(topology.devices_per_node) if topology
                 else SearchSpace())
    evaluations, settings = _predicted(abstract, loss_fn, batch, count, space, backend,
                                       device, link, topology)
    ranked = sorted((e for e in evaluations if e.fits is None), key=lambda e: e.predicted_time)
    compiled = count <= len(present)
    if compiled:
        built = _compile_top(ranked, settings, abstract, loss_fn, batch, devices, device, link,
                             memory_per_device, top_k, exhaustive, topology)
        if measure_steps and built:
            _measure(built, state_fn, concrete, measure_steps)
    for e in ranked:
        if e.fits is None and not compiled and memory_per_device is not None and (
                e.predicted_peak > memory_per_device):
            e.fits, e.note = False, "rejected: predicted only"
        elif e.fits is None:
            e.note = "not compiled" if compiled else "ranked by the cost model only"
    priced = (f"times priced for chip {device.name} on cluster {topology.name} "
              f"({topology.devices_per_node} per node: {topology.intra.name}, "
              f"{topology.network.name})" if topology
              else f"times priced for chip {device.name}, link {link.name}")
    return _choose(evaluations, count, devices, compiled, memory_per_device, priced, topology)


def _layout_key(axes: dict, strategy) -> tuple:
    """What a setting's leaves depend on: the mesh and the strategy's rules and ZeRO."""
    return (tuple(sorted(axes.items())), strategy.rules, strategy.shard_axis,
            strategy.zero_stage)


def _predicted(abstract, loss_fn, batch, count, space, backend, device, link, topology=None):
    """Every candidate with its prediction (or why it cannot run), and their settings."""
    config = model_config(abstract)
    names = {n for leaf in rules.annotated_leaves(abstract.params) for n in (leaf.names or ())}
    found = enumerate_candidates(
        count, loss_fn, int(jax.tree.leaves(batch)[0].shape[0]),
        tensor_names=bool(names & set(TP_NAMES)),
        layers=config.num_layers if config else None, heads=config.num_heads if config else None,
        seq_len=(int(batch["tokens"].shape[1]) - 1) if config and "tokens" in batch else None,
        space=space)
    generic = {} if config else {"residuals": _residual_bytes(abstract, loss_fn, batch),
                                 "flops": _plain_flops(abstract, loss_fn, batch)}
    evaluations, settings, traced, layouts = [], {}, {}, {}
    for cand in tqdm(found, desc=API, unit="candidate", leave=False,
                     disable=len(found) < 500):
        e = Evaluation(cand)
        evaluations.append(e)
        if cand.invalid:
            e.fits, e.note = False, cand.invalid
            continue
        key = _layout_key(cand.axes, cand.strategy)
        try:
            if key in layouts:  # the same leaves: only the strategy's pipeline differs
                settings[id(e)] = reread(layouts[key], cand.strategy)
            else:
                settings[id(e)] = layouts[key] = read_setting(
                    _abstract_mesh(cand.axes), cand.strategy, abstract, batch, config, API,
                    backend=backend)
        except ValueError as error:  # the layout refuses it (an axis that does not divide)
            e.fits, e.note = False, str(error).splitlines()[0][:90]
            continue
        _predict(e, settings[id(e)], generic, device, link,
                 _slots(settings[id(e)], abstract, batch, loss_fn, traced), topology)
    return evaluations, settings


def _slots(s: StepSetting, abstract, batch, loss_fn, traced: dict):
    """The pipeline runtime's slot sizes for a pipelined candidate (None otherwise), traced
    once per micro-batch size, tensor split and checkpoint policy."""
    if s.pipeline is None or not isinstance(loss_fn, Stages):
        return None
    key = (s.rows_per_device // s.pipeline.microbatches, s.tensor, s.sequence_parallel,
           s.pipeline.policy)
    if key not in traced:
        traced[key] = pp.layer_slots(s, abstract, batch, loss_fn)
    return traced[key]


def _family(e: Evaluation) -> str:
    """The predictor that priced a candidate's memory: the pipeline runtime's buffers, or
    the published formulas (their errors differ, so each calibrates only itself)."""
    return "pipeline" if "pp:" in e.candidate.label else "formulas"


def _compile_top(ranked, settings, abstract, loss_fn, batch, devices, device, link, budget,
                 top_k, exhaustive, topology=None) -> dict:
    """Compiles the best-predicted candidates (every one when ``exhaustive``) until ``top_k``
    of them are compiled and one fits (at most ``3 top_k``), then the ``top_k`` best of
    those it would reject for memory on the prediction alone (a prediction is checked
    before it rejects); returns those that fit."""
    built, calibration, rejected = {}, {}, []  # calibration: compiled / predicted peaks
    for e in _diverse(ranked):
        enough = len(built) >= 3 * top_k or (len(built) >= top_k and any(x.fits for x in built))
        if enough and not exhaustive:
            break
        if budget is not None and not exhaustive:
            # The most optimistic correction seen for this family (compiled over predicted
            # peak) and a 10% margin: set aside what clearly cannot fit.
            seen = calibration.get(_family(e), [])
            scale = min(seen) if seen else 1.0
            if e.predicted_peak > budget or e.predicted_peak * scale > 1.1 * budget:
                e.fits = False
                e.note = "rejected: predicted only" + (" (calibrated)" if seen else "")
                rejected.append(e)
                continue
        built[e] = _compile(e, abstract, loss_fn, batch, devices, device, link, budget,
                            settings[id(e)], topology)
        if e.compiled_peak and e.predicted_peak:
            calibration.setdefault(_family(e), []).append(e.compiled_peak / e.predicted_peak)
    for e in sorted(rejected, key=lambda x: x.predicted_time)[:top_k]:
        built[e] = _compile(e, abstract, loss_fn, batch, devices, device, link, budget,
                            settings[id(e)], topology)
        if e.fits:
            e.note = "fits (predicted not to)"
        elif e.compiled_peak is not None:
            e.note = "does not fit (compiled, as predicted)"
    return {e: made for e, made in built.items() if made is not None and e.fits}


def _choose(evaluations, count, devices, compiled, budget, priced: str,
            topology: Topology | None = None) -> Plan:
    """The best usable evaluation as a :class:`Plan`, or the error with the table."""
    usable = [e for e in evaluations if e.fits or (e.fits is None and not compiled)]
    if not usable:
        order = sorted(evaluations, key=lambda e: (e.compiled_peak or math.inf,
                                                   e.predicted_peak or math.inf))
        why = (f"fits in memory_per_device={budget:,.0f} bytes; use more devices, a smaller "
               "batch or model, or raise memory_per_device" if budget
               else "compiles; see each one's verdict")
        raise ValueError(f"{API}: no configuration of {count} devices {why}. The candidates, "
                         "smallest peak first:\n" + table(order, budget, 8, priced))
    best = min(usable, key=lambda e: (e.time, e.candidate.label))
    # The winner, then what could run (compiled to fit, or ranked by the cost model
    # alone), then what cannot; each by its best time.
    order = sorted(evaluations, key=lambda e: (e is not best, e.fits is False, e.time))
    best.note = "chosen" + (f" ({best.note})" if best.note and best.note != "fits" else "")
    axes = best.candidate.axes
    mesh = (make_mesh(**axes, devices=devices[: math.prod(axes.values())]) if compiled
            else _abstract_mesh(axes))
    return Plan(mesh, best.candidate.strategy, order, budget, priced, topology)


def _abstract_mesh(axes: dict) -> AbstractMesh:
    return AbstractMesh(tuple(axes.values()), tuple(axes), (AxisType.Auto,) * len(axes))
