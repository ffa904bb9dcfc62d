"""Shared test helpers: paths to the repo and to ../shared."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

from servetune.schemas.base import document_from_data, parse_yaml_text
from servetune.schemas.workload import Workload

# CI runs the property tests on a fixed sequence of examples, so a red build is
# reproducible and never depends on the day's random draw; locally they explore freely.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# Commands run their simulations in this process unless a test asks for workers: the
# machine's cores are the test runner's, and tests/test_executor.py checks the backends.
os.environ.setdefault("SERVETUNE_WORKERS", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
TRACES = SHARED / "traces"
MEASUREMENTS = SHARED / "gpu_measurements" / "h200"


def shared_file(*parts: str) -> Path:
    """A file under ../shared, or skip the test with the reason."""
    path = SHARED.joinpath(*parts)
    if not path.exists():
        pytest.skip(f"{path} not present (../shared is not checked out beside the repo)")
    return path


def output_names(folder: Path) -> list[str]:
    """The names a user sees in an output folder (``ls``): its outputs, without the
    ``current`` link and hidden entries (``.generations``) of its output sets."""
    return sorted(p.name for p in folder.iterdir()
                  if not p.name.startswith(".") and p.name != "current")


def workload_from_yaml_text(text: str, source: str) -> Workload:
    """A Workload from YAML text, parsed and validated as ``load_workload`` does a file."""
    return document_from_data(parse_yaml_text(text, source), Workload, source)


def assert_data_close(got, want, *, rel: float = 1e-6, abs_tol: float = 0.0, path: str = ""):
    """Nested data (dicts, lists, numbers) equal, floats within ``rel`` (and ``abs_tol``):
    computed values from a refit differ in their last bits across numpy/HiGHS versions
    and CPUs, and a coefficient that is 0 on one machine is 1e-17 on another."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), path
        for key in want:
            assert_data_close(got[key], want[key], rel=rel, abs_tol=abs_tol,
                              path=f"{path}.{key}")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_data_close(g, w, rel=rel, abs_tol=abs_tol, path=f"{path}[{i}]")
    elif isinstance(want, float) or isinstance(got, float):
        assert got == pytest.approx(want, rel=rel, abs=abs_tol), path
    else:
        assert got == want, path
