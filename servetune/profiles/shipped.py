"""Loading GPU profiles: from a path, or by name from the shipped ``gpu_profiles/``."""

from __future__ import annotations

import os
from pathlib import Path

from servetune.errors import ServetuneError
from servetune.schemas.base import load_document
from servetune.schemas.profile import Profile

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "gpu_profiles"


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


def require_kv_pool(profile: Profile, where: str | os.PathLike[str]) -> None:
    """Fail with the memory arithmetic when a profile leaves no usable KV block (the
    model does not fit the GPU at this utilization: vLLM refuses to start then)."""
    if profile.kv_blocks() >= 1:
        return
    mem = profile.memory_summary()
    if "gpu_memory_bytes" not in mem:
        raise ServetuneError(f"{where}: the KV pool has no usable block")
    gib = 2.0**30
    raise ServetuneError(
        f"{where}: {profile.name} leaves no KV cache: GPU memory "
        f"{mem['gpu_memory_bytes'] / gib:.2f} GiB x {mem['gpu_memory_utilization']} - weights "
        f"{mem['weight_bytes_per_gpu'] / gib:.2f} GiB - reserve "
        f"{mem['activation_reserve_bytes'] / gib:.2f} GiB = "
        f"{mem['kv_pool_bytes'] / gib:.2f} GiB; use more tensor parallelism, a GPU with more "
        "memory, or a higher gpu_memory_utilization"
    )
