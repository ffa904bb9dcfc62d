"""Background-job placement: spare capacity, the CP-SAT schedule, its validation.

1. **Spare capacity.** For each GPU type of a plan, one replica is simulated with the
   interactive requests routed to it (its buckets' mix) at a few load levels between 0 and
   its busiest slot's per-replica rate, plus a background class at the *lowest* priority
   (``scheduling: priority``) whose requests have the jobs' length mix. The background
   rate is raised by bracketing and bisection until the interactive classes would miss
   their SLOs or the background would stop keeping up (less than 95% of the background
   work that arrived in the first 80% of the window done by its end). The curve is made
   non-increasing in the interactive load (the lower value wins). Spare capacity of a
   slot is the background token rate of the smallest measured level at or above that
   slot's interactive load (so it never overstates), times the slot's replicas.
   Measurements are cached on disk like replica capacities.
2. **Schedule.** Job work (tokens) goes into slots and types with the CP-SAT model of
   :mod:`servetune.models.placement_cpsat`: maximize completed value, then finish early.
   Slots are the plan's hours; the forecast repeats after its last slot, so a deadline
   may fall on the next day. A job's window starts at its release rounded up to a slot
   start and ends at its deadline rounded down to a slot end.
3. **Validation.** For each type, the slots with the most background work are simulated
   with both loads (interactive at that slot's rate, background at the scheduled rate).
   Where the interactive SLOs break or the background falls behind, that type's spare
   capacity is lowered (x 0.7) and the schedule solved again; the schedule reports the
   checks and whether all passed.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from servetune.apps.plan import (
    CACHE_VERSION,
    Progress,
    WorkloadSlices,
    _r,
    _rel,
    class_rates_for,
    default_cache_dir,
    make_buckets,
    slice_workload,
)
from servetune.errors import InfeasibleError, ServetuneError
from servetune.io import sha256_file, sha256_json, write_text_atomic
from servetune.models.placement_cpsat import (
    PlacementInstance,
    PlacementJob,
    PlacementSolution,
    explain_unplaced,
)
from servetune.profiles.shipped import load_profile
from servetune.schemas.base import load_document
from servetune.schemas.fleet import CapacityPlan, Forecast, Job, Jobs, LengthDistribution
from servetune.schemas.policy import Policy
from servetune.schemas.slo import ClassSLO, SLOSet
from servetune.search import search_scale
from servetune.sim import simulate
from servetune.sim.engine import ENGINE_MODEL_VERSION
from servetune.solvers.placement import solve_placement
from servetune.steady_state import steady_window_s
from servetune.workloads.fitting import load_workload
from servetune.workloads.trace import Trace

if TYPE_CHECKING:
    from servetune.profiles.schema import Profile

BACKGROUND = "background"
BACKGROUND_PRIORITY = 1_000_000  # lower value is served first: this one comes last
KEEP_UP = 0.95  # share of the early background work that must be done by the window's end
OFFERED_SHARE = 0.8
# The steady-state window of a joint run (servetune.steady_state): longer than a capacity
# run's, so that the background backlog has time to show whether it keeps up.
MIN_WINDOW_S = 300.0
SPARE_METHOD_VERSION = 3  # part of the cache key: bump when the measurement changes
MAX_PLACE_ROUNDS = 5
SPARE_HEADROOM = 0.9  # plan background work to at most this share of the measured room
SPARE_DERATE = 0.7
BUSIEST_SLOTS = 2  # slots with the most background work simulated per type
WORK_UNITS_MAX = 4000  # CP-SAT units of the largest job that can fit


# ------------------------------------------------------------------------ job lengths


def sample_lengths(dist: LengthDistribution, n: int, rng: np.random.Generator) -> np.ndarray:
    """Lognormal lengths with the distribution's mean and CV, clipped to [min, max]."""
    if dist.cv <= 0:
        x = np.full(n, dist.mean)
    else:
        sigma2 = math.log1p(dist.cv**2)
        mu = math.log(dist.mean) - sigma2 / 2
        x = rng.lognormal(mu, math.sqrt(sigma2), size=n)
    hi = dist.max if dist.max is not None else np.inf
    return np.clip(np.rint(x), dist.min, hi).astype(np.int64)



