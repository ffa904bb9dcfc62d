"""``optimize``: from a workload (or trace), a profile, SLOs and a search space to the
best policy the simulator confirms, with provenance and a summary.

This is what ``servetune optimize`` and the nightly job call. Steps:

1. the workload's moments (``class_stats``, or the trace's own) and the profile's
   step-time coefficients build the fluid model; the search space's grid is its candidates
   (knobs the models do not cover, such as ``scheduling``, take their first listed value);
2. ``method``: ``milp`` runs the loop of :mod:`servetune.solvers.loop` (MILP, simulate,
   recalibrate) and then sizes long-request lanes with CP-SAT, kept only when the
   simulator says they raise goodput; then, when the SLO set gives two or more of the
   sample's classes different tiers (``per_class``), the tiered search of
   :mod:`servetune.solvers.tiers` (per-class priority, chunk caps, caps and reservations
   chosen jointly) runs too, and its policy replaces the single-class one when the
   simulator says it serves every tier at a higher load; ``grid``, ``random`` and ``optuna`` are the
   baselines of :mod:`servetune.solvers.baselines`;
3. the engine defaults are simulated the same way for comparison;
4. the policy carries provenance in ``metadata`` (inputs' sha256, method, solver
   statuses, objective, simulated metrics, version, the profile's memory figures, why
   the search stopped, the fluid model's error in brief) and no wall-clock figure, so the
   same inputs and seed give the same bytes; times go in the summary, and so does the
   model's error per candidate (``summary["model_error"]``,
   :func:`servetune.solvers.loop.model_error`).

Budgets are work, not time: the loop's iterations, ``max_simulations`` simulations, and
the solvers' deterministic limits (:mod:`servetune.solvers.drivers`), so a slow machine or
a cold numba cache gives the same policy. The goodput searches that do not depend on each
other (a round's candidates, the edges, a baseline's points) run as batches on an
executor (``executor=``, ``--workers`` / ``--ray``), each on a fork of the simulator
(:meth:`Evaluator.fork`), so the policy is the same, byte for byte, on any backend
and number of workers. ``time_limit_s`` is only a safety stop: when it
fires, ``metadata.stopped_by`` is ``"time_limit"`` and the result is not reproducible.

When no candidate meets the SLOs, :class:`~servetune.errors.InfeasibleError` (exit 3)
says which condition binds, the best value reachable and what would make it feasible.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servetune import __version__
from servetune import knobs as knob_table
from servetune.conditions import Condition, Family
from servetune.engines import GpuFacts
from servetune.errors import InfeasibleError, ServetuneError
from servetune.executor import Executor
from servetune.io import round_floats, sha256_doc, sha256_file
from servetune.models.fluid import (
    Calibration,
    FluidModel,
    Knobs,
    LoadModel,
    Platform,
    knobs_grid,
    targets_for,
)
from servetune.models.lanes_cpsat import build_instance
from servetune.optimize_options import (
    DEFAULT_MAX_SIMULATIONS,
    DEFAULT_TIME_LIMIT_S,
    METHODS_IN_WORDS,
)
from servetune.profiles.shipped import load_profile, shipped_or_path
from servetune.schemas.base import document_to_yaml, load_document
from servetune.schemas.policy import Policy
from servetune.schemas.slo import SLOSet
from servetune.schemas.space import SearchSpace, apply_knobs
from servetune.schemas.workload import Workload
from servetune.sim.evaluator import EVAL_REL_TOL, Evaluator, base_sample, judging_window_s
from servetune.solvers import baselines, coordinate, tiers
from servetune.solvers.formulations import solve_lanes
from servetune.solvers.loop import (
    STOP_SIMULATIONS,
    STOP_TIME_LIMIT,
    Evaluated,
    GoodputTask,
    LoopResult,
    equivalence_key,
    find_goodput,
    find_goodputs,
    search,
)
from servetune.solvers.loop import model_error as model_error_of
from servetune.workloads.fitting import class_stats, load_workload
from servetune.workloads.formats import load_trace
from servetune.workloads.tiers import check_fits, classify
from servetune.workloads.trace import Trace

if TYPE_CHECKING:
    from servetune.profiles.schema import Profile

DEFAULT_SPACE_KNOBS: dict[str, list[Any]] = knob_table.default_space_knobs()
RANDOM_BUDGET = 60  # simulations for random / optuna when run on their own
# Widening the space where the answer sits on its edge: at most this many rounds (each
# searches again), and a value beyond the edge must beat the answer's goodput by 1%.
MAX_WIDENINGS = 3
# Simulations coordinate descent may spend after the model-guided search (work).
DESCENT_SIMULATIONS = 300
EDGE_BAR = 0.01


def default_space() -> SearchSpace:
    return SearchSpace(name="default", knobs=DEFAULT_SPACE_KNOBS)


@dataclass
class OptimizeResult:
    policy: Policy | None
    policy_yaml: str
    summary: dict[str, Any]
    status: str = "ok"
    explanation: str = ""
    evaluated: list[Evaluated] = field(default_factory=list)


def base_policy_for(space: SearchSpace, base: Policy | None = None) -> Policy:
    """The base policy: defaults (or ``base``) with every knob the models do not choose
    set to its first listed value in the space."""
    policy = base or Policy()
    others = {p: v[0] for p, v in space.knobs.items() if p not in Knobs.FIELDS}
    try:
        return apply_knobs(policy, others) if others else policy
    except ValueError as exc:
        raise ServetuneError(f"search space: first values are inconsistent: {exc}") from None


def explain_model_infeasible(fluid: FluidModel, points: list[Knobs]) -> tuple[str, dict]:
    """Which condition binds at vanishing load on every candidate, its best value over
    the space, and what would help."""
    best_floor: dict[Condition, tuple[float, float]] = {}  # condition -> (ratio, floor)
    limits_of: dict[Condition, Any] = {}
    for k in points:
        for cond, lim in fluid.limits(k).items():
            if lim.floor_value is None or lim.target is None:
                continue
            ratio = lim.floor_value / lim.target if lim.target > 0 else math.inf
            if cond not in best_floor or ratio < best_floor[cond][0]:
                best_floor[cond] = (ratio, lim.floor_value)
                limits_of[cond] = lim
    blocking = {c: r for c, (r, _) in best_floor.items() if r > 1.0}
    if not blocking:
        msg = "no candidate in the space sustains any load at the SLOs"
        return (msg + "; widen the search space or use a larger GPU",
                {"binding": Condition(Family.STABILITY).key})
    cond = max(blocking, key=lambda c: (blocking[c], c.key))
    lim = limits_of[cond]
    sentence = cond.floor_sentence(lim.floor_value, lim.target)
    helps = cond.advice(lim.floor_value)
    quantile = ""
    if cond.request_class is not None:
        quantile = f"p{fluid.targets[cond.request_class].q * 100:g} "
    message = f"{quantile}{sentence}; " + "; ".join(helps)
    return message, {
        "binding": cond.key,
        "best_value": lim.floor_value,
        "target": lim.target,
        "source": "model",
        "suggestions": helps,
    }


def explain_sim_infeasible(evaluated: list[Evaluated], slo: SLOSet) -> tuple[str, dict]:
    """From the simulations: for each judged metric its best (lowest) value over every
    point tried; the metric whose best is furthest above its target binds."""
    best_of: dict[Condition, tuple[float, float, float]] = {}  # -> (value, limit, rate)
    for ev in evaluated:
        for pt in ev.goodput.points:
            for cls, judged in pt.judged.items():
                target = slo.for_class(cls)
                share = judged.get("rejected_share")
                cond = Condition(Family.REJECTED, cls)
                if share is not None and (cond not in best_of or share < best_of[cond][0]):
                    best_of[cond] = (share, target.max_rejected_share, pt.rate_per_s)
                if target.percentile is None:
                    continue
                for metric, limit in target.limits().items():
                    value = judged.get(f"p{target.percentile:g}_{metric}")
                    if value is None or not math.isfinite(value):
                        continue
                    cond = Condition(Family.of_metric(metric), cls)
                    if cond not in best_of or value < best_of[cond][0]:
                        best_of[cond] = (value, limit, pt.rate_per_s)
    failing = {c: v for c, v in best_of.items() if v[0] > v[1]}
    if not failing:
        return (
            "no candidate met the SLOs in simulation at any rate tried; widen the search "
            "space, relax the SLOs or use a larger GPU",
            {"binding": "simulation", "source": "simulation"},
        )
    # A share turned away above a cap of 0 binds before any latency (ratio infinite).
    cond = max(failing, key=lambda c: (
        failing[c][0] / failing[c][1] if failing[c][1] > 0 else math.inf, c.key))
    value, limit, rate = failing[cond]
    msg = cond.simulated_floor_sentence(value, limit, rate)
    return msg, {"binding": cond.key, "best_value": value, "target": limit, "source": "simulation",
                 "rate_per_s": rate}


def gpu_facts(profile: Profile) -> GpuFacts:
    """The GPU facts an engine's defaults depend on. A profile without hardware (a KV pool
    given outright) counts as a small GPU, whose defaults are the engines' smaller ones."""
    hardware = profile.hardware
    return GpuFacts(name=hardware.name if hardware else "",
                    memory_bytes=hardware.memory_bytes if hardware else 0,
                    kv_tokens=int(profile.kv_blocks()) * int(profile.block_size))


