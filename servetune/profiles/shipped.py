"""Loading GPU profiles (from a path, or by name from the shipped ``gpu_profiles/``: where
that lives is :mod:`servetune.shipped_data`'s to know),
checking that one leaves a KV pool, and summarising one (``servetune profile show``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from servetune.errors import ServetuneError
from servetune.profiles.schema import Profile
from servetune.profiles.steptime import prefill_attn_pairs
from servetune.schemas.base import load_document
from servetune.shipped_data import profiles_dir, shipped_profile, shipped_profile_names

#: The shipped profiles' folder (package data of a wheel, or the checkout's gpu_profiles/).
SHIPPED_DIR = profiles_dir()


def shipped_profiles() -> list[str]:
    """Names (file stems) of the shipped profiles."""
    return shipped_profile_names()


def shipped_or_path(value: str) -> str:
    """A bare shipped-profile name (``h200-llama-3.1-8b``) as its file's path; anything
    else unchanged."""
    shipped = shipped_profile(value)
    return str(shipped) if shipped is not None else value


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """Load a profile YAML; a bare name such as ``h200-llama-3.1-8b`` that is not an
    existing file resolves to the shipped profile of that name."""
    p = Path(path)
    if not p.exists() and p.parent == Path(".") and p.suffix not in (".yaml", ".yml"):
        shipped = shipped_profile(str(p))
        if shipped is not None:
            p = shipped
        else:
            names = ", ".join(shipped_profiles()) or "none"
            raise ServetuneError(f"{path}: no such file or shipped profile (shipped: {names})")
    return load_document(p, Profile)


SUMMARY_SHAPES: tuple[tuple[str, int, int, int], ...] = (
    # label, decode seqs, context per seq, prefill chunk tokens
    ("decode 1 seq @ 1k ctx", 1, 1024, 0),
    ("decode 32 seqs @ 2k ctx", 32, 2048, 0),
    ("decode 128 seqs @ 2k ctx", 128, 2048, 0),
    ("decode 256 seqs @ 1k ctx", 256, 1024, 0),
    ("prefill 512", 0, 0, 512),
    ("prefill 2048", 0, 0, 2048),
    ("prefill 8192", 0, 0, 8192),
    ("mixed 64 seqs @ 2k + 2048 chunk", 64, 2048, 2048),
)


def profile_summary(profile: Profile) -> dict[str, Any]:
    """What ``servetune profile show`` prints, as data: name, calibration, memory and the
    step time at each of :data:`SUMMARY_SHAPES`."""
    rows = []
    for label, d, ctx, p in SUMMARY_SHAPES:
        t = d + p
        s = d + (1 if p else 0)
        w = prefill_attn_pairs(p, 0) if p else 0.0
        sec = profile.step_time.seconds(t, s, d, d * ctx, w)
        rows.append({"shape": label, "tokens": t, "step_ms": round(sec * 1e3, 3),
                     "tokens_per_s": round(t / sec, 1)})
    return {
        "name": profile.name,
        "calibration": profile.calibration.kind,
        "source": profile.calibration.source,
        "tensor_parallel": profile.tensor_parallel,
        "memory": profile.memory_summary(),
        "step_time": profile.step_time.model_dump(mode="json"),
        "steps": rows,
    }


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
