"""The house's rules on imports (docs/architecture.md), read from the source: every `import` and
`from ... import` of a specdec module, at the top of a file or inside a function, is an arrow."""

from __future__ import annotations

import ast
from pathlib import Path

import specdec

SOURCE = Path(specdec.__file__).parent
TOOLS = ("specdec.tools",)  # imported by the command line alone
SPECULATION = ("specdec.drafters", "specdec.spec", "specdec.engine", "specdec.llm")
LAYERS = [  # bottom first (docs/architecture.md): a module imports from its own layer and those below only
    (
        "ground floor",
        (
            "specdec.tree",
            "specdec.metrics",
            "specdec.outputs",
            "specdec.config",
            "specdec.structural_tag",
            "specdec.sequence",
            "specdec.sampling",
            "specdec.platform",
            "specdec.progress",
            "specdec.log_lines",
            "specdec.paths",
            "specdec.output_dir",
            "specdec.kv_cache",
            "specdec.block_manager",
            "specdec.methods",
        ),
    ),
    ("models", ("specdec.kernels", "specdec.models")),
    ("worker", ("specdec.worker",)),
    ("drafters", ("specdec.drafters",)),
    ("spec", ("specdec.spec",)),
    ("engine", ("specdec.engine",)),
    ("entry points", ("specdec.llm", "specdec.prompts", "specdec.model_flags", "specdec.serve")),
    ("command line and tools", ("specdec.cli", "specdec.tools.demo") + TOOLS),
]


def module_name(path: Path) -> str:
    return ".".join(path.with_suffix("").relative_to(SOURCE.parent).parts).removesuffix(".__init__")


def arrows() -> dict[str, set[str]]:
    """module -> the specdec modules it imports (a package's name where a name in it is imported)."""
    modules = {module_name(path): path for path in SOURCE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets.add(node.module)
                # `from specdec.models import loader` imports the module specdec.models.loader
                targets.update(
                    f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in modules
                )
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def within(module: str, rooms: tuple[str, ...]) -> bool:
    return any(module == room or module.startswith(room + ".") for room in rooms)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_the_arrows_it_should():
    """The control: arrows known to exist are found, top-level and inside functions."""
    graph = arrows()
    assert "specdec.models.llama" in graph["specdec.models.loader"]  # at the top
    assert "specdec.models.gguf" in graph["specdec.models.loader"]  # inside a function
    assert "specdec.serve.commands" in graph["specdec.cli"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_back():
    graph = arrows()
    graph.pop("specdec")  # the package's lazy re-exports (specdec.LLM, ...) point down from the top
    graph = {name: targets - {"specdec"} for name, targets in graph.items()}
    assert cycles(graph) == []


def test_the_tools_are_imported_by_the_command_line_alone():
    offenders = {
        name: sorted(t for t in targets if within(t, TOOLS))
        for name, targets in arrows().items()
        if not within(name, TOOLS) and name != "specdec.cli"
    }
    assert {name: ts for name, ts in offenders.items() if ts} == {}


def test_models_know_nothing_of_speculation_and_the_verifier_nothing_of_models():
    graph = arrows()
    models = {
        name: sorted(t for t in targets if within(t, SPECULATION))
        for name, targets in graph.items()
        if within(name, ("specdec.models",))
    }
    assert {name: ts for name, ts in models.items() if ts} == {}
    assert not any(within(t, ("specdec.models", "specdec.worker")) for t in graph["specdec.spec.verify"])


def layer_of(module: str) -> int:
    layers = [number for number, (_, rooms) in enumerate(LAYERS) if within(module, rooms)]
    assert len(layers) == 1, f"{module} belongs to {len(layers)} layers: add it to exactly one in LAYERS"
    return layers[0]


def test_imports_point_down_the_layers():
    """Every module sits in one layer; none imports from a layer above its own (the package's
    root, whose lazy re-exports point down from the top, aside)."""
    graph = arrows()
    graph.pop("specdec")
    upward = {
        name: sorted(f"{t} ({LAYERS[layer_of(t)][0]})" for t in targets - {"specdec"} if layer_of(t) > layer_of(name))
        for name, targets in graph.items()
    }
    assert {name: ts for name, ts in upward.items() if ts} == {}


def test_only_the_runner_routes_rows_to_cache_slots():
    """A forward's slots are explicit (runner.ForwardBatch); cache.rows(slots) is called by the
    runner alone, and by the EAGLE drafter for its head's own cache (a head runs outside a runner)."""
    callers = set()
    for path in SOURCE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "rows":
                callers.add(module_name(path))
    assert callers == {"specdec.worker.runner", "specdec.drafters.eagle"}


def test_no_drafter_reads_a_sequences_room():
    """Each row's k (and a tree's deepest node) comes from the engine's round: a drafter drafts
    what it is given and never reads Sequence.draft_room itself."""
    readers = {
        module_name(path)
        for path in (SOURCE / "drafters").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Attribute) and node.attr == "draft_room"
    }
    assert readers == set()