def _profile_meta(profile: Profile) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": profile.name,
        # what `servetune export` compares with the profile it is given
        "gpu": profile.hardware.name if profile.hardware is not None else None,
        "model": profile.model.name if profile.model is not None else None,
        "gpu_memory_utilization": float(profile.gpu_memory_utilization),
        "block_size": int(profile.block_size),
        "kv_blocks": int(profile.kv_blocks()),
    }
    # The memory facts the exporters read back (servetune.export.memory_facts): with
    # them, `servetune export --engine trtllm` converts memory fractions without --profile.
    try:
        summary = profile.memory_summary()
        out["gpu_memory_bytes"] = int(summary.get("gpu_memory_bytes"))
        out["weight_bytes"] = int(summary.get("weight_bytes_per_gpu"))
        out["activation_bytes"] = int(summary.get("activation_reserve_bytes") or 0)
    except Exception:  # a profile without hardware/model sections (what-if, synthetic)
        out["gpu_memory_bytes"] = None
        out["weight_bytes"] = None
        out["activation_bytes"] = None
    return out


@dataclass(frozen=True)
class SearchInputs:
    """What an optimization method searches with: the model, the candidates, the
    simulator, and its budget: ``max_simulations`` (work: no new candidate starts once
    that many simulations are spent), ``budget`` (simulations, for the sampling
    baselines, within ``max_simulations``), and ``deadline`` (the wall-clock safety stop:
    a ``time.perf_counter()`` value after which no new work starts)."""

    fluid: FluidModel
    points: list[Knobs]
    make_policy: Callable[[Knobs], Policy]
    sim: Evaluator
    space: SearchSpace
    seed: int
    rel_tol: float
    budget: int
    max_simulations: int
    deadline: float
    k: int
    max_iterations: int
    say: Callable[[str], Any]
    executor: Executor | None = None


def _run_milp(run: SearchInputs) -> LoopResult:
    # No local search inside the loop: coordinate descent (_descend) follows, over every
    # value of every knob, whatever the model's error.
    return search(
        run.fluid, run.points, run.make_policy, run.sim, k=run.k,
        max_iterations=run.max_iterations, max_simulations=run.max_simulations,
        time_limit_s=run.deadline - time.perf_counter(), rel_tol=run.rel_tol, log=run.say,
        executor=run.executor, local_simulations=0,
    )


def _edges(space: SearchSpace, knobs: Knobs) -> list[tuple[str, str, Any, Any]]:
    """The modeled knobs whose value in ``knobs`` sits on an edge of the space that can
    be widened: (path, side, value, the value beyond) (:func:`knobs.beyond_edge`)."""
    out = []
    for path, offered in space.knobs.items():
        if path not in Knobs.FIELDS:
            continue
        chosen = getattr(knobs, Knobs.FIELDS[path])
        edge = knob_table.beyond_edge(path, offered, chosen)
        if edge is not None:
            out.append((path, edge[0], chosen, edge[1]))
    return out


