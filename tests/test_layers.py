"""Import layers: no module imports a layer above its own.

The layers, highest first: ``cli -> apps -> solvers -> models -> core`` and
``apps -> sim -> core``. A module may import its own layer and those below it:

- ``cli``: anything;
- ``apps``: solvers, models, sim, core;
- ``solvers``: models, core (not sim: the simulator is the apps' to call);
- ``models``: core;
- ``sim``: core (not solvers or models: the models are checked against it, not built on it);
- ``core``: core only. Core is every other module of the package: schemas, profiles,
  workloads, export, errors, io, and the shared tables (knobs, engines, ...).

Within core, the two families of domain modules keep apart: the profile modules live in
``servetune/profiles/`` and the trace/workload modules in ``servetune/workloads/``; neither
family imports the other, and no other core module imports both.

Every import counts: top level, inside functions, and under ``TYPE_CHECKING`` (a type-only
import still ties the layers together), and so does a module named in a string (what
``importlib.import_module`` or a preload list will import). The checker reads the source
with ``ast``; nothing is imported. A failure lists each offending import as
``file:line``. One more check keeps the command line's start-up free of the heavy
libraries (solvers, numba, matplotlib).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Where each top-level package's source lives (pyproject.toml's package-dir).
SOURCE_ROOTS = {
    "servetune": REPO / "servetune",
    "servetune.models": REPO / "models",
    "servetune.solvers": REPO / "solvers",
}
LAYER_PACKAGES = {
    "servetune.cli": "cli",
    "servetune.apps": "apps",
    "servetune.solvers": "solvers",
    "servetune.models": "models",
    "servetune.sim": "sim",
}
MAY_IMPORT = {
    "cli": {"cli", "apps", "solvers", "models", "sim", "core"},
    "apps": {"apps", "solvers", "models", "sim", "core"},
    "solvers": {"solvers", "models", "core"},
    "models": {"models", "core"},
    "sim": {"sim", "core"},
    "core": {"core"},
}
FAMILIES = ("servetune.profiles", "servetune.workloads")


@dataclass(frozen=True)
class Import:
    path: str  # file, relative to the repository
    line: int
    importer: str  # module name
    target: str  # module name imported (a submodule when ``from pkg import submodule``)

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def layer_of(module: str) -> str | None:
    """The layer of a ``servetune`` module; None for a module outside the package."""
    if module != "servetune" and not module.startswith("servetune."):
        return None
    for package, layer in LAYER_PACKAGES.items():
        if module == package or module.startswith(package + "."):
            return layer
    return "core"


def family_of(module: str) -> str | None:
    for package in FAMILIES:
        if module == package or module.startswith(package + "."):
            return package
    return None


def package_modules() -> dict[str, Path]:
    """Every module of the package by name, from the source roots."""
    out: dict[str, Path] = {}
    for root_name, root in SOURCE_ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([root_name, *parts])] = path
    return out


def imports_of(source: str, module: str, path: str, known: set[str]) -> list[Import]:
    """Every ``servetune`` import in ``source`` (the module named ``module``), wherever it
    stands; ``from pkg import name`` counts as importing ``pkg.name`` when that is one of
    the ``known`` modules."""
    is_package = path.endswith("__init__.py")
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            # a module named in a string (``importlib.import_module``, an engine row's
            # "module:function", a worker's preload list): the module it names
            named = named_module(node.value, known)
            if named is None:
                continue
            targets = [named]
        else:
            continue
        for target in dict.fromkeys(targets):
            if layer_of(target) is not None:
                out.append(Import(path, node.lineno, module, target))
    return out


def named_module(text: str, known: set[str]) -> str | None:
    """The longest ``known`` module that ``text`` names ("pkg.mod", "pkg.mod.attr" or
    "pkg.mod:function"); None when it names none."""
    name = text.split(":", 1)[0]
    if not name.startswith("servetune.") or not name.replace(".", "").replace("_", "").isalnum():
        return None
    parts = name.split(".")
    for k in range(len(parts), 1, -1):
        candidate = ".".join(parts[:k])
        if candidate in known:
            return candidate
    return None


def layer_violations(imports: list[Import]) -> list[str]:
    """One line per import of a layer the importer may not import."""
    out = []
    for imp in imports:
        mine, theirs = layer_of(imp.importer), layer_of(imp.target)
        assert mine is not None and theirs is not None
        if theirs not in MAY_IMPORT[mine]:
            allowed = ", ".join(sorted(MAY_IMPORT[mine]))
            out.append(f"{imp.where()}: {imp.importer} ({mine}) imports {imp.target} "
                       f"({theirs}); {mine} may import only {allowed}")
    return out


def family_violations(imports: list[Import]) -> list[str]:
    """Imports that mix the core families: a family importing the other, or a core module
    outside both importing from both (each of its imports of the second family listed)."""
    out = []
    seen: dict[str, dict[str, Import]] = {}  # importer -> family -> first import
    for imp in imports:
        if layer_of(imp.importer) != "core":
            continue
        own, theirs = family_of(imp.importer), family_of(imp.target)
        if theirs is None or theirs == own:
            continue
        if own is not None:
            out.append(f"{imp.where()}: {imp.importer} ({own}) imports {imp.target} "
                       f"({theirs}); the families stay apart")
            continue
        first = seen.setdefault(imp.importer, {})
        first.setdefault(theirs, imp)
        if len(first) > 1 and first[theirs] is imp:
            other = next(i for f, i in first.items() if f != theirs)
            out.append(f"{imp.where()}: {imp.importer} imports {imp.target} and, at "
                       f"{other.where()}, {other.target}: one core module, two families")
    return out


def strays(modules: dict[str, Path]) -> list[str]:
    """Modules outside a family package named like one of its modules (a copy left
    behind, or a family module in the wrong place)."""
    out = []
    for family in FAMILIES:
        names = {m.rpartition(".")[2] for m in modules if m.startswith(family + ".")}
        for m, path in modules.items():
            if layer_of(m) == "core" and family_of(m) is None and m.rpartition(".")[2] in names:
                out.append(f"{path.relative_to(REPO)}: {m} is named like a module of "
                           f"{family}; move it there")
    return out


@pytest.fixture(scope="module")
def package_imports() -> list[Import]:
    modules = package_modules()
    known = set(modules)
    out = []
    for name, path in modules.items():
        out += imports_of(path.read_text(encoding="utf-8"), name,
                          str(path.relative_to(REPO)), known)
    return out


# ------------------------------------------------------------------- the package


def test_the_checker_sees_every_layer(package_imports):
    modules = package_modules()
    assert {layer_of(m) for m in modules} == set(MAY_IMPORT)
    assert "servetune.solvers.loop" in modules and "servetune.models.fluid" in modules
    # function-level imports are seen too (the CLI imports its pipelines lazily)
    assert any(i.importer.startswith("servetune.cli.") and layer_of(i.target) == "apps"
               for i in package_imports)


def test_no_module_imports_a_higher_layer(package_imports):
    bad = layer_violations(package_imports)
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_core_families_keep_apart(package_imports):
    bad = family_violations(package_imports) + strays(package_modules())
    assert not bad, "core families mixed:\n" + "\n".join(bad)


def test_the_command_line_starts_without_the_heavy_libraries():
    """`servetune --help` and every command's start-up load none of the solvers, the JIT
    or the plotting library: the command modules import them where they are used."""
    heavy = ("pyomo", "ortools", "numba", "matplotlib", "highspy", "torch", "optuna")
    code = ("import sys, servetune.cli; "
            f"print(' '.join(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO)
    assert out.stdout.split() == []


# ---------------------------------------------------------- the checker itself


SIM_SOURCE = '''\
from __future__ import annotations
from typing import TYPE_CHECKING
import numpy as np
from servetune.schemas.policy import Policy
if TYPE_CHECKING:
    from servetune.models.fluid import Knobs
def run():
    from servetune.solvers.loop import search
    from . import engine
    from ..apps import optimize
    return search
'''
KNOWN = {"servetune.sim.engine", "servetune.apps.optimize", "servetune.solvers.loop",
         "servetune.models.fluid", "servetune.schemas.policy"}


def test_checker_reports_each_upward_import_with_file_and_line():
    imports = imports_of(SIM_SOURCE, "servetune.sim.fake", "servetune/sim/fake.py", KNOWN)
    assert [(i.line, i.target) for i in imports] == [
        (4, "servetune.schemas.policy"), (6, "servetune.models.fluid"),
        (8, "servetune.solvers.loop"), (9, "servetune.sim.engine"),
        (10, "servetune.apps.optimize"),
    ]
    bad = layer_violations(imports)
    assert [b.split(": ")[0] for b in bad] == [
        "servetune/sim/fake.py:6", "servetune/sim/fake.py:8", "servetune/sim/fake.py:10",
    ]
    assert bad[1] == ("servetune/sim/fake.py:8: servetune.sim.fake (sim) imports "
                      "servetune.solvers.loop (solvers); sim may import only core, sim")


def test_checker_sees_modules_named_in_strings():
    source = ('import importlib\n'
              'EXPORTER = "servetune.export.vllm:export"\n'
              'PRELOAD = ["servetune.apps.optimize", "servetune.sim.api.simulate"]\n'
              'def load():\n'
              '    return importlib.import_module("servetune.solvers.loop")\n'
              'NOTE = "servetune.apps is where the pipelines live"\n')
    known = {"servetune.export.vllm", "servetune.apps.optimize", "servetune.sim.api",
             "servetune.solvers.loop", "servetune.apps"}
    imports = imports_of(source, "servetune.fake", "servetune/fake.py", known)
    assert [(i.line, i.target) for i in imports] == [
        (2, "servetune.export.vllm"), (3, "servetune.apps.optimize"),
        (3, "servetune.sim.api"), (5, "servetune.solvers.loop")]
    assert [b.split(": ")[0] for b in layer_violations(imports)] == [
        "servetune/fake.py:3", "servetune/fake.py:3", "servetune/fake.py:5"]


def test_checker_allows_downward_imports():
    source = "from servetune.models import fluid\nimport servetune.io\nfrom servetune import sim\n"
    known = {"servetune.models.fluid", "servetune.io", "servetune.sim"}
    imports = imports_of(source, "servetune.apps.fake", "servetune/apps/fake.py", known)
    assert [i.target for i in imports] == ["servetune.models.fluid", "servetune.io",
                                           "servetune.sim"]
    assert layer_violations(imports) == []
    core = imports_of(source, "servetune.fake", "servetune/fake.py", known)
    assert [b.split(" imports ")[1].split(" ")[0] for b in layer_violations(core)] == [
        "servetune.models.fluid", "servetune.sim",
    ]


def test_checker_finds_mixed_families():
    source = ("from servetune.profiles.steptime import StepTimeModel\n"
              "from servetune.workloads.trace import Trace\n")
    known = {"servetune.profiles.steptime", "servetune.workloads.trace"}
    mixed = imports_of(source, "servetune.fake", "servetune/fake.py", known)
    assert family_violations(mixed) == [
        "servetune/fake.py:2: servetune.fake imports servetune.workloads.trace and, at "
        "servetune/fake.py:1, servetune.profiles.steptime: one core module, two families"
    ]
    crossing = imports_of(source, "servetune.profiles.fake", "servetune/profiles/fake.py",
                          known)
    assert [b.split(": ")[0] for b in family_violations(crossing)] == [
        "servetune/profiles/fake.py:2"
    ]
    one_family = imports_of(source.splitlines()[0], "servetune.schemas.fake",
                            "servetune/schemas/fake.py", known)
    assert family_violations(one_family) == []


def test_strays_name_a_family_module_outside_its_package():
    modules = {"servetune.workloads.trace": REPO / "servetune/workloads/trace.py",
               "servetune.trace": REPO / "servetune/trace.py",
               "servetune.sim.trace": REPO / "servetune/sim/trace.py"}
    assert strays(modules) == [
        "servetune/trace.py: servetune.trace is named like a module of servetune.workloads; "
        "move it there"
    ]


def test_the_schemas_sit_below_the_families(package_imports):
    """The documents import neither family: profiles and workloads build on the schemas,
    never the other way round (a Profile document is the profiles family's own)."""
    bad = [f"{i.where()}: {i.importer} imports {i.target}" for i in package_imports
           if i.importer.startswith("servetune.schemas") and family_of(i.target) is not None]
    assert not bad, "schemas above a family:\n" + "\n".join(bad)
