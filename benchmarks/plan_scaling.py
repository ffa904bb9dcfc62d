"""Cold ``servetune plan`` on 1, 2, ... local worker processes and on a local Ray: wall
time and byte-identity of the plans; and the executor's start-up and overhead per task.

Usage (from the repo root, servetune installed; Ray optional)::

    python benchmarks/plan_scaling.py [--workers 1,2] [--ray] [--quick] [--json-out R.json]

Each plan is a fresh ``servetune plan`` process with an empty capacity cache (a cold plan:
every capacity measured) on the README's example (``configs/fleets/reserved-4types.yaml``,
``configs/forecasts/azure-conv-diurnal-100.yaml``, growth sweep 1,1.5,2,4);
``--quick`` measures capacities with ``--capacity-method candidates`` (four fixed
policies instead of the optimizer: about a tenth of the work). The plans of every
configuration must be the same bytes; the script says so or exits 1.

The overhead part maps one tiny simulation (a 20-request trace on the shipped H200
profile) 64 times on each backend, after a first map that starts every worker, and
reports the start-up (executor and first map) and the time per task: Ray's start-up is
what small work cannot win back.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PLAN_ARGS = [
    "--workload", "configs/workloads/azure-conv-2023.yaml",
    "--forecast", "configs/forecasts/azure-conv-diurnal-100.yaml",
    "--fleet", "configs/fleets/reserved-4types.yaml",
    "--slo", "configs/slos/mlperf-llama-3.1-8b-server.yaml",
    "--growth", "1,1.5,2,4", "-q",
]


def _servetune() -> str:
    exe = Path(sys.executable).with_name("servetune")
    return str(exe) if exe.exists() else "servetune"


def run_plan(backend: list[str], work: Path, quick: bool) -> dict:
    out = work / f"plan-{'-'.join(backend).replace('-', '')}.yaml"
    cache = Path(tempfile.mkdtemp(prefix="capacity-", dir=work))
    cmd = [_servetune(), "plan", *PLAN_ARGS, "-o", str(out), "--cache-dir", str(cache),
           *(["--capacity-method", "candidates"] if quick else []), *backend]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {
        # (no CPU time: the workers are the fork server's children, or Ray's, not the
        # plan process's, so getrusage would miss them)
        "backend": " ".join(backend), "wall_s": round(wall, 2),
        "load_before": round(load, 2), "plan": out.read_bytes(),
        "command": " ".join(cmd[1:]),
    }


def _tiny_simulation(shared: tuple, seed: int) -> float:
    from servetune.sim import simulate

    trace, policy, profile = shared
    return float(simulate(trace, policy, profile, seed=seed).metrics.ttft_s.mean())


def overhead(workers: int, with_ray: bool, tasks: int = 64) -> list[dict]:
    import numpy as np

    from servetune.executor import ProcessExecutor, RayExecutor, SerialExecutor
    from servetune.profiles.shipped import load_profile
    from servetune.schemas.policy import Policy
    from servetune.workloads.trace import from_arrays

    n = 20
    trace = from_arrays(np.arange(n) * 0.05, np.full(n, 200), np.full(n, 20))
    shared = (trace, Policy(), load_profile(REPO / "gpu_profiles" / "h200-llama-3.1-8b.yaml"))
    rows = []
    backends = [("serial", SerialExecutor), (f"processes x{workers}",
                                             lambda: ProcessExecutor(workers))]
    if with_ray:
        backends.append((f"ray local x{workers}", lambda: RayExecutor("local", workers)))
    for name, make in backends:
        started = time.perf_counter()
        with make() as ex:
            # start-up: the executor and a first map that starts (warms) every worker
            ex.map(_tiny_simulation, range(2 * workers), shared=shared)
            start_s = time.perf_counter() - started
            t0 = time.perf_counter()
            got = ex.map(_tiny_simulation, range(tasks), shared=shared)
            per_task = (time.perf_counter() - t0) / tasks
        rows.append({"backend": name, "start_s": round(start_s, 2),
                     "per_task_ms": round(1e3 * per_task, 2), "result_sum": round(sum(got), 9)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    ap.add_argument("--ray", action="store_true", help="also plan on a local Ray")
    ap.add_argument("--quick", action="store_true", help="--capacity-method candidates")
    ap.add_argument("--skip-plans", action="store_true", help="only the overhead part")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    counts = [int(x) for x in args.workers.split(",")]
    report: dict = {"machine": os.uname().nodename, "cores": os.cpu_count(),
                    "date": time.strftime("%Y-%m-%d"), "quick": args.quick, "plans": []}
    with tempfile.TemporaryDirectory(prefix="plan-scaling-") as tmp:
        work = Path(tmp)
        if not args.skip_plans:
            backends = [["--workers", str(n)] for n in counts]
            if args.ray:
                backends.append(["--ray", "local", "--workers", str(max(counts))])
            for backend in backends:
                row = run_plan(backend, work, args.quick)
                report["plans"].append(row)
                print(f"plan {row['backend']:>24}: {row['wall_s']:8.1f} s wall "
                      f"(load average {row['load_before']} before)", flush=True)
            first = report["plans"][0]["plan"] if report["plans"] else b""
            same = all(r["plan"] == first for r in report["plans"])
            report["identical"] = same
            print("plans byte-identical:", same)
            for r in report["plans"]:
                r.pop("plan")
        report["overhead"] = overhead(max(counts), args.ray)
        for r in report["overhead"]:
            print(f"overhead {r['backend']:>16}: start {r['start_s']} s, "
                  f"{r['per_task_ms']} ms per tiny task")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    if not report.get("identical", True):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
