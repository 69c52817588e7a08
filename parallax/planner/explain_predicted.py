"""``px.explain`` without compiling: a step's predicted rows at any device count, on a cluster.

``px.explain((mesh, strategy), state, batch, cluster="dgx-h100")`` (or a ``px.plan``
result in place of the pair) reads the step's setting from the mesh's axis sizes (a dict,
a ``jax.sharding.AbstractMesh`` or a ``Mesh``), the strategy, and the abstract state and
batch, and fills every row of the report with the same predictors the compiled route
prints next to its measurements (:mod:`parallax.planner.predicted`): memory per device, the
collectives (each with its time inside a node and across nodes), flops and bubble, and the
step's time split (:mod:`parallax.planner.predicted.step_time`) with its MFU. Nothing is
compiled and no device is simulated, so 16 or 16,384 devices take the same second; the
measured column stays empty.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import AbstractMesh, AxisType

from parallax.mesh import LAYOUT_ORDER, resolve_axis_sizes
from parallax.planner import roofline
from parallax.planner.predicted import compute as pc
from parallax.planner.predicted import memory as pm
from parallax.planner.predicted import pipeline as pp
from parallax.planner.predicted import step_time
from parallax.planner.predicted import traffic as pt
from parallax.planner.report import Report, Row
from parallax.planner.setting import StepSetting, read_setting
from parallax.planner.topology import INTER, INTRA, Topology, cluster, single_node

API = "px.explain"
MEMORY, TRAFFIC, COMPUTE, TIME = ("memory per device", "collectives per step", "compute",
                                  "time per step")


def _axes(mesh, devices: int | None) -> dict[str, int]:
    """The mesh's axis sizes from a dict (one may be -1 with ``devices``) or a mesh."""
    if isinstance(mesh, dict):
        if devices is None and any(v == -1 for v in mesh.values()):
            raise ValueError(f"{API}: the mesh {mesh} has an axis of -1 but no devices=; pass "
                             "devices=N to fill it.")
        total = devices if devices is not None else math.prod(mesh.values())
        return resolve_axis_sizes(API, mesh, total)
    shape = dict(mesh.shape)
    if devices is not None and devices != math.prod(shape.values()):
        raise ValueError(f"{API}: the mesh has {math.prod(shape.values())} devices "
                         f"({shape}) but devices={devices}; give one or make them agree.")
    return shape


def split_rows(split: step_time.StepSplit, topology: Topology, s: StepSetting) -> list[Row]:
    """The time rows of a :class:`~parallax.planner.predicted.step_time.StepSplit`:
    matmuls, memory-bound work, bubble, communication per level, the total, and MFU."""
    sec = lambda name, value, how: Row(TIME, name, value, None, unit="s", how=how)  # noqa: E731
    chip = roofline.chip(topology.chip)
    return [
        sec("matmuls", split.matmul, f"flops / ({chip.name} peak x "
            f"{chip.matmul_efficiency:.3f} achievable: {chip.efficiency_source})"),
        sec("memory-bound work", split.memory_bound,
            "activations' passes, attention scores, accumulators, optimizer / HBM bandwidth"),
        sec("pipeline bubble", split.bubble, f"compute x f / (1 - f), f = "
            f"{100 * split.bubble_fraction:.1f}%"),
        sec(f"communication, {INTRA}", split.communication[INTRA],
            f"{topology.intra.name}: rings inside a node (not overlapped)"),
        sec(f"communication, {INTER}", split.communication[INTER],
            f"{topology.network.name}: rings or trees across nodes (not overlapped)"),
        sec("step time (cluster)", split.total, "compute + bubble + communication"),
        Row(TIME, "MFU", split.mfu, None, unit="fraction",
            how="model flops (no recomputation) / step time / peak"),
    ]


def traffic_rows(split: step_time.StepSplit, topology: Topology, s: StepSetting) -> list[Row]:
    """One row per predicted collective, its message bytes, and where it runs and for how
    long in its ``how``."""
    described = {(k, a): t for (k, a), t in pt.collectives(s).items()}
    rows = []
    for kind, axes, nbytes, count, seconds in sorted(split.collectives,
                                                     key=lambda c: (c[0], c[1])):
        n_in, n_out = topology.group(axes, s.mesh_shape)
        where = (f"{n_in} in a node" if n_out == 1 else f"{n_out} nodes" if n_in == 1
                 else f"{n_in} in a node x {n_out} nodes")
        t = described.get((kind, axes))
        rows.append(Row(TRAFFIC, f"{kind} over {'+'.join(axes) or '()'}", nbytes, None,
                        how=f"{'; '.join(t.how) if t else ''}; x{count}; {where}: "
                            f"{1e3 * seconds[INTRA]:.3g} ms {INTRA}, "
                            f"{1e3 * seconds[INTER]:.3g} ms {INTER}"))
    return rows


