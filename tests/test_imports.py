"""The package's import graph: no cycles (``TYPE_CHECKING`` blocks and function bodies
included), and the core never imports the parallelisms built on it.

Imports are read from the source with ``ast``, so an import hidden in a function or behind
``if TYPE_CHECKING:`` counts like any other. ``from a.b import c`` is an edge to ``a.b.c``
when that is a module, else to ``a.b``. A module's own parent packages are not edges: Python
initialises them before the module either way.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parents[1] / "parallax"

# Top-level modules that the parallelisms are built on. The application layer (cli, demo,
# presets, testing, the package __init__) may import anything.
CORE = {
    "parallax.activations", "parallax.batch", "parallax.context", "parallax.grad",
    "parallax.layout", "parallax.mesh", "parallax.microbatch", "parallax.rules",
    "parallax.state", "parallax.step", "parallax.strategy", "parallax.vma",
    "parallax.local_shards", "parallax.rng", "parallax.finite", "parallax.aux",
    "parallax.mutable", "parallax.local_loss", "parallax.producer", "parallax.guards",
    "parallax.lazy_names", "parallax.context_binding",
}
BUILT_ON_CORE = ("parallax.strategies", "parallax.nn", "parallax.pipeline")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def resolve(name: str) -> str | None:
    """The parallax module ``name`` refers to (itself, or the package holding it)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str) -> set[str]:
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        for target in targets:
            if target == "parallax" or target.startswith("parallax."):
                resolved = resolve(target)
                if resolved and resolved != name and not name.startswith(resolved + "."):
                    found.add(resolved)
    return found


GRAPH = {name: imports(name) for name in MODULES}


def find_cycle() -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(GRAPH):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_reader_sees_the_package():
    assert "parallax.grad" in GRAPH and "parallax.pipeline.runtime" in GRAPH
    assert "parallax.mesh" in GRAPH["parallax.step"] or "parallax.mesh" in GRAPH["parallax.strategy"]


def test_no_import_cycle():
    cycle = find_cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("name", sorted(CORE & set(GRAPH)))
def test_core_does_not_import_what_is_built_on_it(name):
    bad = sorted(t for t in GRAPH[name] if t.startswith(BUILT_ON_CORE))
    assert not bad, f"{name} imports {bad}: the core must not depend on strategies/, nn/ or pipeline/"


def test_every_core_module_exists():
    missing = CORE - set(GRAPH)
    assert not missing, f"listed as core but not in the package: {sorted(missing)}"
