"""The tiered search: per-class policies for several SLO tiers on one engine.

1. *Model*: bisect on the common load scale ``s`` for the largest one at which the tier
   MILP (:mod:`servetune.models.tiers_milp`, solved by HiGHS) finds every tier within its
   SLO (margin >= 0); its answer there is the shared knobs, the priority order and each
   class's chunk cap and seat/KV caps.
2. *Reserve*: CP-SAT sizes each class's guaranteed seats and KV blocks
   (:mod:`servetune.models.reserve_cpsat`) from the demand the model predicts.
3. *Validate*: the simulator searches the policy's goodput on the trace (with and without
   the reservations; the reservations stay unless they cost goodput).
4. *Recalibrate*: per class, TTFT and TPOT factors are fitted to what the simulator
   measured (a metric that failed just above the simulated goodput binds in reality: its
   factor makes the model's prediction there equal the target; others move half-way to
   measured / predicted), and the model is solved again, until the policy repeats or the
   rounds are spent. The best simulated policy wins.

:func:`enumerate_best` is the oracle: every shared setting x order x option per class,
each evaluated directly (:meth:`TierModel.evaluate`); the MILP must find the same margin.

On a fleet of identical replicas, :func:`route_pools` chooses which classes share a
replica pool and how many replicas each pool gets (:mod:`servetune.models.pools_milp`),
from what one replica sustains serving each subset of the classes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from servetune.knobs import CHUNK_CAP, export_names
from servetune.models.fluid import LoadModel, Platform, targets_for
from servetune.models.pools_milp import PoolPlan
from servetune.models.pools_milp import build_model as build_pools
from servetune.models.pools_milp import decode as decode_pools
from servetune.models.reserve_cpsat import ReserveInstance
from servetune.models.reserve_cpsat import build_model as build_reserve
from servetune.models.tiers import (
    ClassOption,
    Evaluation,
    Shared,
    Terms,
    TierCalibration,
    TierModel,
    orderings,
)
from servetune.models.tiers_milp import TierChoice, build_model, decode, second_stage
from servetune.schemas.policy import ClassPolicy, Policy
from servetune.schemas.slo import SLOSet
from servetune.search import GoodputResult
from servetune.solvers.drivers import solve_cpsat, solve_highs
from servetune.solvers.loop import SimPoint, Simulator, find_goodput

if TYPE_CHECKING:
    from servetune.profiles.schema import Profile
    from servetune.workloads.trace import Trace

CHUNK_CAPS = (0, 256, 512, 1024, 2048, 4096)
# (max_seqs, max_kv_fraction) pairs a class may be held to; (None, 1.0): no cap.
CAPS = ((None, 1.0), (None, 0.5), (None, 0.25), (None, 0.1), (32, 1.0), (8, 1.0))
SHARED_SEQS = (256, 1024)
SHARED_BUDGETS = (1024, 2048, 4096, 8192, 16384)
SCALE_TOL = 0.02  # bisection on the scale stops when hi / lo <= 1 + this
MAX_ROUNDS = 4
CAL_CLAMP = (0.2, 5.0)


def class_options(engine: str, chunk_caps: Sequence[int] = CHUNK_CAPS,
                  caps: Sequence[tuple[int | None, float]] = CAPS) -> list[ClassOption]:
    """The options each class chooses among: a chunk cap (where the engine has one: its
    knob row's export) times a cap."""
    chunks = chunk_caps if export_names(engine, CHUNK_CAP) else (0,)
    return [ClassOption(chunk_cap=c, max_seqs=m, max_kv_fraction=f)
            for c in chunks for m, f in caps]


def shared_grid(base: Policy, seqs: Sequence[int] = SHARED_SEQS,
                budgets: Sequence[int] = SHARED_BUDGETS) -> list[Shared]:
    """The shared settings the MILP chooses among (vLLM requires budget >= seats)."""
    w = base.admission.kv_watermark
    return [Shared(s, b, w) for s in seqs for b in budgets if b >= s]


@dataclass
class TierRound:
    """One round: the model's answer, its policy and what the simulator found."""

    scale_model: float
    choice: TierChoice
    policy: Policy
    goodput: GoodputResult[SimPoint]
    calibration: TierCalibration
    variant: str = "reserved"

    def as_dict(self) -> dict[str, Any]:
        best = self.goodput.best_point
        return {
            "model_scale": self.scale_model,
            "simulated_scale": self.goodput.rate_scale,
            "simulated_rate_per_s": self.goodput.rate_per_s,
            "variant": self.variant,
            "levels": list(self.choice.levels),
            "shared": vars(self.choice.shared),
            "options": {c: vars(o) for c, o in self.choice.options.items()},
            "calibration": {"ttft": dict(self.calibration.ttft),
                            "tpot": dict(self.calibration.tpot)},
            "measured_at_goodput": best.measured if best else None,
        }


@dataclass
class TierResult:
    best: TierRound | None
    options: dict[str, list[ClassOption]] = field(default_factory=dict)  # searched
    rounds: list[TierRound] = field(default_factory=list)
    solves: int = 0
    solver_s: float = 0.0
    explanation: dict[str, Any] = field(default_factory=dict)


def tier_model(trace: Trace, profile: Profile, slo: SLOSet, engine: str = "vllm"
               ) -> TierModel:
    """The per-class model of a trace's classes on a profile, with the SLO set's targets."""
    load = LoadModel.from_trace(trace)
    e2e = {c.name: slo.for_class(c.name).e2e_s for c in load.classes
           if slo.for_class(c.name).e2e_s is not None}
    return TierModel(load, Platform.from_profile(profile, engine), targets_for(load, slo),
                     e2e_s=e2e)


# ----------------------------------------------------------------------- the MILP
def solve_at(model: TierModel, scale: float, grid: Sequence[Shared],
             options: dict[str, list[ClassOption]], *, time_limit_s: float = 60.0,
             second: bool = True) -> tuple[TierChoice | None, float]:
    """The MILP at one scale: its choice (None when nothing is stable) and solve time;
    where the margin is >= 0 and ``second``, the second stage's choice with that margin."""
    terms = [model.terms(scale, g, options) for g in grid]
    if not any(t.stable for t in terms):
        return None, 0.0
    m = build_model(model, terms, options)
    outcome, _ = solve_highs(m, time_limit_s=time_limit_s)
    if not outcome.status.has_solution:
        return None, outcome.solve_s
    choice = decode(m, terms, model, options)
    solve_s = outcome.solve_s
    if second and choice.margin >= 0:
        second_stage(m, choice.margin)
        outcome, _ = solve_highs(m, time_limit_s=time_limit_s)
        solve_s += outcome.solve_s
        if outcome.status.has_solution:
            choice = decode(m, terms, model, options)
            # Its own margin (the stage kept it to MARGIN_SLACK), as evaluated directly.
            t = terms[grid.index(choice.shared)]
            ev = model.evaluate(t, choice.levels, choice.options)
            choice = replace(choice, margin=min(ev.margin, 1.0))
    return choice, solve_s


def largest_scale(feasible: Callable[[float], Any], *, start: float = 1.0,
                  tol: float = SCALE_TOL, lo_limit: float = 1 / 256, hi_limit: float = 256.0
                  ) -> tuple[float, Any]:
    """Bracket (doubling or halving from ``start``) then bisect geometrically for the
    largest scale at which ``feasible(scale)`` returns something (not None); returns
    ``(scale, its answer)``, ``(0.0, None)`` when nothing down to ``lo_limit`` is."""
    answer = feasible(start)
    lo, hi = (start, None) if answer is not None else (None, start)
    best = answer
    while lo is None:
        s = hi / 2
        if s < lo_limit:
            return 0.0, None
        best = feasible(s)
        if best is not None:
            lo = s
        else:
            hi = s
    while hi is None:
        s = lo * 2
        if s > hi_limit:
            return lo, best
        a = feasible(s)
        if a is not None:
            lo, best = s, a
        else:
            hi = s
    while hi / lo > 1.0 + tol:
        s = math.sqrt(lo * hi)
        a = feasible(s)
        if a is not None:
            lo, best = s, a
        else:
            hi = s
    return lo, best


def model_goodput(model: TierModel, grid: Sequence[Shared],
                  options: dict[str, list[ClassOption]], *, start: float = 1.0,
                  stats: dict[str, float] | None = None) -> tuple[float, TierChoice | None]:
    """The largest scale the MILP finds feasible, and its choice there."""
    stats = stats if stats is not None else {}

    def feasible(scale: float) -> TierChoice | None:
        choice, solve_s = solve_at(model, scale, grid, options)
        stats["solves"] = stats.get("solves", 0) + 1
        stats["solver_s"] = stats.get("solver_s", 0.0) + solve_s
        return choice if choice is not None and choice.margin >= 0 else None

    return largest_scale(feasible, start=start)


def enumerate_best(model: TierModel, scale: float, grid: Sequence[Shared],
                   options: dict[str, list[ClassOption]]
                   ) -> tuple[float, tuple[Shared, tuple[int, ...], dict[str, ClassOption]] | None]:
    """The oracle: the best margin over every shared setting, order and option per class
    at ``scale`` (each evaluated directly), and the assignment that has it."""
    best_margin, best = -math.inf, None
    names = model.names
    for g in grid:
        terms = model.terms(scale, g, options)
        if not terms.stable:
            continue
        for levels in orderings(len(names)):
            for combo in itertools.product(*(options[n] for n in names)):
                choice = dict(zip(names, combo, strict=True))
                ev = model.evaluate(terms, levels, choice)
                if not all(terms.classes[n].stable[choice[n]] for n in names):
                    continue
                cap = ev.conditions
                if cap["seats"][0] > cap["seats"][1] or cap["kv_memory"][0] > cap["kv_memory"][1]:
                    continue
                if any(not math.isfinite(terms.wait_factor[(n, levels)]) for n in names):
                    continue
                margin = min(ev.margin, 1.0)
                if margin > best_margin:
                    best_margin, best = margin, (g, levels, choice)
    return best_margin, best


# ----------------------------------------------------------------------- policies
def reservations(model: TierModel, choice: TierChoice, scale: float, slo: SLOSet,
                 options: dict[str, list[ClassOption]]) -> dict[str, tuple[int, int]]:
    """CP-SAT's reserved (seats, KV blocks) per class for ``choice`` at ``scale``."""
    terms = model.terms(scale, choice.shared, options)
    seats_total = choice.shared.max_num_seqs
    blocks_total = int(terms.kv_capacity_blocks)
    inst = ReserveInstance(
        names=model.names,
        seats={c: min(int(math.ceil(terms.classes[c].seats[choice.options[c]])), seats_total)
               for c in model.names},
        blocks={c: min(int(math.ceil(terms.classes[c].kv_blocks[choice.options[c]])),
                       blocks_total) for c in model.names},
        values={c: float(getattr(slo.for_class(c), "value", 1.0)) for c in model.names},
        max_num_seqs=seats_total, kv_blocks=blocks_total)
    cp, r, big_r = build_reserve(inst)
    outcome, solver = solve_cpsat(cp, time_limit_s=30.0)
    if not outcome.status.has_solution:
        return {c: (0, 0) for c in model.names}
    return {c: (int(solver.Value(r[c])), int(solver.Value(big_r[c]))) for c in model.names}


def to_policy(base: Policy, choice: TierChoice, names: Sequence[str], kv_blocks: int,
              reserved: dict[str, tuple[int, int]] | None = None) -> Policy:
    """``base`` with the choice's shared knobs, order and per-class settings."""
    distinct = len(set(choice.levels)) > 1
    classes = {}
    for i, name in enumerate(names):
        opt = choice.options[name]
        seats, blocks = (reserved or {}).get(name, (0, 0))
        max_frac = opt.max_kv_fraction
        res_frac = min(math.floor(blocks / max(kv_blocks, 1) * 1000) / 1000, max_frac)
        if opt.max_seqs is not None:
            seats = min(seats, opt.max_seqs)
        classes[name] = ClassPolicy(
            priority=choice.levels[i] if distinct else 0,
            reserved_seqs=seats, max_seqs=opt.max_seqs,
            reserved_kv_fraction=res_frac, max_kv_fraction=max_frac,
            long_prefill_token_threshold=opt.chunk_cap or None)
    data = base.model_dump()
    data["scheduling"] = "priority" if distinct else base.scheduling
    # The per-class chunk caps replace the policy-wide one, and the classes replace the
    # long-request lanes (the tier model has neither).
    data["batching"]["long_prefill_token_threshold"] = 0
    data["long_requests"] = {}
    data["batching"]["max_num_seqs"] = choice.shared.max_num_seqs
    data["batching"]["max_num_batched_tokens"] = choice.shared.max_num_batched_tokens
    data["classes"] = {n: c.model_dump() for n, c in classes.items()}
    return Policy.model_validate(data)


# ----------------------------------------------------------------------- the loop
def recalibrate(model: TierModel, choice: TierChoice, options: dict[str, list[ClassOption]],
                est: GoodputResult[SimPoint], base: TierCalibration) -> TierCalibration:
    """New per-class TTFT/TPOT factors from a simulated goodput search (module docstring)."""
    pt = est.best_point
    if pt is None:
        return base
    above = [p for p in est.points if not p.meets_slo and p.rate_scale > pt.rate_scale]
    fail = min(above, key=lambda p: p.rate_scale) if above else None
    cal_model = model.with_calibration(base)
    terms = cal_model.terms(pt.rate_scale, choice.shared, options)
    if not terms.stable:
        return base
    ev = cal_model.evaluate(terms, choice.levels, choice.options)
    new = {"ttft": dict(base.ttft), "tpot": dict(base.tpot)}
    for name in model.names:
        tgt = model.targets[name]
        for fam in ("ttft", "tpot"):
            pred = ev.conditions.get(f"{fam}[{name}]", (None, None))[0]
            if fam == "tpot" and pred is None:
                pred = cal_model.tpot_value(terms, name, choice.options)
            if not pred or not math.isfinite(pred) or pred <= 0:
                continue
            old = base.of(fam, name)
            limit = getattr(tgt, f"{fam}_s")
            # The measured q-quantile (the SLO's percentile, or its attainment as one).
            over = fail.measured.get(f"{fam}[{name}]") if fail is not None else None
            if limit and over is not None and math.isfinite(over) and over > limit:
                g = limit / pred  # binds in reality just above: match the target there
            else:
                value = pt.measured.get(f"{fam}[{name}]")
                if not value or not math.isfinite(value) or value <= 0:
                    continue
                g = math.sqrt(value / pred)
            new[fam][name] = float(np.clip(old * g, *CAL_CLAMP))
    return TierCalibration(ttft=new["ttft"], tpot=new["tpot"])


def optimize_tiers(model: TierModel, sim: Simulator, slo: SLOSet, base: Policy, *,
                   engine: str = "vllm", max_rounds: int = MAX_ROUNDS,
                   grid: Sequence[Shared] | None = None,
                   options: dict[str, list[ClassOption]] | None = None,
                   start_scale: float = 1.0, rel_tol: float = 0.02, reserve: bool = True,
                   on_round: Callable[[TierRound], None] | None = None) -> TierResult:
    """The loop of the module docstring; the best simulated round wins. ``reserve=False``
    leaves reservations out (the policies are then exactly the MILP's options)."""
    grid = list(grid) if grid is not None else shared_grid(base)
    opts = options or {n: class_options(engine) for n in model.names}
    stats: dict[str, float] = {}
    cal = TierCalibration()
    result = TierResult(best=None, options=opts)
    seen: set[str] = set()
    start = start_scale
    for _ in range(max_rounds):
        current = model.with_calibration(cal)
        scale, choice = model_goodput(current, grid, opts, start=start, stats=stats)
        if choice is None:
            result.explanation = explain(current, grid, opts)
            break
        kv_blocks = int(current.platform.kv_blocks)
        variants = [("caps only", to_policy(base, choice, model.names, kv_blocks))]
        if reserve:
            reserved = reservations(current, choice, scale, slo, opts)
            variants.insert(0, ("reserved", to_policy(base, choice, model.names, kv_blocks,
                                                      reserved)))
        key = variants[0][1].model_dump_json(exclude={"name", "metadata"})
        if key in seen:
            break
        seen.add(key)
        rounds = []
        for label, policy in variants:
            if label != variants[0][0] and policy == variants[0][1]:
                continue
            est = find_goodput(sim, policy, start_scale=max(scale, 1 / 256), rel_tol=rel_tol)
            rounds.append(TierRound(scale, choice, policy, est, cal, label))
        # The reservations stay unless they cost goodput.
        chosen = max(rounds, key=lambda r: (r.goodput.rate_scale, r.variant == "reserved"))
        result.rounds += rounds
        if on_round is not None:
            for r in rounds:
                on_round(r)
        if result.best is None or chosen.goodput.rate_scale > result.best.goodput.rate_scale:
            result.best = chosen
        cal = recalibrate(model, choice, opts, chosen.goodput, cal)
        start = max(chosen.goodput.rate_scale, 1 / 256)
    result.solves = int(stats.get("solves", 0))
    result.solver_s = float(stats.get("solver_s", 0.0))
    return result


def explain(model: TierModel, grid: Sequence[Shared],
            options: dict[str, list[ClassOption]], scale: float = 1 / 256) -> dict[str, Any]:
    """What binds when no scale is feasible: the best assignment's tightest condition at
    the smallest scale searched."""
    margin, best = enumerate_best(model, scale, grid, options) if len(model.names) <= 3 else (
        -math.inf, None)
    if best is None:
        return {"binding": "stability", "margin": margin}
    g, levels, choice = best
    ev: Evaluation = model.evaluate(model.terms(scale, g, options), levels, choice)
    return {"binding": ev.binding(), "margin": margin}


def what_binds(model: TierModel, choice: TierChoice, scale: float,
               options: dict[str, list[ClassOption]]) -> dict[str, dict[str, float]]:
    """Per condition at ``scale``: the model's value, its limit and the relative margin
    (for the report: what binds, per class)."""
    terms: Terms = model.terms(scale, choice.shared, options)
    if not terms.stable:
        return {}
    ev = model.evaluate(terms, choice.levels, choice.options)
    return {k: {"value": v, "limit": lim, "margin": 1.0 - v / lim if lim else 0.0}
            for k, (v, lim) in ev.conditions.items()}


# ----------------------------------------------------------------------- fleets
def route_pools(names: Sequence[str], goodput: dict[tuple[str, ...], float],
                replicas: int) -> PoolPlan:
    """The pools MILP (:mod:`servetune.models.pools_milp`): which classes share replicas,
    and how many each pool gets, for the largest common load scale on ``replicas``
    identical replicas; ``goodput[S]`` is one replica's scale serving exactly the classes
    ``S`` (e.g. from :func:`optimize_tiers`, or the single-class search for one class)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1 (got {replicas})")
    m = build_pools(names, goodput, replicas)
    outcome, _ = solve_highs(m, time_limit_s=60.0)
    if not outcome.status.has_solution:
        raise RuntimeError(f"pools MILP: {outcome.status.value} {outcome.message}")
    return decode_pools(m)
