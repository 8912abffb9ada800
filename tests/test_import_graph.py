"""moelens's modules import one another in one direction only: the graph of module-level imports is acyclic,
no import of a moelens module hides inside a function, and the layers keep to their side (loaders never
reach models, models never reach verify or analysis, hooks never reach the cache)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "moelens"
# Imported inside a function on purpose: they import optional dependencies (triton; pyarrow, the trace extra).
OPTIONAL_MODULES = {"moelens.kernels.triton_experts", "moelens.traces.run", "moelens.traces.parts"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def _targets(node: ast.Import | ast.ImportFrom, importer: str) -> list[str]:
    """The moelens modules an import statement loads (a `from package import name` of a submodule loads it)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "moelens"]
    base = node.module or ""
    if node.level:  # relative: from the importer's package
        package = importer.split(".") if MODULES[importer].name == "__init__.py" else importer.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    if base.split(".")[0] != "moelens":
        return []
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if sub in MODULES else base)
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(name: str) -> tuple[set[str], list[tuple[int, str]]]:
    """(moelens modules imported at module level, (line, module) of those imported inside a function)."""
    tree = ast.parse(MODULES[name].read_text())
    top: set[str] = set()
    nested: list[tuple[int, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue  # annotations only, never run
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(child, name):
                    (nested.append((child.lineno, target)) if in_function else top.add(target))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return top - {name}, nested


GRAPH = {name: imports(name)[0] for name in MODULES}


def test_no_moelens_import_hides_in_a_function():
    hidden = [
        f"{MODULES[name].relative_to(ROOT.parent)}:{line} imports {target}"
        for name in MODULES for line, target in imports(name)[1] if target not in OPTIONAL_MODULES
    ]
    assert not hidden, "function-level imports of moelens modules:\n" + "\n".join(hidden)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := dfs(node)):
            return cycle
    return None


def test_the_import_graph_is_acyclic():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def reachable(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in GRAPH.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def under(prefix: str) -> list[str]:
    return [m for m in MODULES if m == prefix or m.startswith(prefix + ".")]


@pytest.mark.parametrize(
    "layer, forbidden",
    [
        ("moelens.loaders", ("moelens.models", "moelens.pretrained", "moelens.defaults", "moelens.verify")),
        ("moelens.kernels", ("moelens.models", "moelens.loaders", "moelens.pretrained")),
        ("moelens.hooks", ("moelens.cache", "moelens.cache_analysis", "moelens.models")),
        ("moelens.sitemap", ("moelens.models", "moelens.loaders")),
        ("moelens.analysis", ("moelens.traces", "moelens.cli")),  # traces build on the analyses
    ],
)
def test_lower_layers_never_reach_higher_ones(layer, forbidden):
    bad = {
        (module, target)
        for module in under(layer) for target in reachable(module)
        if any(target == f or target.startswith(f + ".") for f in forbidden)
    }
    assert not bad, f"{layer} reaches {sorted(bad)}"


@pytest.mark.parametrize("forbidden", ["moelens.verify", "moelens.analysis", "moelens.loaders", "moelens.cli"])
def test_models_import_no_verify_analysis_or_loader_directly(forbidden):
    bad = {(m, t) for m in under("moelens.models") for t in GRAPH[m] if t == forbidden or t.startswith(forbidden + ".")}
    assert not bad, bad
