"""Reads what a compiled program communicates and how much memory it needs.

Wall-clock times on shared machines are noise; the partitioned HLO is not. After SPMD
partitioning, every collective XLA will run is an instruction in ``compiled.as_text()``:
its kind, its result shape and dtype, and which devices take part (``replica_groups`` or,
for point-to-point, ``source_target_pairs``). This module parses those instructions, maps the
device groups back to mesh axes, multiplies by the trip counts of the loops they sit in, and
reads ``memory_analysis()``. Every communication and memory claim in parallax is tested
through it.

Example:
  >>> import jax, jax.numpy as jnp, parallax as px
  >>> from parallax.analysis import hlo
  >>> mesh = px.make_mesh(data=-1)
  >>> f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh,
  ...             in_specs=jax.P("data"), out_specs=jax.P()))
  >>> [c.kind for c in hlo.collectives(f.lower(jnp.ones(jax.device_count())), mesh)]
  ['all-reduce']

(Over 300 lines: the one reader of HLO text, call graph, collectives and memory, kept
in one module so every communication claim reads the program the same way.)
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")

DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
    "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8,
    "c64": 8, "c128": 16,
}

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%([\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_ARRAY = re.compile(r"([a-z]\w*)\[([\d,]*)\]")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
# XLA 0.12 names the mesh: replica_groups=mesh['data'=4,'tensor'=2] {'data'}
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")
OP_NAME = re.compile(r'op_name="([^"]*)"')
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a partitioned HLO program.

    ``message_bytes`` is the size S that nccl-tests calls the message: the full array for
    all-reduce, all-gather (its result) and reduce-scatter (its input), and what each device
    sends for all-to-all and collective-permute. ``count`` is how many times the instruction
    runs per call of the program (the product of the trip counts of the loops around it).
    ``in_entry`` is False inside a called computation (a loop body: once per scanned layer);
    ``op_name`` is JAX's metadata for the instruction (``transpose(...)`` in a backward pass).
    """

    kind: str
    name: str
    computation: str
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    groups: tuple[tuple[int, ...], ...]
    pairs: tuple[tuple[int, int], ...]
    axes: tuple[str, ...] | None
    count: int
    conditional: bool
    in_entry: bool = True
    op_name: str = ""

    @property
    def group_size(self) -> int:
        if self.kind == "collective-permute":
            return 2
        return len(self.groups[0]) if self.groups else 1

    @property
    def result_bytes(self) -> int:
        return int(sum(math.prod(s) * DTYPE_BYTES[d] for d, s in zip(self.dtypes, self.shapes)))

    @property
    def operand_bytes(self) -> int:
        if self.kind == "all-gather":
            return self.result_bytes // self.group_size
        if self.kind == "reduce-scatter":
            return self.result_bytes * self.group_size
        return self.result_bytes

    @property
    def message_bytes(self) -> int:
        return max(self.result_bytes, self.operand_bytes)

    @property
    def dtype(self) -> str:
        return self.dtypes[0]


def hlo_text(program) -> str:
    """The partitioned HLO text of a ``Compiled``, a ``Lowered`` (compiled here) or a string."""
    if isinstance(program, str):
        return program
    if hasattr(program, "compile") and not hasattr(program, "memory_analysis"):
        program = program.compile()
    return program.as_text()


