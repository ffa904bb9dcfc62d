"""Capacity-planning solves: the MILP of :mod:`servetune.models.capacity_milp` through
HiGHS, slot by slot when one model is too large, and the explanation when no plan fits."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pyomo.contrib import appsi

from servetune.errors import InfeasibleError
from servetune.models.capacity_milp import (
    CapacityInstance,
    CapacitySolution,
    build_model,
    check_servable,
    decode,
    served_gaps,
    slot_instance,
)
from servetune.solvers.drivers import SolveStatus, solve_highs

if TYPE_CHECKING:
    import pyomo.environ as pyo


def _solve_milp(m: pyo.ConcreteModel, time_limit_s: float) -> tuple[str, float]:
    """Solve a capacity model with HiGHS; returns "optimal", "feasible" (time limit with a
    solution), "infeasible" or the driver's message, and the seconds spent."""
    t0 = time.perf_counter()
    outcome = None
    for presolve in ("on", "off"):
        solver = appsi.solvers.Highs()
        solver.highs_options = {"random_seed": 0, "presolve": presolve}
        outcome, _ = solve_highs(m, time_limit_s=time_limit_s, solver=solver, mip_gap=1e-9)
        spent = time.perf_counter() - t0
        # HiGHS occasionally ends a MIP with an "unknown" model status; presolve off
        # settles it (the model is small), so try once more while time is left.
        if outcome.status != SolveStatus.ERROR or spent >= 0.9 * time_limit_s:
            break
    assert outcome is not None
    status = {
        SolveStatus.OPTIMAL: "optimal",
        SolveStatus.FEASIBLE_AT_TIME_LIMIT: "feasible",
        SolveStatus.FEASIBLE_AT_WORK_LIMIT: "feasible",
        SolveStatus.INFEASIBLE: "infeasible",
    }.get(outcome.status, outcome.message or "error")
    return status, time.perf_counter() - t0


def solve_capacity(inst: CapacityInstance, *, time_limit_s: float = 30.0) -> CapacitySolution:
    """Solve the planning MILP of :mod:`servetune.models.capacity_milp`. Cost mode unless
    ``inst.budget`` is set. Raises InfeasibleError naming the binding slot, bucket and count
    limits when the forecast cannot be served within the limits."""
    check_servable(inst)
    budget_mode = inst.budget is not None
    if not budget_mode and not inst.static and inst.n_slots > 1:
        return _solve_by_slot(inst, time_limit_s)
    m = build_model(inst, budget_mode=budget_mode)
    status, secs = _solve_milp(m, time_limit_s)
    if status in ("optimal", "feasible"):
        return decode(inst, m, status, secs)
    if status != "infeasible" or budget_mode:
        raise InfeasibleError(
            f"capacity plan: solver ended with status {status} within {time_limit_s:.0f} s; "
            "raise the time limit or coarsen the buckets",
            details={"status": status},
        )
    raise _explain_infeasible(inst, time_limit_s)


def _solve_by_slot(inst: CapacityInstance, time_limit_s: float) -> CapacitySolution:
    replicas: dict[tuple[str, int], int] = {}
    routing: dict[tuple[str, str, int], float] = {}
    statuses, secs = [], 0.0
    # Slots with the same bucket rates are the same MILP (a daily curve repeats rates, a
    # peak forecast has one): solve each distinct one once.
    solved: dict[tuple[float, ...], CapacitySolution] = {}
    for s in range(inst.n_slots):
        key = tuple(inst.lam[b, s] for b in inst.buckets)
        part = solved.get(key)
        if part is None:
            try:
                part = solve_capacity(slot_instance(inst, s), time_limit_s=time_limit_s)
            except InfeasibleError as err:
                if err.details.get("binding") == "count_limit":
                    raise _explain_infeasible(slot_instance(inst, s), time_limit_s,
                                              slot_index=s) from None
                raise
            solved[key] = part
            secs += part.solver_s
        statuses.append(part.status)
        replicas.update({(t, s): n for (t, _s), n in part.replicas.items()})
        routing.update({(b, t, s): f for (b, t, _s), f in part.routing.items()})
    cost = sum(inst.price[t] * inst.hours * n for (t, _s), n in replicas.items())
    status = "optimal" if all(x == "optimal" for x in statuses) else "feasible"
    return CapacitySolution(status, replicas, routing, cost, 1.0, secs)


def _explain_infeasible(
    inst: CapacityInstance, time_limit_s: float, *, slot_index: int | None = None
) -> InfeasibleError:
    """Re-solve maximizing the served rate within the limits, and name what binds.
    ``slot_index`` names the slot when ``inst`` is one slot cut from a larger plan."""
    relaxed = CapacityInstance(**{**inst.__dict__, "budget": None})
    m = build_model(relaxed, budget_mode=True)
    status, _ = _solve_milp(m, time_limit_s)
    if status not in ("optimal", "feasible"):
        return InfeasibleError(
            "capacity plan: infeasible even without serving everything; check min_gpus "
            "against max_gpus",
            details={"binding": "count_limits"},
        )
    sol = decode(relaxed, m, status, 0.0)
    gaps = served_gaps(inst, sol)
    gap, s, b = gaps[0] if gaps else (0.0, 0, inst.buckets[0])
    if slot_index is not None:
        s = slot_index
    if inst.unit_type:  # serving units: the shared per-GPU-type limits bind
        limits = [
            f"{g}: max {inst.type_max[g]} replicas"
            for g in inst.gpu_types()
            if inst.type_max.get(g) is not None
            and any(inst.mu[u, b] > 0 for u in inst.types if inst.gpu_of(u) == g)
        ]
    else:
        limits = [
            f"{t}: max {inst.n_max[t]} replicas"
            for t in inst.types
            if inst.n_max.get(t) is not None and inst.mu[t, b] > 0
        ]
    limit_text = ", ".join(limits) if limits else "the count limits"
    return InfeasibleError(
        f"capacity plan: count limit too low: slot {s} leaves {gap:.3g} req/s of bucket {b} "
        f"unserved with {limit_text} (all at their limit); raise max_gpus, add a GPU type, "
        f"or lower the forecast",
        details={
            "binding": "count_limit",
            "slot": s,
            "bucket": b,
            "unserved_rate_per_s": gap,
            "served_share": sol.served_share,
            "limits": ({g: inst.type_max.get(g) for g in inst.gpu_types()} if inst.unit_type
                       else {t: inst.n_max.get(t) for t in inst.types}),
        },
    )
