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
    (with serving units, see below, T is the set of units U; these bounds are per unit)
    spare      1 with N+1 redundancy (each type in use carries one spare replica), else 0
    static     (option) replica counts may not change between slots (reserved GPUs)
    budget     (budget mode only) the most the plan may cost over all slots ($)
Variables
    n[t,s]     in Z>=0   replicas of type t in slot s
    f[b,t,s]   in [0,1]  share of bucket b's rate in slot s routed to type t
    used[t,s]  in {0,1}  type t runs in slot s (only with N+1)
Constraints
    route[b,s]:    sum_t f[b,t,s] = 1              (cost mode: everything is served;
                                                    only where lam[b,s] > 0)
                   sum_t f[b,t,s] <= 1             (budget mode: some may be left unserved)
    load_cap[t,s]: sum_b f[b,t,s] lam[b,s] / mu[t,b] <= headroom (n[t,s] - spare used[t,s])
    unusable:      f[b,t,s] = 0 where mu[t,b] = 0
    count limits:  n_min[t] <= n[t,s] <= n_max[t]   (as bounds of n)
    used_link:     n[t,s] <= n_cap used[t,s]  (n_cap: n_max or an upper bound on need)
    budget_cap:    sum_{t,s} price[t] hours n[t,s] <= budget   (budget mode)
    static_count:  n[t,s] = n[t,s-1] for s >= 1                (static option)
Objective
    cost mode:    minimize  sum_{t,s} price[t] hours n[t,s]
                            + eps sum_{b,t,s} hours size[t] f[b,t,s] lam[b,s] / mu[t,b]
                  (eps = 1e-6 x the lowest price; size[t] = 1 without serving units, below:
                  among plans of equal cost, route each request where it uses the least
                  capacity in replicas, which also makes the routing unique where idle
                  replicas would leave it arbitrary)
    budget mode:  maximize  sum_{b,s} hours lam[b,s] sum_t f[b,t,s]   (requests served)
                            - 1e-7 x cost  (the cheapest of equally-serving plans)

Serving units (topologies). With ``unit_type`` set, each member of T is a serving unit
``u`` of some GPU type ``g = gpu_of[u]``: one aggregated replica (``g``) or a
disaggregated group ``g@P:D`` of P prefill and D decode replicas. Then
    size[u]        replicas one unit uses (P+D; 1 for an aggregated unit); price[u] and
                   mu[u,b] are the whole unit's ($ per unit-hour, req/s per unit)
    type_max[g]    at most this many replicas of GPU type g, shared by g's units
    type_min[g]    at least this many replicas of GPU type g in every slot
    type_cap[g,s]: sum_{u: gpu_of[u]=g} size[u] n[u,s] <= type_max[g]
    type_floor[g,s]: sum_{u: gpu_of[u]=g} size[u] n[u,s] >= type_min[g]
N+1 then keeps one spare unit of every unit kind in use. Without ``unit_type`` every type
is its own unit of size 1 and the model is the one above.

In cost mode without the static option no constraint links two slots, so the model
splits into one small MILP per slot; :func:`servetune.solvers.capacity.solve_capacity`
solves them one by one (the same optimum, and far faster than one model with every slot).

Cost mode can be infeasible only through count limits (or a bucket no type can serve);
then the solver re-solves in budget mode without a budget to find the largest servable
share, and :func:`served_gaps` names the slot and bucket left unserved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pyomo.environ as pyo

