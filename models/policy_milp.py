"""Policy MILP: choose the batching and admission knobs that maximise goodput.

Goodput is the largest arrival rate the policy sustains at the SLOs. The fluid model
(:mod:`servetune.models.fluid`) expresses every condition of a policy as an upper bound
on ``x``, the requests arriving per engine step, and the rate is ``lambda = x / t(x)``
with ``t`` the mean step time. With the steps per second ``y = 1/t`` as a variable,
``x <= X`` becomes ``lambda <= X y`` and the step time ``t = max_k (c0_k + c1_k x)``
becomes ``c0_k y + c1_k lambda <= 1`` for every GEMM piece ``k`` (the GEMM term is convex
piecewise linear, so its epigraph is exact: the optimum pushes ``y`` up to ``1/t``).
Each candidate gets its own copy of ``(lambda, y)`` switched on by its binary (the
convex-hull formulation of a disjunction over the grid).

Sets
    P   candidate policies (the valid points of the search-space grid)
    C   request classes;  K  pieces of the step-time model;
    G   conditions: budget_stability, seats, kv_memory, queue_caps (policy-wide) and
        ttft[c], tpot[c] (per class)
Parameters
    share[c]      class c's share of the arrival rate
    c0[k], c1[k]  mean step time t(x) = max_k (c0[k] + c1[k] x), seconds
    X[p,g]        the largest arrivals per step at which candidate p meets condition g
                  (fluid model: KV memory at a Poisson quantile of the running set,
                  seats, token-budget stability, TTFT through Kingman queueing plus
                  prefill steps, TPOT = time of a loaded step, queue caps)
    rate_min      the smallest goodput worth returning (requests/s)
    tie[p]        in [0,1): a tie-break bonus: the candidate's margin (how far its
                  second-tightest condition is above its binding one), times a weight
                  small enough never to trade goodput for it
Variables
    z[p]          in {0,1}  candidate p is chosen
    rate[p]       >= 0      goodput of p when chosen (requests/s), else 0
    steps[p]      >= 0      engine steps per second of p when chosen, else 0
    flow[p,c]     >= 0      class c's arrival rate under p
Constraints
    one_policy:          sum_p z[p] = 1
    class_flow[p,c]:     flow[p,c] = share[c] rate[p]
    step_time[p,k]:      c0[k] steps[p] + c1[k] rate[p] <= z[p]
    budget_stability[p]: rate[p] <= X[p,budget] steps[p]       (T < M: demand below supply)
    seats[p]:            rate[p] <= X[p,seats] steps[p]        (running set <= max_num_seqs)
    kv_memory[p]:        rate[p] <= X[p,kv_memory] steps[p]    (KV quantile <= pool - watermark)
    queue_caps[p]:       rate[p] <= X[p,queue] steps[p]        (shedding below the miss budget)
    ttft[p,c]:           flow[p,c] <= share[c] X[p,ttft[c]] steps[p]
    tpot[p,c]:           flow[p,c] <= share[c] X[p,tpot[c]] steps[p]
    (a condition whose X is not the smallest of its candidate can never bind and is
    left out, as presolve would)
    min_rate:            sum_p rate[p] >= rate_min
Objective
    maximize sum_p rate[p] + eps sum_p tie[p] z[p]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pyomo.environ as pyo

from servetune.conditions import QUEUE_CAPS, Condition, Family
from servetune.models.fluid import FluidModel, Knobs, Limit, binding_limit

# The smallest goodput worth returning, as a share of the workload's rate.
RATE_MIN_SHARE = 1e-3
# The tie-break bonus is worth at most this share of the goodput scale.
TIE_WEIGHT = 1e-4


@dataclass(frozen=True)
class Candidate:
    """One chosen point with the model's prediction for it."""

    knobs: Knobs
    rate_per_s: float  # goodput predicted by the MILP
    steps_per_s: float
    binding: Condition  # the condition that limits it


@dataclass
class MilpInstance:
    points: list[Knobs]
    shares: dict[str, float]
    pieces: list[tuple[float, float]]
    limits: list[dict[Condition, Limit]]  # per point: condition -> Limit
    rate_scale: float = 1.0  # a typical goodput (req/s), scales the tie-break weight

    @staticmethod
    def build(fluid: FluidModel, points: list[Knobs]) -> MilpInstance:
        return MilpInstance(
            points=list(points),
            shares={c.name: c.share for c in fluid.load.classes},
            pieces=fluid.step_pieces(),
            limits=fluid.limits_many(points),
            rate_scale=fluid.load.rate_per_s,
        )

    def redundant(self, p: int, family: Family, cls: str | None = None) -> bool:
        """A condition whose limit is above another condition's on the same candidate
        can never bind; leaving it out keeps the model small (HiGHS's presolve would
        drop it too). Ties keep the first by key, so one always stays."""
        x = self.x_limit(p, family, cls)
        cond = Condition(family, cls)
        for other, lim in self.limits[p].items():
            if other.family in QUEUE_CAPS:
                other = Condition(Family.QUEUE)  # the queue caps are one constraint
            if other == cond:
                continue
            if lim.x_max < x or (lim.x_max == x and other.key < cond.key):
                return True
        return False

    def tie_break(self, p: int) -> float:
        """Margin of candidate p in [0, 1): (second-tightest - binding) / second-tightest
        over its conditions, so among equal goodputs the most robust candidate wins;
        a last, tiny share prefers earlier grid points (deterministic ties)."""
        xs = sorted(lim.x_max for lim in self.limits[p].values())
        margin = 0.0
        if len(xs) > 1 and xs[1] > 0 and xs[1] != float("inf"):
            margin = (xs[1] - xs[0]) / xs[1]
        return 0.99 * margin + 0.01 * (1.0 - p / max(len(self.points), 1))

    def x_limit(self, p: int, family: Family, cls: str | None = None) -> float:
        """X[p, g]: the limit of one condition (inf when the candidate has none)."""
        lims = self.limits[p]
        if family is Family.QUEUE:
            caps = (Condition(Family.QUEUE_REQUESTS), Condition(Family.QUEUE_PROMPT_TOKENS))
            vals = [lims[c].x_max for c in caps if c in lims]
            return min(vals) if vals else float("inf")
        cond = Condition(family, cls)
        return lims[cond].x_max if cond in lims else float("inf")


