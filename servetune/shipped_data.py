"""Where the shipped data lives: the GPU profiles (``gpu_profiles/``, with their calibration
CSVs) and the example configs (``configs/``: jobs, SLOs, spaces, workloads, policies, ...).

The one module that knows. The files stay in the repository's top-level folders;
pyproject.toml's ``package-dir`` maps them into the package as ``servetune._data.gpu_profiles``
and ``servetune._data.configs``, so a wheel holds them under ``servetune/_data/`` and
:mod:`importlib.resources` finds them there. An editable install (``pip install -e .``) has
no ``servetune/_data/``: its import finder maps only folders with Python modules, so the
top-level folders of the checkout beside the package are used instead. Both layouts keep
``configs/`` and ``gpu_profiles/`` side by side, so a job's relative paths
(``../../gpu_profiles/...``) resolve in either.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

#: The shipped folders, as named in the repository (and under ``servetune/_data/``).
DATA_FOLDERS = ("gpu_profiles", "configs")
#: The package each folder is mapped to by pyproject.toml's ``package-dir``.
DATA_PACKAGE = "servetune._data"


def _checkout_root() -> Path:
    """The repository root when the package runs from a checkout (editable install)."""
    return Path(__file__).resolve().parents[1]


def data_dir(folder: str) -> Path:
    """The shipped folder ``gpu_profiles`` or ``configs``: the package data of an installed
    wheel, else the checkout's top-level folder. It may be missing (a broken install);
    callers list nothing then."""
    if folder not in DATA_FOLDERS:
        raise ValueError(f"{folder!r}: not a shipped folder ({', '.join(DATA_FOLDERS)})")
    packaged = resources.files("servetune").joinpath("_data", folder)
    if packaged.is_dir():
        return Path(str(packaged))
    return _checkout_root() / folder


def profiles_dir() -> Path:
    """The shipped GPU profiles (``<name>.yaml``, calibration CSVs under ``calibration/``)."""
    return data_dir("gpu_profiles")


def configs_dir() -> Path:
    """The shipped example configs (``jobs/``, ``slos/``, ``spaces/``, ``workloads/``, ...)."""
    return data_dir("configs")


def jobs_dir() -> Path:
    """The shipped OptimizeJob files (``configs/jobs/<name>.yaml``)."""
    return configs_dir() / "jobs"


def _stems(folder: Path) -> list[str]:
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("*.yaml"))


def shipped_profile_names() -> list[str]:
    """Names (file stems) of the shipped profiles."""
    return _stems(profiles_dir())


def shipped_job_names() -> list[str]:
    """Names (file stems) of the shipped OptimizeJob files."""
    return _stems(jobs_dir())


def _is_bare_name(value: str) -> bool:
    """A bare name (``quickstart``): no folder, no YAML suffix, not an existing file."""
    p = Path(value)
    return (
        bool(value) and not p.exists() and p.parent == Path(".")
        and p.suffix not in (".yaml", ".yml")
    )


def shipped_profile(name: str) -> Path | None:
    """The shipped profile file named ``name`` (``h200-llama-3.1-8b``); None when ``name``
    is not a bare name or no such profile is shipped."""
    if not _is_bare_name(name):
        return None
    path = profiles_dir() / f"{name}.yaml"
    return path if path.is_file() else None


def shipped_job(name: str) -> Path | None:
    """The shipped OptimizeJob file named ``name`` (``quickstart``); None when ``name`` is
    not a bare name or no such job is shipped."""
    if not _is_bare_name(name):
        return None
    path = jobs_dir() / f"{name}.yaml"
    return path if path.is_file() else None
