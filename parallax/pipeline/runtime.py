"""One SPMD runtime for every pipeline schedule: a ``lax.scan`` over the table's ticks.

Inside a ``shard_map`` that is manual over the stage axis only (data axes are the caller's,
tensor axes stay with GSPMD inside the stage bodies), every tick each stage

1. stores what arrived from its neighbours into the activation and gradient rings, at the
   slots the plan gives (``Schedule.as_arrays``);
2. reads its action from the table (indexed by ``axis_index``), reads the slots it needs,
   and ``lax.switch``-es to it: ``F`` (``jax.vjp`` of its chunk; residuals to the stash),
   ``B`` (input gradient from the stashed closure), ``W`` (weight gradient from the same
   closure) or idle; writes back what the branch returns (the buffers themselves never
   enter the switch, which would copy them every tick);
3. sends its output forward and its input gradient backward with one ``ppermute`` each,
   outside the switch, so the collectives are the same on every stage and every tick.

``first`` runs inside the ``F`` of virtual stage 0; ``last`` and its gradient (the seed of the
backward) inside the ``F`` of the last virtual stage; ``first``'s backward inside the ``B`` of
virtual stage 0. Gradients of the stacked layers stay sharded over the stage axis; the
other parameters' gradients are summed over it.

Interleaved schedules (``virtual_stages = v > 1``) run chunk ``c`` of stage ``s`` as virtual
stage ``c * S + s``, which holds layers ``[(c S + s) L_c, (c S + s + 1) L_c)`` of the stack
(``L_c = L / (v S)``), so the pipeline computes the layers in the sequential order. The
stack is stored contiguously over the stage axis (``("layers", "stage")``), so each step
first moves every block of layers to the stage that runs it, and the gradients back
(:mod:`parallax.pipeline.interleave`: each block crosses the stage axis at most once).

References:
  Huang et al. 2019, GPipe; Narayanan et al. 2019, PipeDream (1F1B, weight stashing);
  Narayanan et al. 2021, Memory-Efficient Pipeline-Parallel DNN Training (PipeDream-flush);
  Narayanan et al. 2021 (SC), Megatron-LM interleaved 1F1B; Kim et al. 2020, torchgpipe
  (rematerialisation options); Qi et al. 2023, Zero Bubble (the B/W split).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from parallax.pipeline import actions, interleave
from parallax.pipeline.chunk import Chunk, template
from parallax.pipeline.plan import RuntimePlan, runtime_plan
from parallax.pipeline.schedule import Schedule
from parallax.pipeline.stages import Program
from parallax.vma import to_varying, varying_axes


def caster(axes: frozenset):
    """``vary(x)``: ``x`` cast to vary over ``axes`` (``lax.pcast``), a no-op where it does."""

    def vary(x):
        return to_varying(x, sorted(axes))

    return vary


def execute(prog: Program, sched: Schedule, batch, *, axis: str, remat: str, policy,
            api: str, trace: bool = False):
    """Runs ``sched`` on ``prog``: the mean loss over micro-batches and its gradients.

    Must be called where the mesh (``jax.sharding.get_abstract_mesh()``) has ``axis`` of
    size ``sched.stages`` and ``axis`` is not yet manual; the parameters' stacked layer axis
    should be sharded over ``axis`` (it is resharded otherwise).

    Returns:
      ``(loss, d_stacked, d_others)``, plus the executed action codes ``[ticks, stages]``
      when ``trace`` (what each stage's switch ran at each tick: 0 idle, 1 F, 2 B, 3 W).
    """
    S, v, M = sched.stages, sched.virtual_stages, sched.microbatches
    plan = runtime_plan(sched, remat)
    micro = jax.tree.map(lambda x: x.reshape(M, x.shape[0] // M, *x.shape[1:]), batch)
    outer = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(
        (prog.stacked, prog.others, batch))))
    vary = caster(outer | {axis})

    def body(stacked, others, micro):
        # [v L_c, ...] stored -> [v, L_c, ...] run here (chunk c is virtual stage c S + s)
        stacked = [vary(interleave.to_chunks(p, axis, S, v)) for p in stacked]
        others = [vary(o) for o in others]
        micro = jax.tree.map(vary, micro)
        loss, d_stacked, d_others, *codes = _ticks(
            prog, plan, sched, stacked, others, micro, axis=axis, vary=vary, policy=policy,
            api=api, trace=trace)
        d_stacked = [interleave.from_chunks(g, axis, S, v) for g in d_stacked]
        return (loss, d_stacked, d_others, *codes)

    stacked_spec = [P(axis)] * len(prog.stacked)
    out_specs = (P(), stacked_spec, [P()] * len(prog.others)) + ((P(None, axis),) if trace else ())
    return jax.shard_map(
        body,
        in_specs=(stacked_spec, [P()] * len(prog.others), jax.tree.map(lambda _: P(), micro)),
        out_specs=out_specs,
        axis_names=frozenset({axis}),
    )(prog.stacked, prog.others, micro)


def _ticks(prog, plan: RuntimePlan, sched, stacked, others, micro, *, axis, vary, policy,
           api, trace):
    S, M = sched.stages, sched.microbatches
    s = lax.axis_index(axis)
    pick = lambda tree, i: jax.tree.map(  # noqa: E731
        lambda b: lax.dynamic_index_in_dim(b, i, keepdims=False), tree)
    x_like = prog.first(others, pick(micro, 0))  # shapes only; XLA drops it
    layer = prog.layer if policy is None else jax.checkpoint(prog.layer, policy=policy)
    tmpl = template(layer, [pick(p, 0)[0] for p in stacked], x_like, vary, api)
    chunk = Chunk(layer, tmpl, vary)
    slots = actions.slot_shapes(x_like, tmpl, stacked[0].shape[1])
    state = actions.initial_state(plan.capacity, slots, stacked, others, vary)
    branches = actions.branches(plan, prog, chunk, stacked, others, M, slots, vary)
    fwd = [(i, (i + 1) % S) for i in range(S)]
    bwd = [(i, (i - 1) % S) for i in range(S)]
    table = {name: getattr(plan, name) for name in (
        "kind", "first", "last", "remat", "microbatch", "chunk")}
    table |= {f"read_{name}": np.maximum(plan.slots[name], 0) for name in actions.RINGS}
    table |= {f"write_{name}": plan.writes[name] for name in actions.RINGS}

    def tick(carry, row):
        state, arrived_x, arrived_g = carry
        cell = {name: vary(row[name][s]) for name in row}
        state = dict(state)
        # 1. what arrived (sent last tick) goes to its slot, or to the spare row
        state["activations"] = actions.write(
            state["activations"], cell["write_activations"], arrived_x)
        state["gradients"] = actions.write(state["gradients"], cell["write_gradients"], arrived_g)
        # 2. the action, on one slot of each ring; the buffers stay out of the switch
        got = {name: actions.read(state[name], cell[f"read_{name}"]) for name in actions.RINGS}
        got["params"] = [lax.dynamic_index_in_dim(p, cell["chunk"], keepdims=False)
                         for p in stacked]
        got["batch"] = actions.read(micro, cell["microbatch"])
        out = lax.switch(cell["kind"], branches, cell, got)
        for name in ("inputs", "residuals", "cotangents", "seeds"):
            state[name] = actions.write(state[name], cell[f"write_{name}"], getattr(out, name))
        state["d_stacked"] = [_accumulate(acc, d, cell["chunk"])
                              for acc, d in zip(state["d_stacked"], out.d_chunk)]
        state["d_others"] = [acc + d for acc, d in zip(state["d_others"], out.d_others)]
        state["loss"] = state["loss"] + out.loss
        # 3. send, the same collectives on every stage and every tick
        send_x, send_g = out.send_x, out.send_g
        if S > 1:
            send_x, send_g = lax.ppermute(send_x, axis, fwd), lax.ppermute(send_g, axis, bwd)
        return (state, send_x, send_g), out.code

    zeros_x = jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype)), slots["activations"])
    (state, _, _), codes = lax.scan(tick, (state, zeros_x, zeros_x), table)
    loss = lax.psum(state["loss"], axis) / M
    d_stacked = [g.astype(p.dtype) for g, p in zip(state["d_stacked"], stacked)]
    d_others = [lax.psum(g, axis).astype(o.dtype) for g, o in zip(state["d_others"], others)]
    out = (loss, d_stacked, d_others)
    return out + ((codes[:, None],) if trace else ())


def _accumulate(acc, delta, chunk):
    """``acc[chunk] += delta``; a plain add with one chunk (an update-slice copies ``acc``)."""
    if acc.shape[0] == 1:
        return acc + delta[None]
    return lax.dynamic_update_index_in_dim(
        acc, lax.dynamic_index_in_dim(acc, chunk, keepdims=False) + delta, chunk, 0)


def check_layers(layers: int, stages: int, virtual_stages: int, api: str,
                 axis: str = "stage") -> None:
    """The stack must split into ``stages * virtual_stages`` equal chunks."""
    chunks = stages * virtual_stages
    if layers % chunks:
        lower = layers - layers % chunks
        examples = f"{lower} or {lower + chunks}" if lower else f"{chunks}"
        raise ValueError(
            f"{api}: the model's {layers} stacked layers do not split into stages={stages} "
            f"(mesh axis {axis!r}) x virtual_stages={virtual_stages} = {chunks} equal chunks; "
            f"use a multiple of {chunks} layers (e.g. {examples}), or stages and "
            f"virtual_stages whose product divides {layers}"
        )


def stage_count(axis: str, mesh, api: str) -> int:
    """The size of ``axis`` in ``mesh`` (or the mesh in context), with a clear error."""
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    names = tuple(getattr(mesh, "axis_names", ()) or ())
    if axis not in names:
        shape = dict(getattr(mesh, "shape", {}) or {})
        where = f"the mesh has axes {shape}" if names else "no mesh is set"
        raise ValueError(
            f"{api}: the pipeline runs over mesh axis {axis!r}, but {where}; build the mesh "
            f"with px.make_mesh({axis}=N, ...) and run inside jax.set_mesh(mesh) (px.train_step "
            "does), or pass axis= naming the mesh's pipeline axis"
        )
    return int(mesh.shape[axis])