def computations(text: str) -> dict[str, list[str]]:
    """The HLO text's computations: name -> the lines of its body."""
    blocks: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        match = _COMPUTATION.match(line)
        if match:
            current = match.group(1)
            blocks[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            blocks[current].append(line)
    return blocks


def entry_name(text: str) -> str:
    """The name of the HLO text's ENTRY computation."""
    for line in text.splitlines():
        if line.startswith("ENTRY"):
            return _COMPUTATION.match(line).group(1)
    raise ValueError("hlo: the text has no ENTRY computation; pass compiled.as_text().")


class Call(NamedTuple):
    """A computation that one HLO instruction calls.

    ``kind`` is ``"body"`` or ``"condition"`` (a ``while``; ``times`` is the body's known trip
    count), ``"branch"`` (a ``conditional``: ``branch`` is its index, ``branches`` how many
    there are, the false branch first for a two-way one), ``"call"`` or ``"fusion"``.
    """

    callee: str
    kind: str
    times: int = 1
    branch: int | None = None
    branches: int = 0


def calls(line: str) -> list[Call]:
    """The computations an HLO instruction line calls: the one call-graph reader of parallax."""
    out: list[Call] = []
    if " while(" in line:
        trip = _TRIP_COUNT.search(line)
        times = int(trip.group(1)) if trip else 1
        for kind in ("body", "condition"):
            m = re.search(kind + r"=%([\w.\-]+)", line)
            if m:
                out.append(Call(m.group(1), kind, times if kind == "body" else 1))
    branches = re.search(r"branch_computations=\{([^}]*)\}", line)
    if branches:
        names = re.findall(r"%([\w.\-]+)", branches.group(1))
        out += [Call(name, "branch", 1, i, len(names)) for i, name in enumerate(names)]
    for i, key in enumerate(("false_computation", "true_computation")):
        m = re.search(key + r"=%([\w.\-]+)", line)
        if m:
            out.append(Call(m.group(1), "branch", 1, i, 2))
    for kind, key in (("call", r"\bcall\(.*to_apply"), ("fusion", r"\bfusion\(.*calls")):
        m = re.search(key + r"=%([\w.\-]+)", line)
        if m:
            out.append(Call(m.group(1), kind))
    return out


def _multiplicities(blocks: dict[str, list[str]], entry: str):
    """How often each computation runs per program call, and whether under a conditional."""
    count: dict[str, int] = defaultdict(int)
    conditional: dict[str, bool] = defaultdict(bool)
    count[entry], order = 1, [entry]
    for name in order:  # breadth-first from the entry; HLO call graphs are acyclic
        for line in blocks.get(name, ()):
            for call in calls(line):
                if call.callee not in count:
                    order.append(call.callee)
                count[call.callee] = max(count[call.callee], count[name] * call.times)
                conditional[call.callee] = (conditional[call.callee] or conditional[name]
                                            or call.kind == "branch")
    return count, conditional


def _mesh_groups(match) -> tuple[tuple[int, ...], ...] | None:
    """Groups of the named form: the devices (row-major over the named mesh) that differ
    only along the braced axes. None for a form not understood (sub-axes)."""
    axes = _MESH_AXIS.findall(match.group(1))
    over = [a.strip().strip("'") for a in match.group(2).split(",") if a.strip()]
    names = [name for name, _ in axes]
    if not axes or any(a not in names for a in over):
        return None
    ids = np.arange(math.prod(int(n) for _, n in axes)).reshape([int(n) for _, n in axes])
    grouped = [names.index(a) for a in over]
    rest = [i for i in range(len(names)) if i not in grouped]
    size = math.prod(ids.shape[i] for i in grouped)
    return tuple(tuple(int(i) for i in row)
                 for row in ids.transpose(rest + grouped).reshape(-1, size))


def _groups(line: str, num_devices: int | None) -> tuple[tuple[int, ...], ...]:
    named = _MESH_GROUPS.search(line)
    if named and (groups := _mesh_groups(named)) is not None:
        return groups
    iota = _IOTA_GROUPS.search(line)
    if iota:
        shape = [int(v) for v in iota.group(1).split(",")]
        dims = [int(v) for v in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(v) for v in iota.group(3).split(",")])
        return tuple(tuple(int(i) for i in row) for row in ids.reshape(shape))
    listed = _LIST_GROUPS.search(line)
    if listed and listed.group(1):
        return tuple(
            tuple(int(v) for v in g.split(",") if v)
            for g in re.findall(r"\{([\d,]*)\}", listed.group(1))
        )
    if num_devices:  # replica_groups={} means one group of every device
        return (tuple(range(num_devices)),)
    return ()


def _result_arrays(kind: str, shape_text: str, is_start: bool) -> list[tuple[str, tuple]]:
    arrays = [
        (d, tuple(int(v) for v in dims.split(",") if v))
        for d, dims in _ARRAY.findall(shape_text)
        if d in DTYPE_BYTES
    ]
    if is_start and kind in ("all-gather", "collective-permute"):
        # Async starts return (operand, result, scalar contexts...) on GPU and TPU.
        data = [a for a in arrays if a[1]]
        if len(data) >= 2:
            return [data[1]]
    return arrays


def mesh_axes_of(devices: Iterable[int], mesh) -> tuple[str, ...]:
    """The mesh axes along which the given device ids (indices into the mesh) differ."""
    coords = np.array([np.unravel_index(i, mesh.devices.shape) for i in devices])
    return tuple(
        name for j, name in enumerate(mesh.axis_names) if len(set(coords[:, j])) > 1
    )


