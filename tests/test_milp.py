"""The policy MILP against brute force over the grid with the same fluid formulas."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from optimizer_fixtures import SMALL_SPACE, fluid

from servetune.conditions import Family
from servetune.models.fluid import knobs_grid
from servetune.models.policy_milp import (
    RATE_MIN_SHARE,
    MilpInstance,
    build_model,
)
from servetune.solvers.drivers import SolveStatus, new_highs
from servetune.solvers.formulations import solve_policy_milp


def _brute(fm, points):
    return sorted(((fm.goodput(k)[0], i) for i, k in enumerate(points)), reverse=True)


@pytest.mark.parametrize("tpot", [0.1, 0.03])
def test_milp_optimum_equals_enumeration(tpot):
    fm = fluid(tpot_s=tpot)
    points = knobs_grid(SMALL_SPACE)
    assert len(points) == 3 * 3 * 2 * 2  # tokens >= seqs holds everywhere here
    inst = MilpInstance.build(fm, points)
    out = solve_policy_milp(inst, k=1)
    assert out.statuses == ["optimal"]
    idx, cand = out.solutions[0]
    best_rate = _brute(fm, points)[0][0]
    assert best_rate > 0
    assert cand.rate_per_s == pytest.approx(best_rate, rel=1e-6)
    # The chosen point really has that goodput under the fluid model, and the
    # step-time epigraph is tight: steps per second = 1 / t(x*).
    assert fm.goodput(points[idx])[0] == pytest.approx(best_rate, rel=1e-6)
    x = cand.rate_per_s / cand.steps_per_s
    assert cand.steps_per_s == pytest.approx(1.0 / float(fm.mean_step_s(x)), rel=1e-6)


def test_top_k_by_no_good_cuts_follows_the_enumeration_order():
    fm = fluid()
    points = knobs_grid(SMALL_SPACE)
    inst = MilpInstance.build(fm, points)
    out = solve_policy_milp(inst, k=4)
    rates = [c.rate_per_s for _, c in out.solutions]
    idxs = [i for i, _ in out.solutions]
    assert len(set(idxs)) == 4
    expected = [r for r, _ in _brute(fm, points)[:4]]
    assert rates == pytest.approx(expected, rel=1e-6)


def test_excluded_points_are_never_chosen():
    fm = fluid()
    points = knobs_grid(SMALL_SPACE)
    inst = MilpInstance.build(fm, points)
    ranked = _brute(fm, points)
    best_idx = solve_policy_milp(inst, k=1).solutions[0][0]
    out = solve_policy_milp(inst, k=1, excluded={best_idx})
    idx, cand = out.solutions[0]
    assert idx != best_idx
    assert cand.rate_per_s == pytest.approx(ranked[1][0], rel=1e-6)


def test_infeasible_slo_gives_infeasible_status():
    fm = fluid(tpot_s=0.003)
    inst = MilpInstance.build(fm, knobs_grid(SMALL_SPACE))
    out = solve_policy_milp(inst, k=2)
    assert out.statuses == ["infeasible"]
    assert out.solutions == []


def test_model_names_follow_the_docstring():
    fm = fluid()
    inst = MilpInstance.build(fm, knobs_grid(SMALL_SPACE))
    m = build_model(inst, new_highs(), rate_min=1e-6)
    n, k = len(inst.points), len(inst.pieces)
    assert [len(m.z), len(m.rate), len(m.steps)] == [n, n, n]
    assert m.highs.getNumCol() == 3 * n
    # one row per constraint of the docstring: one_policy, step_time[p,k], tightest[p]
    # (a candidate with no finite limit has none), min_rate
    sizes = {name: end - first for name, (first, end) in m.rows.items()}
    tight = sum(math.isfinite(inst.x_tightest(p)) for p in range(n))
    assert sizes == {"one_policy": 1, "step_time": n * k, "tightest": tight, "min_rate": 1}
    assert m.highs.getNumRow() == 2 + n * k + tight


def test_zero_time_limit_returns_no_solutions():
    fm = fluid()
    inst = MilpInstance.build(fm, knobs_grid(SMALL_SPACE))
    out = solve_policy_milp(inst, k=3, time_limit_s=0.0)
    assert out.outcomes == []


def test_status_enum_values():
    assert [s.value for s in SolveStatus] == [
        "optimal", "feasible_at_time_limit", "infeasible", "error", "feasible_at_work_limit"
    ]


@settings(max_examples=8, deadline=None)
@given(
    ttft=st.floats(0.2, 5.0),
    tpot=st.floats(0.01, 0.2),
    kv_blocks=st.integers(500, 100_000),
    seed=st.integers(0, 1000),
)
def test_milp_matches_enumeration_on_random_instances(ttft, tpot, kv_blocks, seed):
    from optimizer_fixtures import synthetic_load

    fm = fluid(ttft_s=ttft, tpot_s=tpot, kv_blocks=kv_blocks,
               load=synthetic_load(n=2000, seed=seed))
    points = knobs_grid(SMALL_SPACE)
    best = _brute(fm, points)[0][0]
    out = solve_policy_milp(MilpInstance.build(fm, points), k=1)
    if best <= RATE_MIN_SHARE * fm.load.rate_per_s:
        assert out.statuses == ["infeasible"]
    else:
        assert out.statuses == ["optimal"]
        assert out.solutions[0][1].rate_per_s == pytest.approx(best, rel=1e-6)


def _two_class_fluid(seed: int, n: int, classes, targets):
    """A fluid model of two classes, each (name, share, prompt range, output range) with
    ``n`` uniform samples, at 4 req/s on the fixtures' step time."""
    import numpy as np
    from optimizer_fixtures import STEP

    from servetune.models.fluid import ClassLoad, FluidModel, LoadModel, Platform

    rng = np.random.default_rng(seed)
    loads = tuple(ClassLoad.from_samples(name, share, rng.integers(*prompt, n),
                                         rng.integers(*output, n))
                  for name, share, prompt, output in classes)
    return FluidModel(LoadModel(loads, 4.0), Platform(STEP, 60_000, 16), targets)


