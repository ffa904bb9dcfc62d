"""Capacity planning MILP: how many replicas of each GPU type per time slot, and which
GPU type serves which share of each workload bucket (as Melange does).

Sets
    T  GPU types;  B  workload buckets (slices by prompt and output length);  S  time slots
Parameters
    lam[b,s]   arrival rate of bucket b in slot s (req/s)
    mu[t,b]    capacity: req/s of bucket b one replica of type t sustains at the SLOs
               (0 = type t cannot serve bucket b)
    price[t]   cost of one replica of type t per hour ($)
    hours      length of one slot in hours
    headroom   plan each type's load to at most this share of its capacity (0 < u <= 1)
    n_max[t]   at most this many replicas of type t (omitted = unlimited)
    n_min[t]   at least this many replicas of type t in every slot
    spare      1 with N+1 redundancy (each type in use carries one spare replica), else 0
    static     (option) replica counts may not change between slots (reserved GPUs)
    budget     (budget mode only) the most the plan may cost over all slots ($)
Variables
    n[t,s]     in Z>=0   replicas of type t in slot s
    f[b,t,s]   in [0,1]  share of bucket b's rate in slot s routed to type t
    used[t,s]  in {0,1}  type t runs in slot s (only with N+1)
Constraints
    route[b,s]:    sum_t f[b,t,s] = 1              (cost mode: everything is served)
                   sum_t f[b,t,s] <= 1             (budget mode: some may be left unserved)
    load_cap[t,s]: sum_b f[b,t,s] lam[b,s] / mu[t,b] <= headroom (n[t,s] - spare used[t,s])
    unusable:      f[b,t,s] = 0 where mu[t,b] = 0
    count limits:  n_min[t] <= n[t,s] <= n_max[t]   (as bounds of n)
    used_link:     n[t,s] <= n_cap used[t,s]  (n_cap: n_max or an upper bound on need)
    budget_cap:    sum_{t,s} price[t] hours n[t,s] <= budget   (budget mode)
    static_count:  n[t,s] = n[t,s-1] for s >= 1                (static option)
Objective
    cost mode:    minimize  sum_{t,s} price[t] hours n[t,s]
                            + eps sum_{b,t,s} hours f[b,t,s] lam[b,s] / mu[t,b]
                  (eps = 1e-6 x the lowest price: among plans of equal cost, route each
                  request where it uses the least capacity, which also makes the routing
                  unique where idle replicas would leave it arbitrary)
    budget mode:  maximize  sum_{b,s} hours lam[b,s] sum_t f[b,t,s]   (requests served)
                            - 1e-7 x cost  (the cheapest of equally-serving plans)

In cost mode without the static option no constraint links two slots, so the model
splits into one small MILP per slot; :func:`solve_capacity` solves them one by one (the
same optimum, and far faster than one model with every slot).

Cost mode can be infeasible only through count limits (or a bucket no type can serve);
then :func:`solve_capacity` re-solves in budget mode without a budget to find the
largest servable share and reports which slot, bucket and limits bind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pyomo.environ as pyo

from servetune.errors import InfeasibleError

_EPS = 1e-9


@dataclass(frozen=True)
class CapacityInstance:
    types: tuple[str, ...]
    buckets: tuple[str, ...]
    n_slots: int
    lam: dict[tuple[str, int], float]  # (bucket, slot) -> req/s
    mu: dict[tuple[str, str], float]  # (type, bucket) -> req/s per replica
    price: dict[str, float]  # type -> $ per replica-hour
    hours: float = 1.0
    headroom: float = 1.0
    n_max: dict[str, int | None] = field(default_factory=dict)
    n_min: dict[str, int] = field(default_factory=dict)
    n_plus_one: bool = False
    budget: float | None = None
    static: bool = False


@dataclass
class CapacitySolution:
    status: str  # "optimal" | "feasible" (time limit)
    replicas: dict[tuple[str, int], int]  # (type, slot) -> n
    routing: dict[tuple[str, str, int], float]  # (bucket, type, slot) -> f
    cost: float  # $ over all slots
    served_share: float  # requests served / offered
    solver_s: float = 0.0

    def load(self, inst: CapacityInstance, t: str, s: int) -> float:
        """Capacity share used on type t in slot s: sum_b f lam / mu (replica-equivalents)."""
        return sum(
            self.routing.get((b, t, s), 0.0) * inst.lam[b, s] / inst.mu[t, b]
            for b in inst.buckets
            if inst.mu[t, b] > 0
        )


def _need_bound(inst: CapacityInstance, t: str, s: int) -> int:
    """Replicas of type t that would serve all of slot s on their own: an upper bound on
    what an optimal plan uses (for the big-M of used_link)."""
    need = 0.0
    for b in inst.buckets:
        if inst.lam[b, s] <= 0:
            continue
        mus = [inst.mu[u, b] for u in inst.types if inst.mu[u, b] > 0]
        if mus:
            # worst case: the slowest capable type carries the bucket
            need += inst.lam[b, s] / min(mus)
    return int(math.ceil(need / inst.headroom)) + 2 + inst.n_min.get(t, 0)


def build_model(inst: CapacityInstance, *, budget_mode: bool = False) -> pyo.ConcreteModel:
    """The Pyomo model of the module docstring (cost mode unless ``budget_mode``)."""
    m = pyo.ConcreteModel(name="capacity_plan")
    m.T = pyo.Set(initialize=list(inst.types), ordered=True)
    m.B = pyo.Set(initialize=list(inst.buckets), ordered=True)
    m.S = pyo.Set(initialize=list(range(inst.n_slots)), ordered=True)

    m.lam = pyo.Param(m.B, m.S, initialize=lambda _m, b, s: inst.lam[b, s])
    m.mu = pyo.Param(m.T, m.B, initialize=lambda _m, t, b: inst.mu[t, b])
    m.price = pyo.Param(m.T, initialize=lambda _m, t: inst.price[t])
    m.hours = pyo.Param(initialize=inst.hours)
    m.headroom = pyo.Param(initialize=inst.headroom)
    m.spare = pyo.Param(initialize=1 if inst.n_plus_one else 0)

    def n_bounds(_m, t, s):
        hi = inst.n_max.get(t)
        return (inst.n_min.get(t, 0), hi)

    m.n = pyo.Var(m.T, m.S, domain=pyo.NonNegativeIntegers, bounds=n_bounds)
    m.f = pyo.Var(m.B, m.T, m.S, domain=pyo.UnitInterval)

    if budget_mode:
        m.route = pyo.Constraint(
            m.B, m.S, rule=lambda _m, b, s: sum(_m.f[b, t, s] for t in _m.T) <= 1
        )
    else:
        m.route = pyo.Constraint(
            m.B, m.S, rule=lambda _m, b, s: sum(_m.f[b, t, s] for t in _m.T) == 1
        )

    for b in inst.buckets:
        for t in inst.types:
            if inst.mu[t, b] <= 0:
                for s in range(inst.n_slots):
                    m.f[b, t, s].fix(0.0)

    if inst.n_plus_one:
        m.used = pyo.Var(m.T, m.S, domain=pyo.Binary)

        def used_link(_m, t, s):
            cap = inst.n_max.get(t)
            big = cap if cap is not None else _need_bound(inst, t, s)
            return _m.n[t, s] <= big * _m.used[t, s]

        m.used_link = pyo.Constraint(m.T, m.S, rule=used_link)

    def load_cap(_m, t, s):
        demand = sum(
            _m.f[b, t, s] * _m.lam[b, s] / _m.mu[t, b] for b in _m.B if inst.mu[t, b] > 0
        )
        supply = _m.n[t, s] - (_m.spare * _m.used[t, s] if inst.n_plus_one else 0)
        return demand <= _m.headroom * supply

    m.load_cap = pyo.Constraint(m.T, m.S, rule=load_cap)

    if inst.static:
        m.static_count = pyo.Constraint(
            m.T, m.S,
            rule=lambda _m, t, s: _m.n[t, s] == _m.n[t, s - 1] if s >= 1 else pyo.Constraint.Skip,
        )

    cost = sum(m.price[t] * m.hours * m.n[t, s] for t in m.T for s in m.S)
    if budget_mode:
        if inst.budget is not None:
            m.budget_cap = pyo.Constraint(expr=cost <= inst.budget)
        served = sum(
            m.hours * m.lam[b, s] * m.f[b, t, s] for b in m.B for t in m.T for s in m.S
        )
        # A tiny cost term picks the cheapest of equally-serving plans.
        m.objective = pyo.Objective(expr=served - 1e-7 * cost, sense=pyo.maximize)
    else:
        eps = 1e-6 * min(inst.price.values())
        used_capacity = sum(
            m.hours * m.f[b, t, s] * m.lam[b, s] / m.mu[t, b]
            for b in m.B for t in m.T for s in m.S if inst.mu[t, b] > 0
        )
        m.objective = pyo.Objective(expr=cost + eps * used_capacity, sense=pyo.minimize)
    return m


def _solve(m: pyo.ConcreteModel, time_limit_s: float) -> tuple[str, float]:
    import time

    t0 = time.perf_counter()
    status = _solve_once(m, time_limit_s, presolve=True)
    if status not in ("optimal", "feasible", "infeasible", "no_solution"):
        # HiGHS occasionally ends a MIP with an "unknown" model status; presolve off
        # settles it (the model is small), so try once more before giving up.
        status = _solve_once(m, time_limit_s, presolve=False)
    return status, time.perf_counter() - t0


def _solve_once(m: pyo.ConcreteModel, time_limit_s: float, *, presolve: bool) -> str:
    solver = pyo.SolverFactory("appsi_highs")
    solver.config.time_limit = time_limit_s
    solver.highs_options = {"mip_rel_gap": 1e-9, "random_seed": 0,
                            "presolve": "on" if presolve else "off"}
    res = solver.solve(m, load_solutions=False)
    tc = res.solver.termination_condition
    if tc == pyo.TerminationCondition.optimal:
        solver.load_vars()
        return "optimal"
    if tc in (pyo.TerminationCondition.infeasible, pyo.TerminationCondition.infeasibleOrUnbounded):
        return "infeasible"
    if tc == pyo.TerminationCondition.maxTimeLimit:
        try:
            solver.load_vars()
        except Exception:  # no incumbent at the limit
            return "no_solution"
        return "feasible"
    return str(tc)


def _extract(inst: CapacityInstance, m: pyo.ConcreteModel, status: str, secs: float):
    replicas = {(t, s): int(round(pyo.value(m.n[t, s]))) for t in inst.types
                for s in range(inst.n_slots)}
    routing: dict[tuple[str, str, int], float] = {}
    for b in inst.buckets:
        for t in inst.types:
            for s in range(inst.n_slots):
                v = float(pyo.value(m.f[b, t, s]))
                if v > 1e-7:
                    routing[b, t, s] = round(min(1.0, v), 9)
    cost = sum(inst.price[t] * inst.hours * n for (t, _s), n in replicas.items())
    offered = sum(inst.lam.values())
    served = sum(inst.lam[b, s] * f for (b, _t, s), f in routing.items())
    share = 1.0 if offered <= 0 else min(1.0, served / offered)
    return CapacitySolution(status, replicas, routing, cost, share, secs)


def solve_capacity(inst: CapacityInstance, *, time_limit_s: float = 30.0) -> CapacitySolution:
    """Solve the planning MILP. Cost mode unless ``inst.budget`` is set. Raises
    InfeasibleError naming the binding slot, bucket and count limits when the forecast
    cannot be served within the limits."""
    _check(inst)
    budget_mode = inst.budget is not None
    if not budget_mode and not inst.static and inst.n_slots > 1:
        return _solve_by_slot(inst, time_limit_s)
    m = build_model(inst, budget_mode=budget_mode)
    status, secs = _solve(m, time_limit_s)
    if status in ("optimal", "feasible"):
        return _extract(inst, m, status, secs)
    if status != "infeasible" or budget_mode:
        raise InfeasibleError(
            f"capacity plan: solver ended with status {status} within {time_limit_s:.0f} s; "
            "raise the time limit or coarsen the buckets",
            details={"status": status},
        )
    raise _explain_infeasible(inst, time_limit_s)


def _slot_instance(inst: CapacityInstance, s: int) -> CapacityInstance:
    return CapacityInstance(**{
        **inst.__dict__, "n_slots": 1,
        "lam": {(b, 0): inst.lam[b, s] for b in inst.buckets},
    })


def _solve_by_slot(inst: CapacityInstance, time_limit_s: float) -> CapacitySolution:
    replicas: dict[tuple[str, int], int] = {}
    routing: dict[tuple[str, str, int], float] = {}
    statuses, secs = [], 0.0
    for s in range(inst.n_slots):
        try:
            part = solve_capacity(_slot_instance(inst, s), time_limit_s=time_limit_s)
        except InfeasibleError as err:
            if err.details.get("binding") == "count_limit":
                raise _explain_infeasible(_slot_instance(inst, s), time_limit_s,
                                          slot_index=s) from None
            raise
        statuses.append(part.status)
        secs += part.solver_s
        replicas.update({(t, s): n for (t, _s), n in part.replicas.items()})
        routing.update({(b, t, s): f for (b, t, _s), f in part.routing.items()})
    cost = sum(inst.price[t] * inst.hours * n for (t, _s), n in replicas.items())
    status = "optimal" if all(x == "optimal" for x in statuses) else "feasible"
    return CapacitySolution(status, replicas, routing, cost, 1.0, secs)


def _check(inst: CapacityInstance) -> None:
    for b in inst.buckets:
        if all(inst.mu[t, b] <= 0 for t in inst.types) and any(
            inst.lam[b, s] > 0 for s in range(inst.n_slots)
        ):
            raise InfeasibleError(
                f"capacity plan: no GPU type can serve bucket {b} at the SLOs "
                "(capacity 0 on every type); add a GPU type with more memory or relax the SLO",
                details={"binding": "bucket_unservable", "bucket": b},
            )


def _explain_infeasible(
    inst: CapacityInstance, time_limit_s: float, *, slot_index: int | None = None
) -> InfeasibleError:
    """Re-solve maximizing the served rate within the limits, and name what binds.
    ``slot_index`` names the slot when ``inst`` is one slot cut from a larger plan."""
    relaxed = CapacityInstance(**{**inst.__dict__, "budget": None})
    m = build_model(relaxed, budget_mode=True)
    status, _ = _solve(m, time_limit_s)
    if status not in ("optimal", "feasible"):
        return InfeasibleError(
            "capacity plan: infeasible even without serving everything; check min_gpus "
            "against max_gpus",
            details={"binding": "count_limits"},
        )
    sol = _extract(relaxed, m, status, 0.0)
    worst = None  # (unserved req/s, slot, bucket)
    for s in range(inst.n_slots):
        for b in inst.buckets:
            served = sum(sol.routing.get((b, t, s), 0.0) for t in inst.types)
            gap = inst.lam[b, s] * (1.0 - served)
            if gap > 1e-6 and (worst is None or gap > worst[0] + 1e-9):
                worst = (gap, s, b)
    if worst is None:
        worst = (0.0, 0, inst.buckets[0])
    gap, s, b = worst
    if slot_index is not None:
        s = slot_index
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
            "limits": {t: inst.n_max.get(t) for t in inst.types},
        },
    )
