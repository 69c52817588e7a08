"""The package's import graph: no cycle between modules or between packages, and imports
only point down the layers of :data:`LAYERS`.

Imports are read from the source with ``ast``, so an import hidden in a function or behind
``if TYPE_CHECKING:`` counts like any other. ``from a.b import c`` is an edge to ``a.b.c``
when that is a module, else to ``a.b``. A module's own parent packages are not edges: Python
initialises them before the module either way. The package root (``parallax/__init__.py``)
gathers the public names and may import anything.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parents[1] / "parallax"

# Bottom to top: a unit (a top-level module or a subpackage of parallax) imports only units
# of its own layer or below. Everything under the parallelisms is the core they build on.
LAYERS = (
    ("comm", "analysis", "old_import_paths", "ray_cluster"),  # engines: XLA collectives, Ray;
                                                              # compiled programs read
    ("mesh", "rules", "strategy_hooks", "strategy", "layout", "state", "context",
     "activations", "attention_kernel", "attention", "finite_check", "precision",
     "loss_scale", "host_memory"),  # the nouns
    ("step",),  # around the user's step: init, shard, train_step, the batch
    ("grad",),  # around gradients: value_and_grad, producers, micro-batches, module state
    ("distributed", "checkpoint"),  # jax.distributed and Orbax, placing by the core's layouts
    ("data",),  # tokenizers, packing, per-process resumable batches (process_slice below)
    ("pipeline",),  # the parallelisms
    ("strategies",),
    ("nn",),  # layers (nn.tensor_parallel runs them under px.TensorParallel's rules)
    ("models",),  # networks of nn's layers
    ("planner",),  # predicting and choosing among the strategies
    ("metrics",),  # watching a run: throughput, MFU, memory, logs, profiles
    ("ps", "rpc"),  # the originals' APIs
    ("horovod", "tf"),
    ("testing", "cli"),  # applications
)
PARALLELISMS = ("pipeline", "strategies", "models", "nn")
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


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


def unit(name: str) -> str | None:
    """The layer unit of a module: ``parallax.grad.producer`` -> ``grad``; None for the root."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


UNIT_GRAPH: dict[str, set[str]] = {}
for _name, _targets in GRAPH.items():
    if unit(_name):
        UNIT_GRAPH.setdefault(unit(_name), set()).update(
            unit(t) for t in _targets if unit(t) and unit(t) != unit(_name))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_reader_sees_the_package():
    assert "parallax.grad.gradients" in GRAPH and "parallax.pipeline.runtime" in GRAPH
    assert "parallax.mesh" in GRAPH["parallax.strategy"]
    assert "step" in UNIT_GRAPH["grad"]


def test_no_import_cycle_between_modules():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_between_packages():
    cycle = find_cycle(UNIT_GRAPH)
    assert cycle is None, "package-level import cycle: " + " -> ".join(cycle)


def test_every_unit_has_a_layer():
    units = {unit(name) for name in MODULES} - {None}
    assert units == set(RANK), (f"not placed in LAYERS: {sorted(units - set(RANK))}; "
                                f"placed but gone: {sorted(set(RANK) - units)}")


@pytest.mark.parametrize("name", sorted(n for n in GRAPH if unit(n)))
def test_imports_point_down_the_layers(name):
    here = unit(name)
    up = sorted(t for t in GRAPH[name] if unit(t) and RANK[unit(t)] > RANK[here])
    assert not up, (f"{name} (layer {RANK[here]}: {here}) imports {up} from a higher layer; "
                    "move the shared piece down, or pass it in")


@pytest.mark.parametrize("name", sorted(n for n in GRAPH
                                        if unit(n) and RANK[unit(n)] < RANK["pipeline"]))
def test_the_core_does_not_import_the_parallelisms(name):
    bad = sorted(t for t in GRAPH[name] if unit(t) in PARALLELISMS)
    assert not bad, f"{name} imports {bad}: the core must not depend on {PARALLELISMS}"
