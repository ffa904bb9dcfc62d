"""Start-up: the command line registers its commands and prints every help page without
importing the heavy libraries (each import is a property that could fail, not a timing)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

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


# ------------------------------------------------------------------ the kernel cache


def test_the_cache_root_follows_the_environment(monkeypatch, tmp_path):
    from servetune.sim.kernel_cache import cache_root

    for name in ("SERVETUNE_CACHE_DIR", "NUMBA_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "servetune" / "numba"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the spec: absolute only
    assert cache_root() == tmp_path / "home" / ".cache" / "servetune" / "numba"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "servetune" / "numba"
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "nb"))
    assert cache_root() == tmp_path / "nb"
    monkeypatch.setenv("SERVETUNE_CACHE_DIR", str(tmp_path / "st"))
    assert cache_root() == tmp_path / "st" / "numba"


def _package_copy(root: Path) -> Path:
    """A copy of the servetune package under ``root`` (a clone elsewhere on disk)."""
    import servetune

    shutil.copytree(Path(servetune.__file__).parent, root / "servetune",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return root


# Run in a copy: compile (or load) the timeline replay, the simulator's smallest cached
# kernel, and say whether numba compiled it, what it computed and where the cache is.
_REPLAY = """
import json
import numpy as np
import servetune
from servetune.sim import _replay
from servetune.sim.compile_notice import compile_notice
from servetune.sim.kernel_cache import kernel_cache_dir
said = []
phase = np.array([0, 2, 4], dtype=np.int64)
phase_s = np.array([0.0, 1.0, 2.0])
ints = np.zeros((3, 5), dtype=np.int64)
times = np.zeros((3, 2))
with compile_notice(said.append):
    k = _replay.close_all(phase, phase_s, 5.0, 0.0, 10.0, ints, times)
print(json.dumps({"package": servetune.__file__, "compiled": len(said), "k": int(k),
                  "ints": ints.tolist(), "times": times.tolist(),
                  "dir": str(kernel_cache_dir())}))
"""


def _run_in(copy: Path, cache: Path, code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "PYTHONPATH")}
    env["SERVETUNE_CACHE_DIR"] = str(cache)
    proc = subprocess.run([sys.executable, "-c", code], cwd=copy, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.get("package", str(copy)).startswith(str(copy))  # the copy, not the repo
    return out


def test_a_clone_elsewhere_loads_the_kernels_another_compiled(tmp_path):
    cache = tmp_path / "cache"
    first = _run_in(_package_copy(tmp_path / "a"), cache, _REPLAY)
    second = _run_in(_package_copy(tmp_path / "b"), cache, _REPLAY)
    assert first["compiled"] == 1 and second["compiled"] == 0  # b compiled nothing
    assert first["dir"] == second["dir"]
    assert Path(first["dir"]).parent == cache / "numba"
    assert any(Path(first["dir"]).glob("_replay.close_all-*.nbc"))
    drop = ("compiled", "package")
    assert {k: v for k, v in first.items() if k not in drop} == \
        {k: v for k, v in second.items() if k not in drop}
    assert first["k"] == 2 and first["ints"][0][:3] == [0, 1, 2]


def test_an_edit_of_any_kernel_source_starts_a_new_cache(tmp_path):
    from servetune.sim.kernel_cache import KERNEL_SOURCES

    where = "import json; from servetune.sim.kernel_cache import kernel_cache_dir; " \
            "print(json.dumps({'dir': str(kernel_cache_dir())}))"
    cache = tmp_path / "cache"
    base = _run_in(_package_copy(tmp_path / "same"), cache, where)["dir"]
    # the step-time formula and the engine ids are compiled into the kernel, too
    assert {"sim/_kernel.py", "profiles/steptime.py", "engines.py"} <= set(KERNEL_SOURCES)
    for k, name in enumerate(KERNEL_SOURCES):
        copy = _package_copy(tmp_path / f"edit{k}")
        with open(copy / "servetune" / name, "a") as fh:
            fh.write("\n# an edit\n")
        assert _run_in(copy, cache, where)["dir"] != base, name
