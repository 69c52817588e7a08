"""What a compiled program executes: FLOPs and bytes accessed, loops times their trip counts.

XLA's ``compiled.cost_analysis()`` counts a ``while`` body once, whatever its trip count, and
a ``conditional`` as its most expensive branch. The pipeline runtime is a ``while`` over
ticks around one guarded ``while`` per kind of action (0 or 1 trips, as the table says), so
its cost analysis says little about what runs. :func:`executed_cost` reads the same compiled
program (its optimised HLO text) and counts each instruction as XLA's cost analysis does,
but multiplies a loop body by its known trip count, or by the mean trip count the caller
gives for a loop whose count XLA does not know, and weighs each branch of a conditional by
how often it is taken (the caller says how often, e.g. the pipeline runtime's
:func:`parallax.pipeline.runtime.guard_shares.table_fractions`; by default
a loop of unknown count runs once and a conditional takes its most expensive branch, as
XLA counts them). With every trip count 1 it agrees with ``cost_analysis()`` to within the
few per-instruction rules it approximates (tested).

The model of one instruction: FLOPs ``2 * output * contraction`` for ``dot``, one per output
element for elementwise arithmetic; bytes accessed = operands read + output written, where a
fusion parameter read only as the sliced operand of slices counts the slices (a start
index is read whole, however many slices it indexes), an in-place
``dynamic-update-slice`` counts its update, and tuples, bitcasts and control flow count
nothing themselves.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter
from collections.abc import Callable

from parallax.analysis import hlo

_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|c64|c128|f8\w*)\[([\d,]*)\]")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "while", "conditional", "call", "iota"}
_ELEMENTWISE = {"add", "subtract", "multiply", "divide", "maximum", "minimum", "negate",
                "abs", "exponential", "log", "tanh", "rsqrt", "sqrt", "power", "compare",
                "select", "and", "or", "xor", "not", "logistic", "sign", "floor", "ceil",
                "clamp", "exponential-minus-one", "log-plus-one", "atan2", "remainder",
                "round-nearest-even", "round-nearest-afz", "cosine", "sine", "erf", "tan"}
_SLICES = {"slice", "dynamic-slice", "gather"}


@dataclasses.dataclass
class Cost:
    """Executed totals: ``flops``, ``bytes`` accessed, how often each opcode ran, and the
    bytes each opcode accessed (``op_bytes``; a fusion's under ``"fusion"``)."""

    flops: float = 0.0
    bytes: float = 0.0
    ops: Counter = dataclasses.field(default_factory=Counter)
    op_bytes: Counter = dataclasses.field(default_factory=Counter)

    def add(self, other: Cost, times: float = 1.0) -> None:
        self.flops += times * other.flops
        self.bytes += times * other.bytes
        for op, n in other.ops.items():
            self.ops[op] += times * n
        for op, n in other.op_bytes.items():
            self.op_bytes[op] += times * n


@dataclasses.dataclass(frozen=True)
class _Instruction:
    name: str
    opcode: str
    result: str  # the result type text
    operands: tuple[tuple[str, str], ...]  # (type text, name) pairs
    attributes: str
    root: bool
    args: str  # the raw operand text ("0" for parameter(0))
    calls: tuple[hlo.Call, ...]  # the computations it calls (loops, branches, fusions)


def _bytes(type_text: str) -> int:
    return sum(hlo.DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
               for dtype, dims in _ARRAY.findall(type_text))


def _elements(type_text: str) -> int:
    return sum(math.prod(int(d) for d in dims.split(",") if d)
               for _, dims in _ARRAY.findall(type_text))


def _split_call(rest: str) -> tuple[str, str]:
    """``"a, b), attrs"`` -> (``"a, b"``, ``"attrs"``): the operand list and what follows."""
    depth = 1
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i], rest[i + 1:]
    return rest, ""


def _parse(text: str) -> tuple[dict[str, list[_Instruction]], str]:
    computations: dict[str, list[_Instruction]] = {}
    for name, lines in hlo.computations(text).items():
        body = computations[name] = []
        for line in lines:
            match = _INSTRUCTION.match(line)
            if match:
                root, result_name, result, opcode, rest = match.groups()
                args, attributes = _split_call(rest)
                body.append(_Instruction(result_name, opcode, result,
                                         tuple(_OPERAND.findall(args)), attributes, bool(root),
                                         args, tuple(hlo.calls(line))))
    # operands are printed by name: their types are their definitions' result types
    types = {i.name: i.result for body in computations.values() for i in body}
    for body in computations.values():
        body[:] = [dataclasses.replace(i, operands=tuple((types.get(n, ""), n)
                                                         for n in i.operands)) for i in body]
    return computations, hlo.entry_name(text)


def _called(ins: _Instruction, *kinds: str) -> list[hlo.Call]:
    return [c for c in ins.calls if c.kind in kinds]


Fractions = Callable[[str, int], "list[float] | None"]


