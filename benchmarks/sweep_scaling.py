"""A 50-job sweep on 1 worker, 2 local processes and a local Ray with 2 CPUs (issue 17).

The sweep: two shipped Llama-3.1-8B profiles (H200, H100) x the Azure 2023 conversation
workload x the MLPerf server SLOs x 25 seeds, each job an ``optimize`` with the random
baseline on a 100-request sample and a budget of 4 simulations (a job takes 1-3 s). Each
backend runs ``servetune sweep`` as a user would (a fresh process, a fresh output folder;
the wall time includes start-up), and the jobs' files must be the same, byte for byte,
on every backend. A one-job sweep on each backend gives its fixed cost (start-up: the
interpreter, the fork server or Ray).

Run: python benchmarks/sweep_scaling.py [--jobs 50] [--json out.json]
(Ray is skipped, with a note, when it is not installed: pip install 'servetune[ray]'.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
SERVETUNE = [str(Path(sys.executable).parent / "servetune")]  # the console script

BACKENDS = {
    "serial (--workers 1)": ["--workers", "1"],
    "processes (--workers 2)": ["--workers", "2"],
    "ray local, 2 CPUs (--ray local --workers 2)": ["--ray", "local", "--workers", "2"],
}


def sweep_text(profiles: list[str], seeds: int) -> str:
    return f"""apiVersion: servetune/v1
kind: Sweep
name: scaling
defaults: {{requests: 100, max_simulations: 4, method: random}}
products:
  - command: optimize
    profiles: [{', '.join(profiles)}]
    workloads: [{CONFIGS / 'workloads' / 'azure-conv-2023.yaml'}]
    slos: [{CONFIGS / 'slos' / 'mlperf-llama-3.1-8b-server.yaml'}]
    seeds: [{', '.join(str(s) for s in range(seeds))}]
"""


def job_files(out: Path) -> dict[str, bytes]:
    return {f"{d.name}/{f.name}": f.read_bytes()
            for d in sorted((out / "jobs").iterdir())
            for f in sorted(d.iterdir()) if not f.name.startswith(".") and f.name != "current"}


def run(sweep: Path, out: Path, flags: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if k != "SERVETUNE_WORKERS"}
    start = time.perf_counter()
    proc = subprocess.run([*SERVETUNE, "sweep", str(sweep), "--out-dir", str(out), "-q",
                           *flags], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"servetune sweep {' '.join(flags)} failed ({proc.returncode}): "
                 f"{proc.stderr.strip()}")
    return wall


def ray_installed() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=50, help="jobs in the sweep (even)")
    ap.add_argument("--json", type=Path, help="write the numbers here")
    args = ap.parse_args()
    backends = dict(BACKENDS)
    if not ray_installed():
        print("note: ray is not installed; its rows are skipped", file=sys.stderr)
        backends = {k: v for k, v in backends.items() if "ray" not in k}
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="sweep-scaling-") as tmp:
        folder = Path(tmp)
        big, one = folder / "big.yaml", folder / "one.yaml"
        big.write_text(sweep_text(["h200-llama-3.1-8b", "h100-80gb-llama-3.1-8b"],
                                  args.jobs // 2))
        one.write_text(sweep_text(["h200-llama-3.1-8b"], 1))
        # warm the numba cache and the page cache, so no backend pays the compile
        run(one, folder / "warm", ["--workers", "1"])
        reference = None
        for label, flags in backends.items():
            key = flags[0].strip("-") + (flags[-1] if flags[0] == "--workers" else "")
            fixed = run(one, folder / f"one-{key}", flags)
            wall = run(big, folder / f"big-{key}", flags)
            files = job_files(folder / f"big-{key}")
            if reference is None:
                reference = files
            identical = files == reference
            results[label] = {"one_job_s": round(fixed, 1), "sweep_s": round(wall, 1),
                              "identical_to_serial": identical,
                              # other work on the machine skews the ratios: say how much
                              "load_average_1min_after": round(os.getloadavg()[0], 2)}
            print(f"{label}: {args.jobs} jobs {wall:.1f} s (one-job sweep {fixed:.1f} s); "
                  f"job files identical to serial: {identical}", flush=True)
    serial = next(iter(results.values()))["sweep_s"]
    for row in results.values():
        row["speedup"] = round(serial / row["sweep_s"], 2)
    meta = {"date": date.today().isoformat(), "machine": f"{os.cpu_count()} CPUs, "
            f"{platform.processor() or platform.machine()}, Python {platform.python_version()}",
            "jobs": args.jobs}
    print(json.dumps({"meta": meta, "results": results}, indent=2))
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
