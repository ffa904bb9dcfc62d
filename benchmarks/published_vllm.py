"""Replay published end-to-end vLLM measurements in servetune's simulator.

    python benchmarks/published_vllm.py                 # table, profiles as shipped
    python benchmarks/published_vllm.py --no-host       # GPU time only (host cost 0)
    python benchmarks/published_vllm.py --sensitivity   # + the unstated settings varied
    python benchmarks/published_vllm.py --json

Each point of ``benchmarks/published_vllm.yaml`` (format in its header) is replayed with
the matching shipped profile, ``vllm serve`` default batching for the GPU, engine vllm,
as the client sent it: ``concurrency`` requests in flight, each finished one replaced at
once (``vllm bench serve --max-concurrency``), by the same closed-loop replay that
``servetune validate`` uses (:func:`servetune.apps.validate.replay`). Lengths with a
``range_ratio`` are drawn uniform in [L(1-r), L(1+r)], seed 0, as vLLM's random dataset
draws them. The table lists predicted against measured for every metric the source
prints and the relative error of each; the summary gives the median and max absolute
error per metric. The target (issue 32) is median <= 5% and max <= 10% on every metric.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from servetune.apps.optimize import gpu_facts
from servetune.apps.validate import replay
from servetune.engines import engine
from servetune.profiles.shipped import load_profile
from servetune.schemas.policy import Policy
from servetune.sim.api import simulate
from servetune.workloads.bench import BenchRun
from servetune.workloads.trace import Trace

HERE = Path(__file__).resolve().parent
DATA = HERE / "published_vllm.yaml"
METRICS = ("ttft_ms", "ttft_median_ms", "tpot_ms", "itl_median_ms", "e2e_ms",
           "output_tok_s", "output_tok_s_ratio")
TARGET = {"median": 5.0, "max": 10.0}


def profile_name(point: dict[str, Any]) -> str:
    tp = int(point.get("tp", 1))
    return f"{point['gpu']}-{point['model']}" + (f"-tp{tp}" if tp > 1 else "")


def serve_defaults(profile: Any, budget: int | None = None) -> Policy:
    """``vllm serve``'s own batching on the profile's GPU (servetune.engines), the token
    budget replaced by ``budget`` if given."""
    batching = engine("vllm").default_batching(gpu_facts(profile))
    return Policy.model_validate({"name": "vllm-serve-defaults", "batching": {
        "max_num_seqs": batching.max_num_seqs,
        "max_num_batched_tokens": budget or batching.max_num_batched_tokens}})


def lengths(workload: dict[str, Any], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and output tokens of every request: fixed, or uniform within the range
    ratio (integers in [L(1-r), L(1+r)])."""
    n = int(workload["requests"])
    r = float(workload.get("range_ratio", 0.0))
    rng = np.random.default_rng(seed)
    out = []
    for key in ("input_tokens", "output_tokens"):
        mid = int(workload[key])
        lo, hi = max(1, int(mid * (1 - r))), max(1, int(mid * (1 + r)))
        out.append(rng.integers(lo, hi + 1, size=n) if hi > lo else np.full(n, mid))
    return out[0].astype(np.int64), out[1].astype(np.int64)


def warm_server(name: str, prompt: np.ndarray, output: np.ndarray, warm: int,
                block_tokens: int) -> Callable[[np.ndarray], tuple[Trace, int]]:
    """The simulated trace for the run's send times (``replay``'s ``trace_of``): every
    prompt its own prefix blocks (random prompts share none), and, if ``warm`` > 0, its
    first ``warm`` prompts served once before the run, so they are in the prefix cache as
    the run starts. That is what a sweep of runs on one server does: vLLM's random
    dataset builds prompt i from the i-th draw of a generator seeded alike in every run
    (``--seed`` 0), and with fixed lengths nothing else is drawn first, so each run repeats
    the previous run's prompts before its new ones."""
    blocks = prompt // block_tokens
    ids = [np.arange(b) + i * (int(blocks.max()) + 1) for i, b in enumerate(blocks)]
    head = [np.zeros(warm), prompt[:warm], np.ones(warm, dtype=np.int64), ids[:warm]]
    start_s = 1e5 if warm else 0.0  # the warm-up is long done, and the engine idle

    def trace_of(send_s: np.ndarray) -> tuple[Trace, int]:
        rows = [np.concatenate([h, r]) for h, r in
                zip(head[:3], (send_s - send_s[0] + start_s, prompt, output), strict=True)]
        every = head[3] + ids
        offsets = np.concatenate([[0], np.cumsum([len(b) for b in every])])
        return Trace(arrival_s=rows[0], prompt_tokens=rows[1].astype(np.int64),
                     output_tokens=rows[2].astype(np.int64), prefix_offsets=offsets,
                     prefix_block_ids=np.concatenate(every).astype(np.int64),
                     prefix_block_tokens=block_tokens, source=name), warm

    return trace_of


