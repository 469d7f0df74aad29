"""The library's import graph: no module imports itself back through others (an import circle), the
four packages depend one way: policy_search <- quant <- offload <- flexsarathi, and inside
flexsarathi/ the model families' math (models/) and the readers of users' files (formats/) sit at
the bottom in that order: models/ imports no formats/, and neither imports engine/, cli/ or the rest.

Every import statement counts, module-level or inside a function: a function-level import that
closes a circle still ties the modules into one knot (only the import order is hidden). A package's
`__init__` is a node only where a module imports the package itself; importing `a.b.c` also runs
`a/__init__`, but that parent edge is Python's mechanics, not a dependency of the importing module.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("policy_search", "quant", "offload", "flexsarathi")  # each may import only those before it
ALLOWED = {pkg: set(PACKAGES[:i + 1]) for i, pkg in enumerate(PACKAGES)}
# The flexsarathi modules each bottom subpackage may import (a prefix names a module or a package);
# the lower packages stay allowed by ALLOWED. formats/ reads a checkpoint into models/' config and math.
SUBPACKAGE_ALLOWED = {
    "flexsarathi.models": ("flexsarathi.errors", "flexsarathi.models"),
    "flexsarathi.formats": ("flexsarathi.errors", "flexsarathi.models", "flexsarathi.formats"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The library modules `path` imports (a `from pkg import name` names pkg.name where that is a
    module, else pkg itself)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return {m for m in found if m in modules}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) - {name} for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, circles, counter = {}, {}, set(), [], [], [0]

    def visit(start: str) -> None:
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circle():
    circles = _circles(_graph())
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)


def test_the_circle_finder_finds_a_planted_circle():
    """The check above can fail: a graph with a three-module circle beside a clean chain."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]


def test_packages_import_one_way():
    wrong = sorted(f"{name} -> {target}" for name, targets in _graph().items() for target in targets
                   if target.split(".")[0] not in ALLOWED[name.split(".")[0]])
    assert not wrong, f"imports against policy_search <- quant <- offload <- flexsarathi: {wrong}"


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _subpackage_violations(graph: dict[str, set[str]]) -> list[str]:
    """Edges from a SUBPACKAGE_ALLOWED subpackage to a flexsarathi module outside its allowed list."""
    wrong = []
    for name, targets in graph.items():
        for subpackage, allowed in SUBPACKAGE_ALLOWED.items():
            if _within(name, subpackage):
                wrong += [f"{name} -> {target}" for target in targets if _within(target, "flexsarathi")
                          and not any(_within(target, prefix) for prefix in allowed)]
    return sorted(wrong)


def test_bottom_subpackages_exist():
    """The rule below names real packages (a rename would otherwise leave it checking nothing)."""
    for subpackage in SUBPACKAGE_ALLOWED:
        assert (ROOT / subpackage.replace(".", "/") / "__init__.py").is_file(), subpackage


def test_model_math_below_formats_below_the_rest_of_flexsarathi():
    wrong = _subpackage_violations(_graph())
    assert not wrong, f"imports against flexsarathi.models <- flexsarathi.formats <- engine/cli/...: {wrong}"


def test_the_subpackage_rule_finds_planted_upward_imports():
    """The check above can fail: math reading a format, a format reaching the engine."""
    graph = {"flexsarathi.models.llama": {"flexsarathi.models.base", "flexsarathi.formats.checkpoint"},
             "flexsarathi.formats.hub": {"flexsarathi.errors", "flexsarathi.engine.llm_engine"},
             "flexsarathi.formats.checkpoint": {"flexsarathi.models", "quant"},
             "flexsarathi.engine.llm_engine": {"flexsarathi.formats.checkpoint"}}
    assert _subpackage_violations(graph) == ["flexsarathi.formats.hub -> flexsarathi.engine.llm_engine",
                                             "flexsarathi.models.llama -> flexsarathi.formats.checkpoint"]
