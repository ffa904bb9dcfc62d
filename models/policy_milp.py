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
    K   pieces of the step-time model
    G   conditions: budget_stability, seats, kv_memory, queue_caps (policy-wide) and
        ttft[c], tpot[c] (per request class c)
Parameters
    c0[k], c1[k]  mean step time t(x) = max_k (c0[k] + c1[k] x), seconds
    X[p,g]        the largest arrivals per step at which candidate p meets condition g
                  (fluid model: KV memory at a Poisson quantile of the running set,
                  seats, token-budget stability, TTFT through Kingman queueing plus
                  prefill steps, TPOT = time of a loaded step, queue caps)
    X[p]          min_g X[p,g]: the tightest condition of p
    rate_min      the smallest goodput worth returning (requests/s)
    tie[p]        in [0,1): a tie-break bonus: the candidate's margin (how far its
                  second-tightest condition is above its binding one), times a weight
                  small enough never to trade goodput for it
Variables
    z[p]          in {0,1}  candidate p is chosen
    rate[p]       >= 0      goodput of p when chosen (requests/s), else 0
    steps[p]      >= 0      engine steps per second of p when chosen, else 0
Constraints
    one_policy:     sum_p z[p] = 1
    step_time[p,k]: c0[k] steps[p] + c1[k] rate[p] <= z[p]
    tightest[p]:    rate[p] <= X[p] steps[p]
    min_rate:       sum_p rate[p] >= rate_min
Objective
    maximize sum_p rate[p] + eps sum_p tie[p] z[p]

Each candidate's own optimum has a closed form, rate = X[p] / t(X[p]) at steps = 1 /
t(X[p]) (:meth:`MilpInstance.own_optimum`). Ties are broken on it after the solve: the
candidates whose objectives the solver cannot tell apart (within ``TIE_TOLERANCE``,
above its feasibility tolerances) all tie, and of them the one with the largest
objective computed exactly (then the first in grid order) is chosen, so the answer does
not depend on the solver's path.

Why one condition row per candidate: every condition has the form rate[p] <= X[p,g]
steps[p]. A class's own condition, flow[p,c] <= share[c] X[p,g] steps[p] with its flow
flow[p,c] = share[c] rate[p], is the same row once the flow is substituted (a class
with no share has no flow and its conditions never bind), and of several rows
rate[p] <= X steps[p] only the smallest X can bind.

The model is built in matrix form and solved by HiGHS through highspy: it has a few
thousand rows, which Pyomo took about a second to build and hand over, against the
milliseconds HiGHS needs to solve it. The per-candidate copies make it the convex-hull
formulation of the disjunction (Balas), which is ideal: its LP relaxation has integral
vertices. So HiGHS solves the relaxation by simplex, and each top-k re-solve after a
cut restarts from the last basis (:func:`~servetune.solvers.drivers.solve_ideal_highspy`,
which checks the integrality and falls back to branch and bound).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import highspy
import numpy as np

from servetune.conditions import Condition
from servetune.models.fluid import FluidModel, Knobs, Limit, binding_limit

# The smallest goodput worth returning, as a share of the workload's rate.
RATE_MIN_SHARE = 1e-3
# The tie-break bonus is worth at most this share of the goodput scale.
TIE_WEIGHT = 1e-4
# Objectives within this share of the optimum tie: HiGHS's feasibility and optimality
# tolerances (1e-7) cannot order them.
TIE_TOLERANCE = 1e-6


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

    @cached_property
    def x_max(self) -> np.ndarray:
        """X[p] of every candidate: the smallest limit over its conditions (inf when it
        has none); the conditions of a class without a share of the traffic never bind."""
        return np.array([min((lim.x_max for cond, lim in limits.items()
                              if cond.request_class is None
                              or self.shares.get(cond.request_class, 0.0) > 0),
                             default=float("inf")) for limits in self.limits],
                        dtype=np.float64)

    def x_tightest(self, p: int) -> float:
        """X[p] of candidate p (:attr:`x_max`)."""
        return float(self.x_max[p])

    def own_optimum(self) -> tuple[np.ndarray, np.ndarray]:
        """Each candidate's (rate[p], steps[p]) when it is chosen: with t(x) = max_k (c0[k]
        + c1[k] x), steps = 1 / t(X[p]) and rate = X[p] steps; a candidate without a
        finite X runs as fast as the step time allows, rate = 1 / max_k c1[k], steps = 0."""
        x_max = self.x_max
        pieces = np.array(self.pieces, dtype=np.float64).reshape(-1, 2)
        finite = np.isfinite(x_max)
        x = np.where(finite, x_max, 0.0)
        step_s = np.max(pieces[:, :1] + pieces[:, 1:] * x[None, :], axis=0)
        steps = np.where(finite, 1.0 / step_s, 0.0)
        rate = np.where(finite, x * steps, 1.0 / np.max(pieces[:, 1]))
        return rate, steps

    def tie_break(self, p: int) -> float:
        """Margin of candidate p in [0, 1): (second-tightest - binding) / second-tightest
        over its conditions, so among equal goodputs the most robust candidate wins;
        a last, tiny share prefers earlier grid points (deterministic ties)."""
        xs = sorted(lim.x_max for lim in self.limits[p].values())
        margin = 0.0
        if len(xs) > 1 and xs[1] > 0 and xs[1] != float("inf"):
            margin = (xs[1] - xs[0]) / xs[1]
        return 0.99 * margin + 0.01 * (1.0 - p / max(len(self.points), 1))


