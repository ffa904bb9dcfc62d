"""Wall time of `servetune nightly` on the shipped example, stage by stage.

    python benchmarks/nightly_speed.py [--json]

Runs the job twice in fresh folders: first against the vLLM serve defaults (expects exit 0,
a new policy), then with the policy it wrote as the current one (expects exit 10). Stage
times come from the job's own progress messages. Not a test: numbers go to RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "configs/examples/azure-conv-synthetic.csv"
PROFILE = ROOT / "gpu_profiles/h200-llama-3.1-8b.yaml"
SLO = ROOT / "configs/slos/mlperf-llama-3.1-8b-server.yaml"
CURRENT = ROOT / "configs/policies/vllm-serve-defaults.yaml"

STAGES = (("loading", "load"), ("fitting", "fit"), ("optimizing", "optimize"),
          ("simulating", "compare"), ("rendering", "report"), ("writing", "write"))


def timed_run(current: Path, out: Path) -> dict:
    from servetune.apps.nightly import run_nightly

    marks: list[tuple[str, float]] = []

    def progress(text: str) -> None:
        for prefix, name in STAGES:
            if text.startswith(prefix):
                marks.append((name, time.perf_counter()))

    start = time.perf_counter()
    outcome = run_nightly(TRACE, PROFILE, SLO, current, out, progress=progress)
    end = time.perf_counter()
    stages = {}
    for i, (name, t) in enumerate(marks):
        nxt = marks[i + 1][1] if i + 1 < len(marks) else end
        stages[name] = round(nxt - t, 3)
    return {"exit_code": outcome.exit_code, "status": outcome.status,
            "wall_s": round(end - start, 3), "stages_s": stages,
            "gain": outcome.summary.get("gain")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        first = timed_run(CURRENT, Path(tmp) / "first")
        second = timed_run(Path(tmp) / "first" / "policy.yaml", Path(tmp) / "second")
    result = {"machine": platform.processor() or platform.machine(),
              "python": sys.version.split()[0], "first": first, "second": second}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name in ("first", "second"):
            r = result[name]
            print(f"{name}: exit {r['exit_code']} ({r['status']}), {r['wall_s']:.2f} s; "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in r["stages_s"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
