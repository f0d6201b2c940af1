"""The core's rooms: its modules import no actor, bus or CLI code, form no import circle, and
the simulator's and planner's part of it loads without torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "pivot"


def _module(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The pivot modules ``path`` imports at module level (TYPE_CHECKING blocks included)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: set[str] = set()
    for node in tree.body:
        blocks = [node]
        if isinstance(node, ast.If):  # if TYPE_CHECKING: ...
            blocks = node.body
        for stmt in blocks:
            if isinstance(stmt, ast.ImportFrom) and stmt.module and stmt.level == 0:
                if stmt.module.startswith("pivot"):
                    found.add(stmt.module)
                    found.update(f"{stmt.module}.{a.name}" for a in stmt.names)
            elif isinstance(stmt, ast.Import):
                found.update(a.name for a in stmt.names if a.name.startswith("pivot"))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in CORE.rglob("*.py")}
    return {
        name: {m for m in _imports(path) if m in modules} - {name} for name, path in modules.items()
    }


def test_the_core_imports_no_actors_bus_or_cli():
    for path in CORE.rglob("*.py"):
        outside = {
            m
            for m in _imports(path)
            if m.split(".")[1:2] and m.split(".")[1] in ("actors", "bus", "cli")
        }
        assert not outside, f"{_module(path)} imports {sorted(outside)}"


def test_the_core_has_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circle = path[path.index(nxt) :] + [nxt]
                raise AssertionError("import circle: " + " -> ".join(circle))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_checker_finds_a_circle_when_there_is_one(monkeypatch):
    # the graph walk above must be able to fail: feed it a circle
    fake = {"pivot.a": {"pivot.b"}, "pivot.b": {"pivot.a"}}
    monkeypatch.setattr(sys.modules[__name__], "_graph", lambda: fake)
    try:
        test_the_core_has_no_import_circle()
    except AssertionError as exc:
        assert "pivot.a -> pivot.b -> pivot.a" in str(exc)
    else:
        raise AssertionError("the circle went unnoticed")


def test_planning_engines_and_deployments_load_without_torch():
    code = (
        "import sys; import pivot.planning.planner, pivot.planning.staging, pivot.deployment, "
        "pivot.engines.sim_engine, pivot.engines.conformance, pivot.engines.scripted, "
        "pivot.shift, pivot.job, pivot.workload; print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