from servetune.errors import InfeasibleError


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
    # serving units (module docstring): unit -> its GPU type; unit -> replicas per unit
    unit_type: dict[str, str] = field(default_factory=dict)
    unit_size: dict[str, int] = field(default_factory=dict)
    type_max: dict[str, int | None] = field(default_factory=dict)
    type_min: dict[str, int] = field(default_factory=dict)

    def gpu_of(self, u: str) -> str:
        """The GPU type of unit ``u`` (a type is its own unit without serving units)."""
        return self.unit_type.get(u, u)

    def size(self, u: str) -> int:
        """Replicas one unit ``u`` uses."""
        return self.unit_size.get(u, 1)

    def gpu_types(self) -> tuple[str, ...]:
        """The GPU types of the units, in first-seen order."""
        return tuple(dict.fromkeys(self.gpu_of(u) for u in self.types))

    def type_replicas(self, sol: CapacitySolution, g: str, s: int) -> int:
        """Replicas of GPU type ``g`` in slot ``s``: every unit of g, times its size."""
        return sum(self.size(u) * sol.replicas.get((u, s), 0)
                   for u in self.types if self.gpu_of(u) == g)


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
        # A bucket without traffic in a slot needs no routing (and may have no type able
        # to serve it at all).
        m.route = pyo.Constraint(
            m.B, m.S,
            rule=lambda _m, b, s: (sum(_m.f[b, t, s] for t in _m.T) == 1
                                   if inst.lam[b, s] > 0 else pyo.Constraint.Skip),
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

    if inst.unit_type:
        G = inst.gpu_types()

        def type_total(_m, g, s):
            return sum(inst.size(u) * _m.n[u, s] for u in inst.types if inst.gpu_of(u) == g)

        def type_cap(_m, g, s):
            hi = inst.type_max.get(g)
            return type_total(_m, g, s) <= hi if hi is not None else pyo.Constraint.Skip

        def type_floor(_m, g, s):
            lo = inst.type_min.get(g, 0)
            return type_total(_m, g, s) >= lo if lo > 0 else pyo.Constraint.Skip

        m.G = pyo.Set(initialize=list(G), ordered=True)
        m.type_cap = pyo.Constraint(m.G, m.S, rule=type_cap)
        m.type_floor = pyo.Constraint(m.G, m.S, rule=type_floor)

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
        # in replicas: a unit's capacity share weighs its size (1 without serving units)
        used_capacity = sum(
            m.hours * inst.size(t) * m.f[b, t, s] * m.lam[b, s] / m.mu[t, b]
            for b in m.B for t in m.T for s in m.S if inst.mu[t, b] > 0
        )
        m.objective = pyo.Objective(expr=cost + eps * used_capacity, sense=pyo.minimize)
    return m


def decode(
    inst: CapacityInstance, m: pyo.ConcreteModel, status: str, secs: float
) -> CapacitySolution:
    """Read the solved model's values back into a :class:`CapacitySolution`."""
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


def slot_instance(inst: CapacityInstance, s: int) -> CapacityInstance:
    """Slot ``s`` of ``inst`` as an instance of its own (one slot, numbered 0)."""
    return CapacityInstance(**{
        **inst.__dict__, "n_slots": 1,
        "lam": {(b, 0): inst.lam[b, s] for b in inst.buckets},
    })


def check_servable(inst: CapacityInstance) -> None:
    """Raise InfeasibleError when a bucket with traffic has no type that can serve it."""
    for b in inst.buckets:
        if all(inst.mu[t, b] <= 0 for t in inst.types) and any(
            inst.lam[b, s] > 0 for s in range(inst.n_slots)
        ):
            raise InfeasibleError(
                f"capacity plan: no GPU type can serve bucket {b} at the SLOs "
                "(capacity 0 on every type); add a GPU type with more memory or relax the SLO",
                details={"binding": "bucket_unservable", "bucket": b},
            )


def served_gaps(
    inst: CapacityInstance, sol: CapacitySolution
) -> list[tuple[float, int, str]]:
    """(unserved req/s, slot, bucket) for every bucket and slot a budget-mode solution
    leaves partly unserved, largest first (ties: earliest slot, then bucket order)."""
    gaps = []
    for s in range(inst.n_slots):
        for i, b in enumerate(inst.buckets):
            served = sum(sol.routing.get((b, t, s), 0.0) for t in inst.types)
            gap = inst.lam[b, s] * (1.0 - served)
            if gap > 1e-6:
                gaps.append((gap, s, i, b))
    gaps.sort(key=lambda g: (-round(g[0], 9), g[1], g[2]))
    return [(g, s, b) for g, s, _i, b in gaps]
