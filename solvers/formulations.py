"""Solve the optimization formulations of :mod:`servetune.models` with the drivers.

The models build a Pyomo or CP-SAT model and say how to read a solution back; this module
runs them through :mod:`servetune.solvers.drivers` (time limits, explicit statuses, top-k
by no-good cuts), keeping the dependency one way: solvers -> models -> core.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from servetune.models import lanes_cpsat, policy_milp
from servetune.models.lanes_cpsat import LaneInstance
from servetune.models.policy_milp import MilpInstance
from servetune.solvers.drivers import (
    SolveOutcome,
    SolveStatus,
    TopK,
    new_highs,
    solve_cpsat,
    solve_ideal_highspy,
    top_k_highs,
)


def solve_policy_milp(
    inst: MilpInstance,
    *,
    k: int = 3,
    time_limit_s: float = 10.0,
    rate_min: float | None = None,
    excluded: set[int] = frozenset(),
    groups: Sequence[Hashable] | None = None,
) -> TopK:
    """The best ``k`` candidates of the policy MILP by predicted goodput (no-good cuts
    between solves). Each solution is ``(point index, Candidate)``. ``rate_min`` defaults
    to :func:`~servetune.models.policy_milp.default_rate_min`.

    ``groups`` (one key per point) makes the k candidates come from k different groups:
    each solution's cut removes every point of its group, so the next solve looks at the
    best point of another group instead of a near-copy of the last one."""
    if rate_min is None:
        rate_min = policy_milp.default_rate_min(inst)
    model = policy_milp.build_model(inst, new_highs(), rate_min=rate_min,
                                    excluded=sorted(excluded))
    keys = list(groups) if groups is not None else list(range(len(inst.points)))
    if len(keys) != len(inst.points):
        raise ValueError("solve_policy_milp: one group key per point")
    members: dict[Hashable, list[int]] = {}
    for p, key in enumerate(keys):
        members.setdefault(key, []).append(p)

    def cut(solution: tuple[int, policy_milp.Candidate]) -> None:
        # one_policy makes z[p] = 0 the whole no-good cut of a solution p, and z = 0 on
        # its group the cut of the group
        model.exclude(np.array(members[keys[solution[0]]]))

    return top_k_highs(
        k, solve=lambda left: solve_ideal_highspy(model.highs, model.z, time_limit_s=left),
        decode=lambda: policy_milp.decode(inst, model), cut=cut, time_limit_s=time_limit_s)


def solve_lanes(inst: LaneInstance, *, time_limit_s: float = 5.0, seed: int = 0) -> SolveOutcome:
    """CP-SAT over the lane sizes; the outcome's ``solution`` is a
    :class:`~servetune.models.lanes_cpsat.LaneChoice`."""
    lanes = lanes_cpsat.build_model(inst)
    if lanes is None:
        return SolveOutcome(SolveStatus.INFEASIBLE, message=lanes_cpsat.NO_USABLE_THRESHOLD)
    outcome, solver = solve_cpsat(lanes.model, time_limit_s=time_limit_s, seed=seed)
    if outcome.status.has_solution:
        outcome.solution = lanes.decode(solver)
        outcome.objective = lanes.objective_of(outcome.solution)
    return outcome
