"""What a compiled program does per step: how often each computation runs, its matmul
flops, and the bytes each device holds of every argument.

``compiled.cost_analysis()`` counts a loop body once, however many times it runs (measured:
a 2-layer GPT scanned over its layers reported the flops of one layer), and counts every
branch of a conditional. This module reads the partitioned HLO instead: it walks the call
graph from the entry, multiplies by the trip counts of ``while`` loops, and weighs the
branches of conditionals when it knows how often each runs, which it does for the pipeline
runtime's per-tick switch (:class:`PipelineBranches`). Matmul flops are then summed over
``dot`` instructions (and cuBLAS gemm custom calls on GPU), each ``2 x output elements x
contracted size`` times how often it runs.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from parallax.analysis import program
  >>> def f(w, x):
  ...     return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, w)[0]
  >>> compiled = jax.jit(f).lower(jnp.ones((3, 8, 8)), jnp.ones((4, 8))).compile()
  >>> program.matmul_flops(compiled)       # 3 layers x 2 x 4 x 8 x 8
  1536.0
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections import defaultdict

import jax

from parallax.analysis import hlo

_SHAPE = re.compile(r"^\(?([a-z]\w*)\[([\d,]*)\]")
_DEFINES = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(\S+)")
_OPERANDS = re.compile(r"\(\s*(?:[a-z]\w*\[[\d,]*\]\{?[\d,]*\}?\s+)?%([\w.\-]+)")
_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")


@dataclasses.dataclass(frozen=True)
class PipelineBranches:
    """How often the pipeline runtime's per-tick switch takes each branch, per device.

    The runtime scans over the schedule's ticks and switches on each stage's action: branch
    0 idle, 1 forward, 2 input-gradient backward, 3 weight-gradient backward. Every stage
    runs ``microbatches x virtual_stages`` actions of each kind. Inside the forward, the
    runtime branches again on "first virtual stage" (the embedding) and "last virtual
    stage" (head and loss): each is true for ``1 / (stages x virtual_stages)`` of the
    forwards, on average over the stages; inside the input-gradient backward, on
    "rematerialised" (the forward recomputed), true for ``remat_fraction`` of them. Counts
    are therefore per device *on average over the stage axis*.
    """

    ticks: int
    stages: int
    microbatches: int
    virtual_stages: int
    remat_fraction: float

    def switch(self) -> list[float]:
        """Per-tick weights of the four branches (idle, F, B, W)."""
        runs = self.microbatches * self.virtual_stages
        return [(self.ticks - 3 * runs) / self.ticks] + [runs / self.ticks] * 3

    def nested(self, kind: int, branches: int, line: str = "") -> list[float] | None:
        """Weights of a two-way conditional inside the switch's branch ``kind``.

        The runtime names its conditionals (``pp_first``, ``pp_last``, ``pp_remat`` in the
        op_name metadata); without a name, a forward's is taken for first/last and an
        input-gradient backward's for the rematerialisation.
        """
        if branches != 2:
            return None
        edge = 1 / (self.stages * self.virtual_stages)
        named = re.search(r"pp_(first|last|remat)/", line)
        if named:
            true = self.remat_fraction if named.group(1) == "remat" else edge
        else:
            true = {1: edge, 2: self.remat_fraction}.get(kind)
        return None if true is None else [1 - true, true]


def computation_counts(text: str, pipeline: PipelineBranches | None = None) -> dict[str, float]:
    """How many times each computation runs per call of the program (per device).

    Loops multiply by their known trip count. Branches of a conditional count once each
    (an upper bound), except the pipeline runtime's switch and its nested conditionals
    when ``pipeline`` says how often they run.
    """
    blocks = hlo.computations(text)  # the same parse as hlo.collectives
    counts: dict[str, float] = defaultdict(float)

    def visit(name: str, weight: float, trip: int | None, kind: int | None) -> None:
        counts[name] += weight
        for line in blocks.get(name, ()):
            for call in hlo.calls(line):
                if call.kind == "condition":
                    continue
                index, n = call.branch, call.branches
                w, inner_kind = weight * call.times, kind
                if index is not None and pipeline is not None:
                    if n == 4 and trip == pipeline.ticks and kind is None:
                        w, inner_kind = weight * pipeline.switch()[index], index
                    elif kind is not None and (nested := pipeline.nested(kind, n, line)):
                        w = weight * nested[index]
                visit(call.callee, w, call.times if call.times > 1 else trip, inner_kind)

    visit(hlo.entry_name(text), 1.0, None, None)
    return dict(counts)


def _dims(shape_text: str) -> tuple[int, ...] | None:
    m = _SHAPE.match(shape_text)
    return tuple(int(v) for v in m.group(2).split(",") if v) if m else None


def _contracting(line: str) -> tuple[int, ...] | None:
    m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
    if m:
        return tuple(int(v) for v in m.group(1).split(",") if v)
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', line)
    if m:
        return tuple(int(v) for v in json.loads("[" + m.group(1) + "]"))
    return None


def matmul_flops(program, pipeline: PipelineBranches | None = None) -> float:
    """Flops of every matmul in a compiled program per call, with loops and branches counted.

    Args:
      program: a ``Compiled``, a ``Lowered`` or partitioned HLO text.
      pipeline: how often the pipeline runtime's branches run (see :class:`PipelineBranches`).

    Returns:
      ``sum 2 x prod(output dims) x prod(contracted lhs dims) x runs`` over ``dot``
      instructions and cuBLAS gemm calls (elementwise work is not counted, as in the
      ``6 N`` accounting of model flops).
    """
    text = hlo.hlo_text(program)
    counts = computation_counts(text, pipeline)
    total = 0.0
    for name, lines in hlo.computations(text).items():
        runs = counts.get(name, 0.0)
        if not runs:
            continue
        shapes = {}
        for line in lines:
            m = _DEFINES.match(line)
            if not m:
                continue
            shapes[m.group(1)] = _dims(m.group(2))
            is_gemm = " custom-call(" in line and any(t in line for t in _GEMM_TARGETS)
            if not (" dot(" in line or is_gemm):
                continue
            out, contracting = _dims(m.group(2)), _contracting(line)
            operand = _OPERANDS.search(line[line.index("(", line.index("=")):])
            lhs = shapes.get(operand.group(1)) if operand else None
            if out is None or contracting is None or lhs is None:
                continue
            total += runs * 2 * math.prod(out) * math.prod(lhs[d] for d in contracting)
    return total


def collective_totals(program, mesh, pipeline: PipelineBranches | None = None):
    """``{(kind, axes): (count, message_bytes)}`` per call, counted like :func:`computation_counts`.

    The same collectives as ``hlo.collectives``; only how often each runs differs (branches
    of the pipeline's switch weighed by how often they are taken).

    Example:
      >>> import jax, jax.numpy as jnp, parallax as px
      >>> mesh = px.make_mesh(data=8)
      >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
      ...             in_specs=jax.P("data"), out_specs=jax.P()))
      >>> collective_totals(f.lower(jnp.ones(16)).compile(), mesh)
      {('all-reduce', ('data',)): (1.0, 8.0)}
    """
    text = hlo.hlo_text(program)
    counts = computation_counts(text, pipeline)
    totals: dict[tuple, list[float]] = {}
    for c in hlo.collectives(text, mesh):
        runs = counts.get(c.computation, c.count)
        entry = totals.setdefault((c.kind, c.axes), [0.0, 0.0])
        entry[0] += runs
        entry[1] += runs * c.message_bytes
    return {key: (count, size) for key, (count, size) in totals.items()}


def argument_bytes(compiled, args) -> list[list[int]]:
    """Bytes of each leaf of each argument that one device holds, from the compiled shardings.

    Args:
      compiled: a ``jax.stages.Compiled``.
      args: the arguments it was lowered with (arrays or ``ShapeDtypeStruct``s).

    Returns:
      One list per argument, one entry per leaf (``jax.tree.leaves`` order).
    """
    shardings = compiled.input_shardings[0]
    out = []
    for arg, sharding in zip(args, shardings):
        leaves = jax.tree.leaves(arg)
        specs = jax.tree.leaves(sharding)
        if len(specs) == 1 and len(leaves) > 1:  # one sharding given as a prefix
            specs = specs * len(leaves)
        out.append([
            math.prod(s.shard_shape(tuple(x.shape))) * x.dtype.itemsize
            for x, s in zip(leaves, specs)
        ])
    return out


def pipeline_ticks(program) -> int | None:
    """The trip count of the pipeline runtime's tick loop (the ``while`` around a four-way
    conditional: idle, F, B, W), or None when the program has none.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> pipeline_ticks(jax.jit(lambda x: x + 1).lower(jnp.ones(2)).compile()) is None
      True
    """
    text = hlo.hlo_text(program)
    blocks = hlo.computations(text)

    def has_switch(name: str, seen: set) -> bool:
        if name in seen:
            return False
        seen.add(name)
        for line in blocks.get(name, ()):
            calls = hlo.calls(line)
            if any(c.branches == 4 for c in calls):
                return True
            if any(has_switch(c.callee, seen) for c in calls):
                return True
        return False

    for lines in blocks.values():
        for line in lines:
            for c in hlo.calls(line):
                if c.kind == "body" and c.times > 1 and has_switch(c.callee, set()):
                    return c.times
    return None
