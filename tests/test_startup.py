"""Start-up: the command line registers its commands and prints every help page without
importing the heavy libraries (each import is a property that could fail, not a timing)."""

from __future__ import annotations

import json
import subprocess
import sys

# What a help page must not pay for (the solvers, the simulator's compiler, the schemas,
# the plots, the arrays); the commands import them when they run.
HEAVY = ("numpy", "numba", "llvmlite", "pydantic", "pyomo", "ortools", "highspy",
         "matplotlib", "pandas", "pyarrow", "yaml")


def _heavy_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; the heavy modules it left imported, and what
    it printed as JSON on its last line."""
    probe = (f"{code}\nimport json, sys\n"
             f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True)
    lines = proc.stdout.strip().splitlines()
    return {"heavy": json.loads(lines[-1]), "out": lines[:-1]}


def test_importing_the_cli_imports_no_heavy_library():
    assert _heavy_after("import servetune.cli")["heavy"] == []


def test_every_help_page_imports_no_heavy_library():
    # every command and group of the app, found by walking it (a new command is covered)
    code = """
import contextlib, io
import typer.main
from servetune.cli import app

def paths(cmd, prefix):
    yield prefix
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        yield from paths(sub, [*prefix, name])

pages = 0
for path in paths(typer.main.get_command(app), []):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = app(args=[*path, "--help"], prog_name="servetune", standalone_mode=False)
    assert code in (0, None), (path, code)
    assert "Usage: servetune" in out.getvalue(), (path, out.getvalue()[:200])
    pages += 1
print(pages)
"""
    result = _heavy_after(code)
    assert int(result["out"][-1]) >= 15  # the root, the groups and their commands
    assert result["heavy"] == []
