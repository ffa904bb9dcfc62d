"""Optimizer quality and speed: milp vs the exhaustive grid, random search, Optuna and the
engine defaults, on the shipped workloads with the H200 Llama-3.1-8B profile and both
MLPerf SLO sets, and the long-context workload on the L40S and A100 profiles (KV memory
binds there: the fluid model misses most).

Two runs per workload x SLO set:

1. ``optimize`` as a user runs it (method milp, the default 1,332-point space, widened at
   its edges where that helps, 3000 requests per simulation): its wall time, simulations,
   goodput and the defaults';
2. the comparison on a reduced space (seqs 32..1024 x tokens 512..16384 x chunk cap
   0/512/2048: 105 valid points) and a 2000-request sample, where the exhaustive grid
   (every point, goodput by bracketing and bisection) is affordable: milp, grid, random
   and Optuna (when installed) with milp's simulation budget, the vLLM defaults, and
   SGLang's defaults (``baselines.engine_default_knobs``) in the simulator's SGLang
   admission model. Every simulator, like ``optimize``'s, samples longer at rates where
   the base sample would span less than ``min_window_s`` (TTFT target / 3%).
   The fluid model's goodput prediction is compared with the grid's simulated goodput
   point by point (its error is reported), and milp's own account of the model's error
   on the candidates it simulated (``summary["model_error"]``) is kept.

Long-request lanes are treated the same way for every method: none. The reduced space
pins ``long_requests.threshold_tokens`` to null for milp (a space that lists a
``long_requests.*`` knob fixes the lanes, so ``optimize`` skips its CP-SAT lanes step),
which is the Policy default the grid, random and Optuna candidates carry; all methods
search the same 105 points. The default-space run (1.) keeps the lanes step, as a user
runs it.

Sources: the three shipped workloads (sampled with seed 0), plus the real Azure code
trace replayed directly (its first requests, time-compressed). The long-context workload
cannot meet either MLPerf TTFT limit on one H200 (a 50k-token prompt alone takes more than
2 s to prefill), so it also runs with a relaxed SLO (p99 TTFT 10 s, TPOT 100 ms).

Usage: python benchmarks/optimizer_quality.py [--out benchmarks/optimizer_quality.json]
       [--cases conv,code,code-trace,long,long-l40s,long-a100]
       python benchmarks/optimizer_quality.py --table benchmarks/optimizer_quality.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REDUCED = {
    "batching.max_num_seqs": [32, 64, 128, 256, 512, 1024],
    "batching.max_num_batched_tokens": [512, 1024, 2048, 4096, 8192, 16384],
    "batching.long_prefill_token_threshold": [0, 512, 2048],
}
# What every method searches in the comparison: no long-request lanes (module docstring).
NO_LANES = {"long_requests.threshold_tokens": [None]}
SHARED = REPO.parent / "shared"
H200 = "h200-llama-3.1-8b"
# key -> (source kind, workload or trace, SLO sets, shipped profile)
CASES = {
    "conv": ("workload", "azure-conv-2023", ("server", "interactive"), H200),
    "code": ("workload", "azure-code-2023", ("server", "interactive"), H200),
    "code-trace": ("trace", "AzureLLMInferenceTrace_code.csv", ("server", "interactive"), H200),
    "long": ("workload", "long-context-synthetic", ("server", "interactive", "relaxed"), H200),
    "long-l40s": ("workload", "long-context-synthetic", ("relaxed",), "l40s-llama-3.1-8b"),
    "long-a100": ("workload", "long-context-synthetic", ("relaxed",), "a100-80gb-llama-3.1-8b"),
}
RELAXED = {"apiVersion": "servetune/v1", "kind": "SLOSet", "name": "relaxed-long-context",
           "classes": {"default": {"ttft_s": 10.0, "tpot_s": 0.1, "percentile": 99}}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "optimizer_quality.json"))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--table", help="print the markdown table of a results JSON and exit")
    args = ap.parse_args()
    if args.table:
        data = json.loads(Path(args.table).read_text())
        print(render_table(data))
        print()
        print(render_targets(data))
        return

    from servetune.apps.optimize import gpu_facts, model_error_meta, optimize
    from servetune.errors import InfeasibleError
    from servetune.models.fluid import FluidModel, LoadModel, Platform, knobs_grid, targets_for
    from servetune.profiles.shipped import load_profile
    from servetune.schemas.base import document_from_data, load_document
    from servetune.schemas.policy import Policy
    from servetune.schemas.slo import SLOSet
    from servetune.schemas.space import SearchSpace, apply_knobs
    from servetune.schemas.workload import Workload
    from servetune.sim.api import prepare_trace
    from servetune.sim.evaluator import Evaluator, judging_window_s
    from servetune.solvers import baselines
    from servetune.solvers.loop import find_goodput
    from servetune.workloads.fitting import class_stats
    from servetune.workloads.formats import load_trace

    rows = []
    for key in args.cases.split(","):
        kind, wname, slo_names, profile_name = CASES[key]
        profile = load_profile(REPO / "gpu_profiles" / f"{profile_name}.yaml")
        if kind == "trace":
            path = SHARED / "traces" / wname
            if not path.exists():
                print(f"skip {wname}: {path} not present")
                continue
            workload = load_trace(path)
        else:
            workload = load_document(REPO / "configs" / "workloads" / f"{wname}.yaml", Workload)
        for sname in slo_names:
            if sname == "relaxed":
                slo = document_from_data(RELAXED, SLOSet, "relaxed")
            else:
                slo = load_document(
                    REPO / "configs" / "slos" / f"mlperf-llama-3.1-8b-{sname}.yaml", SLOSet
                )
            case = {"workload": wname, "source": kind, "slo": sname, "profile": profile_name}
            print(f"== {wname} x {sname} on {profile_name}", flush=True)
            # 1. As a user runs it.
            t0 = time.perf_counter()
            try:
                full = optimize(workload, profile, slo, seed=0)
                s = full.summary
                case["full"] = {k: s[k] for k in (
                    "goodput_rate_per_s", "defaults_goodput_rate_per_s", "simulations",
                    "defaults_simulations", "solver_s", "simulation_s", "wall_s", "converged",
                    "space_edges",
                )}
                case["full"]["policy"] = {k: v for k, v in s["policy"].items()
                                          if k.startswith(("batching.", "admission.kv",
                                                           "long_requests.threshold"))}
            except InfeasibleError as err:
                case["full"] = {"infeasible": str(err),
                                "wall_s": time.perf_counter() - t0}
            print("  full:", case["full"], flush=True)

            # 2. The comparison on the reduced space.
            space = SearchSpace(name="reduced", knobs={**REDUCED, **NO_LANES})
            res: dict[str, dict] = {}
            t0 = time.perf_counter()
            try:
                # The space as given, as the grid searches it: no widening at its edges.
                milp = optimize(workload, profile, slo, space, n_requests=args.requests,
                                seed=0, widen_edges=False)
                res["milp"] = {
                    "goodput_rate_per_s": milp.summary["goodput_rate_per_s"],
                    "simulations": milp.summary["simulations"],
                    "wall_s": milp.summary["wall_s"],
                    "model_error": model_error_meta(milp.summary["model_error"]),
                }
                res["defaults"] = {
                    "goodput_rate_per_s": milp.summary["defaults_goodput_rate_per_s"],
                    "simulations": milp.summary["defaults_simulations"],
                }
                budget = milp.summary["simulations"]
            except InfeasibleError as err:
                res["milp"] = {"goodput_rate_per_s": 0.0, "infeasible": str(err),
                               "simulations": err.details["summary"]["simulations"],
                               "wall_s": time.perf_counter() - t0}
                budget = max(res["milp"]["simulations"], 1)
            sample = (workload.head(args.requests) if kind == "trace"
                      else prepare_trace(workload, seed=0, n_requests=args.requests))
            points = knobs_grid(REDUCED)
            base = Policy()

            def make_policy(k, base=base):
                return apply_knobs(base, k.as_dotted())

            window = judging_window_s(slo, 0.03)

            def simulator(engine="vllm", sample=sample, workload=workload, slo=slo,
                          profile=profile,
                          window=window):
                # As optimize does: longer samples of the same source at high rates.
                return Evaluator(sample, profile, slo, engine=engine, source=workload,
                                      seed=0, min_window_s=window)

            sim = simulator()
            t0 = time.perf_counter()
            grid = baselines.grid_search(points, make_policy, sim, rel_tol=0.03)
            res["grid"] = {"goodput_rate_per_s": grid.goodput_rate_per_s,
                           "simulations": grid.simulations,
                           "wall_s": time.perf_counter() - t0}
            if res.get("defaults", {}).get("goodput_rate_per_s") is None:
                dsim = simulator()
                vllm_defaults, _ = baselines.engine_default_knobs("vllm", gpu_facts(profile))
                d = find_goodput(dsim, make_policy(vllm_defaults), start_scale=1.0,
                                 factor=2.0, rel_tol=0.03)
                res["defaults"] = {"goodput_rate_per_s": d.rate_per_s,
                                   "simulations": dsim.simulations}
            # SGLang's defaults, in the simulator's SGLang admission model.
            ssim = simulator("sglang")
            sg = find_goodput(ssim, make_policy(
                baselines.engine_default_knobs("sglang", gpu_facts(profile))[0]),
                              start_scale=1.0, factor=2.0, rel_tol=0.03)
            res["sglang-defaults"] = {"goodput_rate_per_s": sg.rate_per_s,
                                      "simulations": ssim.simulations}
            rsim = simulator()
            t0 = time.perf_counter()
            rnd = baselines.random_search(points, make_policy, rsim, budget=budget, seed=0)
            res["random"] = {"goodput_rate_per_s": rnd.goodput_rate_per_s,
                             "simulations": rnd.simulations, "wall_s": time.perf_counter() - t0}
            if baselines.optuna_available():
                osim = simulator()
                opt = baselines.optuna_search(REDUCED, points, make_policy, osim, budget=budget,
                                              seed=0)
                res["optuna"] = {"goodput_rate_per_s": opt.goodput_rate_per_s,
                                 "simulations": opt.simulations}
            else:
                res["optuna"] = {"skipped": "optuna not installed"}
            # The fluid model's goodput against the grid's simulated goodput.
            load = (LoadModel.from_trace(workload) if kind == "trace"
                    else LoadModel.from_class_stats(class_stats(workload)))
            fm = FluidModel(load, Platform.from_profile(profile), targets_for(load, slo))
            errors = []
            for ev in grid.evaluated:
                pred = fm.goodput(ev.knobs)[0]
                simg = ev.goodput.rate_per_s
                if simg > 0 and pred > 0:
                    errors.append(abs(pred - simg) / simg)
            case["fluid_goodput_error"] = {
                "points": len(errors),
                "median_abs_rel": statistics.median(errors) if errors else None,
                "p90_abs_rel": sorted(errors)[int(0.9 * (len(errors) - 1))] if errors else None,
            }
            case["reduced"] = res
            print("  reduced:", json.dumps(res), flush=True)
            print("  fluid error:", case["fluid_goodput_error"], flush=True)
            rows.append(case)
            Path(args.out).write_text(json.dumps(
                {"machine": f"{platform.node()} {platform.machine()} "
                            f"{platform.python_version()}",
                 "date": time.strftime("%Y-%m-%d"), "cases": rows}, indent=1))


def _fmt(v, digits=3):
    return "-" if v is None else f"{v:.{digits}g}"


def _name(case: dict) -> str:
    name = f"{case['workload']} ({case['source']})"
    profile = case.get("profile", H200)
    return name if profile == H200 else f"{name}, {profile}"


def render_targets(data: dict) -> str:
    """milp against the grid on the reduced space, one row per feasible case (markdown)."""
    out = ["| case | milp / grid goodput | grid sims / milp sims | model: worst miss "
           "(recalibrated) | local search sims | optimize wall (default space) |",
           "|---|---:|---:|---:|---:|---:|"]
    for case in data["cases"]:
        red = case["reduced"]
        grid = red.get("grid", {})
        milp = red.get("milp", {})
        if not grid.get("goodput_rate_per_s") or "infeasible" in milp:
            continue
        err = milp.get("model_error") or {}
        miss = err.get("worst_miss")
        out.append(
            f"| {_name(case)} x {case['slo']} | "
            f"{100 * milp['goodput_rate_per_s'] / grid['goodput_rate_per_s']:.1f}% | "
            f"{grid['simulations'] / max(milp['simulations'], 1):.1f}x "
            f"({grid['simulations']} / {milp['simulations']}) | "
            f"{'-' if miss is None else f'{miss:.2f}x'}"
            f"{' (unsure)' if err.get('unsure') else ''} | "
            f"{err.get('local_search_simulations', 0)} | "
            f"{_fmt(case['full'].get('wall_s'))} s |")
    return "\n".join(out)


def render_table(data: dict) -> str:
    """One row per workload x SLO set x method (markdown)."""
    out = [
        "| workload (source) | SLO | method | goodput req/s | vs grid | simulations | wall s |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for case in data["cases"]:
        name = _name(case)
        red = case["reduced"]
        grid = red.get("grid", {}).get("goodput_rate_per_s") or 0.0
        full = case["full"]
        if "infeasible" in full:
            out.append(f"| {name} | {case['slo']} | milp, default space, 3000 req | "
                       f"infeasible (exit 3) | | | {_fmt(full.get('wall_s'))} |")
        else:
            out.append(
                f"| {name} | {case['slo']} | milp, default space, 3000 req | "
                f"{_fmt(full['goodput_rate_per_s'])} | | {full['simulations']} | "
                f"{_fmt(full['wall_s'])} |")
            out.append(
                f"| {name} | {case['slo']} | vLLM defaults, 3000 req | "
                f"{_fmt(full['defaults_goodput_rate_per_s'])} | | "
                f"{full['defaults_simulations']} | |")
        for method in ("milp", "grid", "random", "optuna", "defaults", "sglang-defaults"):
            r = red.get(method, {})
            if "skipped" in r:
                out.append(f"| {name} | {case['slo']} | {method} (reduced) | skipped | | | |")
                continue
            g = r.get("goodput_rate_per_s")
            rel = f"{100 * g / grid:.1f}%" if g is not None and grid > 0 else "-"
            label = "infeasible (exit 3)" if "infeasible" in r else _fmt(g)
            shown = {"defaults": "vLLM defaults", "sglang-defaults": "SGLang defaults"}.get(
                method, method)
            out.append(
                f"| {name} | {case['slo']} | {shown} (reduced) | {label} | {rel} | "
                f"{r.get('simulations', '-')} | {_fmt(r.get('wall_s'))} |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
