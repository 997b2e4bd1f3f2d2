"""The dependency rules of the layout (README, "Layout"), checked on the import statements.

- ``objectives/``, ``search_spaces/`` and ``optimizer/workload/`` import nothing above them:
  from this project only each other's base (``optimizer.types``, ``optimizer.errors``) and
  their own room;
- one module imports Ray (``optimizer/runners.py``);
- only ``optimizer/tracking.py`` imports MLflow;
- no module of the tuner imports vLLM (it runs vLLM as a server, never in-process);
- no import circle among the modules of ``optimizer/``, ``objectives/`` and ``search_spaces/``:
  a module imports what lies below it, and a room's shared records lie at the bottom.

Imports inside functions count: a lazy import is still a dependency; so do imports made for the
type checker alone (``if TYPE_CHECKING:``), and importing ``a.b.c`` depends on the packages
``a`` and ``a.b`` too (Python runs their ``__init__`` first).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("optimizer", "objectives", "search_spaces")
BASE = ("optimizer.types", "optimizer.errors")


def _modules() -> Iterator[tuple[str, Path]]:
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            name = ".".join(rel.parts).removesuffix(".__init__")
            yield name, path


def _imports(path: Path) -> set[str]:
    """Absolute names imported anywhere in the file."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def _project_module(name: str) -> str | None:
    """The project's module a dotted name refers to (``a.b.Name`` -> ``a.b``), else None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _project_imports(name: str, path: Path) -> set[str]:
    """The project's modules that importing ``name`` runs: what it imports (relative imports
    and ``from package import submodule`` resolved) and those modules' parent packages."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *filter(None, [base])])
            targets = [f"{base}.{alias.name}" for alias in node.names]
        for target in targets:
            module = _project_module(target)
            parts = module.split(".") if module else []
            out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {m for m in out if m in MODULES and m != name and not _under(name, m)}


def _circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                found.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _under(name: str, root: str) -> bool:
    return name == root or name.startswith(root + ".")


MODULES = dict(_modules())


@pytest.mark.parametrize(
    "room", ["objectives", "search_spaces", "optimizer.workload"], ids=lambda r: r
)
def test_lower_rooms_import_nothing_above_them(room: str) -> None:
    allowed = (room, *BASE)
    bad = {
        name: sorted(
            i
            for i in _imports(path)
            if _under(i, "optimizer") or _under(i, "objectives") or _under(i, "search_spaces")
            if not any(_under(i, a) for a in allowed)
        )
        for name, path in MODULES.items()
        if _under(name, room)
    }
    assert {k: v for k, v in bad.items() if v} == {}


@pytest.mark.parametrize(
    ("library", "owners"),
    [("ray", {"optimizer.runners"}), ("mlflow", {"optimizer.tracking"}), ("vllm", set())],
)
def test_one_module_owns_each_heavy_dependency(library: str, owners: set[str]) -> None:
    importers = {
        name for name, path in MODULES.items() if any(_under(i, library) for i in _imports(path))
    }
    assert importers == owners


def test_no_import_circles() -> None:
    graph = {name: _project_imports(name, path) for name, path in MODULES.items()}
    assert _circles(graph) == []


def test_the_circle_check_finds_a_circle_through_a_lazy_import_and_a_package() -> None:
    """The checker itself, on a made-up graph and on how it reads the project's imports."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
    # cli.py's lazy ``from optimizer.stability.command import ...`` (inside a function) counts,
    # and depends on the package optimizer.stability too; a module's own packages do not count.
    seen = _project_imports("optimizer.cli", MODULES["optimizer.cli"])
    assert {"optimizer.stability", "optimizer.stability.command"} <= seen
    assert "optimizer" not in seen and "optimizer.cli" not in seen


def test_the_rules_see_the_imports_they_judge() -> None:
    """The checker itself: it finds a lazy import inside a function."""
    assert "ray" in _imports(REPO / "optimizer" / "runners.py")
    assert "optimizer.types" in _imports(REPO / "objectives" / "metrics.py")
