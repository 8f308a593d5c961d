"""Issue 10 B9: every third-party package the gateway imports is declared, with an upper bound."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _imported_top_level(package: Path) -> set[str]:
    names: set[str] = set()
    for file in package.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"gateway", "loadtests", "__future__"}


def _declared(section: list[str]) -> dict[str, str]:
    found = {}
    for requirement in section:
        m = re.match(r"([A-Za-z0-9_.-]+)(.*)", requirement)
        assert m is not None
        found[m.group(1).lower().replace("_", "-")] = m.group(2)
    return found


def test_every_imported_package_is_declared_with_a_tested_range() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = _declared(project["dependencies"])
    distributions = packages_distributions()
    missing = []
    for module in sorted(_imported_top_level(REPO / "gateway")):
        dists = {d.lower().replace("_", "-") for d in distributions.get(module, [module])}
        if not dists & set(declared):
            missing.append(f"{module} ({', '.join(sorted(dists))})")
    assert not missing, f"imported by gateway/ but not declared in [project.dependencies]: {missing}"
    for name, spec in declared.items():
        assert ">=" in spec and "<" in spec.replace("<=", ""), f"{name}: declare a tested range, got {spec!r}"
