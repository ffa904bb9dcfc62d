"""Background-job placement solve: the CP-SAT model of
:mod:`servetune.models.placement_cpsat` in two stages (value, then early finish)."""

from __future__ import annotations

import time

from servetune.models.placement_cpsat import (
    PlacementInstance,
    PlacementSolution,
    add_finish_objective,
    add_value_objective,
    build_model,
    decode,
)
from servetune.solvers.drivers import SolveStatus, solve_cpsat


def solve_placement(inst: PlacementInstance, *, time_limit_s: float = 20.0) -> PlacementSolution:
    """Solve the model of :mod:`servetune.models.placement_cpsat` in two stages (half the
    time limit each): maximize completed value, then minimize the weighted finish slots."""
    t0 = time.perf_counter()
    m, v = build_model(inst)
    add_value_objective(m, v)
    outcome, solver = solve_cpsat(m, time_limit_s=time_limit_s / 2)
    if not outcome.status.has_solution:
        # Every job may be left out, so the model is always feasible; no incumbent
        # means the time limit was too short.
        raise RuntimeError(f"placement: {outcome.message or outcome.status.value}")
    status = "optimal" if outcome.status == SolveStatus.OPTIMAL else "feasible"
    add_finish_objective(m, v, inst, int(round(outcome.objective or 0.0)), solver.Value)
    outcome2, solver2 = solve_cpsat(m, time_limit_s=time_limit_s / 2)
    if outcome2.status.has_solution:
        solver = solver2
        if outcome2.status != SolveStatus.OPTIMAL:
            status = "feasible"
    return decode(inst, v, solver.Value, status, time.perf_counter() - t0)
