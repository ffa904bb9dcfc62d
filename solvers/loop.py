"""The search loop: solve, simulate the best k candidates, recalibrate, solve again.

1. Build the fluid model's limits for every grid point and solve the policy MILP for the
   best k candidates by predicted goodput, each of a different step shape (token
   budget, effective chunk cap: each solution's cut removes its whole shape for the rest
   of the round). Points already simulated are cut off for good, and with them the
   other variants of their shape (seats, watermark, queue caps) that the model ranks no
   higher.
2. Simulate each candidate's goodput (bracket around the model's prediction, then bisect)
   on a fixed sample of the workload. The round's candidates are one *batch*: their
   searches do not depend on each other and run on an executor
   (:mod:`servetune.executor`; :func:`find_goodputs`), each on a fork of the simulator,
   results merged in candidate order. Once there is an incumbent (its goodput narrowed
   to 1% before the batch), every candidate of the batch starts no lower than the
   incumbent's rate plus 1%, and a failure there ends its search: one simulation for a
   candidate that cannot beat it (branch and bound with simulated bounds). The bar is
   fixed for the batch: a candidate that beats the incumbent raises it for the next.
   While nothing has passed yet there is no bar, so the best-predicted candidate is
   simulated first, alone, to set one, and the round's others follow as one batch.
3. Recalibrate: scale the model's TTFT / TPOT predictions so that, for the metric the
   simulator saw fail just above a candidate's goodput, the model's limit falls where the
   simulator's did; other metrics move towards measured / predicted (damped); the KV
   prediction towards the measured peak. A candidate the simulator rejected at every rate
   stays cut.
4. Repeat until the best simulated goodput stops improving (by more than the goodput
   search's tolerance) from one round to the next *and* the recalibrated model promises
   no untried candidate above it by more than that tolerance, or the MILP has nothing
   left, or the iteration limit or the simulation budget is reached.
5. Screen the step shapes never tried, one simulation each at the best goodput plus the
   tolerance (a simulated bound), in batches of k (best predicted first; each batch at
   the bar of the leader before it); search only those that pass.
6. Judge the model (:func:`model_error`): re-predict every simulated candidate with the
   recalibrated model and compare with its simulated goodput bracket. When it misses
   some candidate by more than ``unsure_factor`` (default ``UNSURE_FACTOR`` = 1.25), the
   model's ranking cannot be trusted near the answer, so a local search by simulation
   follows (:func:`_local_search`): the incumbent's neighbours one grid step away in
   each knob (the space's own values, in a fixed order: knob by knob, the step down then
   up) are simulated as one batch, each at the incumbent's goodput plus 1% (the same bar
   as above: a failure there rejects the neighbour in one simulation, and a neighbour
   whose earlier simulations already failed at or below the bar is not simulated
   again); those that pass are searched, the best simulated becomes the incumbent, and
   the search moves there. It stops at a neighbourhood where nothing passes the bar (a
   local optimum *by simulation*), once ``local_simulations`` simulations are spent, or
   when the loop's budget is; it does not start when that budget or the safety stop
   already ended the loop. The result records the model's error and whether this
   fallback ran (:attr:`LoopResult.model_error`).
7. Narrow the answer's goodput bracket to 1% (it stays a lower bound, a tighter one).

Every iteration is logged. Only a candidate that passed the SLOs in simulation is ever
returned: the answer is the best *simulated* goodput, never the model's promise.

Budgets are counted in work (iterations, simulations, the solvers' node / iteration /
deterministic-time limits), so the same inputs stop at the same point on any machine,
cold numba cache or warm, and with any executor or number of workers: a simulation
budget is checked before each batch, and a started batch finishes (its searches are
bounded themselves). The wall-clock ``time_limit_s`` is only a safety stop; when it
fires, :attr:`LoopResult.stopped_by` says ``"time_limit"`` and the answer is not
reproducible (the caller reports it; ``nightly`` keeps the current policy).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np

from servetune import knobs as knob_table
from servetune.conditions import Condition, Family
from servetune.executor import Executor, SerialExecutor
from servetune.models.fluid import Calibration, FluidModel, Knobs, binding_limit
from servetune.models.policy_milp import MilpInstance
from servetune.search import GoodputResult, SimPoint, SimTally
from servetune.search import goodput_search as _goodput_search
from servetune.search import refine_goodput as _refine_goodput
from servetune.solvers.formulations import solve_policy_milp

CAL_CLAMP = (1.0 / 32, 32.0)

# The model is *unsure* when, recalibrated, it still misses a simulated candidate's
# goodput by more than this factor: then the loop searches the incumbent's grid
# neighbours by simulation before it stops. Why 1.25: neighbouring grid points (one step
# in one knob) differ in goodput by a few to a few tens of percent, so a model that can
# be 25% off cannot rank the answer against its neighbours, and only the simulator can.
# Where the model is sound, recalibration leaves it far closer: on the benchmark's conv
# and code workloads its worst miss over the simulated candidates is 1.00-1.04x, against
# 1.5-4.6x where it is structurally wrong (KV-bound long prompts, the bursty code
# trace). A false alarm is cheap: one simulation per neighbour not yet known to fall
# short (the bar rejects a neighbour that cannot beat the incumbent at once).
UNSURE_FACTOR = 1.25
# Simulations the local search may spend (work, like ``max_simulations``).
LOCAL_SIMULATIONS = 40

# Why a search stopped (the policy's ``metadata.stopped_by``).
STOP_CONVERGED = "converged"  # stable, or nothing left to try
STOP_MAX_ITERATIONS = "max_iterations"  # the iteration limit came before it was stable
STOP_SIMULATIONS = "simulation_budget"  # the work budget (simulations) was spent
STOP_EXHAUSTED = "exhausted"  # a baseline simulated every point
STOP_TIME_LIMIT = "time_limit"  # the wall-clock safety stop: result depends on the machine


class Simulator(Protocol):
    """What the loop needs from a simulator (tests may plug in their own)."""

    base_rate_per_s: float
    simulations: int
    simulation_s: float

    def run(self, policy: Any, rate_scale: float) -> SimPoint: ...


def find_goodput(
    sim: Simulator,
    policy: Any,
    *,
    start_scale: float,
    factor: float = 1.25,
    rel_tol: float = 0.02,
    min_scale: float = 1.0 / 256,
    max_scale: float = 256.0,
    max_sims: int = 14,
    prune_at: float | None = None,
) -> GoodputResult[SimPoint]:
    """Bracket the goodput around ``start_scale`` with steps that grow (x factor, then
    squared each time), then bisect geometrically to ``rel_tol``
    (:func:`servetune.search.goodput_search`, at most ``max_sims`` simulations).

    With ``prune_at`` (the best scale found so far elsewhere), the search stops as soon
    as a failing scale at or below it is known: this policy cannot beat that one, so its
    exact goodput does not matter (branch and bound); its estimate is then a lower bound."""
    return _goodput_search(
        lambda scale: sim.run(policy, scale), base_rate_per_s=sim.base_rate_per_s,
        start=start_scale, rel_tol=rel_tol, min_scale=min_scale, max_scale=max_scale,
        factor=factor, accelerate=True, max_evaluations=max_sims, prune_at=prune_at,
    )


def refine_goodput(
    sim: Simulator, policy: Any, est: GoodputResult[SimPoint], *, rel_tol: float,
    max_sims: int = 6,
) -> GoodputResult[SimPoint]:
    """Narrow a finished estimate's bracket (its best passing scale and the lowest
    failing scale above it) to ``rel_tol`` by more bisection
    (:func:`servetune.search.refine_goodput`); the estimate stays a lower bound, only a
    tighter one. Unchanged when nothing passed or nothing failed above."""
    return _refine_goodput(lambda scale: sim.run(policy, scale), est, rel_tol=rel_tol,
                           max_evaluations=max_sims, base_rate_per_s=sim.base_rate_per_s)


# --------------------------------------------------------------------------- batches
#
# The goodput searches of one batch (a round's candidates, a batch of screened shapes, a
# neighbourhood) do not depend on each other, so they run on an executor
# (:mod:`servetune.executor`). Each runs on its own *fork* of the simulator as it was when
# the batch started, and what each fork learned comes back as a :class:`SimTally`, merged
# into the simulator in the batch's order. The serial path forks too, so a fork never
# sees what another search of its batch simulated: the answers, the simulation counts and
# the caches are the same, byte for byte, on any backend and any number of workers.


def fork_simulator(sim: Simulator) -> Simulator:
    """A copy of ``sim`` for one search of a batch, its counters at zero: ``sim.fork()``
    when the simulator has one, else a shallow copy (a simulator whose ``run`` keeps no
    state but its counters, as the tests' stand-ins)."""
    fork = getattr(sim, "fork", None)
    if callable(fork):
        return fork()
    child = copy.copy(sim)
    child.simulations = 0
    child.simulation_s = 0.0
    return child


def tally_of(child: Simulator) -> SimTally:
    """What a fork did (``child.tally()`` when it has one, else its counters)."""
    tally = getattr(child, "tally", None)
    if callable(tally):
        return tally()
    return SimTally(child.simulations, child.simulation_s)


def merge_tally(sim: Simulator, tally: SimTally) -> None:
    """Add a fork's tally to ``sim`` (``sim.merge(tally)`` when it has one, else the
    counters)."""
    merge = getattr(sim, "merge", None)
    if callable(merge):
        merge(tally)
        return
    sim.simulations += tally.simulations
    sim.simulation_s += tally.simulation_s


@dataclass(frozen=True)
class GoodputTask:
    """One goodput search of a batch: :func:`find_goodput`'s arguments but the simulator."""

    policy: Any
    start_scale: float
    rel_tol: float
    prune_at: float | None = None
    factor: float = 1.25


def _goodput_task(sim: Simulator, task: GoodputTask) -> tuple[GoodputResult[SimPoint], SimTally]:
    child = fork_simulator(sim)
    est = find_goodput(child, task.policy, start_scale=task.start_scale, factor=task.factor,
                       rel_tol=task.rel_tol, prune_at=task.prune_at)
    return est, tally_of(child)


def find_goodputs(
    sim: Simulator, tasks: list[GoodputTask], executor: Executor | None = None, *,
    each: Callable[[int, GoodputResult[SimPoint]], Any] | None = None,
) -> list[GoodputResult[SimPoint]]:
    """The goodput search of every task, as one batch on ``executor`` (default: in this
    process), each on a fork of ``sim``; the forks' tallies are merged into ``sim`` in
    task order, and ``each(i, estimate)`` is called in that order as results arrive."""

    def merged(i: int, out: tuple[GoodputResult[SimPoint], SimTally]) -> None:
        merge_tally(sim, out[1])
        if each is not None:
            each(i, out[0])

    results = (executor or SerialExecutor()).map(_goodput_task, tasks, shared=sim,
                                                 each=merged)
    return [est for est, _ in results]


@dataclass
class Evaluated:
    index: int
    knobs: Knobs
    predicted_rate_per_s: float
    binding: Condition | None  # what the model says limits it (None: no model prediction)
    goodput: GoodputResult[SimPoint]
    policy: Any = None
    label: str = ""

    def as_dict(self) -> dict[str, Any]:
        best = self.goodput.best_point
        return {
            "label": self.label,
            "knobs": self.knobs.as_dotted(),
            "predicted_rate_per_s": self.predicted_rate_per_s,
            "binding": self.binding.key if self.binding is not None else "",
            "simulated_rate_per_s": self.goodput.rate_per_s,
            "passed": self.goodput.passed,
            "simulations": len(self.goodput.points),
            "measured_at_goodput": best.measured if best else None,
        }


@dataclass
class LoopResult:
    best: Evaluated | None
    evaluated: list[Evaluated]
    iterations: list[dict[str, Any]]
    calibration: Calibration
    solver_statuses: list[list[str]]
    solver_s: float
    converged: bool
    first_instance: MilpInstance | None = None
    first_status: str = ""
    stopped_by: str = STOP_CONVERGED  # one of the STOP_* values
    # How far the recalibrated model was off, and whether the local search ran
    # (:func:`model_error`, plus ``"fallback"``).
    model_error: dict[str, Any] = field(default_factory=dict)


def recalibrate(
    fluid: FluidModel, evaluated: list[Evaluated], base: Calibration
) -> Calibration:
    """New multipliers for the model's TTFT, TPOT and KV predictions.

    For a latency metric that the simulator saw fail just above a candidate's goodput
    (it binds in reality), the multiplier is set so that the model's prediction at the
    simulated goodput equals the target: the model then reproduces the goodput the
    simulator found. Otherwise the old multiplier moves half-way (in log space) towards
    measured / predicted at the goodput, so near-saturation noise cannot swing it.
    Geometric means over candidates; clamped."""
    measured: dict[str, list[float]] = {"ttft": [], "tpot": [], "kv": []}
    binding: dict[str, list[float]] = {"ttft": [], "tpot": []}
    model = fluid.with_calibration(base)
    for ev in evaluated:
        pt = ev.goodput.best_point
        if pt is None:
            continue
        pred = model.evaluate(ev.knobs, pt.rate_per_s)
        if "ttft_q_s" not in pred:
            continue
        for key, value in pt.measured.items():
            if not (value and math.isfinite(value) and value > 0):
                continue
            cond = _latency_condition(key)
            if cond is not None:
                fam = cond.family.value
                p = pred[f"{fam}_q_s"].get(cond.request_class)
                if p and p > 0 and math.isfinite(p):
                    measured[fam].append(value / p)
            elif key == "kv_peak_tokens":
                p = pred.get("kv_q_tokens")
                if p and p > 0:
                    measured["kv"].append(value / p)
        above = [q for q in ev.goodput.points if not q.meets_slo and q.rate_scale > pt.rate_scale]
        if not above:
            continue
        fail = min(above, key=lambda q: q.rate_scale)
        for cls in fail.judged:
            target = fluid.targets.get(cls)
            if target is None:
                continue
            for fam in ("ttft", "tpot"):
                limit = getattr(target, f"{fam}_s")
                # The class's measured q-quantile: its SLO's percentile, or its attainment
                # taken as one (an attainment verdict has no percentile of its own).
                value = fail.measured.get(f"{fam}[{cls}]")
                p = pred[f"{fam}_q_s"].get(cls)
                if (limit and value is not None and value > limit and p and p > 0
                        and math.isfinite(p)):
                    binding[fam].append(limit / p)

    def fit(fam: str, old: float) -> float:
        if binding.get(fam):
            g = float(np.exp(np.mean(np.log(binding[fam]))))
        elif measured[fam]:
            g = float(np.exp(0.5 * np.mean(np.log(measured[fam]))))
        else:
            return old
        return float(np.clip(old * g, *CAL_CLAMP))

    return Calibration(ttft=fit("ttft", base.ttft), tpot=fit("tpot", base.tpot),
                       kv=fit("kv", base.kv))


def _latency_condition(key: str) -> Condition | None:
    """The TTFT or TPOT condition a measured value's key names (None for other keys)."""
    try:
        cond = Condition.parse(key)
    except ValueError:
        return None
    return cond if cond.family in (Family.TTFT, Family.TPOT) else None


def search(
    fluid: FluidModel,
    points: list[Knobs],
    make_policy: Callable[[Knobs], Any],
    sim: Simulator,
    *,
    k: int = 3,
    max_iterations: int = 4,
    max_simulations: int | None = None,
    time_limit_s: float = 600.0,
    rel_tol: float = 0.03,
    log: Callable[[str], Any] | None = None,
    screen: int = 6,
    refine_tol: float | None = 0.01,
    unsure_factor: float = UNSURE_FACTOR,
    local_simulations: int = LOCAL_SIMULATIONS,
    executor: Executor | None = None,
) -> LoopResult:
    """Run the loop of the module docstring over the grid ``points``; then screen up to
    ``screen`` untried step shapes (:func:`_screen`); when the recalibrated model misses
    a simulated candidate by more than ``unsure_factor``, search the incumbent's grid
    neighbours by simulation (:func:`_local_search`, at most ``local_simulations``
    simulations; 0: never); and narrow the answer's goodput bracket to ``refine_tol``
    (:func:`refine_goodput`; ``None``: as searched).

    ``max_iterations`` and ``max_simulations`` (None: no limit) are the work budget: no
    new batch of candidates starts once ``max_simulations`` simulations are spent (a
    started batch finishes; each goodput search is bounded itself). ``time_limit_s`` is
    the wall-clock safety stop (module docstring). Each batch runs on ``executor``
    (default: in this process); the result is the same on any executor."""
    started = time.perf_counter()
    sims_at_start = sim.simulations

    def budget_spent() -> bool:
        return max_simulations is not None and sim.simulations - sims_at_start >= max_simulations

    def out_of_time() -> bool:
        return time.perf_counter() - started > time_limit_s

    stops: set[str] = set()  # the limits that cut the search short
    calibration = fluid.calibration
    cut: set[int] = set()
    evaluated: list[Evaluated] = []
    iterations: list[dict[str, Any]] = []
    statuses: list[list[str]] = []
    solver_s = 0.0
    best_rates: list[float] = []
    # Points the simulator cannot tell apart enter the MILP once (the first of each).
    first_of: dict[tuple, int] = {}
    for i, kn in enumerate(points):
        first_of.setdefault(equivalence_key(kn), i)
    reps = sorted(first_of.values())
    unique = [points[i] for i in reps]
    shapes = [shape_key(kn) for kn in unique]
    converged = False
    stalled = False
    # The incumbent's goodput is narrowed to refine_tol before it serves as a bound, so
    # the bound can be that tight too.
    refined: set[int] = set()
    bar_tol = refine_tol if refine_tol is not None else rel_tol
    first_instance = None
    first_status = ""
    for it in range(max_iterations):
        left = time_limit_s - (time.perf_counter() - started)
        if left <= 0:
            stops.add(STOP_TIME_LIMIT)
            break
        if budget_spent():
            stops.add(STOP_SIMULATIONS)
            break
        model = fluid.with_calibration(calibration)
        t0 = time.perf_counter()
        inst = MilpInstance.build(model, unique)
        # Diversity: the k candidates of a round have k different step shapes (token
        # budget, effective chunk cap). Seats, watermark and queue caps change nothing
        # until they bind, so without this a round spends its simulations on copies of
        # one shape, and a model that ranks the shapes wrongly is never corrected.
        # The solver's own work limits decide where it stops; the time left is only the
        # safety stop (the whole of it: a share of it would depend on the machine).
        top = solve_policy_milp(inst, k=k, time_limit_s=left, excluded=cut, groups=shapes)
        solver_s += time.perf_counter() - t0
        if top.hit_time_limit:
            stops.add(STOP_TIME_LIMIT)
        statuses.append(top.statuses)
        if first_instance is None:
            first_instance = inst
            first_status = top.statuses[0] if top.statuses else "error"
        if stalled:
            # The last round did not improve; go on only while the recalibrated model
            # still promises an untried candidate above the best by more than the
            # tolerance (it was just told where it was wrong).
            leader = max((e for e in evaluated if e.goodput.passed),
                         key=lambda e: (e.goodput.rate_per_s, -e.index))
            promise = top.solutions[0][1].rate_per_s if top.solutions else 0.0
            if promise <= leader.goodput.rate_per_s * (1.0 + rel_tol):
                converged = True
                iterations.append({
                    "iteration": it + 1,
                    "milp_statuses": top.statuses,
                    "milp_objective": top.outcomes[0].objective if top.outcomes else None,
                    "candidates": [],
                    "best_simulated_rate_per_s": leader.goodput.rate_per_s,
                    "best_knobs": leader.knobs.as_dotted(),
                    "calibration": calibration.as_dict(),
                    "stopped": f"no untried candidate is predicted above {promise:.4g} req/s",
                })
                if log:
                    log(f"iteration {it + 1}: stop, the model predicts at most "
                        f"{promise:.2f} req/s for any untried candidate")
                break
        chosen: list[tuple[int, Any]] = list(top.solutions[:k])
        # The round's candidates are one batch. Without an incumbent there is no bar yet:
        # then the best-predicted candidate goes first, alone, to set one, and the others
        # follow as one batch (without it every one of them would search its goodput in
        # full).
        pilot = not any(e.goodput.passed for e in evaluated) and len(chosen) > 1
        batches = [chosen[:1], chosen[1:]] if pilot else [chosen]
        new: list[Evaluated] = []
        done: list[tuple[int, Any]] = []
        for batch in batches:
            if done and budget_spent():
                stops.add(STOP_SIMULATIONS)
                break  # the work budget is spent: keep what this round has simulated
            if done and out_of_time():
                stops.add(STOP_TIME_LIMIT)
                break  # the safety stop: keep what this round has simulated
            _simulate_batch(batch, it, evaluated, new, make_policy, sim, reps=reps,
                            rel_tol=rel_tol, bar_tol=bar_tol, refine_tol=refine_tol,
                            refined=refined, log=log, executor=executor)
            done.extend(batch)
        _cut_simulated(done, model, inst, shapes, cut, rel_tol)
        passing = [e for e in evaluated if e.goodput.passed]
        best = max(passing, key=lambda e: (e.goodput.rate_per_s, -e.index), default=None)
        calibration = recalibrate(fluid, new, calibration)
        iterations.append(
            {
                "iteration": it + 1,
                "milp_statuses": top.statuses,
                "milp_objective": top.outcomes[0].objective if top.outcomes else None,
                "candidates": [e.as_dict() for e in new],
                "best_simulated_rate_per_s": best.goodput.rate_per_s if best else 0.0,
                "best_knobs": best.knobs.as_dotted() if best else None,
                "calibration": calibration.as_dict(),
            }
        )
        if not chosen:
            converged = best is not None
            break
        best_rates.append(best.goodput.rate_per_s if best else 0.0)
        # The best simulated candidate is stable (within tolerance) this round.
        stalled = len(best_rates) >= 2 and best_rates[-1] > 0 and (
            best_rates[-1] <= best_rates[-2] * (1.0 + rel_tol)
        )
    if stalled and not converged:
        converged = True  # stable when the iteration limit came
    if screen > 0 and first_instance is not None:
        stop = _screen(fluid, first_instance, unique, reps, shapes, evaluated, iterations,
                       make_policy, sim, screen=screen, rel_tol=rel_tol, log=log,
                       out_of_time=out_of_time, budget_spent=budget_spent,
                       refine_tol=refine_tol, refined=refined, batch=max(k, 1),
                       executor=executor)
        if stop:
            stops.add(stop)
    # Judge the model as recalibrated; where it is unsure, search by simulation.
    best, error, stop = _judge_and_fall_back(
        fluid.with_calibration(calibration), unique, reps, evaluated, iterations,
        make_policy, sim, rel_tol=rel_tol, refine_tol=refine_tol, refined=refined, log=log,
        out_of_time=out_of_time, budget_spent=budget_spent, unsure_factor=unsure_factor,
        local_simulations=local_simulations if not stops else 0, executor=executor)
    if stop:
        stops.add(stop)
    return LoopResult(
        best=best,
        evaluated=evaluated,
        iterations=iterations,
        calibration=calibration,
        solver_statuses=statuses,
        solver_s=solver_s,
        converged=converged,
        first_instance=first_instance,
        first_status=first_status,
        stopped_by=_stopped_by(stops, converged),
        model_error=error,
    )


def _cut_simulated(done: list[tuple[int, Any]], model: FluidModel, inst: MilpInstance,
                   shapes: list[tuple], cut: set[int], rel_tol: float) -> None:
    """Cut the round's simulated candidates from the MILP, and each one's step-shape
    variants that the model ranks no higher: they add nothing the simulation did not just
    answer."""
    for idx, cand in done:
        cut.add(idx)
        for j, shape in enumerate(shapes):
            if shape == shapes[idx] and j not in cut and (
                _predicted_rate(model, inst, j) <= cand.rate_per_s * (1.0 + rel_tol)
            ):
                cut.add(j)


def _judge_and_fall_back(
    final_model: FluidModel, unique: list[Knobs], reps: list[int],
    evaluated: list[Evaluated], iterations: list[dict[str, Any]],
    make_policy: Callable[[Knobs], Any], sim: Simulator, *, rel_tol: float,
    refine_tol: float | None, refined: set[int], log: Callable[[str], Any] | None,
    out_of_time: Callable[[], bool], budget_spent: Callable[[], bool],
    unsure_factor: float, local_simulations: int, executor: Executor | None,
) -> tuple[Evaluated | None, dict[str, Any], str | None]:
    """The recalibrated model judged against every simulated candidate; where it misses
    one by more than ``unsure_factor`` and an incumbent exists, the incumbent's grid
    neighbours searched by simulation (:func:`_local_search`, at most
    ``local_simulations``; 0: never). Then the answer's goodput narrowed to
    ``refine_tol``. Returns the answer, the model error (with the verdict the loop acted
    on and the fallback's record), and the limit that stopped the fallback (None)."""
    predictions: dict[Knobs, float] = {}
    judged = model_error(final_model, evaluated, factor=unsure_factor, cache=predictions)
    fallback: dict[str, Any] = {"ran": False, "simulations": 0, "moves": 0,
                                "worst_miss_before": judged["worst_miss"]}
    leader = max((e for e in evaluated if e.goodput.passed),
                 key=lambda e: (e.goodput.rate_per_s, -e.index), default=None)
    stop = None
    if judged["unsure"] and leader is not None and local_simulations > 0:
        fallback["ran"] = True
        fallback["from_rate_per_s"] = leader.goodput.rate_per_s
        before = sim.simulations
        stop, moves, batches = _local_search(
            final_model, unique, reps, evaluated, iterations, make_policy, sim,
            rel_tol=rel_tol, refine_tol=refine_tol, refined=refined, log=log,
            out_of_time=out_of_time, budget_spent=budget_spent,
            max_sims=local_simulations, executor=executor,
        )
        fallback["simulations"] = sim.simulations - before
        fallback["moves"] = moves
        fallback["batches"] = batches
    passing = [e for e in evaluated if e.goodput.passed]
    best = max(passing, key=lambda e: (e.goodput.rate_per_s, -e.index), default=None)
    if best is not None and refine_tol is not None and id(best) not in refined:
        best.goodput = refine_goodput(sim, best.policy, best.goodput, rel_tol=refine_tol)
    if fallback["ran"]:
        fallback["to_rate_per_s"] = best.goodput.rate_per_s if best else 0.0
    error = model_error(final_model, evaluated, factor=unsure_factor, cache=predictions)
    error["unsure"] = judged["unsure"]  # the verdict the loop acted on
    error["fallback"] = fallback
    return best, error, stop


def _simulate_batch(
    batch: list[tuple[int, Any]], it: int, evaluated: list[Evaluated], new: list[Evaluated],
    make_policy: Callable[[Knobs], Any], sim: Simulator, *, reps: list[int], rel_tol: float,
    bar_tol: float, refine_tol: float | None, refined: set[int],
    log: Callable[[str], Any] | None, executor: Executor | None,
) -> None:
    """Simulate one batch of a round's MILP candidates (module docstring, step 2) and add
    them, in order, to ``evaluated`` and ``new``.

    The bar: the incumbent (its goodput narrowed first) raised by the tolerance. Only a
    pass above it matters: a candidate starts no lower, and a failure there or below ends
    its search (one simulation). It is fixed for the batch, so the searches are
    independent."""
    leader = _incumbent(evaluated, sim, refine_tol, refined)
    bar = None if leader is None else leader.goodput.rate_scale * (1.0 + bar_tol)
    tasks = []
    for _, cand in batch:
        # Start where the (recalibrated) model points, or at the bar.
        start_scale = max(cand.rate_per_s, 1e-9) / sim.base_rate_per_s
        tasks.append(GoodputTask(make_policy(cand.knobs),
                                 start_scale if bar is None else max(start_scale, bar),
                                 rel_tol, prune_at=bar))

    def record(i: int, est: GoodputResult[SimPoint]) -> None:
        idx, cand = batch[i]
        ev = Evaluated(reps[idx], cand.knobs, cand.rate_per_s, cand.binding, est,
                       tasks[i].policy, label=f"milp#{it + 1}")
        new.append(ev)
        evaluated.append(ev)
        if log:
            log(f"iteration {it + 1}: {_short(cand.knobs)} predicted "
                f"{cand.rate_per_s:.2f} req/s, simulated {_verdict(est)} "
                f"({len(est.points)} simulations)")

    find_goodputs(sim, tasks, executor, each=record)


def work_stop(budget_spent: bool, out_of_time: bool) -> str:
    """Why no new candidate may start: the work budget (``STOP_SIMULATIONS``), else the
    wall-clock safety stop (``STOP_TIME_LIMIT``), else "" (go on)."""
    if budget_spent:
        return STOP_SIMULATIONS
    return STOP_TIME_LIMIT if out_of_time else ""


def _stopped_by(stops: set[str], converged: bool) -> str:
    """Why the search ended: the safety stop above all (the answer then depends on the
    machine), then the simulation budget, then convergence or the iteration limit."""
    for stop in (STOP_TIME_LIMIT, STOP_SIMULATIONS):
        if stop in stops:
            return stop
    return STOP_CONVERGED if converged else STOP_MAX_ITERATIONS


def _screen(
    fluid: FluidModel, inst: MilpInstance, unique: list[Knobs], reps: list[int],
    shapes: list[tuple], evaluated: list[Evaluated], iterations: list[dict[str, Any]],
    make_policy: Callable[[Knobs], Any], sim: Simulator, *, screen: int, rel_tol: float,
    log: Callable[[str], Any] | None, out_of_time: Callable[[], bool],
    budget_spent: Callable[[], bool], refine_tol: float | None = None,
    refined: set[int] | None = None, batch: int = 3, executor: Executor | None = None,
) -> str:
    """Screen the step shapes the loop never tried, one simulation each.

    Within the search's tolerance the model cannot rank shapes whose goodputs differ by a
    few percent, and recalibration fitted to the tried shapes may misjudge the others.
    The simulator settles it cheaply: each untried shape's best point (by the
    uncalibrated model, best first, at most ``screen`` of them) is simulated once at the
    leader's goodput raised by the tolerance; only one that passes can beat the leader,
    and only then is its goodput searched (branch and bound on simulated bounds). The
    shapes go in batches of ``batch`` on ``executor``, each batch at the bar of the
    leader before it (a shape that passes raises the bar for the next batch).

    Returns the limit that cut the screening short (``STOP_TIME_LIMIT`` or
    ``STOP_SIMULATIONS``, checked before each batch), or "" when every shape chosen was
    screened."""
    leader = max((e for e in evaluated if e.goodput.passed),
                 key=lambda e: (e.goodput.rate_per_s, -e.index), default=None)
    if leader is None:
        return ""
    tried = {shape_key(e.knobs) for e in evaluated}
    best_of: dict[tuple, tuple[float, int]] = {}
    for j, shape in enumerate(shapes):
        if shape in tried:
            continue
        rate = _predicted_rate(fluid, inst, j)
        if rate > 0 and (shape not in best_of or rate > best_of[shape][0]):
            best_of[shape] = (rate, j)
    order = sorted(best_of.values(), key=lambda v: (-v[0], v[1]))[:screen]
    screened: list[Evaluated] = []
    stop = ""
    for at in range(0, len(order), batch):
        stop = work_stop(budget_spent(), out_of_time())
        if stop:
            break
        leader = _incumbent(evaluated + screened, sim, refine_tol,
                            refined if refined is not None else set())
        assert leader is not None
        bar = leader.goodput.rate_scale * (1.0 + (refine_tol or rel_tol))
        part = order[at:at + batch]
        # A failure at the bar ends it: it cannot beat the leader by the tolerance.
        tasks = [GoodputTask(make_policy(unique[j]), bar, rel_tol, prune_at=bar)
                 for _, j in part]

        def record(i: int, est: GoodputResult[SimPoint], part: list = part,
                   tasks: list = tasks) -> None:
            rate, j = part[i]
            screened.append(Evaluated(reps[j], unique[j], rate, None, est, tasks[i].policy,
                                      label="screen"))
            if log:
                log(f"screen: {_short(unique[j])} simulated {_verdict(est)} "
                    f"({len(est.points)} simulations)")

        find_goodputs(sim, tasks, executor, each=record)
    if screened:
        _log_stage(evaluated, iterations, screened, "screen")
    return stop


def _log_stage(
    evaluated: list[Evaluated], iterations: list[dict[str, Any]], found: list[Evaluated],
    stage: str,
) -> None:
    """Add a stage's candidates (``screen``, ``local_search``) to those evaluated, and an
    iteration record of them with the best simulated so far."""
    evaluated.extend(found)
    best = max((e for e in evaluated if e.goodput.passed),
               key=lambda e: (e.goodput.rate_per_s, -e.index))
    iterations.append({
        "iteration": len(iterations) + 1,
        stage: True,
        "candidates": [e.as_dict() for e in found],
        "best_simulated_rate_per_s": best.goodput.rate_per_s,
        "best_knobs": best.knobs.as_dotted(),
    })


def _bracket(est: GoodputResult[SimPoint]) -> tuple[float, float | None]:
    """What the simulations say of a candidate's goodput g: ``lo <= g < hi``, ``lo`` the
    highest passing rate (0.0: none passed), ``hi`` the lowest failing rate above it
    (None: none failed above)."""
    lo = est.rate_per_s if est.passed else 0.0
    above = [p.rate_per_s for p in est.points if not p.meets_slo and p.rate_per_s > lo]
    return lo, (min(above) if above else None)


def _miss(predicted: float, lo: float, hi: float | None) -> float | None:
    """The smallest factor by which a prediction misses a goodput known to lie in
    ``[lo, hi)``: 1 when it falls inside, ``predicted / hi`` above, ``lo / predicted``
    below; None when the model predicts no goodput."""
    if not (predicted > 0 and math.isfinite(predicted)):
        return None
    if hi is not None and predicted > hi:
        return predicted / hi
    if lo > predicted:
        return lo / predicted
    return 1.0


def _ratio_stats(rows: list[dict[str, Any]], ratio: str, miss: str) -> dict[str, Any]:
    ratios = [r[ratio] for r in rows if r[ratio] is not None]
    misses = [(r[miss], i) for i, r in enumerate(rows) if r[miss] is not None]
    worst = max(ratios, key=lambda v: (abs(math.log(v)), v), default=None)
    top = max(misses, key=lambda m: (m[0], -m[1]), default=None)
    return {
        "median_ratio": float(np.median(ratios)) if ratios else None,
        "worst_ratio": worst,
        "worst_miss": top[0] if top else None,
        "worst_miss_label": rows[top[1]]["label"] if top else None,
    }


def _predict(model: FluidModel, knobs: list[Knobs], cache: dict[Knobs, float]) -> None:
    """The model's goodput of each of ``knobs`` not yet in ``cache``, into it: the limits
    of all at once (:meth:`FluidModel.limits_many` shares the work of a step shape),
    each rate as :meth:`FluidModel.goodput` gives it."""
    todo = [k for k in dict.fromkeys(knobs) if k not in cache]
    if not todo:
        return
    if not isinstance(model, FluidModel):  # a stand-in with goodput() only (tests)
        cache.update({k: float(model.goodput(k)[0]) for k in todo})
        return
    for k, lims in zip(todo, model.limits_many(todo), strict=True):
        x = binding_limit(lims).x_max
        cache[k] = float(x / model.mean_step_s(x)) if x > 0 else 0.0


def model_error(
    model: FluidModel, evaluated: list[Evaluated], *, factor: float = UNSURE_FACTOR,
    cache: dict[Knobs, float] | None = None,
) -> dict[str, Any]:
    """How far the fluid model was from the simulator on every candidate simulated.

    Per candidate: ``predicted_rate_per_s`` (what the loop used when it proposed it),
    ``recalibrated_rate_per_s`` (``model``, normally as the loop left it), the simulated
    goodput bracket ``[simulated_rate_per_s, simulated_upper_rate_per_s)`` (a candidate
    the bar rejected has only the upper end), ``ratio`` = simulated / recalibrated (only
    when the bracket is closed and something passed) and ``miss`` (:func:`_miss`, the
    smallest error factor consistent with the bracket). Overall: the median and the worst
    ratio (furthest from 1), the worst miss, for the recalibrated model and, with suffix
    ``_as_proposed``, for the predictions as used; ``unsure`` when the recalibrated
    model's worst miss exceeds ``factor``. ``cache`` keeps the model's predictions
    between calls with the same model."""
    cache = {} if cache is None else cache
    _predict(model, [ev.knobs for ev in evaluated], cache)
    rows: list[dict[str, Any]] = []
    for ev in evaluated:
        lo, hi = _bracket(ev.goodput)
        again = cache[ev.knobs]
        pred = ev.predicted_rate_per_s
        closed = ev.goodput.passed and hi is not None
        rows.append({
            "label": ev.label,
            "knobs": ev.knobs.as_dotted(),
            "predicted_rate_per_s": pred,
            "recalibrated_rate_per_s": again,
            "simulated_rate_per_s": lo,
            "simulated_upper_rate_per_s": hi,
            "ratio": lo / again if closed and again > 0 else None,
            "miss": _miss(again, lo, hi),
            "ratio_as_proposed": lo / pred if closed and pred > 0 else None,
            "miss_as_proposed": _miss(pred, lo, hi),
        })
    out: dict[str, Any] = {"factor": factor, "candidates": len(rows),
                           "compared": sum(r["ratio"] is not None for r in rows)}
    out.update(_ratio_stats(rows, "ratio", "miss"))
    proposed = _ratio_stats(rows, "ratio_as_proposed", "miss_as_proposed")
    out.update({f"{k}_as_proposed": v for k, v in proposed.items()})
    out["unsure"] = out["worst_miss"] is not None and out["worst_miss"] > factor
    out["per_candidate"] = rows
    return out


def _axis_order(value: Any) -> tuple[bool, float]:
    """Grid order of a knob's values: None (no cap) above every number."""
    return (value is None, 0.0 if value is None else float(value))


def _local_search(
    model: FluidModel, unique: list[Knobs], reps: list[int], evaluated: list[Evaluated],
    iterations: list[dict[str, Any]], make_policy: Callable[[Knobs], Any], sim: Simulator, *,
    rel_tol: float, refine_tol: float | None, refined: set[int],
    log: Callable[[str], Any] | None, out_of_time: Callable[[], bool],
    budget_spent: Callable[[], bool], max_sims: int, executor: Executor | None = None,
) -> tuple[str, int, list[int]]:
    """Search the incumbent's grid neighbourhood by simulation (module docstring, step 6):
    each neighbourhood one batch on ``executor``, at most ``max_sims`` simulations (no
    batch starts once they are spent; a started one finishes). Candidates it simulates
    join ``evaluated`` (label ``"local"``). Returns the limit that cut it short
    (``STOP_TIME_LIMIT``, ``STOP_SIMULATIONS`` for the loop's budget; "" otherwise,
    including its own ``max_sims``), the number of moves, and the candidates of each
    neighbourhood simulated (one batch each)."""
    names = list(Knobs.FIELDS.values())
    axes = {n: sorted({getattr(k, n) for k in unique}, key=_axis_order) for n in names}
    index_of = {equivalence_key(k): j for j, k in enumerate(unique)}
    started = sim.simulations
    bar_tol = refine_tol if refine_tol is not None else rel_tol
    found: list[Evaluated] = []
    batches: list[int] = []
    moves = 0
    stop = ""

    def known_below(j: int, bar: float) -> bool:
        key = equivalence_key(unique[j])
        return any(not p.meets_slo and p.rate_scale <= bar
                   for e in evaluated + found if equivalence_key(e.knobs) == key
                   for p in e.goodput.points)

    while True:
        stop = work_stop(budget_spent(), out_of_time())
        if stop or sim.simulations - started >= max_sims:
            break
        leader = _incumbent(evaluated + found, sim, refine_tol, refined)
        assert leader is not None
        bar = leader.goodput.rate_scale * (1.0 + bar_tol)
        here = equivalence_key(leader.knobs)
        neighbours: list[int] = []
        for n in names:
            values = axes[n]
            at = values.index(getattr(leader.knobs, n))
            for step in (-1, 1):
                if not 0 <= at + step < len(values):
                    continue
                kn = replace(leader.knobs, **{n: values[at + step]})
                j = index_of.get(equivalence_key(kn))
                if (j is not None and equivalence_key(unique[j]) != here
                        and j not in neighbours and not known_below(j, bar)):
                    neighbours.append(j)
        tasks = [GoodputTask(make_policy(unique[j]), bar, rel_tol, prune_at=bar)
                 for j in neighbours]

        def record(i: int, est: GoodputResult[SimPoint], neighbours: list = neighbours,
                   tasks: list = tasks) -> None:
            j = neighbours[i]
            rate, binding, _ = model.goodput(unique[j])
            found.append(Evaluated(reps[j], unique[j], float(rate), binding, est,
                                   tasks[i].policy, label="local"))
            if log:
                log(f"local search: {_short(unique[j])} simulated {_verdict(est)} "
                    f"({len(est.points)} simulations)")

        ests = find_goodputs(sim, tasks, executor, each=record)
        batches.append(len(tasks))
        # A neighbour that passed the bar moves the search: to the best candidate
        # simulated (the next incumbent), whose neighbourhood is searched next.
        if not any(est.passed and est.rate_scale >= bar for est in ests):
            break
        moves += 1
    if found:
        _log_stage(evaluated, iterations, found, "local_search")
    return stop, moves, batches


def _incumbent(
    evaluated: list[Evaluated], sim: Simulator, refine_tol: float | None, refined: set[int]
) -> Evaluated | None:
    """The best passing candidate so far, its goodput narrowed to ``refine_tol`` once."""
    leader = max((e for e in evaluated if e.goodput.passed),
                 key=lambda e: (e.goodput.rate_per_s, -e.index), default=None)
    if leader is not None and refine_tol is not None and id(leader) not in refined:
        leader.goodput = refine_goodput(sim, leader.policy, leader.goodput, rel_tol=refine_tol)
        refined.add(id(leader))
    return leader


def _verdict(est: GoodputResult[SimPoint]) -> str:
    if est.passed:
        return f"{est.rate_per_s:.2f} req/s"
    low = min((p.rate_per_s for p in est.points), default=0.0)
    return f"no pass (lowest rate tried {low:.2f} req/s)"


def _predicted_rate(model: FluidModel, inst: MilpInstance, p: int) -> float:
    """The model's goodput of point p: x* / t(x*) at its tightest limit x*."""
    x = inst.x_tightest(p)
    if not (x > 0 and math.isfinite(x)):
        return 0.0
    return float(x / model.mean_step_s(x))


def equivalence_key(k: Knobs) -> tuple:
    """Knobs the simulator cannot tell apart share a key (the knob table's rule: a
    per-request chunk cap at or above the step budget caps nothing, the budget already
    does); the values in ``Knobs.FIELDS`` order."""
    return knob_table.equivalence_key(k.as_dotted())


def shape_key(k: Knobs) -> tuple:
    """The step shape: what one step may hold (token budget, effective chunk cap). The
    other knobs (seats, watermark, queue caps) only decide who waits, and change nothing
    until they bind, which the model says."""
    return equivalence_key(k)[1:3]


def _short(k: Knobs) -> str:
    return knob_table.short_text(k.as_dotted(), sep="=", join=" ")
