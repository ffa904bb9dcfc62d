"""Background-job placement (CP-SAT): put the work of batch jobs into the spare capacity
that interactive traffic leaves on each GPU type in each time slot.

Sets
    J  jobs;  T  GPU types;  S  time slots 0..H-1 (the horizon)
Parameters
    cap[t,s]   spare work units of type t in slot s (all its replicas together)
    W[j]       work units of job j
    r[j]       first slot job j may use (its release, rounded up to a slot start)
    d[j]       last slot job j may use (its deadline, rounded down to a slot end)
    v[j]       value of completing job j by its deadline (integer, scaled)
    w[j]       weight of job j's finish time (>= 1; higher for higher-priority jobs)
    pre[j]     job j may pause between slots and move between types
Variables
    x[j,t,s]   in Z>=0   work of job j done on type t in slot s (only for r[j] <= s <= d[j])
    done[j]    in {0,1}  job j completes by its deadline
    act[j,s]   in {0,1}  job j does work in slot s
    fin[j]     in Z      last slot in which job j works
    on[j,t]    in {0,1}  (non-preemptible only) the one type job j runs on
    start[j,s] in {0,1}  (non-preemptible only) job j starts in slot s
Constraints
    complete[j]:    sum_{t,s} x[j,t,s] = W[j] done[j]      (no partial work is scheduled)
    cumulative[t,s]: sum_j x[j,t,s] <= cap[t,s]
    active[j,s]:    sum_t x[j,t,s] <= W[j] act[j,s];  fin[j] >= s act[j,s]
    non-preemptible j: sum_t on[j,t] = done[j];  x[j,t,s] <= W[j] on[j,t];
                    sum_s start[j,s] <= 1;  act[j,s] <= act[j,s-1] + start[j,s];
                    sum_t x[j,t,s] >= act[j,s]  (a started job keeps working until done)
Objective (lexicographic, two solves by :func:`servetune.solvers.placement.solve_placement`)
    1. maximize  sum_j v[j] done[j]                      (completed value)
    2. with that value fixed, minimize  sum_j w[j] fin[j]   (weighted lateness fin - d
       of the completed jobs, d being fixed: finish as early as the value allows, the
       higher-priority jobs first)

Jobs left out are explained by :func:`explain_unplaced` (window shorter than a slot,
more work than the spare capacity in the window, no contiguous run long enough, or
crowded out by more valuable jobs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ortools.sat.python import cp_model


@dataclass(frozen=True)
class PlacementJob:
    id: str
    work: int  # units
    release_slot: int
    deadline_slot: int  # last usable slot (inclusive); < release_slot = empty window
    value: int
    preemptible: bool = True
    weight: int = 1


@dataclass(frozen=True)
class PlacementInstance:
    types: tuple[str, ...]
    n_slots: int
    cap: dict[tuple[str, int], int]  # (type, slot) -> spare units
    jobs: tuple[PlacementJob, ...]


@dataclass
class JobPlacement:
    id: str
    done: bool
    finish_slot: int | None
    work: dict[tuple[str, int], int] = field(default_factory=dict)  # (type, slot) -> units


@dataclass
class PlacementSolution:
    status: str  # optimal | feasible
    value: int
    total_finish: int
    jobs: dict[str, JobPlacement]
    solver_s: float


def _window(job: PlacementJob, n_slots: int) -> range:
    return range(max(0, job.release_slot), min(n_slots - 1, job.deadline_slot) + 1)


def build_model(inst: PlacementInstance) -> tuple[cp_model.CpModel, dict]:
    """The CP-SAT model of the module docstring; returns the model and its variables."""
    m = cp_model.CpModel()
    x: dict[tuple[str, str, int], cp_model.IntVar] = {}
    done: dict[str, cp_model.IntVar] = {}
    act: dict[tuple[str, int], cp_model.IntVar] = {}
    fin: dict[str, cp_model.IntVar] = {}
    fin_lo: dict[str, int] = {}
    for j in inst.jobs:
        window = _window(j, inst.n_slots)
        done[j.id] = m.NewBoolVar(f"done[{j.id}]")
        lo = window.start if len(window) else 0
        hi = window[-1] if len(window) else 0
        fin[j.id] = m.NewIntVar(lo, hi, f"fin[{j.id}]")
        fin_lo[j.id] = lo
        if not len(window):
            m.Add(done[j.id] == 0)
            continue
        for s in window:
            act[j.id, s] = m.NewBoolVar(f"act[{j.id},{s}]")
            for t in inst.types:
                ub = min(j.work, inst.cap.get((t, s), 0))
                x[j.id, t, s] = m.NewIntVar(0, max(0, ub), f"x[{j.id},{t},{s}]")
            m.Add(sum(x[j.id, t, s] for t in inst.types) <= j.work * act[j.id, s])
            m.Add(fin[j.id] >= s * act[j.id, s])
        # complete[j]
        m.Add(sum(x[j.id, t, s] for t in inst.types for s in window) == j.work * done[j.id])
        if not j.preemptible:
            on = {t: m.NewBoolVar(f"on[{j.id},{t}]") for t in inst.types}
            m.Add(sum(on.values()) == done[j.id])
            for t in inst.types:
                for s in window:
                    m.Add(x[j.id, t, s] <= j.work * on[t])
            start = {s: m.NewBoolVar(f"start[{j.id},{s}]") for s in window}
            m.Add(sum(start.values()) <= 1)
            for s in window:
                prev = act[j.id, s - 1] if s - 1 in window else 0
                m.Add(act[j.id, s] <= prev + start[s])
                m.Add(sum(x[j.id, t, s] for t in inst.types) >= act[j.id, s])
    # cumulative[t,s]
    for t in inst.types:
        for s in range(inst.n_slots):
            terms = [x[j.id, t, s] for j in inst.jobs if (j.id, t, s) in x]
            if terms:
                m.Add(sum(terms) <= inst.cap.get((t, s), 0))
    value = sum(j.value * done[j.id] for j in inst.jobs)
    return m, {"x": x, "done": done, "act": act, "fin": fin, "fin_lo": fin_lo, "value": value}


def add_value_objective(m: cp_model.CpModel, v: dict) -> None:
    """Stage 1: maximize the completed value."""
    m.Maximize(v["value"])


def add_finish_objective(
    m: cp_model.CpModel, v: dict, inst: PlacementInstance, best_value: int,
    hint: Callable[[cp_model.IntVar], int],
) -> None:
    """Stage 2: keep stage 1's value and finish early (weighted finish slots).
    ``hint`` gives stage 1's value of a variable, to start the search from its answer."""
    m.ClearObjective()
    m.Add(v["value"] >= best_value)
    for var in list(v["x"].values()) + list(v["done"].values()) + list(v["act"].values()):
        m.AddHint(var, hint(var))
    for j in inst.jobs:
        fin = v["fin"][j.id]
        # Not done: fin is free; pin it to its lower bound so it does not count.
        m.Add(fin == v["fin_lo"][j.id]).OnlyEnforceIf(v["done"][j.id].Not())
    m.Minimize(sum(j.weight * v["fin"][j.id] for j in inst.jobs))