@dataclass
class JobMix:
    """Request shapes of all jobs together, weighted by their request counts."""

    prompt: np.ndarray
    output: np.ndarray

    @property
    def mean_tokens(self) -> float:
        return float(self.prompt.mean() + self.output.mean())


def job_mix(jobs: Sequence[Job], n: int = 4000, seed: int = 0) -> JobMix:
    rng = np.random.default_rng(seed)
    counts = np.array([j.n_requests() for j in jobs], dtype=float)
    per = np.maximum(1, np.round(n * counts / counts.sum())).astype(int)
    prompt = np.concatenate([sample_lengths(j.prompt_tokens, k, rng)
                             for j, k in zip(jobs, per, strict=True)])
    output = np.concatenate([sample_lengths(j.output_tokens, k, rng)
                             for j, k in zip(jobs, per, strict=True)])
    return JobMix(prompt, output)


# -------------------------------------------------------------------- the joint trace


def joint_trace(
    slices: WorkloadSlices,
    interactive: dict[str, float],
    mix: JobMix,
    background_rate: float,
    duration_s: float,
    seed: int,
) -> Trace:
    """Interactive requests (bucket rates) and background requests (Poisson at
    ``background_rate``) over ``duration_s``, the background as the last class."""
    rng = np.random.default_rng(seed)
    arrival, prompt, output, cls = [], [], [], []
    for b in slices.names:
        r = interactive.get(b, 0.0)
        if r <= 0:
            continue
        k = rng.poisson(r * duration_s) + 1
        arrival.append(np.sort(rng.uniform(0, duration_s, size=k)))
        pick = rng.integers(0, len(slices.prompt[b]), size=k)
        prompt.append(slices.prompt[b][pick])
        output.append(slices.output[b][pick])
        cls.append(slices.class_id[b][pick])
    bg_id = len(slices.class_names)
    if background_rate > 0:
        k = rng.poisson(background_rate * duration_s) + 1
        arrival.append(np.sort(rng.uniform(0, duration_s, size=k)))
        pick = rng.integers(0, len(mix.prompt), size=k)
        prompt.append(mix.prompt[pick])
        output.append(mix.output[pick])
        cls.append(np.full(k, bg_id, dtype=np.int32))
    a = np.concatenate(arrival)
    order = np.argsort(a, kind="stable")
    class_id = np.concatenate(cls).astype(np.int32)[order]
    priority = np.where(class_id == bg_id, BACKGROUND_PRIORITY, 0).astype(np.int32)
    return Trace(
        arrival_s=a[order] - a[order][0],
        prompt_tokens=np.concatenate(prompt).astype(np.int64)[order],
        output_tokens=np.concatenate(output).astype(np.int64)[order],
        class_id=class_id,
        class_names=(*slices.class_names, BACKGROUND),
        priority=priority,
        source=f"placement-mix seed={seed}",
    )


def with_background(policy: Policy, class_names: Sequence[str]) -> Policy:
    """The replica's policy with priority scheduling and the background class last."""
    classes = {c: {"priority": policy.class_priority(c)} for c in class_names}
    classes[BACKGROUND] = {"priority": BACKGROUND_PRIORITY}
    return Policy.model_validate(
        {**policy.model_dump(mode="json"), "scheduling": "priority", "classes": classes}
    )


def interactive_slo(slo: SLOSet, class_names: Sequence[str]) -> SLOSet:
    """The SLO set with a vacuous entry for the background class (judged separately)."""
    classes = {c: slo.for_class(c) for c in class_names}
    classes[BACKGROUND] = ClassSLO(e2e_s=1e12, attainment=1e-9)
    return SLOSet(name=slo.name, classes=classes)


