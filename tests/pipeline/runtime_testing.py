"""A tiny pipelined model and helpers for the runtime tests (each program compiled once)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

import parallax as px
from parallax import pipeline as pp
from parallax.analysis import hlo
from parallax.pipeline.grad import pipeline_grads

D_IN, D, D_OUT, BATCH = 4, 8, 3, 32


def layer(w, x):
    return jnp.tanh(x @ w) + x


TOY = pp.Stages(
    first=lambda p, b: b["x"] @ p["w_in"],
    stage=layer,
    last=lambda p, x, b: jnp.mean((x @ p["w_out"] - b["y"]) ** 2),
    layers=lambda p: p["layers"],
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
def pipelined(name: str, stages: int, microbatches: int, virtual_stages: int = 1,
              remat: str = "except_last", split_backward: bool = False, per_chunk: int = 1):
    """(loss, grads, executed codes, schedule) of the toy model run through the runtime."""
    sched = pp.schedule(name, stages, microbatches, virtual_stages, split_backward)
    layers = stages * virtual_stages * per_chunk

    def run(params, batch):
        return pipeline_grads(TOY, params, lambda p: p, batch, schedule=sched,
                              microbatches=microbatches, remat=remat, trace=True)

    with jax.set_mesh(stage_mesh(stages)):
        loss, grads, codes = jax.jit(run)(toy_params(layers), toy_batch())
    return loss, grads, np.asarray(codes), sched


def compiled(fn, stages: int, *args):
    with jax.set_mesh(stage_mesh(stages)):
        return jax.jit(fn).lower(*args).compile()


_CALLS = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)"
                    r"=%([\w.\-]+)|branch_computations=\{([^}]*)\}")


def switch_dots(compiled_program) -> list[list[int]]:
    """For each ``conditional`` with 4 branches (the runtime's switch: idle, F, B, W), the
    number of ``dot`` instructions reachable from each branch."""
    blocks = hlo._computations(compiled_program.as_text())

    def callees(name):
        for line in blocks.get(name, ()):
            for m in _CALLS.finditer(line):
                yield from ([m.group(1)] if m.group(1) else re.findall(r"%([\w.\-]+)", m.group(2)))

    def dots(name):
        own = sum(1 for line in blocks.get(name, ()) if re.search(r"\sdot\(", line))
        return own + sum(dots(c) for c in callees(name))

    found = []
    for lines in blocks.values():
        for line in lines:
            m = re.search(r"\sconditional\(.*branch_computations=\{([^}]*)\}", line)
            if m and len(names := re.findall(r"%([\w.\-]+)", m.group(1))) == 4:
                found.append([dots(b) for b in names])
    return found
