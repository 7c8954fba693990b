"""The packages' layers: imports run one way, and nothing goes round in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "deployments"


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(pkg: Path = PKG) -> dict[str, set[str]]:
    """Every module of ``pkg`` -> the modules of ``pkg`` it imports, anywhere in its code
    (a lazy import inside a function counts: it is a dependency all the same; so does a
    relative one)."""
    modules = {_module(p): p for p in pkg.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.rsplit(".", node.level - 1)[0]
                    base = f"{up}.{base}" if base else up
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


@pytest.mark.parametrize("pkg", ["deployments", "weights"])
def test_no_import_circles(pkg):
    graph = _imports(ROOT / pkg)
    # a package's __init__ that re-exports its modules is not an edge back into them
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        seen[m] = 1
        for d in sorted(graph.get(m, ())):
            if seen.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in seen:
                visit(d, path + [d])
        seen[m] = 2
    for m in sorted(graph):
        if m not in seen:
            visit(m, [m])


def test_the_engine_model_and_kernels_import_neither_startup_nor_server():
    for m, deps in _imports().items():
        if m.startswith(("deployments.engine", "deployments.model", "deployments.kernels")):
            bad = sorted(d for d in deps if d.startswith(("deployments.startup", "deployments.server",
                                                          "deployments.app", "deployments.tools")))
            assert not bad, f"{m} imports {bad}"


def test_weights_import_nothing_of_the_serving_side():
    for path in (ROOT / "weights").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.startswith("deployments") for n in names), f"{path.name} imports {names}"


def test_only_the_start_and_the_setup_hook_start_threads_or_touch_the_collector():
    allowed = {"deployments.server.start", "deployments.startup.early", "deployments.startup.side"}
    for path in PKG.rglob("*.py"):
        m = _module(path)
        if m in allowed:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "gc":
                raise AssertionError(f"{m} calls gc.{node.attr}")
        # threads: the engine's own loop thread and the loader's are the engine's and the load's;
        # a start-up side thread anywhere else would be the entanglement the start list removed
        if m.startswith("deployments.startup") and m not in allowed:
            assert "threading.Thread(" not in path.read_text(), f"{m} starts a thread of its own"