def executed_cost(program, fractions: Fractions | None = None, *,
                  trip_counts: bool = True) -> Cost:
    """FLOPs and bytes a compiled program executes per device, loops unrolled in the count.

    Args:
      program: a compiled program (``jax.jit(f).lower(...).compile()``) or its HLO text.
      fractions: ``fractions(op_name, branches)`` -> the fraction of executions that take
        each branch of a conditional whose metadata ``op_name`` is given (``None``: the
        most expensive branch, as XLA's cost analysis counts it); for a ``while`` whose
        trip count XLA does not know it is called with ``branches=0`` and gives
        ``[mean trips]`` (``None``: once, as XLA counts it).
      trip_counts: multiply loop bodies by their known trip counts (``False``: once, as
        XLA's cost analysis does).

    Returns:
      A :class:`Cost`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax import lax
      >>> f = jax.jit(lambda w, x: lax.fori_loop(0, 4, lambda i, x: x @ w, x))
      >>> program = f.lower(jnp.ones((8, 8)), jnp.ones((2, 8))).compile()
      >>> executed_cost(program).flops / executed_cost(program, trip_counts=False).flops
      4.0
    """
    text = program if isinstance(program, str) else program.as_text()
    computations, entry = _parse(text)
    cache: dict[str, Cost] = {}

    def computation_cost(name: str) -> Cost:
        if name in cache:
            return cache[name]
        total = Cost()
        for ins in computations.get(name, ()):
            total.add(instruction_cost(ins, name))
        cache[name] = total
        return total

    def instruction_cost(ins: _Instruction, where: str) -> Cost:
        cost = Cost()
        cost.ops[ins.opcode] += 1
        if ins.opcode == "while":
            body = _called(ins, "body")
            times = body[0].times if body and trip_counts else 1
            if trip_counts and fractions and "known_trip_count" not in ins.attributes:
                op_name = hlo.OP_NAME.search(ins.attributes)
                mean = fractions(op_name.group(1) if op_name else "", 0)
                times = mean[0] if mean is not None else times
            for call in _called(ins, "body", "condition"):  # the condition runs as often
                cost.add(computation_cost(call.callee), times)
            return cost
        if ins.opcode == "conditional":
            branches = [computation_cost(c.callee) for c in _called(ins, "branch")]
            op_name = hlo.OP_NAME.search(ins.attributes)
            weights = fractions(op_name.group(1) if op_name else "", len(branches)) \
                if fractions else None
            if weights is None:
                worst = max(branches, key=lambda c: (c.flops, c.bytes), default=Cost())
                cost.add(worst)
            else:
                for branch, weight in zip(branches, weights):
                    cost.add(branch, weight)
            return cost
        if ins.opcode == "call":
            for call in _called(ins, "call"):
                cost.add(computation_cost(call.callee))
            return cost
        if ins.opcode in _FREE:
            return cost
        if ins.opcode == "fusion":
            fused = [c.callee for c in _called(ins, "fusion")]
            inner = _fused_cost(computations, fused[0]) if fused else (0.0, {})
            cost.flops += inner[0]
            cost.bytes += _fusion_bytes(ins, computations.get(fused[0], []) if fused else [])
            cost.op_bytes["fusion"] += cost.bytes
            return cost
        cost.flops += _flops(ins)
        cost.bytes += _instruction_bytes(ins)
        cost.op_bytes[ins.opcode] += cost.bytes
        return cost

    return computation_cost(entry)


def _flops(ins: _Instruction) -> float:
    if ins.opcode in ("dot", "convolution"):
        lhs = ins.operands[0][0] if ins.operands else ""
        dims = [int(d) for d in (_ARRAY.search(lhs).group(2).split(",") if _ARRAY.search(lhs)
                                 else []) if d]
        contract = _CONTRACT.search(ins.attributes)
        k = math.prod(dims[int(i)] for i in contract.group(1).split(",") if i) \
            if contract and dims else 1
        return 2.0 * _elements(ins.result) * k
    if ins.opcode in _ELEMENTWISE:
        return float(_elements(ins.result))
    if ins.opcode in ("reduce", "reduce-window"):
        return float(sum(_elements(t) for t, _ in ins.operands[: len(ins.operands) // 2]))
    return 0.0


def _fused_cost(computations, name: str) -> tuple[float, dict]:
    return sum(_flops(ins) for ins in computations.get(name, ())), {}

def _instruction_bytes(ins: _Instruction) -> float:
    if ins.opcode == "dynamic-slice":
        return 2.0 * _bytes(ins.result)
    if ins.opcode == "dynamic-update-slice":
        return 2.0 * _bytes(ins.operands[1][0]) if len(ins.operands) > 1 else 0.0
    return float(_bytes(ins.result) + sum(_bytes(t) for t, _ in ins.operands))


def _fusion_bytes(ins: _Instruction, body: list[_Instruction]) -> float:
    """Operands read (slices of those only sliced) + output written (in-place updates)."""
    users: dict[str, list[_Instruction]] = {}
    index_of: dict[str, int] = {}
    for i in body:
        if i.opcode == "parameter":
            number = re.match(r"\s*(\d+)", i.args)
            index_of[i.name] = int(number.group(1)) if number else -1
        for k, (_, operand) in enumerate(i.operands):
            users.setdefault(operand, []).append((i, k))
    read = [0.0] * len(ins.operands)
    in_place = None
    root = next((i for i in body if i.root), None)
    if root is not None and root.opcode == "dynamic-update-slice" and root.operands:
        in_place = root.operands[0][1]
    for pname, number in index_of.items():
        if not 0 <= number < len(ins.operands):
            continue
        uses = users.get(pname, [])
        full = _bytes(ins.operands[number][0])
        # only the sliced operand (operand 0) is read in part: a start index is read whole
        if pname == in_place and all(u is root and k == 0 for u, k in uses):
            read[number] = 0.0
        elif uses and all(u.opcode in _SLICES and k == 0 for u, k in uses):
            read[number] = float(sum(_bytes(u.result) for u, _ in uses))
        else:
            read[number] = float(full)
    written = float(_bytes(ins.result))
    if in_place is not None and len(root.operands) > 1:
        written = float(_bytes(root.operands[1][0]))
    return sum(read) + written

