"""The dependency rules of the layout (README, "Layout"), checked on the import statements.

- ``objectives/``, ``search_spaces/`` and ``optimizer/workload/`` import nothing above them:
  from this project only each other's base (``optimizer.types``, ``optimizer.errors``) and
  their own room;
- one room imports Ray (``optimizer/runners/``);
- only ``optimizer/tracking/sync.py`` imports MLflow;
- no module of the tuner imports vLLM (it runs vLLM as a server, never in-process);
- no import circle among the modules of ``optimizer/``, ``objectives/`` and ``search_spaces/``:
  a module imports what lies below it, and a room's shared records lie at the bottom;
- no import runs back up a floor: a room (a package of ``optimizer/`` with all its modules, a
  module at the top of ``optimizer/``, ``objectives``, ``search_spaces``) lies on one floor, so
  there is no circle among rooms either. A package whose ``__init__`` says that each of its
  modules is a room of its own (``service/``) is not one room; the one import known to run
  back up is listed, with its reason, and the test fails once it is gone. So
  ``stability/`` (plan, options, verdicts, a run on one server: below ``config.py``, which
  builds its options) and ``stability_check/`` (the check of a study folder and its command:
  above ``study.py``) are two rooms on two floors.

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

#: Packages each module of which is a room of its own (their ``__init__`` imports nothing and
#: says so): ``service/security.py`` lies below ``export/`` and ``tracking/``, the service's
#: facade above the study.
ROOM_FOLDERS = ("optimizer.service",)

#: The imports known to run back up a floor, (importer, imported) with the reason: none.
BACK_UP: dict[tuple[str, str], str] = {}


def _room(name: str) -> str:
    """The room a module is in: its package under ``optimizer`` (unless that package is a
    folder of rooms), the module itself at the top of ``optimizer``, else its top package."""
    parts = name.split(".")
    if parts[0] != "optimizer" or len(parts) == 1:
        return parts[0]
    package = ".".join(parts[:2])
    return name if package in ROOM_FOLDERS else package


def _room_graph(graph: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """Rooms and the rooms they import (a room's imports of itself left out), from a graph of
    modules; the imports of :data:`BACK_UP` left out."""
    rooms: dict[str, set[str]] = {}
    for name, imported in graph.items():
        out = rooms.setdefault(_room(name), set())
        out.update(_room(i) for i in imported if (name, i) not in BACK_UP)
    return {room: out - {room} for room, out in rooms.items()}


def _reaches(graph: Mapping[str, set[str]], start: str) -> set[str]:
    """What ``start`` imports, directly or not."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


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
    [
        ("ray", {"optimizer.runners", "optimizer.runners.base", "optimizer.runners.serve"}),
        ("mlflow", {"optimizer.tracking.sync"}),
        ("vllm", set()),
    ],
)
def test_one_module_owns_each_heavy_dependency(library: str, owners: set[str]) -> None:
    importers = {
        name for name, path in MODULES.items() if any(_under(i, library) for i in _imports(path))
    }
    assert importers == owners


def _module_graph() -> dict[str, set[str]]:
    return {name: _project_imports(name, path) for name, path in MODULES.items()}


def test_no_import_circles() -> None:
    assert _circles(_module_graph()) == []


def test_no_import_runs_back_up_a_floor() -> None:
    """No circle among rooms: a package is on one floor, not below a room that imports it
    from above."""
    assert _circles(_room_graph(_module_graph())) == []


def test_the_imports_known_to_run_back_up_are_still_there() -> None:
    graph = _module_graph()
    assert {(a, b) for a, b in BACK_UP if b not in graph.get(a, set())} == set()


@pytest.mark.parametrize(
    ("upper", "lower"),
    [
        ("optimizer.config", "optimizer.stability"),
        ("optimizer.study", "optimizer.config"),
        ("optimizer.stability_check", "optimizer.study"),
        ("optimizer.cli", "optimizer.stability_check"),
    ],
    ids=lambda r: r.removeprefix("optimizer."),
)
def test_the_stability_rooms_lie_below_config_and_above_study(upper: str, lower: str) -> None:
    """The job file builds the stability options (``stability/`` below ``config.py``); the
    check of a study folder prepares the study (``stability_check/`` above ``study.py``)."""
    rooms = _room_graph(_module_graph())
    assert lower in _reaches(rooms, upper)
    assert upper not in _reaches(rooms, lower)


def test_the_circle_check_finds_a_circle_through_a_lazy_import_and_a_package() -> None:
    """The checker itself, on a made-up graph and on how it reads the project's imports."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
    # cli.py's lazy ``from optimizer.stability_check.command import ...`` (inside a function)
    # counts, and depends on the package optimizer.stability_check too; a module's own packages
    # do not count.
    seen = _project_imports("optimizer.cli", MODULES["optimizer.cli"])
    assert {"optimizer.stability_check", "optimizer.stability_check.command"} <= seen
    assert "optimizer" not in seen and "optimizer.cli" not in seen


def test_the_floor_check_finds_a_package_used_from_below_and_above() -> None:
    """The checker itself: a package one module of which a lower room imports, while another
    imports that room's importer, is a circle of rooms (the stability package before it was
    parted: ``config.py`` imported its options, its workflow imported ``study.py``)."""
    graph = {
        "optimizer.config": {"optimizer.stability.options"},
        "optimizer.study": {"optimizer.config"},
        "optimizer.stability.options": set(),
        "optimizer.stability.workflow": {"optimizer.study"},
        "optimizer.service.security": set(),
        "optimizer.service.facade": {"optimizer.study"},
        "optimizer.export.workflow": {"optimizer.service.security", "optimizer.study"},
    }
    assert _circles(graph) == []
    assert _circles(_room_graph(graph)) == [
        ["optimizer.config", "optimizer.stability", "optimizer.study"]
    ]
    assert _room("optimizer.service.facade") == "optimizer.service.facade"  # a folder of rooms
    assert _room("optimizer.cli") == "optimizer.cli" and _room("objectives.slo") == "objectives"


def test_the_rules_see_the_imports_they_judge() -> None:
    """The checker itself: it finds a lazy import inside a function."""
    assert "ray" in _imports(REPO / "optimizer" / "runners" / "__init__.py")
    assert "optimizer.types" in _imports(REPO / "objectives" / "metrics.py")


def test_no_module_is_over_900_lines() -> None:
    """A module over 900 lines holds more than one job: split it along them (README, Layout)."""
    long = {
        name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > 900
    }
    assert long == {}
