"""Solver drivers: run HiGHS (a Pyomo model through Pyomo's appsi, or a model built in
matrix form through highspy) and CP-SAT within limits and report one explicit status,
and enumerate the best k solutions with no-good cuts.

Two kinds of limit. The *work* limits (HiGHS: branch-and-bound nodes and simplex
iterations; CP-SAT: deterministic time with a fixed number of workers) stop a solve at
the same point on any machine, so they decide results. The wall-clock ``time_limit_s``
is only a safety stop: when it fires the answer depends on the machine's speed, and
the outcome says so (``stopped_by == "time_limit"``) for the caller to report.

Statuses (``SolveStatus``):

- ``optimal``: the solver proved the solution optimal (within its gap);
- ``feasible_at_time_limit``: the wall-clock safety stop ended it with a solution in hand;
- ``infeasible``: no solution exists (proved);
- ``error``: anything else (no solution at a limit, numerical trouble, a crash);
  the message says what happened;
- ``feasible_at_work_limit``: a work limit ended it with a solution in hand.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import highspy
import numpy as np
import pyomo.environ as pyo
from pyomo.common.tee import capture_output
from pyomo.contrib import appsi
from pyomo.contrib.appsi.base import TerminationCondition as TC

if TYPE_CHECKING:  # ortools loads only when a CP-SAT model is solved
    from ortools.sat.python import cp_model


class SolveStatus(StrEnum):
    OPTIMAL = "optimal"
    FEASIBLE_AT_TIME_LIMIT = "feasible_at_time_limit"
    INFEASIBLE = "infeasible"
    ERROR = "error"
    FEASIBLE_AT_WORK_LIMIT = "feasible_at_work_limit"

    @property
    def has_solution(self) -> bool:
        return self in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE_AT_TIME_LIMIT,
                        SolveStatus.FEASIBLE_AT_WORK_LIMIT)


# Work limits, generous: the optimizer's MILPs and CP-SATs (a few hundred binaries) solve
# at the root or in a few hundred nodes, so these never end a shipped example's solve;
# they bound a pathological one at the same point on every machine.
HIGHS_MAX_NODES = 1_000_000
HIGHS_MAX_SIMPLEX_ITERATIONS = 50_000_000
# CP-SAT's deterministic time (its own work units, about seconds on a fast core), with one
# worker: the lane model solves in well under 0.1 of them.
CPSAT_MAX_DETERMINISTIC_TIME = 60.0


@dataclass
class SolveOutcome:
    status: SolveStatus
    objective: float | None = None
    solve_s: float = 0.0
    message: str = ""
    solution: Any = None  # the model-specific decoded solution
    # "time_limit" (the wall-clock safety stop fired: the result depends on the machine),
    # "work_limit" (a deterministic limit ended it), "" (the solve finished).
    stopped_by: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": self.status.value,
            "objective": self.objective,
            "message": self.message,
        }


@dataclass
class TopK:
    """The best k solutions found one after another, each cut off before the next."""

    outcomes: list[SolveOutcome] = field(default_factory=list)
    out_of_time: bool = False  # the safety time ran out before all k solves had run

    @property
    def solutions(self) -> list[Any]:
        return [o.solution for o in self.outcomes if o.status.has_solution]

    @property
    def statuses(self) -> list[str]:
        return [o.status.value for o in self.outcomes]

    @property
    def solve_s(self) -> float:
        return sum(o.solve_s for o in self.outcomes)

    @property
    def hit_time_limit(self) -> bool:
        """Whether the wall-clock safety stop cut any solve short (or left none to run)."""
        return self.out_of_time or any(o.stopped_by == "time_limit" for o in self.outcomes)


# Why HiGHS stopped, from appsi's termination condition and from highspy's model status.
_APPSI_STOPPED = {
    TC.optimal: "optimal",
    TC.maxTimeLimit: "time_limit",
    TC.maxIterations: "work_limit",  # appsi's name for HiGHS's node and iteration limits
    TC.infeasible: "infeasible",
    TC.infeasibleOrUnbounded: "infeasible",
}
_HIGHS_STOPPED = {
    highspy.HighsModelStatus.kOptimal: "optimal",
    highspy.HighsModelStatus.kTimeLimit: "time_limit",
    highspy.HighsModelStatus.kIterationLimit: "work_limit",
    highspy.HighsModelStatus.kSolutionLimit: "work_limit",  # HiGHS's node limit
    highspy.HighsModelStatus.kInfeasible: "infeasible",
    highspy.HighsModelStatus.kUnboundedOrInfeasible: "infeasible",
}


def _status_of(stopped: str, *, has_solution: bool) -> tuple[SolveStatus, str]:
    """A solve's status and ``stopped_by`` from why the solver stopped (``optimal``,
    ``time_limit``, ``work_limit``, ``infeasible`` or anything else) and whether it holds a
    feasible solution: a limit with no solution in hand is an error."""
    if stopped == "optimal":
        return SolveStatus.OPTIMAL, ""
    if stopped == "time_limit":
        return (SolveStatus.FEASIBLE_AT_TIME_LIMIT if has_solution else SolveStatus.ERROR,
                stopped)
    if stopped == "work_limit":
        return (SolveStatus.FEASIBLE_AT_WORK_LIMIT if has_solution else SolveStatus.ERROR,
                stopped)
    if stopped == "infeasible":
        return SolveStatus.INFEASIBLE, ""
    return SolveStatus.ERROR, ""


def _highs() -> Any:
    solver = appsi.solvers.Highs()
    if not solver.available():
        return None
    return solver


def solve_highs(
    model: pyo.ConcreteModel, *, time_limit_s: float, solver: Any = None, mip_gap: float = 1e-6,
    max_nodes: int = HIGHS_MAX_NODES, max_simplex_iterations: int = HIGHS_MAX_SIMPLEX_ITERATIONS,
) -> tuple[SolveOutcome, Any]:
    """Solve a Pyomo model with HiGHS (persistent appsi interface, so a later call after
    adding a cut re-uses the loaded model). Returns the outcome and the solver to re-use.

    ``max_nodes`` and ``max_simplex_iterations`` are the work limits that decide where a
    hard solve stops; ``time_limit_s`` is the wall-clock safety stop (module docstring)."""
    if solver is None:
        solver = _highs()
        if solver is None:
            return SolveOutcome(SolveStatus.ERROR, message="HiGHS (highspy) is not available"), None
    solver.config.time_limit = max(float(time_limit_s), 0.01)
    # HiGHS options passed through appsi as they are (highspy's setOptionValue).
    solver.highs_options = {"mip_max_nodes": int(max_nodes),
                            "simplex_iteration_limit": int(max_simplex_iterations)}
    solver.config.mip_gap = mip_gap
    solver.config.load_solution = False
    solver.config.stream_solver = False
    start = time.perf_counter()
    try:
        res = solver.solve(model)
    except Exception as exc:  # the solver's own failure; reported, never raised
        return SolveOutcome(
            SolveStatus.ERROR, solve_s=time.perf_counter() - start, message=f"HiGHS: {exc}"
        ), solver
    elapsed = time.perf_counter() - start
    tc = res.termination_condition
    status, stopped_by = _status_of(_APPSI_STOPPED.get(tc, "other"),
                                    has_solution=res.best_feasible_objective is not None)
    if status.has_solution:
        res.solution_loader.load_vars()
    msg = "" if status != SolveStatus.ERROR else f"HiGHS stopped: {tc.name}"
    return SolveOutcome(
        status,
        objective=float(res.best_feasible_objective) if status.has_solution else None,
        solve_s=elapsed,
        message=msg,
        stopped_by=stopped_by,
    ), solver


_highs_banner_shown = False


def new_highs() -> highspy.Highs:
    """An empty HiGHS instance that writes nothing (the first one of a process prints
    HiGHS's banner to stdout, which would break ``--json`` output: it is caught here)."""
    global _highs_banner_shown
    if _highs_banner_shown:
        highs = highspy.Highs()
    else:
        with capture_output(capture_fd=True):
            highs = highspy.Highs()
        _highs_banner_shown = True
    highs.setOptionValue("output_flag", False)
    return highs


def solve_highspy(
    highs: highspy.Highs, *, time_limit_s: float, mip_gap: float = 1e-6,
    max_nodes: int = HIGHS_MAX_NODES, max_simplex_iterations: int = HIGHS_MAX_SIMPLEX_ITERATIONS,
) -> SolveOutcome:
    """Solve a model loaded in ``highs`` (a model built in matrix form), with the same
    limits and statuses as :func:`solve_highs`. A later call after a change (a bound, a
    row) solves the changed model."""
    for option, value in (("time_limit", max(float(time_limit_s), 0.01)),
                          ("mip_rel_gap", float(mip_gap)), ("mip_max_nodes", int(max_nodes)),
                          ("simplex_iteration_limit", int(max_simplex_iterations))):
        highs.setOptionValue(option, value)
    start = time.perf_counter()
    try:
        highs.run()
    except Exception as exc:  # the solver's own failure; reported, never raised
        return SolveOutcome(SolveStatus.ERROR, solve_s=time.perf_counter() - start,
                            message=f"HiGHS: {exc}")
    elapsed = time.perf_counter() - start
    code = highs.getModelStatus()
    info = highs.getInfo()
    status, stopped_by = _status_of(
        _HIGHS_STOPPED.get(code, "other"),
        has_solution=info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible)
    return SolveOutcome(
        status,
        objective=float(info.objective_function_value) if status.has_solution else None,
        solve_s=elapsed,
        message="" if status != SolveStatus.ERROR else
        f"HiGHS stopped: {highs.modelStatusToString(code)}",
        stopped_by=stopped_by,
    )


# HiGHS's simplex_strategy values: its default (dual) and primal.
_SIMPLEX_DUAL, _SIMPLEX_PRIMAL = 1, 4
# How far from 0 or 1 a binary of a relaxation's solution may be and still count as integral.
INTEGRALITY_TOL = 1e-6


def solve_ideal_highspy(
    highs: highspy.Highs, integer_cols: np.ndarray, *, time_limit_s: float,
) -> SolveOutcome:
    """Solve a MILP loaded in ``highs`` whose formulation is *ideal* (its LP relaxation's
    vertices are integral, as in the convex-hull formulation of a disjunction) through
    its LP relaxation by simplex, which after a bound change (a no-good cut) restarts
    from the last basis in milliseconds, where branch and bound solves its root LP again
    from scratch. A simplex solution is a vertex, so it is the MILP's optimum when its
    ``integer_cols`` are integral; the model's integrality is restored and branch and
    bound runs only when they are not (degenerate numerics). The limits and statuses are
    :func:`solve_highspy`'s."""
    cols = np.asarray(integer_cols, dtype=np.int32)
    n = len(cols)
    start = time.perf_counter()
    highs.changeColsIntegrality(n, cols, np.full(n, highspy.HighsVarType.kContinuous))
    # From scratch primal simplex is the faster (4-6x on the policy MILP); after a cut
    # the last basis stays dual feasible, and dual simplex restarts from it in a few
    # iterations.
    hot = highs.getBasis().valid
    highs.setOptionValue("simplex_strategy", _SIMPLEX_DUAL if hot else _SIMPLEX_PRIMAL)
    relaxed = solve_highspy(highs, time_limit_s=time_limit_s)
    if relaxed.status == SolveStatus.INFEASIBLE:
        return relaxed  # a relaxation without a solution: the MILP has none either
    if relaxed.status == SolveStatus.OPTIMAL:
        values = np.asarray(highs.getSolution().col_value)[cols]
        if np.all(np.abs(values - np.round(values)) <= INTEGRALITY_TOL):
            return relaxed
    highs.changeColsIntegrality(n, cols, np.full(n, highspy.HighsVarType.kInteger))
    highs.setOptionValue("simplex_strategy", _SIMPLEX_DUAL)
    exact = solve_highspy(highs, time_limit_s=max(time_limit_s - relaxed.solve_s, 0.0))
    exact.solve_s = time.perf_counter() - start
    return exact


def top_k_highs(
    k: int,
    *,
    solve: Callable[[float], SolveOutcome],
    decode: Callable[[], Any],
    cut: Callable[[Any], None],
    time_limit_s: float,
) -> TopK:
    """Solve a model loaded in HiGHS with ``solve(seconds left)`` (:func:`solve_highspy`,
    or :func:`solve_ideal_highspy` for an ideal formulation), record, cut the solution off
    with ``cut`` (a no-good cut: it changes the model so that the decoded solution, and
    whatever the caller counts as the same, is infeasible), and repeat up to ``k`` times
    or until the time limit is spent or the model turns infeasible."""
    out = TopK()
    deadline = time.perf_counter() + time_limit_s
    for _ in range(max(k, 1)):
        left = deadline - time.perf_counter()
        if left <= 0:
            out.out_of_time = True
            break
        outcome = solve(left)
        if outcome.status.has_solution:
            outcome.solution = decode()
        out.outcomes.append(outcome)
        if not outcome.status.has_solution:
            break
        cut(outcome.solution)
    return out


def preload_cpsat() -> None:
    """Import OR-Tools now, before a run's work begins: a command that will solve CP-SAT
    models calls this first, so that its slow import (and a Ctrl-C during it) happens
    before any work rather than halfway through a run."""
    # lazy: as in cpsat_status; this is the place a command chooses to pay it
    from ortools.sat.python import cp_model  # noqa: F401


def cpsat_status(code: int) -> SolveStatus:
    """Map an OR-Tools CP-SAT status code to ours."""
    # lazy: OR-Tools takes 0.5 s to import; runs that solve only MILPs never need it
    from ortools.sat.python import cp_model

    if code == cp_model.OPTIMAL:
        return SolveStatus.OPTIMAL
    if code == cp_model.FEASIBLE:
        return SolveStatus.FEASIBLE_AT_TIME_LIMIT
    if code == cp_model.INFEASIBLE:
        return SolveStatus.INFEASIBLE
    return SolveStatus.ERROR


# CP-SAT's random_seed is a 32-bit signed integer.
CPSAT_SEEDS = 2**31


def solve_cpsat(
    model: cp_model.CpModel, *, time_limit_s: float, seed: int = 0, workers: int = 1,
    max_deterministic_time: float = CPSAT_MAX_DETERMINISTIC_TIME,
) -> tuple[SolveOutcome, cp_model.CpSolver]:
    """Solve a CP-SAT model deterministically: a fixed seed and number of workers (one by
    default; CP-SAT's search with several workers depends on thread timing), stopped by
    ``max_deterministic_time`` (work, the same on every machine) or by ``time_limit_s``
    (the wall-clock safety stop, module docstring). Any whole ``seed`` is accepted: CP-SAT
    takes a 32-bit one, so it gets ``seed`` modulo 2^31."""
    # lazy: as in cpsat_status
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(float(time_limit_s), 0.01)
    solver.parameters.max_deterministic_time = float(max_deterministic_time)
    solver.parameters.random_seed = int(seed) % CPSAT_SEEDS
    solver.parameters.num_workers = int(workers)
    start = time.perf_counter()
    try:
        code = solver.Solve(model)
    except Exception as exc:  # reported, never raised
        return SolveOutcome(SolveStatus.ERROR, message=f"CP-SAT: {exc}"), solver
    status = cpsat_status(code)
    stopped_by = ""
    if code not in (cp_model.OPTIMAL, cp_model.INFEASIBLE, cp_model.MODEL_INVALID):
        # Stopped by a limit: the work limit when its deterministic time is spent,
        # otherwise the wall clock.
        if solver.deterministic_time >= 0.999 * float(max_deterministic_time):
            stopped_by = "work_limit"
            if status == SolveStatus.FEASIBLE_AT_TIME_LIMIT:
                status = SolveStatus.FEASIBLE_AT_WORK_LIMIT
        else:
            stopped_by = "time_limit"
    msg = "" if status != SolveStatus.ERROR else f"CP-SAT stopped: {solver.StatusName(code)}"
    return SolveOutcome(
        status,
        objective=float(solver.ObjectiveValue()) if status.has_solution else None,
        solve_s=time.perf_counter() - start,
        message=msg,
        stopped_by=stopped_by,
    ), solver
