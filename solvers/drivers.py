"""Solver drivers: run HiGHS (through Pyomo's appsi) and CP-SAT with a time limit and
report one explicit status, and enumerate the best k solutions with no-good cuts.

Statuses (``SolveStatus``):

- ``optimal``: the solver proved the solution optimal (within its gap);
- ``feasible_at_time_limit``: the time limit stopped it with a solution in hand;
- ``infeasible``: no solution exists (proved);
- ``error``: anything else (no solution at the time limit, numerical trouble, a crash);
  the message says what happened.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import pyomo.environ as pyo
from pyomo.contrib import appsi
from pyomo.contrib.appsi.base import TerminationCondition as TC

if TYPE_CHECKING:  # ortools loads only when a CP-SAT model is solved
    from ortools.sat.python import cp_model


class SolveStatus(StrEnum):
    OPTIMAL = "optimal"
    FEASIBLE_AT_TIME_LIMIT = "feasible_at_time_limit"
    INFEASIBLE = "infeasible"
    ERROR = "error"

    @property
    def has_solution(self) -> bool:
        return self in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE_AT_TIME_LIMIT)


@dataclass
class SolveOutcome:
    status: SolveStatus
    objective: float | None = None
    solve_s: float = 0.0
    message: str = ""
    solution: Any = None  # the model-specific decoded solution

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

    @property
    def solutions(self) -> list[Any]:
        return [o.solution for o in self.outcomes if o.status.has_solution]

    @property
    def statuses(self) -> list[str]:
        return [o.status.value for o in self.outcomes]

    @property
    def solve_s(self) -> float:
        return sum(o.solve_s for o in self.outcomes)


def _highs() -> Any:
    solver = appsi.solvers.Highs()
    if not solver.available():
        return None
    return solver


def solve_highs(
    model: pyo.ConcreteModel, *, time_limit_s: float, solver: Any = None, mip_gap: float = 1e-6
) -> tuple[SolveOutcome, Any]:
    """Solve a Pyomo model with HiGHS (persistent appsi interface, so a later call after
    adding a cut re-uses the loaded model). Returns the outcome and the solver to re-use."""
    if solver is None:
        solver = _highs()
        if solver is None:
            return SolveOutcome(SolveStatus.ERROR, message="HiGHS (highspy) is not available"), None
    solver.config.time_limit = max(float(time_limit_s), 0.01)
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
    has_solution = res.best_feasible_objective is not None
    if tc == TC.optimal:
        status = SolveStatus.OPTIMAL
    elif tc == TC.maxTimeLimit and has_solution:
        status = SolveStatus.FEASIBLE_AT_TIME_LIMIT
    elif tc in (TC.infeasible, TC.infeasibleOrUnbounded):
        status = SolveStatus.INFEASIBLE
    else:
        status = SolveStatus.ERROR
    if status.has_solution:
        res.solution_loader.load_vars()
    msg = "" if status != SolveStatus.ERROR else f"HiGHS stopped: {tc.name}"
    return SolveOutcome(
        status,
        objective=float(res.best_feasible_objective) if status.has_solution else None,
        solve_s=elapsed,
        message=msg,
    ), solver


def top_k_highs(
    model: pyo.ConcreteModel,
    k: int,
    *,
    binaries: Callable[[pyo.ConcreteModel], list[Any]],
    decode: Callable[[pyo.ConcreteModel], Any],
    time_limit_s: float,
    group: Callable[[pyo.ConcreteModel, Any], list[Any]] | None = None,
) -> TopK:
    """Solve, record, cut the solution off with a no-good cut, and repeat up to ``k``
    times or until the time limit is spent or the model turns infeasible.

    With ``group`` (the binaries of the solutions the caller counts as the same as a
    decoded one), the cut removes that whole group (``sum(group) = 0``), so the k
    solutions are k different groups."""
    out = TopK()
    deadline = time.perf_counter() + time_limit_s
    solver = None
    model.no_good = pyo.ConstraintList()
    for _ in range(max(k, 1)):
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        outcome, solver = solve_highs(model, time_limit_s=left, solver=solver)
        if outcome.status.has_solution:
            outcome.solution = decode(model)
        out.outcomes.append(outcome)
        if not outcome.status.has_solution:
            break
        if group is not None:
            model.no_good.add(sum(group(model, outcome.solution)) == 0)
            continue
        ones = [b for b in binaries(model) if pyo.value(b) > 0.5]
        zeros = [b for b in binaries(model) if pyo.value(b) <= 0.5]
        model.no_good.add(sum(1 - b for b in ones) + sum(zeros) >= 1)
    return out


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


def solve_cpsat(
    model: cp_model.CpModel, *, time_limit_s: float, seed: int = 0, workers: int = 1
) -> tuple[SolveOutcome, cp_model.CpSolver]:
    """Solve a CP-SAT model deterministically (one worker, fixed seed) within the limit."""
    # lazy: as in cpsat_status
    from ortools.sat.python import cp_model

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(float(time_limit_s), 0.01)
    solver.parameters.random_seed = int(seed)
    solver.parameters.num_search_workers = int(workers)
    start = time.perf_counter()
    try:
        code = solver.Solve(model)
    except Exception as exc:  # reported, never raised
        return SolveOutcome(SolveStatus.ERROR, message=f"CP-SAT: {exc}"), solver
    status = cpsat_status(code)
    msg = "" if status != SolveStatus.ERROR else f"CP-SAT stopped: {solver.StatusName(code)}"
    return SolveOutcome(
        status,
        objective=float(solver.ObjectiveValue()) if status.has_solution else None,
        solve_s=time.perf_counter() - start,
        message=msg,
    ), solver
