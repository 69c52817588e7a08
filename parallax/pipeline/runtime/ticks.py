"""One SPMD runtime for every pipeline schedule: a ``lax.scan`` over the table's ticks.

Inside a ``shard_map`` that is manual over the stage axis only (data axes are the caller's,
tensor axes stay with GSPMD inside the stage bodies), every tick each stage

1. stores what arrived into its inbox, at the slots the lowered table gives: what the
   previous stage sent last tick, what the next stage sent, and what it kept for itself (the
   placement says which channel each value takes; the loss's gradient comes by the last), or
   in the inbox's spare row where nothing meant for it arrived;
2. reads its action from the table (indexed by ``axis_index``) and runs it in place: one
   guarded loop per kind, ``F``, ``B``, ``W`` (:mod:`parallax.pipeline.runtime.actions`),
   or ``BW`` where the schedule does not split the backward (its ``W`` runs inside its
   ``B``, and the ``W``'s tick idles), each a ``lax.while_loop`` of one trip where the
   cell is of its kind and none elsewhere, which writes its ring slots, accumulators and
   payload straight into the carried buffers. An idle tick runs none and touches no
   buffer. (A ``lax.switch`` over the actions made XLA copy a buffer that it returned, or
   that it read and was written in the same tick: so every tick stored a stash slot and
   added gradient deltas, zeros unless its action made them: 3.2x the sequential
   program's bytes, measured);
3. sends its payload to both neighbours with one ``ppermute`` each (one when there are two
   stages, none with one), outside the guards, so the collectives are the same on every
   stage and every tick, and keeps it for itself. After an idle or ``W`` tick the payload
   is the last one made again; the table sends its arrivals to the spare rows.

``first`` runs inside the ``F`` of virtual stage 0; ``last`` and its gradient (the seed of the
backward) inside the ``F`` of the last virtual stage; ``first``'s backward inside the ``B`` of
virtual stage 0. Gradients of the stacked layers stay sharded over the stage axis; the
other parameters' gradients are summed over it.

A module's non-parameter state (BatchNorm statistics, RNG streams) is carried per stage
and written by ``F`` only (:mod:`parallax.pipeline.runtime.stage_state`).

With ``v`` chunks per stage, chunk ``c`` of stage ``s`` is the virtual stage the schedule's
placement says; the stack is stored contiguously over the stage axis (``("layers",
"stage")``), so each step first moves every block of layers to the stage that runs it, and
the gradients back (:mod:`parallax.pipeline.runtime.layer_moves`).

References:
  Huang et al. 2019, GPipe; Narayanan et al. 2019, PipeDream (1F1B, weight stashing);
  Narayanan et al. 2021, Memory-Efficient Pipeline-Parallel DNN Training (PipeDream-flush);
  Narayanan et al. 2021 (SC), Megatron-LM interleaved 1F1B; Kim et al. 2020, torchgpipe
  (rematerialisation options); Qi et al. 2024, Zero Bubble (the B/W split, ZB-V).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from parallax.comm import nesting
from parallax.pipeline.runtime import layer_moves, rings, stage_state, stashed
from parallax.pipeline.runtime.actions import ACTIONS, Env
from parallax.pipeline.runtime.chunk import Chunk, template
from parallax.pipeline.runtime.guarded import guard
from parallax.pipeline.runtime.lowering import RUNTIME_CODES, LoweredSchedule, lower_schedule
from parallax.pipeline.schedules.table import Schedule
from parallax.pipeline.runtime.settings import PipelineSettings
from parallax.pipeline.runtime.program import Program
from parallax.comm.varying import to_varying, varying_axes


def caster(axes: frozenset):
    """``vary(x)``: ``x`` cast to vary over ``axes`` (``lax.pcast``), a no-op where it does."""

    def vary(x):
        return to_varying(x, sorted(axes))

    return vary


def execute(prog: Program, sched: Schedule, batch, settings: PipelineSettings, *, api: str,
            trace: bool = False, layout=None, lowered: LoweredSchedule | None = None,
            table: dict | None = None, versions: stashed.Versions | None = None,
            run: stage_state.StateRun | None = None):
    """Runs ``sched`` on ``prog``: the mean loss over micro-batches and its gradients.

    Must be called where the mesh (``jax.sharding.get_abstract_mesh()``) has
    ``settings.axis`` of size ``sched.stages`` and that axis is not yet manual; the
    parameters' stacked layer axis should be sharded over it (it is resharded otherwise).

    Args:
      settings: the pipeline's checked settings (:class:`PipelineSettings`): the mesh axis,
        the rematerialisation mode and the checkpoint policy are read here.
      api: the entry point named in errors.
      layout: a :class:`parallax.pipeline.runtime.layer_moves.Layout` (which stored layers
        each chunk runs); default: the even split for the schedule's placement.
      lowered: the :class:`LoweredSchedule` (default: ``lower_schedule(sched,
        settings.remat_mode)``); with ``table``, only its static parts (capacities, mixed
        flags) are read.
      table: the per-tick arrays to scan (``lowered.table()``), possibly traced: a program
        compiled for a widened table (:func:`parallax.pipeline.runtime.lowering.widen`)
        runs any table of that shape.
      versions: ``weights="stashed"``: the optimizer and its state
        (:mod:`parallax.pipeline.runtime.stashed`); the step then updates the weights.
      run: how the module's non-parameter state (``prog.stacked_state``,
        ``prog.others_state``) flows (:class:`stage_state.StateRun`); None: no state.

    Returns:
      ``(loss, d_stacked, d_others)``, or with ``versions`` ``(loss, new_stacked,
      new_others, new_stacked_state, new_others_state)``; with ``run``, then the module
      state after the step, ``(stacked_state, others_state)``; plus the executed action codes
      ``[ticks, stages]`` when ``trace`` (what each stage ran at each tick, from its guarded
      loops' trip counts: 0 idle, 1 F, 2 B, 3 W).
    """
    axis, M = settings.axis, sched.microbatches
    nesting.check({axis}, api, nesting.PIPELINE_FIX)
    module = (stage_state.encode(prog.stacked_state), stage_state.encode(prog.others_state))
    run = run if run is not None and any(module) else None
    if run is not None:
        stage_state.check_order(sched, api)
    lowered = lowered or lower_schedule(sched, settings.remat_mode,
                                        versions=versions is not None,
                                        snapshots=run is not None and run.threaded)
    table = lowered.table() if table is None else table
    layout = layout or layer_moves.Layout.even(prog.stacked[0].shape[0], sched.placement)
    micro = jax.tree.map(lambda x: x.reshape(M, x.shape[0] // M, *x.shape[1:]), batch)
    outer = frozenset().union(*(varying_axes(x) for x in jax.tree.leaves(
        (prog.stacked, prog.others, batch))))
    vary = caster(outer | {axis})

    if run is not None:
        writes = stage_state.first_last_writes(prog, micro)
        owner = stage_state.owners(sched.placement, *writes, api)

    def body(stacked, others, micro, module, stacked_state, others_state):
        # stored [L / S, ...] -> run here [v, L_c, ...] (chunk c is the placement's)
        stacked = [vary(layer_moves.to_chunks(p, axis, layout)) for p in stacked]
        carried = None
        if run is not None:
            s_raw, o_raw, index = module
            carrier = stage_state.Carrier(
                stage_state.StateRun(run.threaded, run.rng, index, run.shards),
                prog.stacked_state, prog.others_state, M, leading(micro), vary)
            carried = stage_state.Carried(
                carrier, [vary(layer_moves.to_chunks(x, axis, layout)) for x in s_raw],
                [vary(x) for x in o_raw], o_raw, *writes, owner)
        given, others = others, [vary(o) for o in others]  # given: replicated, as passed
        micro = jax.tree.map(vary, micro)
        opt = None
        if versions is not None:
            opt = [vary(layer_moves.to_chunks(x, axis, layout)) if m else vary(x)
                   for x, m in zip(stacked_state, versions.stacked.mirrors)]
        # [v, slots]: which of this stage's slots hold a layer (uneven layouts pad with masks)
        mask = None if layout.mask is None else jnp.asarray(layout.mask)[lax.axis_index(axis)]
        chunk, x_like = _chunk(prog, stacked, others, micro, carried, vary, settings.policy,
                               api)
        env = Env(lowered, prog, chunk, stacked, others, micro, mask, vary,
                  versions.stacked if versions is not None else None, carried)
        loss, d_stacked, d_others, *rest = _ticks(env, x_like, table, opt, axis, trace)
        d_stacked = [layer_moves.from_chunks(g, axis, layout) for g in d_stacked]
        if run is not None:
            (s_new, o_new), *rest = rest
            rest = [([layer_moves.from_chunks(x, axis, layout) for x in s_new], o_new), *rest]
        if versions is None:
            return (loss, d_stacked, d_others, *rest)
        opt, *codes = rest
        opt = [layer_moves.from_chunks(x, axis, layout) if m else
               stashed.first_stage_value(x, axis)
               for x, m in zip(opt, versions.stacked.mirrors)]
        new_others, others_state = stashed.update_others(versions.others, given,
                                                         others_state, d_others)
        return (loss, d_stacked, new_others, opt, others_state, *codes)

    stacked_spec = [P(axis)] * len(prog.stacked)
    others_spec = [P()] * len(prog.others)
    state_specs = ([], [])
    state_args = ([], [])
    if versions is not None:
        state_specs = ([P(axis) if m else P() for m in versions.stacked.mirrors],
                       [P()] * len(versions.others_state))
        state_args = (versions.stacked_state, versions.others_state)
    module_specs = ([P(axis)] * len(module[0]), [P()] * len(module[1]))
    out_specs = (P(), stacked_spec, others_spec)
    out_specs += (module_specs,) if run is not None else ()
    if versions is not None:
        out_specs += state_specs
    out_specs += ((P(None, axis),) if trace else ())
    module_in = (*module, jnp.asarray(run.index, jnp.uint32)) if run is not None else ()
    out = jax.shard_map(
        body,
        in_specs=(stacked_spec, others_spec, jax.tree.map(lambda _: P(), micro),
                  (*module_specs, P()) if run is not None else (), *state_specs),
        out_specs=out_specs,
        axis_names=frozenset({axis}),
    )(prog.stacked, prog.others, micro, module_in, *state_args)
    if run is None:
        return out
    loss, d_stacked, d_others, (s_new, o_new), *rest = out
    return (loss, d_stacked, d_others, (stage_state.decode_like(s_new, prog.stacked_state),
                                        stage_state.decode_like(o_new, prog.others_state)),
            *rest)


def leading(micro) -> int:
    """Examples per micro-batch (``micro`` is ``[M, rows, ...]`` per leaf)."""
    leaves = jax.tree.leaves(micro)
    return int(leaves[0].shape[1]) if leaves and leaves[0].ndim > 1 else 1


def _chunk(prog: Program, stacked, others, micro, carried, vary, policy, api: str):
    """``(chunk, x_like)``: the :class:`Chunk` that runs this stage's layers, built from one
    template trace of a layer on the first micro-batch's shapes, and that activation."""
    pick = lambda tree, i: jax.tree.map(  # noqa: E731
        lambda b: lax.dynamic_index_in_dim(b, i, keepdims=False), tree)
    carrier = carried.carrier if carried is not None else None
    o_in = carrier.others_in(carried.others, 0) if carrier else []
    x_like = prog.first(others, o_in, pick(micro, 0))[0]  # shapes only; XLA drops it
    one = ([x[0] for x in carrier.layer_in([x[0] for x in carried.stacked], 0)]
           if carrier else [])
    tmpl = template(prog.layer, [pick(p, 0)[0] for p in stacked], x_like, vary, policy, api,
                    one)
    return Chunk(prog.layer, tmpl, vary, policy), x_like


def _ticks(env: Env, x_like, table, opt, axis: str, trace: bool):
    """One stage's scan over the ticks of ``table``, inside the ``shard_map``."""
    vary, carrier = env.vary, env.carrier
    S, M = env.lowered.kind.shape[1], jax.tree.leaves(env.micro)[0].shape[0]
    s = lax.axis_index(axis)
    s_live, o_live = (env.carried.stacked, env.carried.others) if carrier else ([], [])
    keep = env.versions  # weights="stashed"
    slots = rings.slot_shapes(x_like, env.chunk.tmpl, env.stacked[0].shape[1], env.stacked,
                              keep, s_live, o_live, env.threaded)
    rows = {name: env.lowered.rows(name) for name in rings.RINGS}
    state = rings.initial_state(rows, slots, env.stacked, env.others, vary, s,
                                M if keep else None)
    if keep:
        state["live"], state["opt"] = list(env.stacked), list(opt)
    if carrier is not None:
        state |= stage_state.initial(s_live, o_live, env.threaded, vary)
    up = [(i, (i + 1) % S) for i in range(S)]
    down = [(i, (i - 1) % S) for i in range(S)]

    def tick(carry, row):
        state, from_below, from_above = carry
        cell = {name: vary(row[name][s]) for name in row}
        state = dict(state)
        # 1. what arrived goes to its inbox slot (or to the spare row): from the previous
        #    stage, the next, and what this stage kept (its payload, unchanged by an idle or
        #    W tick, whose arrival the table sends to the spare row)
        for channel, value in (("up", from_below), ("down", from_above),
                               ("local", state["payload"])):
            state["inbox"] = rings.write(state["inbox"], cell[f"arrive_{channel}"], value)
        # 2. the action, in place: one guarded loop per kind, of which at most one runs
        code = vary(jnp.int32(0))
        for kind, action in ACTIONS.items():
            if kind not in env.lowered.kinds:  # no cell runs it (BW: split; W: not split)
                continue
            trips, state = guard(kind, cell["kind"] == RUNTIME_CODES[kind],
                                 functools.partial(action, env), state, vary, cell)
            code = code + RUNTIME_CODES[kind] * trips
        # 3. send, the same collectives on every stage and every tick
        payload = state["payload"]
        with jax.named_scope("parallax/pipeline_send"):  # names the sends in profiles
            if S > 2:
                sent_up = lax.ppermute(payload, axis, up)
                sent_down = lax.ppermute(payload, axis, down)
            elif S == 2:  # both neighbours are the other stage: one permute serves both ways
                sent_up = sent_down = lax.ppermute(payload, axis, up)
            else:
                sent_up = sent_down = payload
        return (state, sent_up, sent_down), code

    x0 = jax.tree.map(lambda a: vary(jnp.zeros(a.shape, a.dtype)), slots["inbox"])
    (state, *_), codes = lax.scan(tick, (state, x0, x0), table)
    loss = lax.psum(state["loss"], axis) / M
    reduce = env.prog.reduce  # a precision policy's reduce dtype, else the accumulators'
    d_others = [lax.psum(g if reduce is None else g.astype(reduce), axis).astype(o.dtype)
                for g, o in zip(state["d_others"], env.others)]
    if keep:  # the new weights instead of gradients, and the optimizer's new state
        out = (loss, state["live"], d_others, state["opt"])
    else:
        d_stacked = [g.astype(p.dtype) for g, p in zip(state["d_stacked"], env.stacked)]
        out = (loss, d_stacked, d_others)
    if carrier is not None:
        out += (stage_state.finish(state, env.carried, axis),)
    return out + ((codes[:, None],) if trace else ())


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