def decode(
    inst: PlacementInstance, v: dict, value_of: Callable[[cp_model.IntVar], int],
    status: str, solver_s: float,
) -> PlacementSolution:
    """Read a solved model back into a :class:`PlacementSolution`."""
    jobs: dict[str, JobPlacement] = {}
    total_finish = 0
    for j in inst.jobs:
        d = bool(value_of(v["done"][j.id]))
        work = {
            (t, s): int(value_of(var))
            for (jid, t, s), var in v["x"].items()
            if jid == j.id and value_of(var) > 0
        }
        fin = max((s for (_t, s) in work), default=None) if d else None
        if fin is not None:
            total_finish += fin
        ordered = dict(sorted(work.items(), key=lambda kv: (kv[0][1], kv[0][0])))
        jobs[j.id] = JobPlacement(j.id, d, fin, ordered)
    value = sum(j.value for j in inst.jobs if jobs[j.id].done)
    return PlacementSolution(status, value, total_finish, jobs, solver_s)


def explain_unplaced(inst: PlacementInstance, sol: PlacementSolution, job_id: str) -> str:
    """Why job ``job_id`` is not in the schedule, in one line."""
    job = next(j for j in inst.jobs if j.id == job_id)
    window = _window(job, inst.n_slots)
    if not len(window):
        return "no whole slot lies between its release and its deadline"
    alone = sum(inst.cap.get((t, s), 0) for t in inst.types for s in window)
    if alone < job.work:
        return (
            f"needs {job.work} work units but only {alone} are spare in its window "
            f"(slots {window.start}-{window[-1]}) even with the GPUs to itself"
        )
    if not job.preemptible:
        best = 0
        for t in inst.types:
            for a in window:
                run = 0
                for s in range(a, window[-1] + 1):
                    if inst.cap.get((t, s), 0) < 1:
                        break
                    run += inst.cap.get((t, s), 0)
                best = max(best, run)
        if best < job.work:
            return (
                f"not preemptible: needs {job.work} units in one unbroken run on one GPU type; "
                f"the longest such run in its window offers {best}"
            )
    used = sum(
        u for p in sol.jobs.values() if p.id != job_id for (_t, s), u in p.work.items()
        if s in window
    )
    return (
        f"crowded out: its window has {alone} spare units, {used} go to jobs that add more "
        f"value, leaving {alone - used}; it needs {job.work}"
    )
