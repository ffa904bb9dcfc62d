"""Benchmark: load time and peak memory of a large Azure-format CSV trace.

Writes a synthetic N-row CSV in the Azure 2023 / week-long format (``TIMESTAMP`` with 7
fractional digits, ``ContextTokens``, ``GeneratedTokens``), then loads it with
``servetune.workloads.formats.load_trace`` in a fresh child process and reports wall time and
the child's peak resident memory (VmHWM), next to the same child's memory after
importing servetune only (the baseline), and the CPU seconds (user + system) of the load,
which depend less than wall time on other work sharing the machine. The loader holds the
output columns (24 bytes a row: float64 arrival, int64 prompt, int64 output) plus one
4 MiB chunk's temporaries.

Usage: python benchmarks/trace_load.py [--rows 10000000] [--gzip] [--keep PATH]
[--reader auto|own|both]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# Peak memory is VmHWM from /proc (it starts afresh at exec; ru_maxrss would inherit the
# parent's high-water mark on Linux).
CHILD = r"""
import json, os, sys, time
import servetune.workloads.formats as formats
from servetune.workloads.formats import load_trace
if sys.argv[2] == "own":  # this project's reader whatever the size
    formats.ARROW_MIN_BYTES = 1 << 62
from servetune.workloads.stats import trace_stats
def hwm_kib():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
base = hwm_kib()
c0, t0 = os.times(), time.perf_counter()
trace = load_trace(sys.argv[1])
load_s, c1 = time.perf_counter() - t0, os.times()
cpu_s = (c1.user - c0.user) + (c1.system - c0.system)
peak = hwm_kib()
stats = trace_stats(trace)
print(json.dumps({"load_s": load_s, "cpu_s": cpu_s, "baseline_rss_mib": base / 1024,
                  "peak_rss_mib": peak / 1024,
                  "requests": stats["requests"], "rate_per_s": stats["rate_per_s"],
                  "column_mib": (trace.arrival_s.nbytes + trace.prompt_tokens.nbytes
                                 + trace.output_tokens.nbytes) / 2**20}))
"""


def write_csv(path: Path, rows: int, *, compress: bool, seed: int = 0) -> None:
    """Azure-format rows: Poisson arrivals at 5.5 req/s, log-normal lengths."""
    rng = np.random.default_rng(seed)
    opener = gzip.open if compress else open
    start = np.datetime64("2024-05-10T00:00:00", "ns")
    t_ns = 0
    with opener(path, "wt", newline="") as fh:
        fh.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        block = 1_000_000
        for lo in range(0, rows, block):
            n = min(block, rows - lo)
            gaps = (rng.exponential(1 / 5.5, n) * 1e7).astype(np.int64) * 100  # 100 ns ticks
            ns = t_ns + np.cumsum(gaps)
            t_ns = int(ns[-1])
            stamps = np.datetime_as_string(start + ns.astype("timedelta64[ns]"), unit="ns")
            prompt = np.maximum(rng.lognormal(6.7, 1.0, n), 1).astype(np.int64)
            output = np.maximum(rng.lognormal(4.9, 0.9, n), 1).astype(np.int64)
            lines = [
                f"{s[:10]} {s[11:27]},{p},{o}\n"
                for s, p, o in zip(stamps.tolist(), prompt.tolist(), output.tolist(), strict=True)
            ]
            fh.write("".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--gzip", action="store_true", help="write and load a .csv.gz")
    parser.add_argument("--keep", type=Path, help="write the CSV here and keep it")
    parser.add_argument("--reader", choices=("auto", "own", "both"), default="auto",
                        help="auto: pyarrow's for large CSVs when installed; own: this "
                             "project's; both: one child each, own first")
    args = parser.parse_args()
    tmp = None
    if args.keep is not None:
        path = args.keep
    else:
        tmp = tempfile.TemporaryDirectory()
        path = Path(tmp.name) / ("trace.csv.gz" if args.gzip else "trace.csv")
    if not path.exists():
        t0 = time.perf_counter()
        write_csv(path, args.rows, compress=args.gzip)
        print(f"wrote {args.rows:,} rows, {path.stat().st_size / 2**20:,.0f} MiB in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)
    for reader in (("own", "auto") if args.reader == "both" else (args.reader,)):
        out = subprocess.run([sys.executable, "-c", CHILD, str(path), reader], check=True,
                             capture_output=True, text=True, env=dict(os.environ))
        result = json.loads(out.stdout)
        result["reader"] = reader
        result["file_mib"] = path.stat().st_size / 2**20
        result["rows_per_s"] = result["requests"] / result["load_s"]
        print(json.dumps(result, indent=2))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