def _search_beyond_edges(run: SearchInputs, loop: LoopResult) -> tuple[LoopResult, list[dict]]:
    """When the loop's answer sits on an edge of the space, try the value beyond it (one
    simulation at the answer's goodput plus 1%, as the loop bounds candidates); where that
    does better, widen the space there and run the loop again on the widened space, up to
    ``MAX_WIDENINGS`` times. Returns the loop result over everything simulated, and one
    record per edge tried in each round (the answer of that round, its other knobs as
    they were; ``widened``: whether the space grew there)."""
    records: list[dict] = []
    for round_ in range(1, MAX_WIDENINGS + 1):
        best = loop.best
        if best is None or loop.stopped_by in (STOP_TIME_LIMIT, STOP_SIMULATIONS):
            break
        grow: dict[str, Any] = {}
        tried: list[Evaluated] = []
        beyond_edges = []
        for path, side, chosen, beyond in _edges(run.space, best.knobs):
            neighbour = replace(best.knobs, **{Knobs.FIELDS[path]: beyond})
            if (neighbour.max_num_batched_tokens < neighbour.max_num_seqs
                    or equivalence_key(neighbour) == equivalence_key(best.knobs)):
                continue  # not a valid point, or one the simulator cannot tell apart
            beyond_edges.append((path, side, chosen, beyond, neighbour))
        if beyond_edges and run.sim.simulations >= run.max_simulations:
            loop.stopped_by = STOP_SIMULATIONS  # the work budget ends it here
            break
        # The edges of a round are one batch, each at the same bar.
        bar = best.goodput.rate_scale * (1.0 + EDGE_BAR)
        tasks = [GoodputTask(run.make_policy(e[4]), bar, run.rel_tol, prune_at=bar)
                 for e in beyond_edges]
        ests = find_goodputs(run.sim, tasks, run.executor)
        for (path, side, chosen, beyond, neighbour), task, est in zip(
                beyond_edges, tasks, ests, strict=True):
            tried.append(Evaluated(best.index, neighbour, 0.0, None, est, task.policy,
                                   label="edge"))
            records.append({"round": round_, "knob": path, "side": side, "value": chosen,
                            "beyond": beyond,
                            "simulated_rate_per_s": est.rate_per_s if est.passed else None,
                            "widened": bool(est.passed)})
            run.say(f"edge: {path} = {chosen} is the {'smallest' if side == 'low' else 'largest'}"
                    f" value offered; {beyond} simulated "
                    + (f"{est.rate_per_s:.2f} req/s" if est.passed else "no better"))
            if est.passed:
                grow[path] = beyond
        if not grow:
            loop.evaluated.extend(tried)
            break
        knobs = {p: list(v) + ([grow[p]] if p in grow else []) for p, v in run.space.knobs.items()}
        space = SearchSpace(name=run.space.name, knobs=knobs)
        run = replace(run, space=space, points=knobs_grid(space.knobs, run.points[0]))
        run.say("widened the space at its edges (" + ", ".join(
            f"{p} += {v}" for p, v in grow.items()) + "); searching again")
        # What is left of the work budget (the loop counts its own simulations).
        left = run.max_simulations - run.sim.simulations
        again = _run_milp(replace(run, max_simulations=max(left, 1)))
        loop = _merged(loop, tried, again)
    return loop, records


def _merged(first: LoopResult, between: list[Evaluated], again: LoopResult) -> LoopResult:
    """One loop result for a search, the candidates tried at its edges, and the search
    again over the widened space: everything simulated; the best simulated of all."""
    evaluated = [*first.evaluated, *between, *again.evaluated]
    passing = [e for e in evaluated if e.goodput.passed]
    best = max(passing, key=lambda e: (e.goodput.rate_per_s, -e.index), default=None)
    offset = len(first.iterations)
    iterations = [*first.iterations, *({**it, "iteration": it["iteration"] + offset,
                                        "widened_space": True} for it in again.iterations)]
    return LoopResult(
        best=best, evaluated=evaluated, iterations=iterations,
        calibration=again.calibration,
        solver_statuses=[*first.solver_statuses, *again.solver_statuses],
        solver_s=first.solver_s + again.solver_s, converged=again.converged,
        first_instance=first.first_instance, first_status=first.first_status,
        stopped_by=again.stopped_by,
        # the search again judged the model over the widened space, its fallback included
        model_error=again.model_error,
    )


def _run_grid(run: SearchInputs) -> baselines.BaselineResult:
    say = run.say
    return baselines.grid_search(
        run.points, run.make_policy, run.sim, rel_tol=run.rel_tol,
        budget=run.max_simulations, deadline=run.deadline, executor=run.executor,
        progress=lambda i, n: say(f"grid: {i}/{n} points simulated") if i % 25 == 0
        or i == n else None,
    )


def _run_random(run: SearchInputs) -> baselines.BaselineResult:
    return baselines.random_search(
        run.points, run.make_policy, run.sim, budget=min(run.budget, run.max_simulations),
        seed=run.seed, rel_tol=run.rel_tol, deadline=run.deadline, executor=run.executor,
    )


def _run_optuna(run: SearchInputs) -> baselines.BaselineResult:
    return baselines.optuna_search(
        run.space.knobs, run.points, run.make_policy, run.sim,
        budget=min(run.budget, run.max_simulations), seed=run.seed, rel_tol=run.rel_tol,
        deadline=run.deadline,
    )


@dataclass(frozen=True)
class Method:
    """An optimization method: its name, what runs it, whether it is a baseline (judged
    by the simulator alone, compared with the model-guided loop), and what it does."""

    name: str
    run: Callable[[SearchInputs], Any]
    baseline: bool
    help: str


# The methods of `servetune optimize --method`, in the order of METHODS (schemas.job).
METHOD_TABLE: dict[str, Method] = {m.name: m for m in (
    Method("milp", _run_milp, False,
           "the policy MILP on the fluid model, its answers simulated and the model "
           "recalibrated; then long-request lanes sized with CP-SAT"),
    Method("grid", _run_grid, True,
           "every point of the search space simulated (the brute-force oracle)"),
    Method("random", _run_random, True,
           "points in a seeded random order until the simulation budget is spent"),
    Method("optuna", _run_optuna, True,
           "Optuna's TPE sampler over the knobs, same budget (the optional extra optuna)"),
)}