def build_model(inst: MilpInstance, *, rate_min: float, excluded: set[int] = frozenset()):
    """The Pyomo model, named as in the module docstring."""
    m = pyo.ConcreteModel(name="policy_milp")
    m.P = pyo.Set(initialize=range(len(inst.points)), ordered=True)
    m.C = pyo.Set(initialize=list(inst.shares), ordered=True)
    m.K = pyo.Set(initialize=range(len(inst.pieces)), ordered=True)
    m.share = pyo.Param(m.C, initialize=inst.shares)
    m.c0 = pyo.Param(m.K, initialize={k: c0 for k, (c0, _) in enumerate(inst.pieces)})
    m.c1 = pyo.Param(m.K, initialize={k: c1 for k, (_, c1) in enumerate(inst.pieces)})

    m.z = pyo.Var(m.P, domain=pyo.Binary)
    m.rate = pyo.Var(m.P, domain=pyo.NonNegativeReals)
    m.steps = pyo.Var(m.P, domain=pyo.NonNegativeReals)
    m.flow = pyo.Var(m.P, m.C, domain=pyo.NonNegativeReals)

    m.one_policy = pyo.Constraint(expr=sum(m.z[p] for p in m.P) == 1)
    m.class_flow = pyo.Constraint(
        m.P, m.C, rule=lambda m, p, c: m.flow[p, c] == m.share[c] * m.rate[p]
    )
    m.step_time = pyo.Constraint(
        m.P, m.K, rule=lambda m, p, k: m.c0[k] * m.steps[p] + m.c1[k] * m.rate[p] <= m.z[p]
    )

    def policy_wide(family: Family):
        def rule(m, p):
            x_max = inst.x_limit(p, family)
            if x_max == float("inf") or inst.redundant(p, family):
                return pyo.Constraint.Skip
            return m.rate[p] <= x_max * m.steps[p]
        return rule

    m.budget_stability = pyo.Constraint(m.P, rule=policy_wide(Family.BUDGET))
    m.seats = pyo.Constraint(m.P, rule=policy_wide(Family.SEATS))
    m.kv_memory = pyo.Constraint(m.P, rule=policy_wide(Family.KV_MEMORY))
    m.queue_caps = pyo.Constraint(m.P, rule=policy_wide(Family.QUEUE))

    def per_class(family: Family):
        def rule(m, p, c):
            x_max = inst.x_limit(p, family, c)
            if x_max == float("inf") or inst.redundant(p, family, c):
                return pyo.Constraint.Skip
            return m.flow[p, c] <= m.share[c] * x_max * m.steps[p]
        return rule

    m.ttft = pyo.Constraint(m.P, m.C, rule=per_class(Family.TTFT))
    m.tpot = pyo.Constraint(m.P, m.C, rule=per_class(Family.TPOT))
    m.min_rate = pyo.Constraint(expr=sum(m.rate[p] for p in m.P) >= rate_min)
    m.excluded = pyo.Constraint(
        sorted(excluded), rule=lambda m, p: m.z[p] == 0
    )
    m.tie = pyo.Param(m.P, initialize={p: inst.tie_break(p) for p in range(len(inst.points))})
    eps = TIE_WEIGHT * max(inst.rate_scale, 1e-9)
    m.goodput = pyo.Objective(
        expr=sum(m.rate[p] for p in m.P) + eps * sum(m.tie[p] * m.z[p] for p in m.P),
        sense=pyo.maximize,
    )
    return m


def decoder(inst: MilpInstance) -> Callable[[pyo.ConcreteModel], tuple[int, Candidate]]:
    """Read a solved model back: the chosen point p (z[p] = 1) and its prediction."""

    def decode(m: pyo.ConcreteModel) -> tuple[int, Candidate]:
        p = max(m.P, key=lambda p: pyo.value(m.z[p]))
        lims = inst.limits[p]
        binding = binding_limit(lims).condition
        return p, Candidate(
            knobs=inst.points[p],
            rate_per_s=float(pyo.value(m.rate[p])),
            steps_per_s=float(pyo.value(m.steps[p])),
            binding=binding,
        )

    return decode


def choice_binaries(m: pyo.ConcreteModel) -> list:
    """The z[p] binaries (what a no-good cut between top-k solves ranges over)."""
    return [m.z[p] for p in m.P]


def default_rate_min(inst: MilpInstance) -> float:
    """rate_min: 0.1% of the workload's own rate (well above the solver's feasibility
    tolerance)."""
    return RATE_MIN_SHARE * max(inst.rate_scale, 1e-3)
