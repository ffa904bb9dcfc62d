"""pyproject.toml's bounds and constraints.txt's pins agree: every direct dependency is
pinned, and every pin is inside its bound (so `pip install -c constraints.txt` resolves)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_constraints_pin_every_direct_dependency_within_its_bounds():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[_norm(name)] = version.strip()
    for spec in [*project["dependencies"], *project["optional-dependencies"]["dev"]]:
        req = Requirement(spec)
        assert _norm(req.name) in pins, f"{req.name} is not pinned in constraints.txt"
        assert req.specifier.contains(pins[_norm(req.name)]), (req.name, pins[_norm(req.name)])
        assert any(s.operator == "<" for s in req.specifier), f"{req.name} has no upper bound"


def test_ci_and_readme_install_with_the_constraints():
    assert "-c constraints.txt" in (REPO / ".ci" / "run").read_text()
    readme = (REPO / "README.md").read_text()
    assert readme.count("pip install -c constraints.txt -e") >= 2