@dataclass
class JointRun:
    """``background_offered_tokens``: tokens of the background requests that arrived in
    the first ``OFFERED_SHARE`` of the window; ``background_done_tokens``: those of them
    finished by the window's end. A backlog that grows leaves them unfinished."""

    meets_slo: bool
    attainment: float
    background_offered_tokens: float
    background_done_tokens: float

    @property
    def keeps_up(self) -> bool:
        return self.background_done_tokens >= KEEP_UP * self.background_offered_tokens


def run_joint(
    slices: WorkloadSlices, interactive: dict[str, float], mix: JobMix, background_rate: float,
    duration_s: float, policy: Policy, profile: Profile, slo: SLOSet, *, engine: str,
    seed: int,
) -> JointRun:
    trace = joint_trace(slices, interactive, mix, background_rate, duration_s, seed)
    pol = with_background(policy, slices.class_names)
    judge = interactive_slo(slo, slices.class_names)
    res = simulate(trace, pol, profile, engine=engine)
    verdicts = res.slo_verdicts(judge)
    ok = all(v[0] for c, v in verdicts.items() if c != BACKGROUND)
    met = res.slo_met(judge)
    bg = trace.class_ids() == len(slices.class_names)
    att = float(met[~bg].mean()) if (~bg).any() else 1.0
    tokens = (trace.prompt_tokens + trace.output_tokens).astype(float)
    status = np.asarray(res.output.status)
    finish = np.asarray(res.output.finish_s, dtype=float)
    early = bg & (trace.arrival_s <= OFFERED_SHARE * duration_s)
    with np.errstate(invalid="ignore"):
        done = early & (status == 0) & (finish <= duration_s)
    return JointRun(ok, att, float(tokens[early].sum()), float(tokens[done].sum()))


def joint_window_s(interactive_requests: int, interactive_rate: float) -> float:
    """How long a joint run lasts: the time its interactive requests take to arrive,
    and at least the steady-state window :data:`MIN_WINDOW_S`."""
    span = interactive_requests / interactive_rate if interactive_rate > 0 else 0.0
    return max(steady_window_s(floor_s=MIN_WINDOW_S), span)


# ------------------------------------------------------------------- spare capacity


@dataclass
class SpareCurve:
    """Background tokens/s one replica of a type can take at each interactive load."""

    gpu_type: str
    levels_rate_per_s: list[float]
    spare_tok_s: list[float]
    simulations: int

    def at(self, rate: float) -> float:
        """Spare at the smallest measured level >= ``rate`` (never overstated)."""
        for level, spare in zip(self.levels_rate_per_s, self.spare_tok_s, strict=True):
            if rate <= level * (1 + 1e-9):
                return spare
        return 0.0