@dataclass
class PolicyMilp:
    """The model loaded in HiGHS: ``z``, ``rate`` and ``steps`` hold each variable's
    column per candidate p; ``rows`` each constraint's rows (first, end), named as in the
    module docstring."""

    highs: highspy.Highs
    z: np.ndarray
    rate: np.ndarray
    steps: np.ndarray
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)
    # each candidate's own optimum (MilpInstance.own_optimum), its objective, and whether
    # it may still be chosen (z[p] not fixed to 0)
    own_rate: np.ndarray = field(default_factory=lambda: np.zeros(0))
    own_steps: np.ndarray = field(default_factory=lambda: np.zeros(0))
    objective: np.ndarray = field(default_factory=lambda: np.zeros(0))
    open: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))

    def add_rows(self, name: str, cols: np.ndarray, coefs: np.ndarray,
                 lower: float, upper: float) -> None:
        """Constraint ``name``: one row per line of ``cols`` (its columns) and
        ``coefs`` (their coefficients), lower <= row <= upper."""
        cols = np.atleast_2d(np.asarray(cols, dtype=np.int32))
        coefs = np.broadcast_to(np.asarray(coefs, dtype=np.float64), cols.shape)
        n, width = cols.shape
        first = self.highs.getNumRow()
        if n:
            self.highs.addRows(n, np.full(n, lower), np.full(n, upper), n * width,
                               np.arange(0, n * width, width, dtype=np.int32),
                               cols.ravel(), np.ascontiguousarray(coefs).ravel())
        self.rows[name] = (first, first + n)

    def values(self) -> np.ndarray:
        return np.asarray(self.highs.getSolution().col_value)

    def exclude(self, points: np.ndarray) -> None:
        """Fix z[p] to 0 for ``points`` (a no-good cut: one_policy makes it the whole cut)."""
        points = np.asarray(points, dtype=np.int64)
        cols = self.z[points].astype(np.int32)
        self.highs.changeColsBounds(len(cols), cols, np.zeros(len(cols)), np.zeros(len(cols)))
        self.open[points] = False


def build_model(inst: MilpInstance, highs: highspy.Highs, *, rate_min: float,
                excluded: Sequence[int] = ()) -> PolicyMilp:
    """The model loaded into the empty ``highs``, named as in the module docstring
    (``excluded`` candidates have z[p] fixed to 0)."""
    n = len(inst.points)
    z, rate, steps = np.arange(n), n + np.arange(n), 2 * n + np.arange(n)
    bonus = TIE_WEIGHT * max(inst.rate_scale, 1e-9) * np.array(
        [inst.tie_break(p) for p in range(n)])
    z_upper = np.ones(n)
    z_upper[list(excluded)] = 0.0
    highs.addCols(3 * n, np.concatenate([bonus, np.ones(n), np.zeros(n)]), np.zeros(3 * n),
                  np.concatenate([z_upper, np.full(2 * n, highspy.kHighsInf)]), 0,
                  np.array([], dtype=np.int32), np.array([], dtype=np.int32), np.array([]))
    highs.changeColsIntegrality(n, z.astype(np.int32),
                                np.full(n, highspy.HighsVarType.kInteger))
    highs.changeObjectiveSense(highspy.ObjSense.kMaximize)
    # The model is reduced already (one condition row per candidate); HiGHS's presolve
    # finds nothing to remove and spent 0.3-1.3 s probing the binaries of a 1,038-point
    # model that branch and bound then solves at its root in about 60 ms.
    highs.setOptionValue("presolve", "off")
    own_rate, own_steps = inst.own_optimum()
    m = PolicyMilp(highs, z, rate, steps, own_rate=own_rate, own_steps=own_steps,
                   objective=own_rate + bonus, open=z_upper > 0.5)
    inf = highspy.kHighsInf
    m.add_rows("one_policy", z[None, :], 1.0, 1.0, 1.0)
    pieces = np.array(inst.pieces, dtype=np.float64).reshape(-1, 2)  # rows (c0[k], c1[k])
    m.add_rows("step_time",  # rows k-major: (k, p)
               np.tile(np.stack([steps, rate, z], axis=1), (len(pieces), 1)),
               np.column_stack([np.repeat(pieces, n, axis=0), -np.ones(len(pieces) * n)]),
               -inf, 0.0)
    x_max = inst.x_max
    bound = np.flatnonzero(np.isfinite(x_max))
    m.add_rows("tightest", np.stack([rate[bound], steps[bound]], axis=1),
               np.stack([np.ones(len(bound)), -x_max[bound]], axis=1), -inf, 0.0)
    m.add_rows("min_rate", rate[None, :], 1.0, rate_min, inf)
    return m


def decode(inst: MilpInstance, m: PolicyMilp) -> tuple[int, Candidate]:
    """Read a solved model back: the chosen point p (z[p] = 1), or the candidate it ties
    with that the tie-break prefers (module docstring), and its prediction."""
    chosen = int(np.argmax(m.values()[m.z]))
    best = m.objective[chosen]
    tied = m.open & (m.objective >= best - TIE_TOLERANCE * max(abs(best), 1e-12))
    tied[chosen] = True
    p = int(np.argmax(np.where(tied, m.objective, -np.inf)))  # the first of equal ones
    return p, Candidate(
        knobs=inst.points[p],
        rate_per_s=float(m.own_rate[p]),
        steps_per_s=float(m.own_steps[p]),
        binding=binding_limit(inst.limits[p]).condition,
    )


def default_rate_min(inst: MilpInstance) -> float:
    """rate_min: 0.1% of the workload's own rate (well above the solver's feasibility
    tolerance)."""
    return RATE_MIN_SHARE * max(inst.rate_scale, 1e-3)