def collectives(program, mesh=None) -> list[Collective]:
    """Every collective in the partitioned program, in program order.

    Args:
      program: a ``jax.stages.Compiled``, a ``jax.stages.Lowered`` or HLO text.
      mesh: when given, each collective's device groups are mapped to the mesh axes they span
        (``axes``); device ids in the HLO index ``mesh.devices.flat``.

    Returns:
      A list of :class:`Collective`. Async pairs (``all-reduce-start``/``-done``) count once.
    """
    text = hlo_text(program)
    blocks = computations(text)
    entry = entry_name(text)
    count, conditional = _multiplicities(blocks, entry)
    num_devices = mesh.size if mesh is not None else None
    found = []
    for computation, lines in blocks.items():
        for line in lines:
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            name, shape_text, op, _ = match.groups()
            kind = op[: -len("-start")] if op.endswith("-start") else op
            if kind not in KINDS:
                continue
            arrays = _result_arrays(kind, shape_text, op.endswith("-start"))
            pairs_match = _PAIRS.search(line)
            pairs = tuple(
                (int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs_match.group(1))
            ) if pairs_match else ()
            groups = () if kind == "collective-permute" else _groups(line, num_devices)
            axes = None
            if mesh is not None:
                if pairs:
                    moved = {a for pair in pairs for a in mesh_axes_of(pair, mesh)}
                    axes = tuple(a for a in mesh.axis_names if a in moved)
                elif groups:
                    axes = mesh_axes_of(groups[0], mesh)
            found.append(Collective(
                kind=kind,
                name=name,
                computation=computation,
                dtypes=tuple(a[0] for a in arrays),
                shapes=tuple(a[1] for a in arrays),
                groups=groups,
                pairs=pairs,
                axes=axes,
                count=count.get(computation, 0) or 1,
                conditional=conditional.get(computation, False),
                in_entry=computation == entry,
                op_name=op_name.group(1) if (op_name := OP_NAME.search(line)) else "",
            ))
    return found


@dataclasses.dataclass(frozen=True)
class CollectiveSummary:
    """Collectives of one kind over one set of mesh axes, totalled per program call."""

    kind: str
    axes: tuple[str, ...] | None
    count: int
    message_bytes: int


def summarize(found: Iterable[Collective]) -> list[CollectiveSummary]:
    """Totals of count and message bytes per (kind, axes), each multiplied by its trip count."""
    totals: dict[tuple, list[int]] = {}
    for c in found:
        t = totals.setdefault((c.kind, c.axes), [0, 0])
        t[0] += c.count
        t[1] += c.count * c.message_bytes
    return [CollectiveSummary(k, a, n, b) for (k, a), (n, b) in totals.items()]


def total_bytes(found: Iterable[Collective], kind: str | None = None, axes=None) -> int:
    """Message bytes per program call, over the collectives of ``kind`` along ``axes``."""
    axes = (axes,) if isinstance(axes, str) else (tuple(axes) if axes is not None else None)
    return sum(
        c.count * c.message_bytes
        for c in found
        if (kind is None or c.kind == kind) and (axes is None or c.axes == axes)
    )


def count(found: Iterable[Collective], kind: str | None = None, axes=None) -> int:
    """How many collectives of ``kind`` along ``axes`` run per program call."""
    axes = (axes,) if isinstance(axes, str) else (tuple(axes) if axes is not None else None)
    return sum(
        c.count for c in found
        if (kind is None or c.kind == kind) and (axes is None or c.axes == axes)
    )


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device bytes from ``compiled.memory_analysis()``.

    ``peak_bytes`` is arguments + outputs - aliased (donated) + temporaries: what the program
    holds at its high point, by XLA's own accounting.
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int

    @property
    def peak_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes


def memory(program) -> Memory:
    """Reads ``memory_analysis()`` of a ``Compiled`` (or compiles a ``Lowered``)."""
    if hasattr(program, "compile") and not hasattr(program, "memory_analysis"):
        program = program.compile()
    stats = program.memory_analysis()
    return Memory(
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        generated_code_bytes=int(stats.generated_code_size_in_bytes),
    )


def table(found: Iterable[Collective]) -> str:
    """A short text table of :func:`summarize`, for reports and the CLI."""
    rows = sorted(summarize(found), key=lambda s: (s.kind, str(s.axes)))
    lines = [f"{'collective':<20}{'mesh axes':<22}{'count':>7}{'bytes':>14}"]
    for s in rows:
        axes = ",".join(s.axes) if s.axes else ("-" if s.axes is None else "()")
        lines.append(f"{s.kind:<20}{axes:<22}{s.count:>7}{s.message_bytes:>14,}")
    return "\n".join(lines)