def optimize(
    source: Trace | Workload,
    profile: Profile,
    slo: SLOSet,
    space: SearchSpace | None = None,
    *,
    method: str = "milp",
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    max_simulations: int = DEFAULT_MAX_SIMULATIONS,
    seed: int = 0,
    n_requests: int | None = None,
    engine: str = "vllm",
    inputs: dict[str, Any] | None = None,
    base_policy: Policy | None = None,
    progress: Callable[[str], Any] | None = None,
    compare_defaults: bool = True,
    k: int = 3,
    max_iterations: int = 4,
    budget: int | None = None,
    rel_tol: float = 0.03,
    widen_edges: bool = True,
    executor: Executor | None = None,
    per_class: bool | None = None,
    descent_simulations: int = DESCENT_SIMULATIONS,
) -> OptimizeResult:
    """Choose a policy (see the module docstring). ``source`` is a Workload or a Trace;
    ``inputs`` names the input files and their sha256 for the provenance.
    ``max_simulations`` (and ``max_iterations``, ``budget``) are the work budget that
    decides the result; ``time_limit_s`` is the wall-clock safety stop. With
    ``widen_edges`` (method milp), an answer on the edge of the space is checked against
    the value beyond it, and the space widened there when that does better
    (:func:`_search_beyond_edges`); the baselines search the space as given. The
    independent goodput searches (a round's candidates, the edges, a baseline's points)
    run on ``executor`` (default: in this process); the result is the same, byte for
    byte, on any executor. ``per_class`` (None: when the SLO set gives two or more of the
    sample's classes different tiers) runs the tiered search after the single-class one
    (method milp). ``descent_simulations``: the simulations coordinate descent may spend
    after the model-guided search (method milp; :func:`_descend`)."""
    wall_start = time.perf_counter()
    if not (isinstance(max_simulations, int) and max_simulations >= 1):
        raise ServetuneError(
            f"argument `max_simulations` must be a whole number >= 1 (got {max_simulations})"
        )
    say = progress or (lambda _msg: None)
    space = space or default_space()
    spec = METHOD_TABLE.get(method)
    if spec is None:
        raise ServetuneError(f"argument `method` {method!r}: choose {METHODS_IN_WORDS}")
    setup = _setup(source, profile, slo, space, base_policy, engine=engine, seed=seed,
                   n_requests=n_requests, say=say)
    run = SearchInputs(
        setup.fluid, setup.points, setup.make_policy, setup.sim, space, seed=seed,
        rel_tol=rel_tol, budget=budget or RANDOM_BUDGET, max_simulations=max_simulations,
        deadline=wall_start + time_limit_s, k=k, max_iterations=max_iterations, say=say,
        executor=executor,
    )
    if spec.baseline:
        outcome = _baseline_search(spec, run, wall_start, method)
    else:
        outcome = _model_guided_search(
            spec, run, setup, profile, slo, wall_start, method, time_limit_s=time_limit_s,
            widen_edges=widen_edges, engine=engine,
            per_class=per_class if per_class is not None else has_tiers(setup.sample, slo),
            descent_simulations=descent_simulations)
    if outcome.stopped_by == STOP_TIME_LIMIT:
        say(f"{method}: the safety time limit ({time_limit_s:g} s) stopped the search after "
            f"{setup.sim.simulations} simulations; the result depends on this machine's speed")
    if outcome.best is None:
        message, details = explain_sim_infeasible(outcome.evaluated, slo)
        _raise_infeasible(message, details, setup.sim, outcome.solver_s, wall_start, method,
                          outcome.iterations)
    best, search_rate = judge_leaders(outcome.evaluated, outcome.best, setup.sim,
                                      rel_tol=rel_tol, say=say, base=setup.base)
    predicted = None
    if not spec.baseline:
        # The recalibrated model's word on the answer and on its neighbourhood (the
        # candidates one move from it), against the simulator's.
        final_model = setup.fluid.with_calibration(_cal(outcome.calibration))
        predicted = float(final_model.goodput(best.knobs)[0])
        outcome.model_error = {
            **(outcome.model_error or {}),
            "near_answer": near_answer_error(final_model, best, outcome.evaluated)}
    method_sims = setup.sim.simulations
    defaults = _engine_defaults(setup, profile, say) if compare_defaults else _Defaults()
    policy = _policy_with_provenance(
        best, outcome, defaults, profile, method=method, seed=seed, engine=engine,
        inputs=inputs, sample_requests=len(setup.sample), predicted=predicted)
    text = document_to_yaml(
        policy,
        header=f"servetune {__version__} policy ({method}); provenance in metadata",
    )
    warnings = _warnings(best, outcome, setup.window, time_limit_s=time_limit_s,
                         max_simulations=max_simulations, rel_tol=rel_tol, say=say)
    summary = {
        "method": method,
        "status": "ok",
        "policy": policy.knobs(),
        # the per-class settings that differ from the defaults (SLO tiers)
        "classes": {name: cp.model_dump(exclude_defaults=True)
                    for name, cp in policy.classes.items()},
        "goodput_rate_per_s": best.goodput.rate_per_s,
        # the search's estimate of the answer's goodput, before the evaluator judged it
        "search_goodput_rate_per_s": search_rate,
        # how `servetune goodput` reproduces goodput_rate_per_s
        "evaluation": {"requests": len(setup.sample), "seed": seed, "tolerance": EVAL_REL_TOL,
                       "window_s": setup.window},
        "defaults_goodput_rate_per_s": defaults.rate,
        "defaults_rule": defaults.rule,
        "predicted_goodput_rate_per_s": predicted,
        "attainment": best.goodput.best_point.attainment,
        "turned_away": best.goodput.best_point.turned_away,
        "simulations": method_sims,
        "defaults_simulations": defaults.simulations,
        "solver_s": outcome.solver_s,
        "simulation_s": setup.sim.simulation_s,
        "wall_s": time.perf_counter() - wall_start,
        "converged": outcome.converged,
        "stopped_by": outcome.stopped_by,
        "space_edges": outcome.edges,
        "max_simulations": max_simulations,
        "time_limit_s": time_limit_s,
        "calibration": outcome.calibration,
        "model_error": round_floats(outcome.model_error) if outcome.model_error else None,
        "sample_window_s": best.goodput.best_point.measured.get("sample_window_s"),
        "min_window_s": setup.window,
        "warnings": warnings,
        "iterations": round_floats(outcome.iterations),
    }
    return OptimizeResult(policy, text, summary, evaluated=outcome.evaluated)


@dataclass(frozen=True)
class _Setup:
    """What every method searches over: the sample the simulator replays, the fluid
    model, the base policy and its candidate points, and the evaluator."""

    sample: Trace
    fluid: FluidModel
    base: Policy
    points: list[Knobs]
    make_policy: Callable[[Knobs], Policy]
    sim: Evaluator
    window: float


