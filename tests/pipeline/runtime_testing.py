"""A tiny pipelined model and helpers for the runtime tests (each program compiled once)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import parallax as px
from parallax import context
from parallax import pipeline as pp
from parallax.analysis import hlo
from parallax.pipeline.runtime import ticks
from parallax.pipeline.runtime.gradients import pipeline_grads
from parallax.pipeline.runtime.lowering import lower_schedule, widen
from parallax.pipeline.runtime.settings import PipelineSettings
from parallax.pipeline.runtime.program import program

D_IN, D, D_OUT, BATCH = 4, 8, 3, 32


def layer(w, x):
    return jnp.tanh(x @ w) + x


TOY = pp.Stages(
    first=lambda p, b: b["x"] @ p["w_in"],
    stage=layer,
    last=lambda p, x, b: jnp.mean((x @ p["w_out"] - b["y"]) ** 2),
    layers=lambda p: p["layers"],
)


class Stack(nnx.Module):
    def __init__(self, w):  # the stacked layers: split over the stage axis by px.Pipeline
        self.w = nnx.Param(jnp.asarray(w), out_sharding=("layers", None, None),
                           eager_sharding=False)


class Toy(nnx.Module):
    """The toy as an NNX model (for px.Pipeline in px.train_step): tanh(x @ w) + x blocks
    between an input and an output projection."""

    def __init__(self, layers: int = 4, width: int = D):
        p = toy_params(layers, width)
        self.w_in = nnx.Param(jnp.asarray(p["w_in"]), out_sharding=(None, "embed"),
                              eager_sharding=False)
        self.w_out = nnx.Param(jnp.asarray(p["w_out"]), out_sharding=("embed", None),
                               eager_sharding=False)
        self.blocks = Stack(p["layers"])


LOSS = pp.Stages(
    first=lambda m, b: b["x"] @ m.w_in[...],
    stage=lambda block, x: layer(block.w[...], x),
    last=lambda m, x, b: jnp.mean((x @ m.w_out[...] - b["y"]) ** 2),
    layers=lambda m: m.blocks,
)


def toy_params(layers: int, width: int = D, seed: int = 0):
    # numpy, not jax.random: eager jax ops each compile, which costs more than the tests
    rng = np.random.default_rng(seed)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)  # noqa: E731
    return {
        "w_in": normal(D_IN, width) / 2,
        "layers": normal(layers, width, width) / (2 * width**0.5),
        "w_out": normal(width, D_OUT),
    }


def toy_batch(size: int = BATCH, seed: int = 1):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((size, D_IN), np.float32),
            "y": rng.standard_normal((size, D_OUT), np.float32)}


def stage_mesh(stages: int):
    return px.make_mesh(stage=stages, devices=jax.devices()[:stages])


@functools.cache
def reference(layers: int):
    """(loss, grads) of the sequential toy model, on one device."""
    return jax.jit(jax.value_and_grad(TOY))(toy_params(layers), toy_batch())


@functools.cache
def pipelined(name: str, stages: int, microbatches: int, virtual_stages: int | None = None,
              remat: str = "except_last", split_backward: bool | None = None,
              per_chunk: int = 1):
    """(loss, grads, executed codes, schedule) of the toy model run through the runtime."""
    sched = pp.schedule(name, stages, microbatches, virtual_stages, split_backward)
    layers = stages * sched.virtual_stages * per_chunk

    def run(params, batch):
        settings = PipelineSettings.of("test", microbatches=microbatches, schedule=sched,
                                       remat=remat)
        return pipeline_grads(TOY, params, lambda p: p, batch, settings, trace=True)

    with jax.set_mesh(stage_mesh(stages)):
        loss, grads, codes = jax.jit(run)(toy_params(layers), toy_batch())
    return loss, grads, np.asarray(codes), sched


@functools.cache
def family(names: tuple, stages: int, microbatches: int, virtual_stages: int | None = None,
           remat: str = "except_last", per_chunk: int = 1):
    """``{name: (loss, grads, executed codes, schedule)}`` for schedules of one shape (same
    stages, micro-batches, chunks and placement), all run by ONE compiled program: their
    lowered schedules are widened to one shape and each table is passed as an argument."""
    scheds = [pp.schedule(name, stages, microbatches, virtual_stages) for name in names]
    lowered = widen([lower_schedule(s, remat) for s in scheds])
    settings = PipelineSettings.of("test", microbatches=microbatches, schedule=scheds[0],
                                   remat=remat)
    layers = stages * scheds[0].virtual_stages * per_chunk

    def run(params, batch, table):
        prog = program(TOY, params, lambda q: q, "test")
        with context.manual(("stage",)):
            loss, d_stacked, d_others, codes = ticks.execute(
                prog, scheds[0], batch, settings, api="test", trace=True, lowered=lowered[0],
                table=table)
        return loss, prog.grads(d_stacked, d_others), codes

    with jax.set_mesh(stage_mesh(stages)):
        step = jax.jit(run).lower(toy_params(layers), toy_batch(), lowered[0].table()).compile()
        out = {}
        for name, sched, one in zip(names, scheds, lowered):
            loss, grads, codes = step(toy_params(layers), toy_batch(), one.table())
            out[name] = (loss, grads, np.asarray(codes), sched)
    return out


def compiled(fn, stages: int, *args):
    with jax.set_mesh(stage_mesh(stages)):
        return jax.jit(fn).lower(*args).compile()


def guard_dots(compiled_program) -> list[dict]:
    """For each tick loop (a ``while`` whose body holds the runtime's guarded loops ``pp_F``,
    ``pp_B``, ``pp_W``, ``pp_BW``), the number of ``dot`` instructions reachable from each
    guard's body (``{"F": ..., "B": ..., "W": ...}``, a list where a kind has several
    guards) and from the tick body outside them (``"outside"``)."""
    blocks = hlo.computations(compiled_program.as_text())

    def guard_of(line):
        m = re.search(r'\swhile\(.*op_name="[^"]*pp_(F|B|W|BW)/while"', line)
        return m and m.group(1)

    def dots(name, skip_guards=False):
        own = sum(1 for line in blocks.get(name, ()) if re.search(r"\sdot\(", line))
        for line in blocks.get(name, ()):
            if skip_guards and guard_of(line):
                continue
            own += sum(dots(c.callee, skip_guards) for c in hlo.calls(line))
        return own

    found = []
    for body in {m.group(1) for lines in blocks.values() for line in lines
                 if (m := re.search(r"\swhile\(.*body=%([\w.\-]+)", line))}:
        guards = [(kind, re.search(r"body=%([\w.\-]+)", line).group(1))
                  for line in blocks.get(body, ()) if (kind := guard_of(line))]
        if guards:
            counts: dict = {"outside": dots(body, skip_guards=True)}
            for kind, guarded in guards:
                counts.setdefault(kind, []).append(dots(guarded))
            found.append(counts)
    return found
