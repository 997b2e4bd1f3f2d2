"""The dependency rules of the layout (README, "Layout"), checked on the import statements.

- ``objectives/``, ``search_spaces/`` and ``optimizer/workload/`` import nothing above them:
  from this project only each other's base (``optimizer.types``, ``optimizer.errors``) and
  their own room;
- one module imports Ray (``optimizer/runners.py``);
- only ``optimizer/tracking.py`` imports MLflow;
- no module of the tuner imports vLLM (it runs vLLM as a server, never in-process).

Imports inside functions count: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
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


def test_the_rules_see_the_imports_they_judge() -> None:
    """The checker itself: it finds a lazy import inside a function."""
    assert "ray" in _imports(REPO / "optimizer" / "runners.py")
    assert "optimizer.types" in _imports(REPO / "objectives" / "metrics.py")