def test_per_class_flows_and_targets():
    from servetune.models.fluid import Target

    fm = _two_class_fluid(2, 3000, [("chat", 0.8, (50, 1500), (20, 400)),
                                    ("docs", 0.2, (4000, 30000), (50, 300))],
                          {"chat": Target(ttft_s=0.5, tpot_s=0.05, q=0.99),
                           "docs": Target(ttft_s=10.0, tpot_s=0.2, q=0.9)})
    points = knobs_grid(SMALL_SPACE)
    inst = MilpInstance.build(fm, points)
    assert set(inst.shares) == {"chat", "docs"}
    out = solve_policy_milp(inst, k=1)
    idx, cand = out.solutions[0]
    best = _brute(fm, points)[0][0]
    assert cand.rate_per_s == pytest.approx(best, rel=1e-6)
    assert cand.binding.request_class == "chat" or cand.binding.stability
    # The chat class's tighter TTFT binds before the docs class's looser one.
    lims = fm.limits(points[idx])
    ttft = {c.request_class: lim.x_max for c, lim in lims.items() if c.family is Family.TTFT}
    assert ttft["chat"] <= ttft["docs"]


def test_limits_of_many_shapes_at_once_equal_one_shape_at_a_time():
    # limits_many evaluates every step shape in one array (and narrows every limit in
    # one bisection); each point alone must get exactly the same limits, in order.
    fm = fluid()
    points = knobs_grid(SMALL_SPACE)
    together = fm.limits_many(points)
    for k, lims in zip(points, together, strict=True):
        alone = fm.limits_many([k])[0]
        assert list(alone) == list(lims)
        assert [(v.x_max, v.floor_value, v.target) for v in alone.values()] == [
            (v.x_max, v.floor_value, v.target) for v in lims.values()]


def test_a_class_without_traffic_never_binds():
    from servetune.models.fluid import Target

    fm = _two_class_fluid(3, 2000, [("chat", 1.0, (50, 1500), (20, 400)),
                                    ("idle", 0.0, (50, 1500), (20, 400))],
                          {"chat": Target(ttft_s=5.0, tpot_s=0.2, q=0.9),
                           "idle": Target(ttft_s=1e-6, tpot_s=1e-6, q=0.9)})  # unmeetable
    inst = MilpInstance.build(fm, knobs_grid(SMALL_SPACE))
    assert all(inst.x_tightest(p) > 0 for p in range(len(inst.points)))
    out = solve_policy_milp(inst, k=1)
    assert out.statuses == ["optimal"]
    assert out.solutions[0][1].rate_per_s > 0


def test_ties_go_to_the_larger_exact_objective_then_grid_order():
    # Points that differ only in knobs the fluid model ignores here (a queue cap far
    # above any queue) have the same goodput; the solver cannot order them, the
    # tie-break after the solve does: the larger exact objective, then the first point.
    import numpy as np

    from servetune.models.policy_milp import TIE_WEIGHT

    fm = fluid()
    points = knobs_grid({**SMALL_SPACE, "admission.max_queued_requests": [None, 10**9]})
    inst = MilpInstance.build(fm, points)
    rate, _ = inst.own_optimum()
    objective = rate + TIE_WEIGHT * inst.rate_scale * np.array(
        [inst.tie_break(p) for p in range(len(points))])
    out = solve_policy_milp(inst, k=6)
    order = np.lexsort((np.arange(len(points)), -objective))  # by objective, then index
    assert [p for p, _ in out.solutions] == [int(p) for p in order[:6]]
    # the chosen point ties in goodput with its twin (the other queue cap)
    from dataclasses import replace

    first = out.solutions[0][0]
    other_cap = None if points[first].max_queued_requests is not None else 10**9
    twin = points.index(replace(points[first], max_queued_requests=other_cap))
    assert twin != first and rate[twin] == pytest.approx(rate[first], rel=1e-12)


def test_a_relaxation_that_is_not_integral_falls_back_to_branch_and_bound():
    # A knapsack's LP relaxation takes a fraction of an item; solve_ideal_highspy must
    # notice and return the integral optimum (items 0 and 2: value 9 of weight 5).
    import highspy
    import numpy as np

    from servetune.solvers.drivers import solve_ideal_highspy

    highs = new_highs()
    values, weights = np.array([5.0, 6.0, 4.0]), np.array([3.0, 4.0, 2.0])
    highs.addCols(3, values, np.zeros(3), np.ones(3), 0, np.array([], dtype=np.int32),
                  np.array([], dtype=np.int32), np.array([]))
    highs.addRow(-highspy.kHighsInf, 5.0, 3, np.arange(3, dtype=np.int32), weights)
    highs.changeColsIntegrality(3, np.arange(3, dtype=np.int32),
                                np.full(3, highspy.HighsVarType.kInteger))
    highs.changeObjectiveSense(highspy.ObjSense.kMaximize)
    outcome = solve_ideal_highspy(highs, np.arange(3), time_limit_s=10.0)
    assert outcome.status == SolveStatus.OPTIMAL
    assert outcome.objective == pytest.approx(9.0)
    assert np.round(highs.getSolution().col_value).tolist() == [1.0, 0.0, 1.0]