def explain_predicted(setup, state, batch, *, devices: int | None = None,
                      cluster_name: Topology | str | None = None, chip=None, link=None,
                      config=None, stages=None) -> Report:
    """The predicted report of ``setup = (mesh, strategy)`` (see the module docstring).

    Without a cluster the devices are priced as one node of ``chip`` on ``link`` (the
    chip's own); with one, its chip unless ``chip`` is given.
    """
    try:
        mesh, strategy = setup
    except (TypeError, ValueError):
        raise TypeError(f"{API}: expected a px.train_step step, or (mesh, strategy) with the "
                        f"mesh as axis sizes (e.g. ({{'data': 64, 'tensor': 8}}, strategy)) or "
                        f"a px.plan result, got {type(setup).__name__}.") from None
    axes = _axes(mesh, devices)
    unknown = [a for a in axes if a not in LAYOUT_ORDER]
    if unknown:
        raise ValueError(f"{API}: unknown mesh axes {unknown}; the axes are "
                         f"{', '.join(LAYOUT_ORDER)}.")
    total = math.prod(axes.values())
    if cluster_name is not None:
        topology = cluster(cluster_name)
        device = roofline.chip(chip or topology.chip)
    else:
        device = roofline.chip(chip or "h100")
        topology = single_node(device.name, roofline.link_for(device, link), total)
    abstract = AbstractMesh(tuple(axes.values()), tuple(axes), (AxisType.Auto,) * len(axes))
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    s = read_setting(abstract, strategy, state, batch, config, API, backend="gpu")
    split = step_time.estimate(s, topology, device)
    rows = _memory_rows(s, state, batch, stages) + traffic_rows(split, topology, s)
    flops = pc.flops(s)
    if flops is not None:
        rows.append(Row(COMPUTE, "matmul flops", flops.value, None, unit="flop", how=flops.how))
    bubble = pc.bubble(s)
    if bubble is not None:
        rows.append(Row(COMPUTE, "pipeline bubble", bubble.value, None, unit="fraction",
                        how=bubble.how))
    rows += split_rows(split, topology, s)
    facts = {"strategy": strategy.name, "mesh": " x ".join(f"{a}={n}" for a, n in axes.items())
             + f" ({total} devices, predicted: nothing compiled)",
             "cluster": f"{topology.name}: {topology.describe(axes)}", "chip": device.name,
             "batch": f"{s.batch_rows} examples"}
    if total >= topology.devices_per_node and cluster_name is not None:
        ici, dcn = topology.hybrid_axes(axes)
        facts["make_hybrid_mesh"] = f"ici={ici}, dcn={dcn}"
    return Report(f"px.explain (predicted): {strategy.name}", rows, facts)


def _memory_rows(s: StepSetting, state, batch, stages) -> list[Row]:
    predicted = pm.state_bytes(s)
    args = (predicted["parameters"].value + predicted["optimizer state"].value
            + predicted["other state"].value + s.batch_bytes / max(s.size(s.batch_axes), 1))
    rows = [Row(MEMORY, "parameters", predicted["parameters"].value, None,
                how=predicted["parameters"].how),
            Row(MEMORY, "optimizer state", predicted["optimizer state"].value
                + predicted["other state"].value, None,
                how=predicted["optimizer state"].how + " + counters"),
            Row(MEMORY, "gradients", predicted["gradients"].value, None,
                how=predicted["gradients"].how),
            Row(MEMORY, "arguments (state + batch)", args, None,
                how="state + the batch's share")]
    temps = working_rows(s, state, batch, stages, rows)
    if temps is not None:
        rows.append(Row(MEMORY, "temporaries", temps.value, None, how=temps.how))
        rows.append(Row(MEMORY, "peak", args + temps.value, None,
                        how="arguments + temporaries"))
    return rows


def working_rows(s: StepSetting, state, batch, stages, rows: list) -> pm.Estimate | None:
    """Appends the predicted activation and pipeline-buffer rows to ``rows`` and returns the
    predicted temporaries (the pipeline's buffers where there is one), for both reports."""
    act = pm.activation_bytes(s)
    if act is not None:
        rows.append(Row(MEMORY, "activations", act.value, None, how=act.how))
    temps, piped = pm.temporary_bytes(s), pp.stage_temporaries(s, state, batch, stages)
    if piped is not None:
        temps, parts = piped
        rows.append(Row(MEMORY, "pipeline buffers", sum(parts.values()), None,
                        how=", ".join(f"{k} {v / 1e6:.3g} MB" for k, v in parts.items() if v)))
    return temps
