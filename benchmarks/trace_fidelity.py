"""Trace fidelity: does the goodput measured on a sample of the workload fitted to a trace
match the goodput of replaying that trace?

For each real trace (Azure 2023 code and conversation, Mooncake synthetic as the
long-context trace) and SLO set, a stretch of the trace (the whole trace by default, else
its first ``--requests`` rows) is fitted (``fit_workload``, ``arrival_process="auto"``)
and compared two ways: "before" = the stationary fit (``rate_windows_s=None``: bursts and
length copula, no slow rate profile or length drift: the fit before the two-timescale
model) and "after" = today's ``auto`` fit (the block bootstrap where its rule fires, else
the parametric classes; the rule's evidence is recorded per trace). ``--fits auto`` runs
the new fit only; the table then takes "before" from an earlier run's JSON (``--before``,
its "auto" column, matched by trace, SLO and policy). A short stretch is a poor judge:
p99 TTFT over 3000 requests is set by ~30 requests, i.e. by one or two bursts, so the
default is the whole trace (8,818, 19,365 and 3,993 rows). Two policies are measured, on
the H200 Llama-3.1-8B profile: the vLLM engine defaults and the policy ``optimize`` chooses
given the stretch itself (default space, seed 0). Goodput is the same search on every side
(``Evaluator`` on exactly that many requests, no longer samples;
``find_goodput`` from rate scale 1, factor 2, 2% tolerance): (a) replaying the stretch
time-scaled, (b) on a sample of the same size from each fitted workload (seeds
``--seeds``; the ratio reported first is seed 0's, then the median over the seeds).
The long-context trace cannot meet either MLPerf TTFT limit, so it runs with a relaxed
SLO (p99 TTFT 10 s, TPOT 100 ms) as ``optimizer_quality.py`` does.

Usage: python benchmarks/trace_fidelity.py [--out benchmarks/trace_fidelity.json]
       [--cases code,conv,long] [--requests 0 (whole trace)] [--seeds 0,1,2,3]
       [--fits stationary,auto]
       python benchmarks/trace_fidelity.py --table benchmarks/trace_fidelity.json
       [--before benchmarks/trace_fidelity_two_timescale.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
CASES = {
    "code": ("AzureLLMInferenceTrace_code.csv", ("server", "interactive")),
    "conv": ("AzureLLMInferenceTrace_conv.csv", ("server", "interactive")),
    "long": ("mooncake_synthetic_trace.jsonl.gz", ("relaxed",)),
}
RELAXED = {"apiVersion": "servetune/v1", "kind": "SLOSet", "name": "relaxed-long-context",
           "classes": {"default": {"ttft_s": 10.0, "tpot_s": 0.1, "percentile": 99}}}
FITS = ("stationary", "auto")  # before (no slow profile), after


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "trace_fidelity.json"))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--requests", type=int, default=0, help="first rows; 0: whole trace")
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--fits", default=",".join(FITS))
    ap.add_argument("--slos", default="", help="only these SLO sets (default: the case's)")
    ap.add_argument("--table", help="print the markdown table of a results JSON and exit")
    ap.add_argument("--before", help="with --table: take 'before' from this JSON's 'auto'")
    args = ap.parse_args()
    if args.table:
        data = json.loads(Path(args.table).read_text())
        if args.before:
            old = {(c["trace"], c["slo"], c["policy"]): c
                   for c in json.loads(Path(args.before).read_text())["cases"]}
            for c in data["cases"]:
                prev = old.get((c["trace"], c["slo"], c["policy"]))
                if prev is not None and "stationary" not in c:
                    c["stationary"] = prev["auto"]
        print(render_table(data))
        return
    fits = [f for f in args.fits.split(",") if f]

    from servetune.apps.optimize import gpu_facts, optimize
    from servetune.errors import InfeasibleError
    from servetune.profiles.shipped import load_profile
    from servetune.schemas.base import document_from_data, load_document
    from servetune.schemas.policy import Policy
    from servetune.schemas.slo import SLOSet
    from servetune.schemas.space import apply_knobs
    from servetune.sim.evaluator import Evaluator
    from servetune.solvers import baselines
    from servetune.solvers.loop import find_goodput
    from servetune.workloads.fitting import (
        bootstrap_evidence,
        bootstrap_stratum_s,
        fit_workload,
        sample_trace,
    )
    from servetune.workloads.formats import load_trace

    profile = load_profile(REPO / "gpu_profiles" / "h200-llama-3.1-8b.yaml")
    defaults_knobs, _ = baselines.engine_default_knobs("vllm", gpu_facts(profile))
    defaults = apply_knobs(Policy(), defaults_knobs.as_dotted())
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []

    def goodput(trace, policy, slo) -> float:
        sim = Evaluator(trace, profile, slo)
        return find_goodput(sim, policy, start_scale=1.0, factor=2.0, rel_tol=0.02).rate_per_s

    for key in args.cases.split(","):
        fname, slo_names = CASES[key]
        path = SHARED / "traces" / fname
        if not path.exists():
            print(f"skip {fname}: {path} not present")
            continue
        stretch = load_trace(path)
        if args.requests > 0:
            stretch = stretch.head(args.requests)
        fitted = {"stationary": fit_workload(stretch, rate_windows_s=None),
                  "auto": fit_workload(stretch)}
        fitted = {f: fitted[f] for f in fits}
        models = {f: _describe(w) for f, w in fitted.items()}
        # what auto decided the bootstrap on (counts and lengths, no goodput)
        stratum = bootstrap_stratum_s(stretch.duration_s, 60.0)
        evidence = None if stratum is None else _evidence(bootstrap_evidence(
            stretch, fit_workload(stretch, arrival_process="parametric"), 60.0, stratum))
        samples = {f: [sample_trace(w, n_requests=len(stretch), seed=s) for s in seeds]
                   for f, w in fitted.items()}
        for sname in slo_names:
            if args.slos and sname not in args.slos.split(","):
                continue
            if sname == "relaxed":
                slo = document_from_data(RELAXED, SLOSet, "relaxed")
            else:
                slo = load_document(
                    REPO / "configs" / "slos" / f"mlperf-llama-3.1-8b-{sname}.yaml", SLOSet)
            print(f"== {key} x {sname}", flush=True)
            t0 = time.perf_counter()
            policies = {"defaults": defaults}
            try:
                policies["chosen"] = optimize(stretch, profile, slo, seed=0).policy
            except InfeasibleError as err:
                print("  optimize infeasible:", err)
            opt_s = time.perf_counter() - t0
            for pname, policy in policies.items():
                case = {"trace": key, "file": fname, "requests": len(stretch),
                        "span_s": stretch.duration_s, "slo": sname, "policy": pname,
                        "optimize_wall_s": opt_s if pname == "chosen" else None,
                        "bootstrap_evidence": evidence,
                        "trace_goodput": goodput(stretch, policy, slo)}
                for f in fits:
                    g = [goodput(s, policy, slo) for s in samples[f]]
                    tg = case["trace_goodput"]
                    ratios = [x / tg if tg > 0 else None for x in g]
                    case[f] = {"model": models[f], "goodput": g, "ratios": ratios,
                               "ratio_seed0": ratios[0],
                               "ratio_median": (statistics.median(ratios)
                                                if None not in ratios else None)}
                print(" ", json.dumps(case), flush=True)
                rows.append(case)
            Path(args.out).write_text(json.dumps(
                {"machine": f"{platform.node()} {platform.machine()} "
                            f"{platform.python_version()}",
                 "date": time.strftime("%Y-%m-%d"), "seeds": seeds, "cases": rows}, indent=1))


def _evidence(ev: dict) -> dict:
    worst = max(ev["variance_time"], key=lambda c: c["excess"])
    return {"modulated": ev["modulated"],
            "variance_time_worst": {k: round(v, 3) for k, v in worst.items()},
            "variance_time_misfit": ev["variance_time_misfit"],
            "top_prompts": ev["top_prompts"],
            "top_prompt_chi2": round(ev["top_prompt_chi2"], 2),
            "top_prompt_limit": round(ev["top_prompt_limit"], 2),
            "top_prompts_clustered": ev["top_prompts_clustered"]}


def _describe(workload) -> str:
    boot = workload.block_bootstrap
    if boot is not None:
        return (f"block bootstrap, {len(boot.block_counts)} x {boot.block_s:g} s blocks in "
                f"{boot.n_strata} x {boot.stratum_s:g} s strata")
    cls = workload.classes["default"]
    a = cls.arrival
    text = a.process if a.process == "poisson" else f"{a.process} CV {a.interarrival_cv:.2f}"
    if a.modulation is not None:
        text += f" + {len(a.modulation.levels)} levels x {a.modulation.window_s:g} s"
    if a.windows is not None:
        m = a.windows.rate_multipliers
        flat = max(m) == min(m)
        text += (f"; {len(m)} x {a.windows.window_s:.0f} s windows"
                 f" ({'flat rate' if flat else f'rate {min(m):.2f}-{max(m):.2f}'})")
    shift = cls.length_shift
    if shift is not None:
        for what, d in (("prompt", shift.prompt), ("output", shift.output)):
            if d is not None:
                text += f", {what} shift {min(d):+.2f}..{max(d):+.2f}"
    r = cls.prompt_output_correlation
    return text + (f"; lengths r {r:+.2f}" if r is not None else "; lengths independent")


def _r(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def render_table(data: dict) -> str:
    """One row per trace x SLO x policy (markdown)."""
    out = [
        "| trace (stretch) | SLO | policy | trace goodput req/s | before: model | "
        "before: fitted/trace seed 0 (median) [range] | after: model | "
        "after: fitted/trace seed 0 (median) [range] |",
        "|---|---|---|---:|---|---:|---|---:|",
    ]
    for c in data["cases"]:
        cells = []
        for f in FITS:
            if f not in c:
                cells.append("- | -")
                continue
            d = c[f]
            rng = [r for r in d["ratios"] if r is not None]
            cells.append(f"{d['model']} | {_r(d['ratio_seed0'])} ({_r(d['ratio_median'])}) "
                         f"[{_r(min(rng) if rng else None)}-{_r(max(rng) if rng else None)}]")
        out.append(
            f"| {c['trace']} ({c['requests']} rows, {c['span_s']:.0f} s) | {c['slo']} | "
            f"{c['policy']} | {c['trace_goodput']:.3g} | {cells[0]} | {cells[1]} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
