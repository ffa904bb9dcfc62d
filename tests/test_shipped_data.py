"""The shipped data (profiles, calibration CSVs, example configs): where
:mod:`servetune.shipped_data` finds it in this (editable) install, that pyproject.toml ships
all of it as package data, and that every shipped profile and job is listed and found by
name. ``tests/test_wheel.py`` (slow) checks the same from a built wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from servetune.cli import app
from servetune.errors import ServetuneError
from servetune.profiles.shipped import SHIPPED_DIR, load_profile, shipped_profiles
from servetune.schemas.base import load_document
from servetune.schemas.job import OptimizeJob
from servetune.shipped_data import (
    DATA_FOLDERS,
    DATA_PACKAGE,
    configs_dir,
    data_dir,
    jobs_dir,
    profiles_dir,
    shipped_job,
    shipped_job_names,
    shipped_profile,
    shipped_profile_names,
)

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]
runner = CliRunner()


def test_editable_install_finds_the_checkout_folders():
    assert profiles_dir() == REPO / "gpu_profiles"
    assert configs_dir() == REPO / "configs"
    assert jobs_dir() == REPO / "configs" / "jobs"
    assert SHIPPED_DIR == profiles_dir()
    for folder in DATA_FOLDERS:
        assert data_dir(folder).is_dir()
    with pytest.raises(ValueError):
        data_dir("notebooks")


@pytest.mark.parametrize("folder", DATA_FOLDERS)
def test_pyproject_maps_each_folder_into_the_package(folder):
    package = f"{DATA_PACKAGE}.{folder}"
    assert SETUPTOOLS["package-dir"][package] == folder
    assert package in SETUPTOOLS["packages"]


@pytest.mark.parametrize("folder", DATA_FOLDERS)
def test_package_data_globs_cover_every_shipped_file(folder):
    """What setuptools puts in the wheel (the package-data globs, relative to the folder)
    is every file of the folder but Python scripts and caches."""
    root = REPO / folder
    patterns = SETUPTOOLS["package-data"][f"{DATA_PACKAGE}.{folder}"]
    shipped = {p for pattern in patterns for p in root.glob(pattern) if p.is_file()}
    wanted = {
        p for p in root.rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    }
    assert sorted(map(str, wanted - shipped)) == []
    assert any(p.suffix == ".csv" for p in shipped)


def test_every_shipped_profile_is_listed_and_found_by_name():
    names = sorted(p.stem for p in (REPO / "gpu_profiles").glob("*.yaml"))
    assert "h200-llama-3.1-8b" in names
    assert shipped_profile_names() == names == shipped_profiles()
    for name in names:
        assert shipped_profile(name) == REPO / "gpu_profiles" / f"{name}.yaml"
        assert load_profile(name).name
    with pytest.raises(ServetuneError) as err:
        load_profile("no-such-gpu")
    for name in names:
        assert name in str(err.value)


def test_every_shipped_job_is_listed_and_its_paths_resolve():
    names = sorted(p.stem for p in (REPO / "configs" / "jobs").glob("*.yaml"))
    assert "quickstart" in names
    assert shipped_job_names() == names
    for name in names:
        path = shipped_job(name)
        assert path == REPO / "configs" / "jobs" / f"{name}.yaml"
        job = load_document(path, OptimizeJob)
        for value in (job.trace, job.workload, job.profile, job.slo, job.space):
            if value is not None:
                p = path.parent / value
                assert p.is_file() or shipped_profile(value) is not None, (name, value)


def test_bare_names_only():
    assert shipped_job("configs/jobs/quickstart.yaml") is None
    assert shipped_job("quickstart.yaml") is None
    assert shipped_job("") is None
    assert shipped_profile("gpu_profiles/h200-llama-3.1-8b") is None
    assert shipped_profile("no-such-gpu") is None


def test_optimize_unknown_job_name_lists_the_shipped_jobs(tmp_path):
    res = runner.invoke(app, ["optimize", "no-such-job", "-o", str(tmp_path / "p.yaml")])
    assert res.exit_code != 0
    assert "no such file or shipped job" in res.output
    for name in shipped_job_names():
        assert name in res.output
    # a path that is not there is reported as a missing file, not looked up by name
    res = runner.invoke(app, ["optimize", str(tmp_path / "job.yaml"), "-o",
                              str(tmp_path / "p.yaml")])
    assert res.exit_code != 0
    assert "file not found" in res.output