def measure_spare(
    gpu_type: str,
    slices: WorkloadSlices,
    bucket_weights: dict[str, float],
    peak_rate: float,
    mix: JobMix,
    policy: Policy,
    profile: Profile,
    slo: SLOSet,
    *,
    levels: int = 5,
    engine: str = "vllm",
    interactive_requests: int = 1200,
    seed: int = 0,
    cache_dir: Path | None = None,
) -> SpareCurve:
    """The spare curve of one type, by bisection on the background rate per level."""
    total_w = sum(bucket_weights.values())
    weights = {b: w / total_w for b, w in bucket_weights.items() if w > 0} if total_w else {}
    level_rates = [peak_rate * k / (levels - 1) for k in range(levels)] if levels > 1 else [
        peak_rate
    ]
    key = sha256_json({
        "v": CACHE_VERSION, "kind": "spare", "method": SPARE_METHOD_VERSION,
        "engine_model": ENGINE_MODEL_VERSION,
        "profile": profile.model_dump(mode="json"),
        "pools": {b: slices.pool_hash(b) for b in sorted(weights)}, "weights": weights,
        "levels": level_rates, "mix": [mix.prompt.tolist(), mix.output.tolist()],
        "policy": policy.model_dump(mode="json"), "slo": slo.model_dump(mode="json"),
        "engine": engine, "n": interactive_requests, "seed": seed,
    })
    cdir = cache_dir if cache_dir is not None else default_cache_dir()
    path = cdir / f"spare-{key}.json"
    if path.is_file():
        try:
            d = json.loads(path.read_text())
            return SpareCurve(gpu_type, d["levels"], d["spare_tok_s"], 0)
        except (ValueError, KeyError):
            pass
    spare: list[float] = []
    sims = 0
    for li, rate in enumerate(level_rates):
        interactive = {b: rate * w for b, w in weights.items()}
        duration = joint_window_s(interactive_requests, rate)
        def passes(scale: float, interactive=interactive, duration=duration, li=li) -> bool:
            nonlocal sims
            sims += 1
            run = run_joint(slices, interactive, mix, scale, duration, policy,
                            profile, slo, engine=engine, seed=seed + 17 * li)
            return run.meets_slo and run.keeps_up

        scale = search_scale(passes, start=1.0, rel_tol=0.05, min_scale=1 / 64,
                             max_scale=512.0).scale
        # scale x 1 req/s of background, less a margin: the search stops at the edge
        spare.append(SPARE_HEADROOM * scale * mix.mean_tokens)
    # More interactive load never leaves more room: keep the curve non-increasing, taking
    # the lower (safer) value where simulation noise says otherwise.
    spare = [min(spare[: i + 1]) for i in range(len(spare))]
    curve = SpareCurve(gpu_type, level_rates, spare, sims)
    try:
        cdir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(
            {"levels": level_rates, "spare_tok_s": spare, "gpu_type": gpu_type}, sort_keys=True
        ))
    except ServetuneError:
        pass
    return curve


# ------------------------------------------------------------------------ the command


@dataclass
class PlacementRun:
    schedule: dict[str, Any]
    solution: PlacementSolution
    instance: PlacementInstance
    timings: dict[str, float]


def interactive_load(
    plan: CapacityPlan, slices: WorkloadSlices, forecast: Forecast
) -> dict[tuple[str, int], dict[str, float]]:
    """Per (type, forecast slot): per-replica interactive rate of each bucket (req/s)."""
    lam = slices.bucket_rates(forecast, plan.growth)
    out: dict[tuple[str, int], dict[str, float]] = {}
    for g in plan.gpu_types:
        for s in range(forecast.n_slots):
            n = _replicas(plan, g.name, s)
            rates = {}
            if n > 0:
                for b in slices.names:
                    f = plan.routing.get(b, {}).get(g.name)
                    if f:
                        rates[b] = f[s % len(f)] * lam[b, s] / n
            out[g.name, s] = rates
    return out


def _replicas(plan: CapacityPlan, t: str, s: int) -> int:
    row = plan.replicas.get(t, [0])
    return int(row[s % len(row)])