def itl_median_s(result: Any, first: int = 0) -> float:
    """Median over every inter-token gap of the requests from row ``first`` on: each
    decode token's gap is the step that produced it (requests decode in consecutive
    steps), so the median of the step durations weighted by the requests in them that
    had their first token before the step began."""
    first_token_s = np.asarray(result.output.first_token_s, dtype=np.float64)
    durations: list[float] = []
    weights: list[int] = []
    for step in result.step_log():
        decodes = sum(1 for rid, _ in step["scheduled"]
                      if rid >= first and first_token_s[rid] <= step["start_s"] + 1e-12)
        each = step.get("step_durations_s", [step["duration_s"]])
        durations.extend(each)
        weights.extend([decodes] * len(each))
    d, w = np.asarray(durations), np.asarray(weights, dtype=float)
    order = np.argsort(d, kind="stable")
    cum = np.cumsum(w[order])
    return float(d[order][np.searchsorted(cum, cum[-1] / 2.0)])


def replay_point(point: dict[str, Any], *, no_host: bool = False,
                 change: dict[str, Any] | None = None,
                 host_s_per_seq: float | None = None) -> dict[str, float]:
    """Predicted metrics of one point (closed loop at its concurrency); ``host_s_per_seq``
    pins that term instead of the engine's default (the fit)."""
    change = dict(change or {})
    profile = load_profile(profile_name(point))
    if no_host:
        profile = profile.model_copy(update={"step_time": profile.step_time.gpu_only()})
    elif host_s_per_seq is not None:
        profile = profile.model_copy(update={"step_time": profile.step_time.model_copy(
            update={"host_s_per_seq": host_s_per_seq})})
    policy = serve_defaults(profile, change.pop("max_num_batched_tokens", None))
    seed = int(change.pop("seed", 0))
    w = {**point["workload"], **change}
    prompt, output = lengths(w, seed)
    n, conc = len(prompt), int(w["concurrency"])
    run = BenchRun(path=point["id"], fmt="published", sha256="", send_s=np.zeros(n),
                   prompt_tokens=prompt, output_tokens=output, ttft_s=np.zeros(n),
                   e2e_s=np.zeros(n), intended_s=np.zeros(n), max_concurrency=conc,
                   request_rate=float("inf"))
    trace_of = warm_server(point["id"], prompt, output, int(w.get("warm_prompts", 0)),
                           profile.block_size)
    rep = replay(run, policy, profile, engine="vllm", trace_of=trace_of)
    span = float(np.nanmax(rep.send_s + rep.e2e_s) - rep.send_s[0])
    # one more simulation at the converged send times, keeping the step log for the ITLs
    trace, first = trace_of(rep.send_s)
    logged = simulate(trace, policy, profile, engine="vllm", step_log=True)
    return {
        "ttft_ms": float(np.nanmean(rep.ttft_s)) * 1e3,
        "ttft_median_ms": float(np.nanmedian(rep.ttft_s)) * 1e3,
        "tpot_ms": float(np.nanmean(rep.tpot_s)) * 1e3,
        "itl_median_ms": itl_median_s(logged, first) * 1e3,
        "e2e_ms": float(np.nanmean(rep.e2e_s)) * 1e3,
        "output_tok_s": float(output.sum()) / span,
        "rounds": rep.rounds,
    }


def run(points: list[dict[str, Any]], *, no_host: bool = False) -> dict[str, Any]:
    predicted = {p["id"]: replay_point(p, no_host=no_host) for p in points}
    rows = []
    errors: dict[str, list[float]] = {k: [] for k in METRICS}
    for point in points:
        pred = predicted[point["id"]]
        row: dict[str, Any] = {"id": point["id"], "profile": profile_name(point),
                               "fitted": point.get("fitted", "")}
        for k in METRICS:
            meas = point.get("measured", {}).get(k)
            if meas is None:
                continue
            if k == "output_tok_s_ratio":
                value = pred["output_tok_s"] / predicted[meas["of"]]["output_tok_s"]
                meas = meas["value"]
            else:
                value = pred[k]
            err = (value / float(meas) - 1.0) * 100.0
            row[k] = {"measured": float(meas), "predicted": round(value, 4),
                      "error_pct": round(err, 2)}
            errors[k].append(abs(err))
        rows.append(row)
    summary = {k: ({"points": len(v), "median_abs_pct": round(float(np.median(v)), 2),
                    "max_abs_pct": round(float(np.max(v)), 2)} if v else {"points": 0})
               for k, v in errors.items()}
    every = [e for v in errors.values() for e in v]
    overall = ({"metrics": len(every), "median_abs_pct": round(float(np.median(every)), 2),
                "max_abs_pct": round(float(np.max(every)), 2)} if every else {})
    return {"host": "off" if no_host else "engine defaults", "rows": rows,
            "summary": summary, "overall": overall, "target": TARGET}


