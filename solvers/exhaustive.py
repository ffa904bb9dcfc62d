"""Exhaustive solvers for small capacity-planning and job-placement instances: the oracles
the MILP (:mod:`servetune.models.capacity_milp`) and the CP-SAT model
(:mod:`servetune.models.placement_cpsat`) are checked against, in the tests and in
``benchmarks/capacity_quality.py``.

- Capacity: every slot is planned on its own (no constraint links slots in cost mode), by
  enumerating every replica count per type up to the count that serves the slot alone,
  and keeping the cheapest combination for which an LP finds a routing that serves every
  bucket within each type's capacity.
- Placement (preemptible jobs only): every subset of jobs, in order of value, is checked
  by earliest-deadline-first, which is exact for divisible work with release times and
  deadlines on pooled capacity.
"""

from __future__ import annotations

import itertools
import math

import highspy
import numpy as np

from servetune.models.capacity_milp import CapacityInstance
from servetune.models.placement_cpsat import PlacementInstance, PlacementJob


def routing_feasible(inst: CapacityInstance, s: int, n: dict[str, int]) -> bool:
    """Is there a routing of slot ``s`` with every bucket served and every type within
    ``headroom x (replicas - spare)`` of its capacity, given ``n`` replicas per type?"""
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    pairs = [(b, t) for b in inst.buckets for t in inst.types if inst.mu[t, b] > 0]
    for _ in pairs:
        h.addVar(0.0, 1.0)
    for b in inst.buckets:
        idx = [i for i, (bb, _t) in enumerate(pairs) if bb == b]
        if not idx:
            if inst.lam[b, s] > 0:
                return False
            continue
        h.addRow(1.0, 1.0, len(idx), np.array(idx, dtype=np.int32), np.ones(len(idx)))
    for t in inst.types:
        idx = [i for i, (_b, tt) in enumerate(pairs) if tt == t]
        coef = [inst.lam[pairs[i][0], s] / inst.mu[t, pairs[i][0]] for i in idx]
        spare = 1 if (inst.n_plus_one and n[t] > 0) else 0
        if idx:
            h.addRow(-highspy.kHighsInf, inst.headroom * (n[t] - spare), len(idx),
                     np.array(idx, dtype=np.int32), np.array(coef))
    h.run()
    return h.getModelStatus() == highspy.HighsModelStatus.kOptimal


def cheapest_plan_cost(inst: CapacityInstance) -> tuple[float, int]:
    """The optimal cost of a cost-mode instance (no count limits, no static option) and
    the number of replica combinations enumerated."""
    total, combos = 0.0, 0
    for s in range(inst.n_slots):
        bound = {
            t: math.ceil(sum(inst.lam[b, s] / inst.mu[t, b] for b in inst.buckets
                             if inst.mu[t, b] > 0) / inst.headroom) + int(inst.n_plus_one)
            for t in inst.types
        }
        best = math.inf
        for combo in itertools.product(*(range(bound[t] + 1) for t in inst.types)):
            combos += 1
            n = dict(zip(inst.types, combo, strict=True))
            cost = sum(inst.price[t] * inst.hours * n[t] for t in inst.types)
            if cost < best - 1e-12 and routing_feasible(inst, s, n):
                best = cost
        total += best
    return total, combos


def edf_feasible(inst: PlacementInstance, subset: list[PlacementJob]) -> bool:
    """Can every job of ``subset`` (preemptible) finish in its window? Earliest deadline
    first on the capacity of all types pooled, slot by slot."""
    left = {j.id: j.work for j in subset}
    for s in range(inst.n_slots):
        room = sum(inst.cap.get((t, s), 0) for t in inst.types)
        ready = sorted(
            (j for j in subset if j.release_slot <= s <= j.deadline_slot and left[j.id] > 0),
            key=lambda j: (j.deadline_slot, j.id),
        )
        for j in ready:
            take = min(room, left[j.id])
            left[j.id] -= take
            room -= take
        if any(left[j.id] > 0 and j.deadline_slot <= s for j in subset):
            return False
    return all(v == 0 for v in left.values())


def best_placement_value(inst: PlacementInstance) -> int:
    """The most value any feasible set of (preemptible) jobs completes."""
    best = 0
    for k in range(len(inst.jobs) + 1):
        for subset in itertools.combinations(inst.jobs, k):
            value = sum(j.value for j in subset)
            if value > best and edf_feasible(inst, list(subset)):
                best = value
    return best
