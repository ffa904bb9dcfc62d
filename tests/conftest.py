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


def workload_from_yaml_text(text: str, source: str) -> Workload:
    """A Workload from YAML text, parsed and validated as ``load_workload`` does a file."""
    return document_from_data(parse_yaml_text(text, source), Workload, source)
