"""Simulator speed benchmark.

Measures, on one core:

1. the full Azure 2023 conversation trace (19,366 requests) with the shipped H200
   Llama-3.1-8B profile and vLLM serve defaults (the default Policy): median wall time of
   5 fast-mode runs after one warm-up run (numba compilation is reported separately);
2. the same input in ``--reference`` mode (step by step, pure Python), once, and the
   fast/reference speed ratio;
3. a 1,000,000-request synthetic workload (a Workload fitted to the conversation trace,
   sampled with seed 0), in a fresh subprocess: simulation time and peak resident memory
   (the process's peak RSS, and its growth over the state just before the run).

Usage (from the repo root)::

    python benchmarks/sim_speed.py [--runs 5] [--skip-reference] [--skip-million]
        [--reference-requests N] [--json OUT.json]

Prints a markdown table for benchmarks/RESULTS.md ("## Simulator").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
CONV = SHARED / "traces" / "AzureLLMInferenceTrace_conv.csv"
PROFILE = "h200-llama-3.1-8b"


def _inputs():
    from servetune.profiles.shipped import load_profile
    from servetune.schemas.policy import Policy
    from servetune.workloads.formats import load_trace

    if not CONV.exists():
        sys.exit(f"{CONV} not found: ../shared must be checked out beside the repo")
    return load_trace(CONV), Policy(name="vllm-serve-defaults"), load_profile(PROFILE)


def bench_trace(runs: int, reference: bool, reference_requests: int | None) -> dict:
    from servetune.sim import simulate

    trace, policy, profile = _inputs()
    out: dict = {"requests": len(trace)}
    t0 = time.perf_counter()
    first = simulate(trace, policy, profile)
    out["first_run_s"] = time.perf_counter() - t0  # includes numba compilation
    summary = first.summary()
    out["accounted"] = summary["completed"] + summary["shed"] + summary["rejected"]
    out["steps"] = summary["steps"]
    walls = []
    for _ in range(runs):
        t0 = time.perf_counter()
        simulate(trace, policy, profile)
        walls.append(time.perf_counter() - t0)
    out["fast_runs_s"] = walls
    out["fast_median_s"] = statistics.median(walls)
    if reference:
        n = reference_requests or len(trace)
        sub = trace.head(n)
        fast_sub = [0.0] * 3
        for i in range(3):
            t0 = time.perf_counter()
            simulate(sub, policy, profile)
            fast_sub[i] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref = simulate(sub, policy, profile, reference=True)
        out["reference_requests"] = n
        out["reference_s"] = time.perf_counter() - t0
        out["reference_steps"] = int(ref.output.steps)
        out["fast_same_input_s"] = statistics.median(fast_sub)
        out["speedup"] = out["reference_s"] / out["fast_same_input_s"]
    return out


def _million_child() -> None:
    """Run in a subprocess: sample 1M requests, simulate them, report time and memory."""
    from servetune.sim import simulate
    from servetune.workloads.fitting import fit_workload, sample_trace

    trace, policy, profile = _inputs()
    workload = fit_workload(trace, name="azure-conv")
    t0 = time.perf_counter()
    big = sample_trace(workload, n_requests=1_000_000, seed=0)
    sample_s = time.perf_counter() - t0
    small = sample_trace(workload, n_requests=2_000, seed=1)
    simulate(small, policy, profile)  # compile outside the measurement
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    result = simulate(big, policy, profile)
    sim_s = time.perf_counter() - t0
    rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    s = result.summary()
    print(json.dumps({
        "requests": s["requests"],
        "completed": s["completed"],
        "steps": s["steps"],
        "simulated_s": float(big.arrival_s[-1]),
        "sample_s": sample_s,
        "sim_s": sim_s,
        "peak_rss_mib": rss_peak / 1024,
        "rss_growth_mib": (rss_peak - rss_before) / 1024,
    }))


def bench_million() -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--million-child"], capture_output=True, text=True,
        check=False, cwd=REPO,
    )
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--skip-million", action="store_true")
    ap.add_argument("--reference-requests", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--million-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.million_child:
        _million_child()
        return
    results = {
        "machine": f"{_cpu_model()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, load average at start {os.getloadavg()[0]:.1f}",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "conv": bench_trace(args.runs, not args.skip_reference, args.reference_requests),
    }
    if not args.skip_million:
        results["million"] = bench_million()
    conv = results["conv"]
    print(f"machine: {results['machine']}; date {results['date']}")
    print("| measurement | value | target |")
    print("|---|---:|---|")
    print(f"| Azure conv: requests accounted | {conv['accounted']:,} / {conv['requests']:,} "
          f"| all |")
    print(f"| Azure conv: engine steps | {conv['steps']:,} | |")
    print(f"| Azure conv: first run incl. numba compile | {conv['first_run_s']:.2f} s | |")
    print(f"| Azure conv: fast mode, median of {args.runs} | {conv['fast_median_s']:.3f} s "
          f"| <= 1 s |")
    if "reference_s" in conv:
        print(f"| reference mode ({conv['reference_requests']:,} requests) | "
              f"{conv['reference_s']:.2f} s | |")
        print(f"| fast / reference speed-up, same input | {conv['speedup']:.1f}x | >= 20x |")
    million = results.get("million")
    if million and "error" not in million:
        print(f"| 1,000,000-request workload ({million['simulated_s'] / 3600:.1f} simulated h) "
              f"| {million['sim_s']:.2f} s | |")
        print(f"| 1M: peak RSS (growth during the run) | {million['peak_rss_mib']:.0f} MiB "
              f"(+{million['rss_growth_mib']:.0f} MiB) | bounded |")
    elif million:
        print(f"| 1,000,000-request workload | failed: {million['error']} | |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
