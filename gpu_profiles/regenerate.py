"""Rebuild every shipped profile in this folder from the calibration CSVs beside it.

    python gpu_profiles/regenerate.py          # rewrite the YAML files
    python gpu_profiles/regenerate.py --check  # exit 1 if any file would change

Deterministic: the same CSVs give the same bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from servetune.io import write_text_atomic
from servetune.profiles.build import derive_profile, fit_profile, profile_header
from servetune.schemas.base import document_to_yaml

HERE = Path(__file__).resolve().parent
H200 = HERE / "calibration" / "h200"

MEASURED = [  # (file stem, model, tp)
    ("h200-llama-3.1-8b", "llama-3.1-8b", 1),
    ("h200-qwen2.5-32b", "qwen2.5-32b", 1),
]
DERIVED = [  # (file stem, model, gpu, tp)
    ("h100-80gb-llama-3.1-8b", "llama-3.1-8b", "h100-80gb", 1),
    ("a100-80gb-llama-3.1-8b", "llama-3.1-8b", "a100-80gb", 1),
    ("a100-40gb-llama-3.1-8b", "llama-3.1-8b", "a100-40gb", 1),
    ("l40s-llama-3.1-8b", "llama-3.1-8b", "l40s", 1),
    ("h100-80gb-llama-3.1-70b-tp4", "llama-3.1-70b", "h100-80gb", 4),
    ("h100-80gb-llama-3.1-70b-tp8", "llama-3.1-70b", "h100-80gb", 8),
    ("h200-llama-3.1-70b-tp4", "llama-3.1-70b", "h200", 4),
    ("h200-llama-3.1-70b-tp8", "llama-3.1-70b", "h200", 8),
]


def build() -> dict[Path, str]:
    out: dict[Path, str] = {}
    for stem, model, tp in MEASURED:
        profile, _ = fit_profile(H200, model, tensor_parallel=tp, name=stem,
                                 paths_relative_to=HERE)
        out[HERE / f"{stem}.yaml"] = document_to_yaml(profile, header=profile_header(profile))
    for stem, model, gpu, tp in DERIVED:
        profile = derive_profile(H200, model, gpu, tensor_parallel=tp, name=stem,
                                 paths_relative_to=HERE)
        out[HERE / f"{stem}.yaml"] = document_to_yaml(profile, header=profile_header(profile))
    return out


def main(argv: list[str]) -> int:
    files = build()
    if "--check" in argv:
        stale = [p.name for p, text in files.items()
                 if not p.is_file() or p.read_text(encoding="utf-8") != text]
        if stale:
            print("out of date: " + ", ".join(stale))
            return 1
        print(f"{len(files)} profiles up to date")
        return 0
    for path, text in files.items():
        write_text_atomic(path, text)
        print(f"wrote {path.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
