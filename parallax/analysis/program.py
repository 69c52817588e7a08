"""What a compiled program does per step: how often each computation runs, its matmul
flops, and the bytes each device holds of every argument, in device or host memory.

``compiled.cost_analysis()`` counts a loop body once, however many times it runs (measured:
a 2-layer GPT scanned over its layers reported the flops of one layer), and counts every
branch of a conditional. This module reads the partitioned HLO instead: it walks the call
graph from the entry, multiplies by the trip counts of ``while`` loops, and weighs the
branches of conditionals (and loops XLA cannot count) when it knows how often each runs,
which it does for the pipeline runtime's guarded actions (:class:`PipelineBranches`).
Matmul flops are then summed over ``dot`` instructions (and cuBLAS gemm custom calls on
GPU), each ``2 x output elements x contracted size`` times how often it runs.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from parallax.analysis import program
  >>> def f(w, x):
  ...     return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, w)[0]
  >>> compiled = jax.jit(f).lower(jnp.ones((3, 8, 8)), jnp.ones((4, 8))).compile()
  >>> program.matmul_flops(compiled)       # 3 layers x 2 x 4 x 8 x 8
  1536.0

(A little over 300 lines: one reader of the compiled program, whose every question, runs,
flops, argument bytes and where they live, walks the same HLO and shardings.)
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


# The pipeline runtime (parallax.pipeline.runtime.actions) names its control flow in the
# op_name metadata: each tick runs one guarded ``while`` (0 or 1 trips) per kind of action,
# ``pp_F``, ``pp_B``, ``pp_W``, and ``pp_BW`` (a backward that runs its W too); inside them
# a flag is a ``lax.cond`` (``pp_first``, ``pp_last``) or, for a rematerialised backward, a
# guarded ``while`` (``pp_remat``).
PIPELINE_GUARD = re.compile(r"pp_(F|B|W|BW)/while$")
PIPELINE_FLAG = re.compile(
    r"pp_(F|B|W|BW)/while/body/(?:.*/)?pp_(first|last|remat)/(cond|while)$")


def pipeline_shares(op_name: str, branches: int, action_share, flag_share):
    """How often the pipeline runtime's control flow named ``op_name`` runs, as a
    ``fractions(op_name, branches)`` callable answers: ``[mean trips]`` for a guarded loop
    (``branches == 0``), ``[false, true]`` shares for a flag's two-way conditional, None for
    anything else. ``action_share(kind)`` is the share of ticks running ``kind`` (``"F"``,
    ``"B"``, ``"W"``, ``"BW"``); ``flag_share(kind, flag)`` the share of that kind's cells
    carrying ``flag`` (``"first"``, ``"last"``, ``"remat"``), or None when unknown.
    """
    flag = PIPELINE_FLAG.search(op_name)
    if flag:
        true = flag_share(flag.group(1), flag.group(2))
        if true is None:
            return None
        if flag.group(3) == "while":
            return [true] if branches == 0 else None
        return [1 - true, true] if branches == 2 else None  # the false branch first
    guard = PIPELINE_GUARD.search(op_name)
    if guard and branches == 0:
        return [action_share(guard.group(1))]
    return None


@dataclasses.dataclass(frozen=True)
class PipelineBranches:
    """How often the pipeline runtime's guarded actions run, per device, from its shape.

    The runtime scans over the schedule's ticks; each tick every stage runs at most one of
    its guarded loops (forward, input-gradient backward, weight-gradient backward, or where
    the schedule does not split the backward one backward doing both), and every stage
    runs ``microbatches x virtual_stages`` actions of each kind. Inside the
    forward and the backward, "first virtual stage" (the embedding) and "last virtual
    stage" (head and loss) hold for ``1 / (stages x virtual_stages)`` of them on average
    over the stages; inside the input-gradient backward, "rematerialised" (the forward
    recomputed) for ``remat_fraction``. Counts are therefore per device *on average over
    the stage axis*. (:func:`parallax.pipeline.runtime.guard_shares.table_fractions` answers the
    same question exactly, from the schedule's table.)

    Called as ``fractions(op_name, branches)``: for a guarded loop (``branches == 0``)
    ``[mean trips]``, for a flag's two-way conditional ``[false, true]`` shares, None for
    anything else.
    """

    ticks: int
    stages: int
    microbatches: int
    virtual_stages: int
    remat_fraction: float
    fused: bool = False  # the schedule does not split the backward: B runs its W (BW)

    def share(self, kind: str) -> float:
        """The share of ticks in which a stage runs ``kind`` (F, B, W or BW)."""
        runs = self.microbatches * self.virtual_stages
        ran = {"F": True, "B": not self.fused, "W": not self.fused, "BW": self.fused}[kind]
        return runs / self.ticks if ran else 0.0

    def flag_share(self, kind: str, flag: str) -> float:
        """The share of a kind's cells carrying ``flag`` (first, last, remat)."""
        del kind  # on average over the stages, the same for every kind
        return (self.remat_fraction if flag == "remat"
                else 1 / (self.stages * self.virtual_stages))

    def __call__(self, op_name: str, branches: int) -> list[float] | None:
        return pipeline_shares(op_name, branches, self.share, self.flag_share)


def computation_counts(text: str, pipeline: PipelineBranches | None = None) -> dict[str, float]:
    """How many times each computation runs per call of the program (per device).

    Loops multiply by their known trip count (a loop XLA cannot count runs once). Branches
    of a conditional count once each (an upper bound), except the pipeline runtime's, and
    its guarded loops run as often as ``pipeline`` says (any
    ``fractions(op_name, branches)`` callable, as :class:`PipelineBranches`).
    """
    blocks = hlo.computations(text)  # the same parse as hlo.collectives
    counts: dict[str, float] = defaultdict(float)

    def visit(name: str, weight: float) -> None:
        counts[name] += weight
        for line in blocks.get(name, ()):
            found = hlo.OP_NAME.search(line) if pipeline is not None else None
            op_name = found.group(1) if found else ""
            for call in hlo.calls(line):
                if call.kind == "condition":
                    continue
                w = weight * call.times
                if op_name and call.kind == "body" and "known_trip_count" not in line:
                    shares = pipeline(op_name, 0)
                    w = weight * shares[0] if shares else w
                elif op_name and call.kind == "branch":
                    shares = pipeline(op_name, call.branches)
                    w = weight * shares[call.branch] if shares else w
                visit(call.callee, w)

    visit(hlo.entry_name(text), 1.0)
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
      pipeline: how often the pipeline runtime's actions run (see :class:`PipelineBranches`).

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

    The same collectives as ``hlo.collectives``; only how often each runs differs (the
    pipeline's guarded actions and flags weighed by how often they run).

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


def host_argument_bytes(compiled, args) -> int:
    """Bytes per device of the arguments the program takes in host memory (their compiled
    sharding's ``memory_kind`` is ``pinned_host`` or ``unpinned_host``: ZeRO-Offload's state).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> host = jax.device_put(jnp.ones(4), jax.memory.Space.Host)
      >>> host_argument_bytes(jax.jit(lambda x, y: (x, y + 1)).lower(host, jnp.ones(2))
      ...                     .compile(), (host, jnp.ones(2)))
      16
    """
    shardings = jax.tree.leaves(compiled.input_shardings[0])
    sizes = [n for per_arg in argument_bytes(compiled, args) for n in per_arg]
    return sum(n for n, s in zip(sizes, shardings, strict=True)
               if s.memory_kind in ("pinned_host", "unpinned_host"))


def device_memory(compiled, args) -> hlo.Memory:
    """``hlo.memory(compiled)`` with the host-memory arguments taken out where
    ``memory_analysis`` counts them with the device's (the CPU backend reports no host
    bytes: its host and device memories are one). The state comes back donated, so a
    host result aliases its argument and is taken out once."""
    mem = hlo.memory(compiled)
    host = host_argument_bytes(compiled, args)
    if not host or compiled.memory_analysis().host_argument_size_in_bytes:
        return mem
    aliased = min(host, mem.alias_bytes)
    return dataclasses.replace(mem, argument_bytes=mem.argument_bytes - host,
                               output_bytes=mem.output_bytes - aliased,
                               alias_bytes=mem.alias_bytes - aliased)


def pipeline_ticks(program) -> int | None:
    """The trip count of the pipeline runtime's tick loop (the ``while`` whose body runs the
    guarded actions ``pp_F``, ``pp_B``, ``pp_W``), or None when the program has none.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> pipeline_ticks(jax.jit(lambda x: x + 1).lower(jnp.ones(2)).compile()) is None
      True
    """
    text = hlo.hlo_text(program)
    blocks = hlo.computations(text)

    def has_guard(name: str, seen: set) -> bool:
        if name in seen:
            return False
        seen.add(name)
        for line in blocks.get(name, ()):
            op_name = hlo.OP_NAME.search(line)
            if " while(" in line and op_name and PIPELINE_GUARD.search(op_name.group(1)):
                return True
            if any(has_guard(c.callee, seen) for c in hlo.calls(line) if c.kind != "body"):
                return True
        return False

    for lines in blocks.values():
        for line in lines:
            for c in hlo.calls(line):
                if c.kind == "body" and c.times > 1 and has_guard(c.callee, set()):
                    return c.times
    return None