def _setup(source: Trace | Workload, profile: Profile, slo: SLOSet, space: SearchSpace,
           base_policy: Policy | None, *, engine: str, seed: int, n_requests: int | None,
           say: Callable[[str], Any]) -> _Setup:
    """The workload's moments, the sample the simulator replays, the model, the
    candidates and the evaluator (errors for an input that gives none of them)."""
    if isinstance(source, Workload):
        load = LoadModel.from_class_stats(class_stats(source))
    elif isinstance(source, Trace):
        load = LoadModel.from_trace(source)
    else:
        raise ServetuneError("optimize: give a Workload or a Trace")
    sample = base_sample(source, seed=seed, n_requests=n_requests)
    platform = Platform.from_profile(profile)
    try:
        fluid = FluidModel(load, platform, targets_for(load, slo))
    except KeyError as exc:
        raise ServetuneError(
            f"SLO set {slo.name!r} has no entry for class {exc.args[0]!r} and no 'default'; "
            "add one"
        ) from None
    base = base_policy_for(space, base_policy)
    points = knobs_grid(space.knobs, Knobs.from_policy(base))
    if not points:
        raise ServetuneError(
            "search space: no valid point (every max_num_batched_tokens < max_num_seqs)"
        )

    def make_policy(knobs: Knobs) -> Policy:
        return apply_knobs(base, knobs.as_dotted())

    window = judging_window_s(slo)
    sim = Evaluator(sample, profile, slo, engine=engine, source=source, seed=seed,
                    min_window_s=window)
    say(f"{len(points)} candidate policies, {len(sample)} requests per simulation "
        f"(base rate {sim.base_rate_per_s:.3g} req/s)")
    return _Setup(sample, fluid, base, points, make_policy, sim, window)


@dataclass
class _Outcome:
    """A method's search: its answer (None: no candidate met the SLOs), every candidate
    it simulated, its iterations for the summary, and how it ended."""

    best: Evaluated | None
    evaluated: list[Evaluated]
    iterations: list[dict[str, Any]]
    converged: bool | None
    stopped_by: str
    solver_s: float = 0.0
    solver_meta: dict[str, Any] = field(default_factory=dict)
    edges: list[dict] = field(default_factory=list)
    calibration: dict[str, Any] | None = None
    model_error: dict[str, Any] | None = None


def _model_guided_search(spec: Method, run: SearchInputs, setup: _Setup, profile: Profile,
                         slo: SLOSet, wall_start: float, method: str, *,
                         time_limit_s: float, widen_edges: bool, engine: str,
                         per_class: bool, descent_simulations: int) -> _Outcome:
    """The model-guided method and its later stages: the loop, the space widened at its
    edges, long-request lanes (CP-SAT), coordinate descent, SLO tiers."""
    sim = run.sim
    loop = spec.run(run)
    edges: list[dict] = []
    if widen_edges:
        loop, edges = _search_beyond_edges(run, loop)
    out = _Outcome(loop.best, list(loop.evaluated), loop.iterations, loop.converged,
                   loop.stopped_by, solver_s=loop.solver_s,
                   solver_meta={"milp": {"statuses": loop.solver_statuses}}, edges=edges,
                   calibration=loop.calibration.as_dict(), model_error=loop.model_error)
    if loop.first_status == "infeasible":
        message, details = explain_model_infeasible(run.fluid, run.points)
        _raise_infeasible(message, details, sim, out.solver_s, wall_start, method,
                          out.iterations)
    if not loop.evaluated:
        if not loop.first_status:
            raise ServetuneError(
                f"argument `time_limit_s` {time_limit_s:g} s ran out before any candidate was "
                "simulated; allow more time"
            )
        raise ServetuneError(
            f"the policy MILP stopped with status {loop.first_status!r} before finding a "
            "candidate; allow more time (argument `time_limit_s`) or use a smaller search space"
        )
    if out.best is not None:
        _lanes_stage(out, run)
    if out.best is not None and descent_simulations > 0:
        left = max(0, min(descent_simulations, run.max_simulations - sim.simulations))
        out.best, descent_info = _descend(run, out.best, out.evaluated, setup.base,
                                          gpu_facts(profile), budget=left, widened=edges)
        out.iterations.append({"iteration": len(out.iterations) + 1, "descent": descent_info})
    if out.best is not None and per_class:
        out.best, tiers_info, tiers_s = _try_tiers(
            out.best, setup.sample, profile, slo, sim, engine=engine, rel_tol=run.rel_tol,
            say=run.say)
        out.solver_s += tiers_s
        out.solver_meta["tiers"] = {"solves": tiers_info["solves"]}
        out.iterations.append({"iteration": len(out.iterations) + 1, "tiers": tiers_info})
        out.evaluated += tiers_info.pop("_evaluated")
    return out


def _lanes_stage(out: _Outcome, run: SearchInputs) -> None:
    """Long-request lanes sized with CP-SAT on the answer (:func:`_try_lanes`), recorded in
    ``out``."""
    assert out.best is not None
    out.best, lanes_info, lanes_s = _try_lanes(
        run.fluid, out.best, run.sim, run.space, rel_tol=run.rel_tol, seed=run.seed,
        say=run.say, time_limit_s=run.deadline - time.perf_counter(),
    )
    out.solver_s += lanes_s
    if lanes_info and lanes_info.get("stopped_by") == STOP_TIME_LIMIT:
        out.stopped_by = STOP_TIME_LIMIT
    if lanes_info:
        out.solver_meta["lanes"] = {"status": lanes_info["status"]}
        out.iterations.append({"iteration": len(out.iterations) + 1, "lanes": lanes_info})
        if lanes_info.get("candidate"):
            out.evaluated.append(lanes_info.pop("_evaluated"))
        lanes_info.pop("_evaluated", None)


def _baseline_search(spec: Method, run: SearchInputs, wall_start: float,
                     method: str) -> _Outcome:
    """A baseline method: the simulator alone over the space."""
    # The baselines need no model, but if even vanishing load breaks a condition on
    # every candidate, say so now instead of simulating the whole space.
    if all(run.fluid.goodput(kn)[0] <= 0 for kn in run.points):
        message, details = explain_model_infeasible(run.fluid, run.points)
        _raise_infeasible(message, details, run.sim, 0.0, wall_start, method, [])
    res = spec.run(run)
    if res.skipped:
        raise ServetuneError(f"argument `method` {method}: {res.skipped}")
    return _Outcome(res.best, res.evaluated,
                    [{"iteration": i + 1, "candidates": [e.as_dict()]}
                     for i, e in enumerate(res.evaluated)],
                    not res.stopped_at_deadline, res.stopped_by)