def fit_host(points: list[dict[str, Any]], *, tol_s: float = 0.5e-6) -> dict[str, Any]:
    """vLLM's host seconds per sampled sequence, fitted by bisection so that the metrics
    each point lists under ``fit_metrics`` are met on average (predicted/measured - 1
    summed to zero; every metric grows with the term)."""
    fitted = [(p, k) for p in points for k in p.get("fit_metrics", [])]
    if not fitted:
        raise SystemExit("no point lists fit_metrics")

    def error(h: float) -> float:
        return sum(replay_point(p, host_s_per_seq=h)[k] / float(p["measured"][k]) - 1.0
                   for p, k in fitted)

    lo, hi = 0.0, 2e-3
    if error(lo) >= 0:
        return {"host_s_per_seq": 0.0, "on": [f"{p['id']}:{k}" for p, k in fitted]}
    while hi - lo > tol_s:
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if error(mid) < 0 else (lo, mid)
    return {"host_s_per_seq": round((lo + hi) / 2.0, 7),
            "on": [f"{p['id']}:{k}" for p, k in fitted]}


def sensitivity(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each setting a point's source does not state (its ``vary`` list: a label and the
    workload or budget change) moved on its own, and how much every predicted figure the
    point measures moves (percent)."""
    by_id = {p["id"]: p for p in points}
    out = []
    for point in points:
        if not point.get("vary"):
            continue
        base = replay_point(point)
        for label, change in point["vary"]:
            moved = replay_point(point, change=change)
            row: dict[str, Any] = {"id": point["id"], "setting": label}
            for k, meas in point["measured"].items():
                if k == "output_tok_s_ratio":  # over the other point, which stays put
                    k = "output_tok_s"
                    ref = replay_point(by_id[meas["of"]])["output_tok_s"]
                    row["output_tok_s_ratio"] = round(
                        (moved[k] / ref) / (base[k] / ref) * 100 - 100, 2)
                else:
                    row[k] = round((moved[k] / base[k] - 1) * 100, 2)
            out.append(row)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--no-host", action="store_true", help="GPU time only (host cost 0)")
    ap.add_argument("--sensitivity", action="store_true",
                    help="also vary the settings the sources do not state")
    ap.add_argument("--fit-host", action="store_true",
                    help="fit vLLM's host seconds per sequence on the points' fit_metrics "
                         "(to copy into servetune.engines.VLLM_HOST_S_PER_SEQ)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    points = (yaml.safe_load(Path(args.data).read_text(encoding="utf-8")) or {}).get("points")
    points = points or []
    if args.fit_host:
        fit = fit_host(points)
        print(json.dumps(fit) if args.json else
              f"host_s_per_seq {fit['host_s_per_seq'] * 1e6:.1f} us, fitted on "
              + ", ".join(fit["on"]))
        return 0
    out = run(points, no_host=args.no_host)
    if args.sensitivity:
        out["sensitivity"] = sensitivity(points)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    if not points:
        print(f"{args.data}: no published points to replay")
        return 0
    for row in out["rows"]:
        cells = [f"{row['id']:<22}{'*' if row['fitted'] else ' '} {row['profile']:<24}"]
        for k in METRICS:
            if k in row:
                r = row[k]
                cells.append(f"{k} {r['measured']:.4g}/{r['predicted']:.4g} "
                             f"({r['error_pct']:+.1f}%)")
        print("  ".join(cells))
    print("(measured/predicted; * = a term was fitted on this point: RESULTS.md)")
    for k, s in out["summary"].items():
        if s["points"]:
            print(f"{k}: {s['points']} points, median |err| {s['median_abs_pct']}%, "
                  f"max {s['max_abs_pct']}%")
    if out["overall"]:
        o = out["overall"]
        print(f"all: {o['metrics']} figures, median |err| {o['median_abs_pct']}%, "
              f"max {o['max_abs_pct']}%")
    for s in out.get("sensitivity", []):
        moves = ", ".join(f"{k} {v:+.2f}%" for k, v in s.items() if k not in ("id", "setting"))
        print(f"sensitivity {s['id']}: {s['setting']}: {moves}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
