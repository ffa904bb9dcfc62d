"""A built wheel is usable on its own (slow: ``pytest -m slow tests/test_wheel.py``).

Builds the wheel from a copy of the sources (``pip wheel --no-deps``: pip fetches the build
backend into an isolated build environment from the configured index), installs it with
``--no-deps`` into a temporary folder, and runs the ``servetune`` it installs, with that
folder first on ``PYTHONPATH`` (the dependencies come from the running interpreter's
environment), from an empty working directory, so that nothing of the checkout is in reach:

- ``servetune profile show h200-llama-3.1-8b`` (the ``--help`` example) prints the shipped
  profile;
- ``servetune optimize quickstart`` runs the shipped quick-start job by name, its relative
  paths resolved inside the package data (a small budget: ``--max-simulations 8 --requests
  300``).

Takes about 30 s on 2 cores (build 5 s, install 1 s, profile show 1 s, optimize ~20 s,
most of it numba compiling the simulator for the fresh install).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "README.md", "servetune", "models", "solvers", "gpu_profiles",
           "configs")


def _run(args: list[str], cwd: Path, env: dict[str, str] | None = None,
         timeout: float = 600) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=timeout, check=False)
    assert res.returncode == 0, f"{' '.join(args)}\n{res.stdout}\n{res.stderr}"
    return res


@pytest.mark.slow
def test_wheel_installs_and_runs_the_shipped_examples(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        else:
            shutil.copy2(path, src / name)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)],
         cwd=tmp_path)
    wheels = list(dist.glob("servetune-*.whl"))
    assert len(wheels) == 1, wheels
    site = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
          "--target", str(site), str(wheels[0])], cwd=tmp_path)
    assert (site / "servetune" / "_data" / "gpu_profiles" / "h200-llama-3.1-8b.yaml").is_file()
    assert (site / "servetune" / "_data" / "configs" / "jobs" / "quickstart.yaml").is_file()

    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    cli = [sys.executable, str(site / "bin" / "servetune")]

    where = _run([sys.executable, "-c", "import servetune, servetune.shipped_data as s; "
                  "print(servetune.__file__); print(s.profiles_dir())"], cwd=empty, env=env)
    module, profiles = where.stdout.split()
    assert Path(module).is_relative_to(site), module  # the wheel's, not the checkout's
    assert Path(profiles) == site / "servetune" / "_data" / "gpu_profiles"

    show = _run([*cli, "profile", "show", "h200-llama-3.1-8b"], cwd=empty, env=env)
    assert "h200-llama-3.1-8b" in show.stdout
    assert "KV pool" in show.stdout

    opt = _run([*cli, "optimize", "quickstart", "-o", "policy.yaml", "--max-simulations", "8",
                "--requests", "300", "--quiet"], cwd=empty, env=env)
    assert "wrote policy.yaml" in opt.stdout
    assert "max_num_seqs" in (empty / "policy.yaml").read_text(encoding="utf-8")
    assert sorted(p.name for p in empty.iterdir()) == ["policy.yaml"]
