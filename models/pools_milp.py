"""Pools MILP: route request classes to replica pools on a fleet of identical replicas.

A fleet of ``R`` replicas may serve all the classes together (one pool, one per-class
policy), each class apart, or anything between. A pool serving the classes of ``S`` on
``n`` replicas, its traffic split evenly, sees ``1/n`` of those classes' load on each
replica, so it keeps every tier of ``S`` within its SLO up to the common load scale
``n g[S]``, where ``g[S]`` is what one replica serving exactly ``S`` sustains with its
own best policy (per-class for two or more classes; from the tier search, validated in
the simulator). Choosing the pools and their sizes is then a small MILP:

Sets
    C   request classes;  S  the non-empty subsets of C (candidate pools)
Parameters
    g[S]   the largest common scale one replica serving exactly S sustains
    R      replicas in the fleet;  U = R max_S g[S]  (a bound on the scale)
Variables
    w[S] in {0,1}        pool S is used
    n[S] in {0..R}       its replicas
    sigma >= 0           the common load scale every class is served at
Constraints
    cover[c]:    sum_{S contains c} w[S] = 1       (each class in exactly one pool)
    replicas:    sum_S n[S] = R
    open[S]:     w[S] <= n[S] <= R w[S]
    serve[S]:    sigma <= g[S] n[S] + U (1 - w[S])
Objective
    maximize  sigma - eps sum_S w[S]   (among equal scales, the fewest pools)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import pyomo.environ as pyo

TIE_WEIGHT = 1e-6


@dataclass(frozen=True)
class PoolPlan:
    scale: float  # sigma: the common load scale the fleet serves every tier at
    pools: dict[tuple[str, ...], int]  # classes of a pool -> its replicas


def subsets(names: Sequence[str]) -> list[tuple[str, ...]]:
    """The non-empty subsets of ``names``, smallest first (order kept within each)."""
    return [combo for k in range(1, len(names) + 1)
            for combo in itertools.combinations(names, k)]


def build_model(names: Sequence[str], goodput: dict[tuple[str, ...], float],
                replicas: int) -> pyo.ConcreteModel:
    """The model of the module docstring (``goodput``: g[S] for every subset)."""
    pools = [s for s in subsets(names) if s in goodput]
    bound = replicas * max(goodput[s] for s in pools)
    m = pyo.ConcreteModel(name="pools_milp")
    m.S = pyo.Set(initialize=range(len(pools)), ordered=True)
    m.C = pyo.Set(initialize=list(names), ordered=True)
    m.w = pyo.Var(m.S, domain=pyo.Binary)
    m.n = pyo.Var(m.S, domain=pyo.NonNegativeIntegers, bounds=(0, replicas))
    m.sigma = pyo.Var(domain=pyo.NonNegativeReals)
    m.cover = pyo.Constraint(m.C, rule=lambda m, c: sum(
        m.w[i] for i in m.S if c in pools[i]) == 1)
    m.replicas = pyo.Constraint(expr=sum(m.n[i] for i in m.S) == replicas)
    m.open_lo = pyo.Constraint(m.S, rule=lambda m, i: m.w[i] <= m.n[i])
    m.open_hi = pyo.Constraint(m.S, rule=lambda m, i: m.n[i] <= replicas * m.w[i])
    m.serve = pyo.Constraint(m.S, rule=lambda m, i: m.sigma <= goodput[pools[i]] * m.n[i]
                             + bound * (1 - m.w[i]))
    m.obj = pyo.Objective(sense=pyo.maximize,
                          expr=m.sigma - TIE_WEIGHT * sum(m.w[i] for i in m.S))
    m.pools = pools
    m.goodput = goodput
    return m


def decode(m: pyo.ConcreteModel) -> PoolPlan:
    """The chosen pools; the scale is recomputed from them (exact, not the solver's sigma
    within its tolerance)."""
    chosen = {m.pools[i]: int(round(pyo.value(m.n[i]))) for i in m.S
              if pyo.value(m.w[i]) > 0.5}
    return PoolPlan(scale=min(m.goodput[p] * n for p, n in chosen.items()), pools=chosen)


def best_by_enumeration(names: Sequence[str], goodput: dict[tuple[str, ...], float],
                        replicas: int) -> float:
    """The oracle: every partition of the classes into pools x every split of the
    replicas (each pool at least one), the best common scale."""
    best = 0.0
    for partition in _partitions(list(names)):
        if any(p not in goodput for p in partition):
            continue
        k = len(partition)
        if k > replicas:
            continue
        for split in compositions(replicas, k):
            best = max(best, min(goodput[p] * n for p, n in zip(partition, split, strict=True)))
    return best


def _partitions(items: list[str]) -> list[list[tuple[str, ...]]]:
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for part in _partitions(rest):
        out.append([(first,)] + part)
        for i in range(len(part)):
            merged = tuple(sorted((first,) + part[i], key=items.index))
            out.append(part[:i] + [merged] + part[i + 1:])
    return out


def compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to give ``parts`` pools at least one of ``total`` replicas each."""
    if parts == 1:
        return [(total,)]
    return [(first,) + rest for first in range(1, total - parts + 2)
            for rest in compositions(total - first, parts - 1)]
