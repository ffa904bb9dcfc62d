"""Benchmark: peak memory of ``servetune simulate`` on long traces, with and without a timeline.

Writes synthetic Azure-format CSV traces (``benchmarks/trace_load.py``'s generator: Poisson
arrivals at 5.5 req/s, log-normal lengths, seed 0; the shipped H200 Llama-3.1-8B profile
serves that rate with room to spare) of 2,000,000 and 200,000 requests into a temporary
folder, then runs, each in a fresh child process::

    servetune simulate --trace T.csv --profile h200-llama-3.1-8b
        --policy configs/policies/vllm-serve-defaults.yaml
        [--timeline t.json --timeline-window 600:660] [--records r.csv]

and reports the child's peak resident memory (its VmHWM as it exits), its wall time, and
the size of what it wrote. The runs without a
timeline show what the timeline adds; the two trace lengths show how memory grows with
the trace. Baseline rows: ``servetune --help`` (the interpreter and its imports) and a 2,000-request
run (the simulator's imports: numba, the compiled kernel).

Usage (from the repo root)::

    python benchmarks/sim_memory.py [--requests 2000000 200000] [--window 600:660]
        [--skip-records] [--checkout OTHER_WORKTREE] [--json OUT.json]

Prints a markdown table for benchmarks/RESULTS.md ("## Simulator memory").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_load import write_csv  # noqa: E402  (the benchmark folder is not a package)

PROFILE = "h200-llama-3.1-8b"
POLICY = REPO / "configs" / "policies" / "vllm-serve-defaults.yaml"
# The CLI in a child that reports its peak RSS (VmHWM: since its exec; ru_maxrss would
# include the parent's high-water mark at the fork on Linux) on its way out.
CHILD = r"""
import atexit, sys
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            sys.stderr.write(f"\nVmHWM_KiB {line.split()[1]}\n")
atexit.register(peak)
from servetune.cli import main
main()
"""
SERVETUNE = [sys.executable, "-c", CHILD]


CHECKOUT = REPO  # the servetune source the children run (--checkout)


def measure(args: list[str], outputs: list[Path]) -> dict:
    """Run ``args`` as a child; its peak RSS (MiB), wall time (s), outputs' sizes (MiB)."""
    for path in outputs:
        path.unlink(missing_ok=True)
    with tempfile.TemporaryFile() as out_fh, tempfile.TemporaryFile() as err_fh:
        t0 = time.perf_counter()
        env = {**os.environ, "NUMBA_NUM_THREADS": "1", "PYTHONPATH": str(CHECKOUT)}
        child = subprocess.Popen(args, cwd=CHECKOUT, stdout=out_fh, stderr=err_fh, env=env)
        child.wait()
        out_fh.seek(0)
        err_fh.seek(0)
        out, err = out_fh.read(), err_fh.read()
        wall = time.perf_counter() - t0
    lines = err.decode(errors="replace").strip().splitlines()
    peak = [int(line.split()[1]) / 1024 for line in lines if line.startswith("VmHWM_KiB ")]
    if child.returncode != 0:
        tail = [line for line in lines if line and not line.startswith("VmHWM_KiB ")][-1:]
        return {"error": f"exit {child.returncode}: {(tail or ['failed'])[0]}", "wall_s": wall,
                "peak_rss_mib": peak[0] if peak else None}
    result = {"peak_rss_mib": peak[0], "wall_s": wall,
              "outputs_mib": {p.name: p.stat().st_size / 2**20 for p in outputs}}
    for line in out.decode(errors="replace").splitlines():
        if "engine steps" in line:
            result["steps"] = int(line.split()[-1].replace(",", ""))
    return result


def simulate_args(trace: Path, folder: Path, window: str | None, records: bool
                  ) -> tuple[list[str], list[Path]]:
    args = [*SERVETUNE, "simulate", "--trace", str(trace), "--profile", PROFILE,
            "--policy", str(POLICY)]
    outputs = []
    if window is not None:
        timeline = folder / "t.json"
        args += ["--timeline", str(timeline), "--timeline-window", window]
        outputs.append(timeline)
    if records:
        path = folder / "records.csv"
        args += ["--records", str(path)]
        outputs.append(path)
    return args, outputs


def machine() -> dict:
    lscpu = shutil.which("lscpu")
    head = (subprocess.run([lscpu], capture_output=True, text=True).stdout.splitlines()[:12]
            if lscpu else [])
    return {"nproc": os.cpu_count(), "lscpu": head, "python": platform.python_version(),
            "load_average": os.getloadavg()[0],
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[2_000_000, 200_000])
    ap.add_argument("--window", default="600:660")
    ap.add_argument("--skip-records", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--checkout", type=Path, default=REPO,
                    help="the servetune source tree to measure (e.g. an older worktree)")
    args = ap.parse_args()
    global CHECKOUT
    CHECKOUT = args.checkout.resolve()
    results: dict = {"machine": machine(), "window": args.window, "checkout": str(CHECKOUT),
                     "runs": []}
    # compile (or load the numba cache) outside the measurements
    with tempfile.TemporaryDirectory(prefix="sim_memory.") as tmp:
        folder = Path(tmp)
        small = folder / "warm.csv"
        write_csv(small, 2_000, compress=False)
        warm_args, warm_out = simulate_args(small, folder, args.window, True)
        measure(warm_args, warm_out)
        results["runs"].append({"what": "servetune --help (the interpreter and imports)",
                                **measure([*SERVETUNE, "--help"], [])})
        warm = measure(*simulate_args(small, folder, args.window, False))
        results["runs"].append({"what": "--timeline-window (baseline: numba, profile)",
                                "requests": 2_000, **warm})
        for n in args.requests:
            trace = folder / f"trace_{n}.csv"
            t0 = time.perf_counter()
            write_csv(trace, n, compress=False)
            print(f"wrote {n:,} requests in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            variants = [("--timeline-window", args.window, False), ("plain", None, False)]
            if not args.skip_records:
                variants.append(("--records", None, True))
            for label, window, records in variants:
                run_args, outputs = simulate_args(trace, folder, window, records)
                run = measure(run_args, outputs)
                run.update(what=label, requests=n, trace_mib=trace.stat().st_size / 2**20)
                results["runs"].append(run)
                print(json.dumps(run), file=sys.stderr)
            trace.unlink()
    m = results["machine"]
    print(f"machine: {m['nproc']} cores, Python {m['python']}, load average at start "
          f"{m['load_average']:.1f}; {m['date']}")
    print("| requests | run | peak RSS | wall | steps | output |")
    print("|---:|---|---:|---:|---:|---:|")
    for run in results["runs"]:
        n = f"{run['requests']:,}" if "requests" in run else "-"
        if "error" in run:
            print(f"| {n} | {run['what']} | failed: {run['error']} | | | |")
            continue
        outputs = ", ".join(f"{k} {v:.2f} MiB" for k, v in run["outputs_mib"].items()) or "-"
        steps = f"{run['steps']:,}" if "steps" in run else "-"
        print(f"| {n} | {run['what']} | {run['peak_rss_mib']:.0f} MiB | {run['wall_s']:.1f} s "
              f"| {steps} | {outputs} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