@dataclass(frozen=True)
class _Defaults:
    """vLLM serve's defaults simulated for comparison (None: not asked for)."""

    rate: float | None = None
    rule: str | None = None
    simulations: int = 0


def _engine_defaults(setup: _Setup, profile: Profile, say: Callable[[str], Any]) -> _Defaults:
    d_knobs, rule = baselines.engine_default_knobs("vllm", gpu_facts(profile))
    d_policy = apply_knobs(setup.base, d_knobs.as_dotted())
    before = setup.sim.simulations
    d_est = setup.sim.goodput(d_policy)  # the one evaluator's, as the answer's
    say(f"vLLM serve defaults ({rule}): {d_est.rate_per_s:.2f} req/s in simulation")
    return _Defaults(d_est.rate_per_s, rule, setup.sim.simulations - before)


def _policy_with_provenance(best: Evaluated, outcome: _Outcome, defaults: _Defaults,
                            profile: Profile, *, method: str, seed: int, engine: str,
                            inputs: dict[str, Any] | None, sample_requests: int,
                            predicted: float | None) -> Policy:
    """The answer as a policy document, named for the method, its provenance in
    ``metadata``."""
    point = best.goodput.best_point
    assert point is not None  # best passed the simulator
    policy = best.policy.model_copy(deep=True)
    policy.name = f"servetune-{method}"
    policy.metadata = round_floats(
        {
            "generated_by": f"servetune {__version__}",
            "method": method,
            "seed": seed,
            "engine": engine,
            "inputs": inputs or {},
            "sample_requests": sample_requests,
            "solver": outcome.solver_meta,
            # What ended the search: converged / max_iterations / simulation_budget /
            # exhausted (work: the same on every machine) or time_limit (the safety stop:
            # not reproducible; nightly keeps the current policy).
            "stopped_by": outcome.stopped_by,
            # Where the answer sat on an edge of the search space, the value beyond it
            # was simulated; where it did better the space grew there (widened: true).
            "space_edges": outcome.edges,
            "objective": {
                "name": "goodput_rate_per_s",
                "predicted": predicted,
                "binding": best.binding.key if best.binding is not None else None,
            },
            "simulated": {
                "goodput_rate_per_s": best.goodput.rate_per_s,
                "rate_scale": best.goodput.rate_scale,
                "attainment": point.attainment,
                "at_goodput": {k: v for k, v in point.measured.items()},
                # requests the policy shed or rejected at its goodput, and which (the SLO
                # set's max_rejected_share caps their share; 0 by default)
                "turned_away": point.turned_away,
                "defaults_goodput_rate_per_s": defaults.rate,
                "defaults_rule": defaults.rule,
            },
            "profile": _profile_meta(profile),
            "model_error": model_error_meta(outcome.model_error),
        }
    )
    return policy


def _warnings(best: Evaluated, outcome: _Outcome, window: float, *, time_limit_s: float,
              max_simulations: int, rel_tol: float, say: Callable[[str], Any]) -> list[str]:
    """What the user should know about the answer: a search the safety time limit cut
    short, a sample too short to judge the TTFT target at the goodput."""
    warnings: list[str] = []
    if outcome.stopped_by == STOP_TIME_LIMIT:
        warnings.append(
            f"the safety time limit ({time_limit_s:g} s) stopped the search before its work "
            f"budget ({max_simulations} simulations) or convergence did, so this policy "
            "depends on the machine's speed; raise --time-limit"
        )
    window_at_goodput = best.goodput.best_point.measured.get("sample_window_s")
    if window_at_goodput is not None and window_at_goodput < 0.95 * window:
        warnings.append(
            f"the sample covers only {window_at_goodput:.3g} s of arrivals at the goodput "
            f"(at least {window:.3g} s are needed to judge the TTFT target at a "
            f"{rel_tol:.0%} rate tolerance); the goodput may be optimistic: give more "
            "requests (--requests) or a longer trace"
        )
        say("warning: " + warnings[-1])
    return warnings


# The search's leaders judged by the one evaluator's own search: those whose estimate is
# within the search tolerance of the best, at most this many.
MAX_JUDGED_LEADERS = 3


def judge_leaders(
    evaluated: list[Evaluated], best: Evaluated, sim: Evaluator, *, rel_tol: float,
    say: Callable[[str], Any], base: Policy | None = None,
) -> tuple[Evaluated, float]:
    """The answer and the goodput it is printed with: the search's leaders (estimates
    within ``rel_tol`` of the best, at most ``MAX_JUDGED_LEADERS``, distinct policies)
    each judged by :meth:`Evaluator.goodput`, the search every command uses
    (``servetune goodput`` reproduces it). The best judged wins; among those within the
    evaluator's tolerance of it, the one that changes fewest knobs from ``base`` (a lane
    or a cap that buys nothing measurable is left out). Returns it (its goodput the
    judged one) and the search's estimate of it."""
    passing = sorted((e for e in evaluated if e.goodput.passed),
                     key=lambda e: (-e.goodput.rate_per_s, e.index))
    leaders: dict[str, Evaluated] = {}
    for ev in passing:
        if ev.goodput.rate_per_s < best.goodput.rate_per_s / (1.0 + rel_tol):
            break
        key = ev.policy.model_dump_json(exclude={"name", "metadata"})
        leaders.setdefault(key, ev)
        if len(leaders) == MAX_JUDGED_LEADERS:
            break
    judged = [(replace(ev, goodput=sim.goodput(ev.policy)), ev) for ev in leaders.values()]
    high = max(j.goodput.rate_per_s for j, _ in judged)
    reference = knob_table.values(base) if base is not None else {}

    def changed(policy: Policy) -> int:
        return sum(v != reference.get(k) for k, v in knob_table.values(policy).items())

    top, searched = min(
        (pair for pair in judged if pair[0].goodput.rate_per_s >= high / (1.0 + EVAL_REL_TOL)),
        key=lambda pair: (changed(pair[0].policy), -pair[0].goodput.rate_per_s))
    if not top.goodput.passed:  # the evaluator's search fails where the search passed
        say("warning: the evaluator's own search finds no passing rate for the answer; "
            "its goodput is the search's estimate")
        return searched, searched.goodput.rate_per_s
    say(f"judged {len(judged)} leader(s) by the evaluator: {top.goodput.rate_per_s:.3f} req/s "
        f"(search estimate {searched.goodput.rate_per_s:.3f})")
    return top, searched.goodput.rate_per_s


