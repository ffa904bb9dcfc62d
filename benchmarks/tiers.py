"""SLO tiers (issue 16): the joint per-class policy against the alternatives a user has.

Usage (from the repo root, servetune installed)::

    python benchmarks/tiers.py [--quick] [--json-out benchmarks/tiers.json]

On the shipped two- and three-tier examples (``configs/examples/tiered-2class.csv`` with
``configs/slos/tiers-chat-longctx.yaml``; ``tiered-mixed.csv`` with
``tiers-chat-longctx-batch.yaml``), one H200 with Llama-3.1-8B, vLLM, every policy's
goodput is the largest common load scale (every class's rate times it) at which every tier
meets its SLO in the simulator, and the value it serves there (each class's ``value`` per
request within its limits, per second):

(a) ``vllm serve`` defaults;
(b) the best single-class policy (``optimize`` with per-class settings off);
(c) priorities alone: (b) with priority scheduling, the tightest TTFT tier first;
(d) separate pools: each class on a GPU of its own with its own single-class policy
    (goodput per GPU: the common scale the pools sustain, over the number of GPUs);
(j) the joint per-class policy (``optimize``'s tiered search: tier MILP + CP-SAT
    reservations, validated and recalibrated in the simulator);
(f) a fleet of replicas: the pools MILP routes the classes to replica pools (all together
    with the joint policy, each apart, or pairs) from one replica's goodput on each
    subset, for 2, 3 and 4 replicas (two-tier) or 3, 4 and 6 (three-tier);
(e) on a small instance (the two-tier example's first ``--small`` requests, the shared
    knobs fixed to (b)'s), every combination of priority order x each class's chunk cap x
    each class's KV cap, each simulated (a goodput search each), against the tier
    MILP's answer restricted to the same options and simulated the same way: the MILP
    matches when its goodput is within the search tolerance of the best.

The report says, per class, what binds: the tier model's tightest condition at (j)'s
goodput and which classes the simulator saw fail just above it. ``--quick`` runs only
the two-tier example and a smaller (e).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from servetune.apps.optimize import optimize  # noqa: E402
from servetune.models.pools_milp import compositions  # noqa: E402
from servetune.models.tiers import ClassOption, Shared  # noqa: E402
from servetune.profiles.shipped import load_profile  # noqa: E402
from servetune.schemas.base import load_document  # noqa: E402
from servetune.schemas.policy import ClassPolicy, Policy  # noqa: E402
from servetune.schemas.slo import SLOSet  # noqa: E402
from servetune.sim import simulate  # noqa: E402
from servetune.sim.evaluator import Evaluator, judging_window_s  # noqa: E402
from servetune.solvers import tiers  # noqa: E402
from servetune.solvers.loop import find_goodput  # noqa: E402
from servetune.workloads.formats import load_trace  # noqa: E402
from servetune.workloads.tiers import classify  # noqa: E402

INSTANCES = {
    "two-tier": ("configs/examples/tiered-2class.csv", "configs/slos/tiers-chat-longctx.yaml"),
    "three-tier": ("configs/examples/tiered-mixed.csv",
                   "configs/slos/tiers-chat-longctx-batch.yaml"),
}
PROFILE = "h200-llama-3.1-8b"
REL_TOL = 0.03


def value_served(trace, policy, profile, slo, scale: float) -> float:
    """Value per second served within the tiers' limits at ``scale``."""
    if scale <= 0:
        return 0.0
    res = simulate(trace, policy, profile, rate_scale=scale)
    return float(res.summary(slo)["overall"]["value_served_per_s"] or 0.0)


def goodput_of(sim, policy, start: float = 1.0):
    return find_goodput(sim, policy, start_scale=start, rel_tol=REL_TOL)


def first_failures(est, slo: SLOSet) -> dict:
    """At the lowest failing scale above the goodput: each class's attainment and the
    limits its measured quantile broke."""
    best = est.best_point
    above = [p for p in est.points if not p.meets_slo
             and (best is None or p.rate_scale > best.rate_scale)]
    if not above:
        return {}
    fail = min(above, key=lambda p: p.rate_scale)
    out: dict = {"scale": fail.rate_scale, "classes": {}}
    for name, judged in fail.judged.items():
        target = slo.for_class(name)
        broken = []
        for fam in ("ttft", "tpot"):
            limit = getattr(target, f"{fam}_s")
            value = fail.measured.get(f"{fam}[{name}]")
            if limit is not None and value is not None and value > limit:
                broken.append(f"{fam} {value:.3g} s > {limit:g} s")
        out["classes"][name] = {"attainment": judged.get("attainment"), "broken": broken}
    return out


