"""Loading GPU profiles: from a path, or by name from the shipped ``gpu_profiles/``."""

from __future__ import annotations

import os
from pathlib import Path

from servetune.errors import ServetuneError
from servetune.schemas.base import load_document
from servetune.schemas.profile import Profile

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "gpu_profiles"


def shipped_profiles() -> list[str]:
    """Names (file stems) of the profiles shipped in ``gpu_profiles/``."""
    if not SHIPPED_DIR.is_dir():
        return []
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.yaml"))


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Load a profile YAML; a bare name such as ``h200-llama-3.1-8b`` that is not an
    existing file resolves to the shipped profile of that name."""
    p = Path(path)
    if not p.exists() and p.parent == Path(".") and p.suffix not in (".yaml", ".yml"):
        shipped = SHIPPED_DIR / f"{p.name}.yaml"
        if shipped.is_file():
            p = shipped
        else:
            names = ", ".join(shipped_profiles()) or "none"
            raise ServetuneError(f"{path}: no such file or shipped profile (shipped: {names})")
    return load_document(p, Profile)