def near_answer_error(model: FluidModel, answer: Evaluated,
                      evaluated: list[Evaluated]) -> dict[str, Any]:
    """The model's error (:func:`servetune.solvers.loop.model_error`) on the answer and
    the candidates simulated one knob away from it: how far the model can be trusted
    where the answer was chosen."""
    here = Knobs.from_policy(answer.policy).as_dotted()
    near = [e for e in evaluated if e.policy is not None and sum(
        v != here[k] for k, v in Knobs.from_policy(e.policy).as_dotted().items()) <= 1
        and e.policy.long_requests == answer.policy.long_requests]
    error = model_error_of(model, [answer, *(e for e in near if e is not answer)])
    return {k: error[k] for k in ("candidates", "median_ratio", "worst_miss")}


def model_error_meta(error: dict[str, Any] | None) -> dict[str, Any] | None:
    """The model's error in brief, for the policy's metadata (no per-candidate rows, no
    times: the same inputs give the same bytes; rounded with the rest of the metadata).
    None for the baselines, which use no model."""
    if not error:
        return None
    fallback = error.get("fallback") or {}
    return {
        "median_ratio": error.get("median_ratio"),
        "worst_ratio": error.get("worst_ratio"),
        "worst_miss": error.get("worst_miss"),
        "factor": error.get("factor"),
        "unsure": error.get("unsure"),
        "local_search_simulations": fallback.get("simulations", 0),
        "near_answer": error.get("near_answer"),
    }


def _cal(cal: dict[str, float] | None):
    return Calibration(**cal) if cal else Calibration()


def _raise_infeasible(message, details, sim, solver_s, wall_start, method, iterations) -> None:
    summary = {
        "method": method,
        "status": "infeasible",
        "explanation": message,
        "infeasible": round_floats(details),
        "policy": None,
        "goodput_rate_per_s": 0.0,
        "defaults_goodput_rate_per_s": None,
        "defaults_rule": None,
        "attainment": None,
        "simulations": sim.simulations,
        "solver_s": solver_s,
        "simulation_s": sim.simulation_s,
        "wall_s": time.perf_counter() - wall_start,
        "iterations": round_floats(iterations),
    }
    raise InfeasibleError(f"no policy in the space meets the SLOs: {message}",
                          details={"summary": summary, **details})


def _try_lanes(
    fluid: FluidModel, best: Evaluated, sim: Evaluator, space: SearchSpace, *,
    rel_tol: float, seed: int, say: Callable[[str], Any], time_limit_s: float,
) -> tuple[Evaluated, dict[str, Any] | None, float]:
    """Size long-request lanes for the best candidate with CP-SAT at its simulated
    goodput; simulate the lane variant and keep it only when it does better.

    CP-SAT stops on its deterministic-time limit; ``time_limit_s`` (what is left of the
    run's safety stop) only guards the wall clock, and the info says when it fired."""
    if any(p.startswith("long_requests.") for p in space.knobs):
        return best, None, 0.0  # the space fixes the lanes itself
    rate = best.goodput.rate_per_s
    inst = build_instance(fluid, best.knobs, rate)
    if not any(0 < t.long_share <= 0.2 and t.short_ttft_ok for t in inst.thresholds):
        return best, None, 0.0
    t0 = time.perf_counter()
    outcome = solve_lanes(inst, time_limit_s=max(time_limit_s, 0.0), seed=seed)
    lanes_s = time.perf_counter() - t0
    info: dict[str, Any] = {"status": outcome.status.value, "message": outcome.message}
    if outcome.stopped_by:  # only when a limit ended it, so finished solves keep their bytes
        info["stopped_by"] = outcome.stopped_by
    if not outcome.status.has_solution:
        return best, info, lanes_s
    choice = outcome.solution
    try:
        policy = apply_knobs(best.policy, choice.policy_fields())
    except ValueError as exc:
        info["message"] = f"lane policy rejected: {exc}"
        return best, info, lanes_s
    # It must beat the best: a failure at the best's own rate ends the search.
    est = find_goodput(
        sim, policy, start_scale=best.goodput.rate_scale, rel_tol=rel_tol,
        prune_at=best.goodput.rate_scale,
    )
    ev = Evaluated(best.index, best.knobs, best.predicted_rate_per_s, best.binding, est, policy,
                   label="lanes")
    info["candidate"] = {**choice.policy_fields(), "simulated_rate_per_s": est.rate_per_s,
                         "simulations": len(est.points)}
    info["_evaluated"] = ev
    better = est.passed and est.rate_per_s > best.goodput.rate_per_s * (1 + rel_tol / 2)
    info["kept"] = bool(better)
    # A search pruned at the best's rate that never passed says only that the lanes
    # fail there: say that, not "0 req/s".
    simulated = (f"simulated {est.rate_per_s:.2f} req/s" if est.passed else
                 f"fails at the best's {best.goodput.rate_per_s:.2f} req/s")
    info["candidate"]["verdict"] = simulated
    say(f"long-request lanes (CP-SAT {outcome.status.value}): threshold "
        f"{choice.threshold_tokens}, {simulated}"
        f"{' (kept)' if better else ' (not better; dropped)'}")
    return (ev if better else best), info, lanes_s


def descent_axes(space: SearchSpace, sample: Trace, widened: Sequence[dict] = ()
                 ) -> dict[str, list[Any]]:
    """What coordinate descent searches: the space's knobs, with the values beyond its
    edges where :func:`_search_beyond_edges` widened it (``widened``: its records), and,
    unless the space pins them, the long-request lane at ``sample``'s quantiles
    (:func:`servetune.solvers.coordinate.lane_axes`)."""
    # lazy: the engine module imports numba, which importing the optimizer should not pay
    from servetune.sim.engine import lane_footprint

    axes = {p: list(v) for p, v in space.knobs.items()}
    for edge in widened:
        if edge["widened"] and edge["beyond"] not in axes[edge["knob"]]:
            axes[edge["knob"]].append(edge["beyond"])
    if not any(p.startswith("long_requests.") for p in space.knobs):
        axes.update(coordinate.lane_axes(lane_footprint(sample)))
    return axes