def run_place(
    jobs_path: Path,
    plan_path: Path,
    forecast_path: Path,
    *,
    out_path: Path | None = None,
    cache_dir: Path | None = None,
    levels: int = 5,
    interactive_requests: int = 1200,
    time_limit_s: float = 20.0,
    validate: bool = True,
    seed: int = 0,
    progress: Progress | None = None,
) -> PlacementRun:
    """Everything ``servetune place`` does, as a function."""
    t_start = time.perf_counter()
    jobs_doc = load_document(jobs_path, Jobs)
    plan = load_document(plan_path, CapacityPlan)
    forecast = load_document(forecast_path, Forecast)
    for i, j in enumerate(jobs_doc.jobs):
        if j.deadline_s <= j.release_s:
            raise InfeasibleError(
                f"{jobs_path}: jobs.{i} ({j.id}): deadline_s {j.deadline_s:g} is not after "
                f"release_s {j.release_s:g}; no schedule can run it",
                details={"binding": "deadline_before_release", "job": j.id},
            )
    base = plan_path.parent

    def plan_input(name: str) -> Path:
        entry = plan.inputs.get(name) or {}
        p = Path(entry.get("path", ""))
        p = p if p.is_absolute() else base / p
        if not entry or not p.is_file():
            raise ServetuneError(
                f"{plan_path}: inputs.{name}.path: {p} not found; run `servetune plan` again"
            )
        return p

    workload = load_workload(plan_input("workload"))
    slo = load_document(plan_input("slo"), SLOSet)
    sample = plan.sample
    buckets = make_buckets(sample.get("prompt_edges", (1024, 4096)),
                           sample.get("output_edges", (256,)))
    slices = slice_workload(workload, buckets, n_requests=int(sample.get("requests", 20000)),
                            seed=int(sample.get("seed", 0)))
    missing = sorted(set(b.name for b in plan.buckets) - set(slices.names))
    if missing:
        raise ServetuneError(f"{plan_path}: buckets: {missing[0]} no longer matches the "
                             "workload; run `servetune plan` again")
    try:
        class_rates_for(forecast, slices.class_names, slices.class_weight)
    except ServetuneError as err:
        raise ServetuneError(f"{forecast_path}: {err.message.removeprefix('forecast: ')}") from None
    profiles = {}
    for i, g in enumerate(plan.gpu_types):
        p = Path(g.profile)
        p = p if p.is_absolute() else base / p
        if not p.is_file():
            raise ServetuneError(f"{plan_path}: gpu_types.{i}.profile: {p} not found")
        profiles[g.name] = load_profile(p)
    policies = {g.name: Policy.model_validate(g.policy) if g.policy else Policy()
                for g in plan.gpu_types}

    mix = job_mix(jobs_doc.jobs, seed=seed)
    load = interactive_load(plan, slices, forecast)
    t0 = time.perf_counter()
    curves: dict[str, SpareCurve] = {}
    for g in plan.gpu_types:
        if not any(_replicas(plan, g.name, s) for s in range(forecast.n_slots)):
            continue
        weights: dict[str, float] = {}
        for s in range(forecast.n_slots):
            for b, r in load[g.name, s].items():
                weights[b] = weights.get(b, 0.0) + r * _replicas(plan, g.name, s)
        peak = max(sum(load[g.name, s].values()) for s in range(forecast.n_slots))
        if not weights:  # a type kept warm without traffic: its mix is the plan's
            weights = {b.name: b.share for b in plan.buckets}
        curves[g.name] = measure_spare(
            g.name, slices, weights, peak, mix, policies[g.name], profiles[g.name], slo,
            levels=levels, engine=plan.engine, interactive_requests=interactive_requests,
            seed=seed, cache_dir=cache_dir,
        )
        if progress:
            c = curves[g.name]
            progress(f"spare {g.name}: " + ", ".join(
                f"{lv:.2g} req/s -> {sp:,.0f} tok/s" for lv, sp in
                zip(c.levels_rate_per_s, c.spare_tok_s, strict=True)))
    spare_s = time.perf_counter() - t0

    slot_s = plan.slot_s
    horizon = max(24 if forecast.n_slots > 1 else 1,
                  math.ceil(max(j.deadline_s for j in jobs_doc.jobs) / slot_s))
    types = tuple(curves)
    spare_tok_s = {
        (t, h): curves[t].at(sum(load[t, h % forecast.n_slots].values()))
        * _replicas(plan, t, h % forecast.n_slots)
        for t in types for h in range(horizon)
    }
    # One work unit is sized so the largest job that could fit at all spans at most
    # WORK_UNITS_MAX units (a job larger than all spare capacity cannot fit anyway).
    total_spare = sum(spare_tok_s.values()) * slot_s
    max_work = max(j.total_tokens() for j in jobs_doc.jobs)
    unit = max(1, math.ceil(min(max_work, total_spare) / WORK_UNITS_MAX))
    # Finish-time weights from priority (lower value first): the most urgent class of
    # jobs weighs as many times as there are priority levels, the least urgent once.
    levels_p = sorted({j.priority for j in jobs_doc.jobs})
    pjobs = tuple(
        PlacementJob(
            id=j.id,
            work=max(1, math.ceil(j.total_tokens() / unit)),
            release_slot=math.ceil(j.release_s / slot_s - 1e-9),
            deadline_slot=math.floor(j.deadline_s / slot_s + 1e-9) - 1,
            value=max(1, round(j.value * 1000)),
            preemptible=j.preemptible,
            weight=len(levels_p) - levels_p.index(j.priority),
        )
        for j in jobs_doc.jobs
    )
    # Solve, then simulate the busiest placed slots with both loads; a type whose
    # interactive SLOs break there gets its spare capacity lowered and the model is
    # solved again (the slot mix can differ from the averaged mix the curve measured).
    scale = {t: 1.0 for t in types}
    checks: dict[str, Any] = {}
    rounds = 0
    while True:
        rounds += 1
        cap = {(t, h): int(v * scale[t] * slot_s // unit) for (t, h), v in spare_tok_s.items()}
        inst = PlacementInstance(types=types, n_slots=horizon, cap=cap, jobs=pjobs)
        sol = solve_placement(inst, time_limit_s=time_limit_s)
        if not validate:
            break
        checks = validate_schedule(plan, slices, load, mix, sol, unit, policies, profiles, slo,
                                   forecast.n_slots, interactive_requests, seed)
        failing = [t for t, c in checks.items()
                   if not (c["meets_slo"] and c["background_keeps_up"])]
        if not failing or rounds >= MAX_PLACE_ROUNDS:
            break
        for t in failing:
            scale[t] *= SPARE_DERATE
        if progress:
            progress(f"round {rounds}: lower the spare capacity of {', '.join(failing)}")
    spare_tok_s = {(t, h): v * scale[t] for (t, h), v in spare_tok_s.items()}
    base_out = out_path.parent if out_path is not None else Path.cwd()
    inputs = {
        name: {"path": _rel(p, base_out), "sha256": sha256_file(p)}
        for name, p in (("jobs", jobs_path), ("plan", plan_path), ("forecast", forecast_path))
    }
    validation = {
        "validated": bool(validate) and all(
            c["meets_slo"] and c["background_keeps_up"] for c in checks.values()
        ),
        "rounds": rounds,
        "per_type": checks,
    }
    schedule = schedule_document(jobs_doc, inst, sol, unit, slot_s, spare_tok_s, validation,
                                 inputs, name=f"{jobs_doc.name}-{plan.name}")
    if plan.solver.get("scaling", "hourly") == "hourly" and not sol.value:
        schedule["note"] = (
            "the plan scales replicas with the load (scaling: hourly), which leaves little "
            "room; plan with scaling: static (reserved GPUs) to keep the night for jobs"
        )
    timings = {"spare_s": spare_s, "solver_s": sol.solver_s,
               "total_s": time.perf_counter() - t_start}
    return PlacementRun(schedule, sol, inst, timings)


def validate_schedule(
    plan: CapacityPlan, slices: WorkloadSlices, load: dict, mix: JobMix,
    sol: PlacementSolution, unit: int, policies: dict, profiles: dict, slo: SLOSet,
    n_forecast_slots: int, interactive_requests: int, seed: int,
) -> dict[str, dict[str, Any]]:
    """Simulate, per type, the slots with the most background work, with both loads;
    report the first that breaks the interactive SLOs, else the busiest."""
    work: dict[tuple[str, int], int] = {}
    for p in sol.jobs.values():
        for (t, s), u in p.work.items():
            work[t, s] = work.get((t, s), 0) + u
    out: dict[str, dict[str, Any]] = {}
    for t in sorted({t for t, _s in work}):
        slots = sorted((s for tt, s in work if tt == t), key=lambda s: (-work[t, s], s))
        for s in slots[:BUSIEST_SLOTS]:
            row = _check_slot(plan, slices, load, mix, work, unit, policies, profiles, slo,
                              n_forecast_slots, interactive_requests, seed, t, s)
            ok = row["meets_slo"] and row["background_keeps_up"]
            if t not in out or not ok:
                out[t] = row
            if not ok:
                break
    return out


def _check_slot(
    plan: CapacityPlan, slices: WorkloadSlices, load: dict, mix: JobMix, work: dict,
    unit: int, policies: dict, profiles: dict, slo: SLOSet, n_forecast_slots: int,
    interactive_requests: int, seed: int, t: str, s: int,
) -> dict[str, Any]:
    fs = s % n_forecast_slots
    n = _replicas(plan, t, fs)
    bg_tok_s = work[t, s] * unit / plan.slot_s / n
    bg_rate = bg_tok_s / mix.mean_tokens
    interactive = load[t, fs]
    irate = sum(interactive.values())
    duration = joint_window_s(interactive_requests, irate)
    run = run_joint(slices, interactive, mix, bg_rate, duration, policies[t], profiles[t],
                    slo, engine=plan.engine, seed=seed + 991)
    return {
        "slot": s,
        "interactive_rate_per_s": _r(irate, 4),
        "background_tok_s": _r(bg_tok_s, 1),
        "meets_slo": run.meets_slo,
        "attainment": _r(run.attainment, 4),
        "background_keeps_up": run.keeps_up,
    }


def schedule_document(
    jobs_doc: Jobs, inst: PlacementInstance, sol: PlacementSolution, unit: int, slot_s: float,
    spare_tok_s: dict[tuple[str, int], float], validation: dict[str, Any],
    inputs: dict[str, Any],
    *, name: str,
) -> dict[str, Any]:
    rows = []
    for j in jobs_doc.jobs:
        p = sol.jobs[j.id]
        mean_tok = j.mean_request_tokens()
        row: dict[str, Any] = {
            "id": j.id, "scheduled": p.done, "value": j.value,
            "release_s": j.release_s, "deadline_s": j.deadline_s,
        }
        if p.done:
            assert p.finish_slot is not None
            finish = (p.finish_slot + 1) * slot_s
            row["finish_s"] = finish
            row["lateness_s"] = finish - j.deadline_s
            alloc = []
            for (t, s), u in p.work.items():
                tokens = u * unit
                alloc.append({"slot": s, "start_s": s * slot_s, "gpu_type": t,
                              "tokens": tokens, "requests": round(tokens / mean_tok)})
            row["allocation"] = alloc
        else:
            row["reason"] = explain_unplaced(inst, sol, j.id)
        rows.append(row)
    value_total = sum(j.value for j in jobs_doc.jobs)
    value_done = sum(j.value for j in jobs_doc.jobs if sol.jobs[j.id].done)
    return {
        "apiVersion": "servetune/v1",
        "kind": "Schedule",
        "name": name,
        "inputs": inputs,
        "slot_s": slot_s,
        "horizon_slots": inst.n_slots,
        "work_unit_tokens": unit,
        "summary": {
            "jobs": len(rows),
            "scheduled": sum(1 for r in rows if r["scheduled"]),
            "value_completed": value_done,
            "value_total": value_total,
            "tokens_scheduled": sum(
                a["tokens"] for r in rows if r["scheduled"] for a in r["allocation"]
            ),
            "spare_tokens": int(sum(v * slot_s for v in spare_tok_s.values())),
        },
        "jobs": rows,
        "spare_tok_s": {
            t: [_r(spare_tok_s[t, h], 1) for h in range(inst.n_slots)] for t in inst.types
        },
        "validation": validation,
        "solver": {"status": sol.status, "objective_value": sol.value},
    }
