"""The floor plan holds: every package imports only from the layers below it (read from the
source with `ast`, imports inside functions included), no two packages import each other, and
no module grows past what can be read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "sandbox": {"core"},
    "routing": {"core"},
    "broker": {"core"},
    "workers": {"core", "broker", "routing", "sandbox"},
    "api": {"core", "broker", "routing", "workers"},
    "deploy": {"core", "broker", "routing", "sandbox", "workers", "api"},
    "trainers": {"core", "api"},
}
"""Which first-party packages each package may import."""

MAX_MODULE_LINES = 700


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported_packages(path: Path) -> dict[str, list[int]]:
    """First-party packages `path` imports, with the lines that import them."""
    found: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            top = name.split(".")[0]
            if top in ALLOWED:
                found.setdefault(top, []).append(node.lineno)
    return found


def package_graph() -> dict[str, dict[str, list[str]]]:
    """package → imported package → the places (`path:line`) that import it."""
    graph: dict[str, dict[str, list[str]]] = {package: {} for package in ALLOWED}
    for package in ALLOWED:
        for path in modules(package):
            for target, lines in imported_packages(path).items():
                if target != package:
                    where = [f"{path.relative_to(ROOT)}:{line}" for line in lines]
                    graph[package].setdefault(target, []).extend(where)
    return graph


def test_every_package_exists() -> None:
    for package in ALLOWED:
        assert (ROOT / package / "__init__.py").is_file(), package


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_the_layers_below(package: str) -> None:
    graph = package_graph()
    wrong = {
        target: places
        for target, places in graph[package].items()
        if target not in ALLOWED[package]
    }
    assert not wrong, f"{package} may import only {sorted(ALLOWED[package])}; found {wrong}"


def test_no_two_packages_import_each_other() -> None:
    graph = package_graph()
    cycles = sorted((a, b) for a in graph for b in graph[a] if a < b and a in graph.get(b, {}))
    assert cycles == []


def test_no_module_is_longer_than_one_sitting() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for package in ALLOWED
        for path in modules(package)
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_the_checker_sees_a_violation(tmp_path: Path) -> None:
    """The import reader finds module-level and function-level imports alike."""
    source = tmp_path / "m.py"
    source.write_text(
        "import api.app\nfrom core import schemas\n\ndef f():\n    from workers.agent import x\n"
    )
    assert imported_packages(source) == {"api": [1], "core": [2], "workers": [5]}