def _descend(
    run: SearchInputs, best: Evaluated, evaluated: list[Evaluated], base: Policy,
    gpu: GpuFacts, *, budget: int, widened: Sequence[dict] = (),
) -> tuple[Evaluated, dict[str, Any]]:
    """Coordinate descent by simulation (:mod:`servetune.solvers.coordinate`) from the
    best so far, the engine's defaults and a space-filling design, over
    :func:`descent_axes`. Adds what it simulated to ``evaluated``; returns the best and a
    record."""
    axes = descent_axes(run.space, run.sim.trace, widened)

    def make_policy(point: dict[str, Any]) -> Policy:
        return apply_knobs(base, coordinate.dotted_of(point))

    d_knobs, _rule = baselines.engine_default_knobs("vllm", gpu)
    defaults = coordinate.snapped({**coordinate.point_of(base, axes), **d_knobs.as_dotted()},
                                  axes)
    starts = [defaults, *coordinate.design(axes, coordinate.DESIGN_POINTS, run.seed)]
    result = coordinate.descend(
        run.sim, axes, make_policy, best, starts, budget=budget, rel_tol=run.rel_tol,
        known=evaluated, executor=run.executor, log=run.say)
    evaluated.extend(result.evaluated)
    passing = [e for e in evaluated if e.goodput.passed]
    top = max(passing, key=lambda e: e.goodput.rate_per_s)
    info = {"simulations": result.simulations, "moves": result.moves,
            "starts": result.starts, "stopped_by": result.stopped_by,
            "from_rate_per_s": best.goodput.rate_per_s, "to_rate_per_s": top.goodput.rate_per_s,
            "axes": axes}
    run.say(f"coordinate descent: {result.simulations} simulations, {result.moves} moves, "
            f"{best.goodput.rate_per_s:.3f} -> {top.goodput.rate_per_s:.3f} req/s")
    return (top if top.goodput.rate_per_s > best.goodput.rate_per_s else best), info


def has_tiers(sample: Trace, slo: SLOSet) -> bool:
    """Two or more of the sample's classes have different SLO tiers."""
    present = {sample.class_names[i] for i in set(sample.class_ids().tolist())}
    distinct = set()
    for name in present:
        try:
            distinct.add(slo.for_class(name).model_dump_json())
        except KeyError:
            return False
    return len(present) >= 2 and len(distinct) >= 2


def _try_tiers(
    best: Evaluated, sample: Trace, profile: Profile, slo: SLOSet, sim: Evaluator, *,
    engine: str, rel_tol: float, say: Callable[[str], Any],
) -> tuple[Evaluated, dict[str, Any], float]:
    """The tiered search (:func:`servetune.solvers.tiers.optimize_tiers`) from the best
    single-class policy; its best policy replaces that one when it serves every tier at a
    higher simulated load."""
    model = tiers.tier_model(sample, profile, slo, engine)
    start = best.goodput.rate_scale or 1.0

    def said(r: tiers.TierRound) -> None:
        say(f"per-class policy ({r.variant}): model {r.scale_model * sim.base_rate_per_s:.2f} "
            f"req/s, simulated {r.goodput.rate_per_s:.2f} req/s")

    result = tiers.optimize_tiers(model, sim, slo, best.policy, engine=engine,
                                  start_scale=start, rel_tol=rel_tol, on_round=said)
    info: dict[str, Any] = {
        "single_class_goodput_rate_per_s": best.goodput.rate_per_s,
        "rounds": [r.as_dict() for r in result.rounds],
        "solves": result.solves,
        "kept": False,
    }
    evaluated = []
    for i, r in enumerate(result.rounds):
        evaluated.append(Evaluated(
            best.index, Knobs.from_policy(r.policy), r.scale_model * sim.base_rate_per_s,
            None, r.goodput, r.policy, label=f"per-class {i + 1} ({r.variant})"))
    info["_evaluated"] = evaluated
    top = result.best
    if top is None:
        info["explanation"] = result.explanation
        say("per-class policy: the tier model finds no load at which every tier meets its SLO")
        return best, info, result.solver_s
    info["what_binds"] = tiers.what_binds(
        model.with_calibration(top.calibration), top.choice, top.goodput.rate_scale or
        top.scale_model, result.options)
    better = (top.goodput.passed
              and top.goodput.rate_per_s > best.goodput.rate_per_s * (1 + rel_tol / 2))
    info["kept"] = bool(better)
    say(f"per-class policy: {top.goodput.rate_per_s:.2f} req/s against "
        f"{best.goodput.rate_per_s:.2f} single-class"
        f"{' (kept)' if better else ' (not better; dropped)'}")
    if not better:
        return best, info, result.solver_s
    chosen = evaluated[result.rounds.index(top)]
    return chosen, info, result.solver_s


def optimize_files(
    *,
    trace: Path | None,
    workload: Path | None,
    profile: str,
    slo: Path,
    space: Path | None,
    trace_format: str | None = None,
    columns: str | None = None,
    **kwargs: Any,
) -> OptimizeResult:
    """:func:`optimize` on input files: loads them (a trace, or else a workload; a profile
    path or shipped name; the SLO set; the search space, or the default one; a trace read
    as ``trace_format`` with ``columns`` when given), records
    each file's name and sha256 as the policy's provenance, and passes ``kwargs`` on."""
    inputs: dict[str, Any] = {}
    source: Trace | Workload
    if trace is not None:
        source = load_trace(trace, trace_format, columns=columns)
        inputs["trace"] = {"file": trace.name, "sha256": sha256_file(trace)}
    else:
        assert workload is not None
        source = load_workload(workload)
        inputs["workload"] = {"file": workload.name, "sha256": sha256_file(workload)}
    profile = shipped_or_path(profile)
    prof = load_profile(profile)
    prof_path = Path(profile)
    if prof_path.is_file():
        inputs["profile"] = {"file": prof_path.name, "sha256": sha256_file(prof_path)}
    else:
        inputs["profile"] = {"file": profile, "sha256": sha256_doc(prof)}
    slo_set = load_document(slo, SLOSet)
    inputs["slo"] = {"file": slo.name, "sha256": sha256_file(slo)}
    if isinstance(source, Trace):  # classes by the set's length bands, and all judged
        source = classify(source, slo_set)
        check_fits(source, slo_set, str(slo))
    space_doc = None
    if space is not None:
        space_doc = load_document(space, SearchSpace)
        inputs["space"] = {"file": space.name, "sha256": sha256_file(space)}
    else:
        inputs["space"] = {"file": "(built-in default)"}
    return optimize(source, prof, slo_set, space_doc, inputs=inputs, **kwargs)
