"""Replay published end-to-end vLLM measurements in servetune's simulator.

    python benchmarks/published_vllm.py                 # table, profiles as shipped
    python benchmarks/published_vllm.py --no-host       # GPU time only (host cost 0)
    python benchmarks/published_vllm.py --json

Each point of ``benchmarks/published_vllm.yaml`` (format in its header) is replayed with
the matching shipped profile, ``vllm serve`` default batching for the GPU, engine vllm:
``concurrency`` requests are kept in flight (each finished request is replaced by the next
one when it finishes, as ``vllm bench serve --max-concurrency`` does) until ``requests``
have been sent. The table lists predicted vs measured mean TTFT, TPOT, end-to-end latency
and output throughput and the relative error of each; the summary gives the median and
max absolute error per metric. The target (issue 13) is median <= 5% and max <= 10%.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from servetune.profiles.shipped import load_profile
from servetune.schemas.policy import Policy
from servetune.sim.api import simulate
from servetune.workloads.trace import from_arrays

HERE = Path(__file__).resolve().parent
DATA = HERE / "published_vllm.yaml"
METRICS = ("ttft_ms", "tpot_ms", "e2e_ms", "output_tok_s")
TARGET = {"median": 5.0, "max": 10.0}


def profile_name(point: dict[str, Any]) -> str:
    tp = int(point.get("tp", 1))
    return f"{point['gpu']}-{point['model']}" + (f"-tp{tp}" if tp > 1 else "")


def replay(point: dict[str, Any], *, no_host: bool = False) -> dict[str, float]:
    """Predicted means of one point's workload (closed loop at its concurrency)."""
    profile = load_profile(profile_name(point))
    if no_host:
        profile = profile.model_copy(update={"step_time": profile.step_time.gpu_only()})
    w = point["workload"]
    n, conc = int(w["requests"]), int(w["concurrency"])
    prompt, output = int(w["input_tokens"]), int(w["output_tokens"])
    # Closed loop: simulate wave by wave; a request's slot frees when it finishes, so its
    # successor arrives then. Iterate arrivals to a fixed point (a few passes suffice:
    # each pass fixes the finish times of one more wave).
    arrival = np.zeros(n)
    for _ in range(max(1, int(np.ceil(n / conc))) + 1):
        trace = from_arrays(arrival, np.full(n, prompt), np.full(n, output))
        result = simulate(trace, Policy(), profile, engine="vllm")
        m = result.metrics
        finish = arrival + m.e2e_s
        nxt = arrival.copy()
        nxt[conc:] = np.sort(finish)[: n - conc] if n > conc else nxt[conc:]
        if np.allclose(nxt, arrival):
            break
        arrival = nxt
    span = float(np.max(arrival + m.e2e_s) - np.min(arrival))
    return {
        "ttft_ms": float(np.nanmean(m.ttft_s)) * 1e3,
        "tpot_ms": float(np.nanmean(m.tpot_s)) * 1e3,
        "e2e_ms": float(np.nanmean(m.e2e_s)) * 1e3,
        "output_tok_s": n * output / span,
    }


def run(points: list[dict[str, Any]], *, no_host: bool = False) -> dict[str, Any]:
    rows = []
    errors: dict[str, list[float]] = {k: [] for k in METRICS}
    for point in points:
        pred = replay(point, no_host=no_host)
        row: dict[str, Any] = {"id": point["id"], "profile": profile_name(point)}
        for k in METRICS:
            meas = point.get("measured", {}).get(k)
            if meas is None:
                continue
            err = (pred[k] / float(meas) - 1.0) * 100.0
            row[k] = {"measured": float(meas), "predicted": round(pred[k], 3),
                      "error_pct": round(err, 2)}
            errors[k].append(abs(err))
        rows.append(row)
    summary = {k: ({"points": len(v), "median_abs_pct": round(float(np.median(v)), 2),
                    "max_abs_pct": round(float(np.max(v)), 2)} if v else {"points": 0})
               for k, v in errors.items()}
    return {"host": "off" if no_host else "engine defaults", "rows": rows,
            "summary": summary, "target": TARGET}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--no-host", action="store_true", help="GPU time only (host cost 0)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    points = (yaml.safe_load(Path(args.data).read_text(encoding="utf-8")) or {}).get("points")
    points = points or []
    out = run(points, no_host=args.no_host)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    if not points:
        print(f"{args.data}: no published points to replay")
        return 0
    for row in out["rows"]:
        cells = [f"{row['id']:<28} {row['profile']:<28}"]
        for k in METRICS:
            if k in row:
                r = row[k]
                cells.append(f"{k} {r['measured']:.4g}/{r['predicted']:.4g} "
                             f"({r['error_pct']:+.1f}%)")
        print("  ".join(cells))
    for k, s in out["summary"].items():
        if s["points"]:
            print(f"{k}: {s['points']} points, median |err| {s['median_abs_pct']}%, "
                  f"max {s['max_abs_pct']}%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