def run_instance(name: str, trace_path: str, slo_path: str, small: int, quick: bool) -> dict:
    profile = load_profile(PROFILE)
    slo = load_document(REPO / slo_path, SLOSet)
    trace = classify(load_trace(REPO / trace_path), slo)
    sim = Evaluator(trace, profile, slo, source=trace,
                         min_window_s=judging_window_s(slo, REL_TOL))
    base_rate = sim.base_rate_per_s
    out: dict = {"trace": trace_path, "slo": slo_path, "requests": len(trace),
                 "base_rate_per_s": base_rate,
                 "classes": {c: {"share": float((trace.class_ids() == i).mean()),
                                 "value": slo.for_class(c).value}
                             for i, c in enumerate(trace.class_names)}}
    rows: dict[str, dict] = {}

    def record(label: str, policy: Policy, est, gpus: int = 1, extra: dict | None = None):
        rows[label] = {"goodput_scale": est.rate_scale,
                       "goodput_rate_per_s": est.rate_scale * base_rate / gpus,
                       "gpus": gpus,
                       "value_per_s": value_served(trace, policy, profile, slo,
                                                   est.rate_scale) / gpus,
                       "simulations": len(est.points), **(extra or {})}
        print(f"  {name} {label}: scale {est.rate_scale:.3f}, "
              f"{rows[label]['goodput_rate_per_s']:.2f} req/s per GPU", flush=True)

    t0 = time.perf_counter()
    defaults = Policy()
    record("a_defaults", defaults, goodput_of(sim, defaults))

    single = optimize(trace, profile, slo, per_class=False, rel_tol=REL_TOL,
                      compare_defaults=False)
    single_policy = single.policy
    record("b_single_class", single_policy, goodput_of(sim, single_policy,
                                                        single.summary["goodput_rate_per_s"]
                                                        / base_rate or 1.0),
           extra={"wall_s": single.summary["wall_s"], "knobs": single_policy.knobs()})

    order = sorted(trace.class_names, key=lambda c: (slo.for_class(c).ttft_s or math.inf, c))
    prio = single_policy.model_copy(deep=True)
    prio.scheduling = "priority"
    prio.classes = {c: ClassPolicy(priority=i) for i, c in enumerate(order)}
    record("c_priorities_alone", prio, goodput_of(sim, prio, rows["b_single_class"]
                                                  ["goodput_scale"] or 1.0))

    # (d) separate pools: each class alone on its own GPU, its own single-class policy.
    pool_scales = {}
    for cid, cname in enumerate(trace.class_names):
        sub = trace.take(np.flatnonzero(trace.class_ids() == cid))
        res = optimize(sub, profile, slo, per_class=False, rel_tol=REL_TOL,
                       compare_defaults=False)
        # Its scale relative to the class's rate in the mixed trace (sub's own rate).
        pool_scales[cname] = res.summary["goodput_rate_per_s"] / (
            out["classes"][cname]["share"] * base_rate)
    common = min(pool_scales.values())
    gpus = len(pool_scales)
    rows["d_separate_pools"] = {"goodput_scale": common,
                                "goodput_rate_per_s": common * base_rate / gpus, "gpus": gpus,
                                "pool_scales": pool_scales}
    print(f"  {name} d_separate_pools: scales {pool_scales}", flush=True)

    model = tiers.tier_model(trace, profile, slo)
    joint = tiers.optimize_tiers(model, sim, slo, single_policy,
                                 start_scale=rows["b_single_class"]["goodput_scale"] or 1.0,
                                 rel_tol=REL_TOL)
    top = joint.best
    if top is not None:
        record("j_joint_per_class", top.policy, top.goodput, extra={
            "policy_classes": {c: p.model_dump(exclude_defaults=True)
                               for c, p in top.policy.classes.items()},
            "shared": {"max_num_seqs": top.policy.batching.max_num_seqs,
                       "max_num_batched_tokens": top.policy.batching.max_num_batched_tokens},
            "model_scale": top.scale_model, "rounds": len(joint.rounds),
            "solves": joint.solves, "solver_s": joint.solver_s,
            "what_binds_model": tiers.what_binds(
                model.with_calibration(top.calibration), top.choice,
                max(top.goodput.rate_scale, 1e-3),
                {n: tiers.class_options("vllm") for n in model.names}),
            "fails_first_in_simulation": first_failures(top.goodput, slo)})
        # (f) a fleet: the pools MILP routes classes to replica pools, from what one
        # replica sustains serving each subset of the classes.
        names = trace.class_names
        goodput = {(c,): pool_scales[c] for c in names}
        goodput[tuple(names)] = top.goodput.rate_scale
        for pair in itertools.combinations(names, 2):
            if len(names) == 2:
                break
            ids = [names.index(c) for c in pair]
            sub = trace.take(np.flatnonzero(np.isin(trace.class_ids(), ids)))
            res = optimize(sub, profile, slo, rel_tol=REL_TOL, compare_defaults=False)
            share = sum(out["classes"][c]["share"] for c in pair)
            goodput[pair] = res.summary["goodput_rate_per_s"] / (share * base_rate)
        fleet = {}
        for replicas in (len(names), len(names) + 1, 2 * len(names)):
            plan = tiers.route_pools(names, goodput, replicas)
            fleet[replicas] = {"pools": {"+".join(p): n for p, n in plan.pools.items()},
                               "scale": plan.scale,
                               "rate_per_s_per_gpu": plan.scale * base_rate / replicas,
                               "all_together_per_gpu": goodput[tuple(names)] * base_rate,
                               "all_apart_scale": max(
                                   min(pool_scales[c] * n for c, n in zip(names, split,
                                                                          strict=True))
                                   for split in compositions(replicas, len(names)))}
            print(f"  {name} f_fleet R={replicas}: {fleet[replicas]['pools']} scale "
                  f"{plan.scale:.3f}", flush=True)
        rows["f_fleet"] = {"subset_scales": {"+".join(k): v for k, v in goodput.items()},
                           "plans": fleet}
    out["policies"] = rows
    out["wall_s"] = time.perf_counter() - t0
    if name == "two-tier":
        out["exhaustive"] = exhaustive(trace, profile, slo, single_policy, small, quick)
    return out


def exhaustive(trace, profile, slo, single_policy: Policy, small: int, quick: bool) -> dict:
    """(e): every order x chunk cap x KV cap per class on a small instance, simulated."""
    sub = trace.head(small)
    sim = Evaluator(sub, profile, slo, source=sub,
                         min_window_s=judging_window_s(slo, REL_TOL))
    names = sub.class_names
    shared = Shared(single_policy.batching.max_num_seqs,
                    single_policy.batching.max_num_batched_tokens,
                    single_policy.admission.kv_watermark)
    chunks = (0, 512) if quick else (0, 512, 2048)
    caps = ((None, 1.0), (None, 0.25))
    options = {n: [ClassOption(c, m, f) for c in chunks for m, f in caps] for n in names}
    kv_blocks = int(profile.kv_blocks())
    t0 = time.perf_counter()
    results = []
    for levels in tiers.orderings(len(names)):
        for combo in itertools.product(*(options[n] for n in names)):
            choice = tiers.TierChoice(0.0, shared, levels, dict(zip(names, combo, strict=True)))
            policy = tiers.to_policy(single_policy, choice, names, kv_blocks)
            est = find_goodput(sim, policy, start_scale=1.0, rel_tol=REL_TOL)
            results.append((est.rate_scale, levels, combo))
    enum_s = time.perf_counter() - t0
    best_scale = max(r[0] for r in results)
    model = tiers.tier_model(sub, profile, slo)
    t1 = time.perf_counter()
    milp = tiers.optimize_tiers(model, sim, slo, single_policy, grid=[shared], options=options,
                                reserve=False, rel_tol=REL_TOL)
    milp_s = time.perf_counter() - t1
    milp_scale = milp.best.goodput.rate_scale if milp.best else 0.0
    best = max(results, key=lambda r: r[0])
    return {
        "requests": len(sub), "combinations": len(results),
        "best_scale": best_scale,
        "best": {"levels": list(best[1]), "options": [vars(o) for o in best[2]]},
        "milp_scale": milp_scale,
        "milp_choice": ({"levels": list(milp.best.choice.levels),
                         "options": {c: vars(o) for c, o in milp.best.choice.options.items()}}
                        if milp.best else None),
        "matches": bool(milp_scale >= best_scale / (1 + REL_TOL)),
        "ratio": milp_scale / best_scale if best_scale else None,
        "enumeration_s": enum_s, "milp_loop_s": milp_s,
        "milp_simulations": sum(len(r.goodput.points) for r in milp.rounds),
        "enumeration_simulations": "one goodput search per combination",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--small", type=int, default=1500, help="requests in (e)'s instance")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    out = {"date": date.today().isoformat(), "machine": platform.platform(),
           "cpus": __import__("os").cpu_count(), "instances": {}}
    for name, (trace_path, slo_path) in INSTANCES.items():
        if args.quick and name != "two-tier":
            continue
        print(f"{name}:", flush=True)
        out["instances"][name] = run_instance(name, trace_path, slo_path, args.small,
                                              args.quick)
    text = json.dumps(out, indent=1, default=float)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
