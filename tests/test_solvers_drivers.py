"""Solver drivers: statuses mapped explicitly and the time limit honoured."""

from __future__ import annotations

import numpy as np
import pyomo.environ as pyo

from servetune.solvers.drivers import SolveStatus, solve_cpsat, solve_highs


def _hard_knapsack(n: int = 60, m: int = 8, seed: int = 3) -> pyo.ConcreteModel:
    """A multi-dimensional knapsack: all-zero is feasible at once, optimality is hard."""
    rng = np.random.default_rng(seed)
    w = rng.integers(200, 1000, (m, n))
    v = w.sum(axis=0) // m + rng.integers(0, 20, n)
    cap = w.sum(axis=1) // 2
    model = pyo.ConcreteModel()
    model.x = pyo.Var(range(n), domain=pyo.Binary)
    model.cap = pyo.Constraint(
        range(m), rule=lambda mm, i: sum(int(w[i, j]) * mm.x[j] for j in range(n)) <= int(cap[i])
    )
    model.obj = pyo.Objective(expr=sum(int(v[j]) * model.x[j] for j in range(n)),
                              sense=pyo.maximize)
    return model


def test_highs_small_model_is_optimal():
    m = pyo.ConcreteModel()
    m.x = pyo.Var(domain=pyo.NonNegativeIntegers, bounds=(0, 10))
    m.c = pyo.Constraint(expr=3 * m.x <= 10)
    m.o = pyo.Objective(expr=m.x, sense=pyo.maximize)
    out, _ = solve_highs(m, time_limit_s=10)
    assert out.status == SolveStatus.OPTIMAL
    assert out.objective == 3


def test_highs_infeasible():
    m = pyo.ConcreteModel()
    m.x = pyo.Var(domain=pyo.Binary)
    m.c = pyo.Constraint(expr=m.x >= 2)
    m.o = pyo.Objective(expr=m.x)
    out, _ = solve_highs(m, time_limit_s=10)
    assert out.status == SolveStatus.INFEASIBLE
    assert out.objective is None


def test_highs_time_limit_stops_before_optimality():
    out, _ = solve_highs(_hard_knapsack(), time_limit_s=0.05)
    assert out.status in (SolveStatus.FEASIBLE_AT_TIME_LIMIT, SolveStatus.ERROR)
    if out.status == SolveStatus.FEASIBLE_AT_TIME_LIMIT:
        assert out.objective is not None
    else:
        assert "maxTimeLimit" in out.message


def test_cpsat_statuses():
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    x = m.NewIntVar(0, 10, "x")
    m.Add(3 * x <= 10)
    m.Maximize(x)
    out, solver = solve_cpsat(m, time_limit_s=5)
    assert out.status == SolveStatus.OPTIMAL and solver.Value(x) == 3

    bad = cp_model.CpModel()
    y = bad.NewIntVar(0, 1, "y")
    bad.Add(y >= 2)
    assert solve_cpsat(bad, time_limit_s=5)[0].status == SolveStatus.INFEASIBLE


def test_cpsat_takes_any_whole_seed():
    """CP-SAT's seed is 32-bit; a larger one (a user's --seed) is taken modulo 2^31, not
    a TypeError from OR-Tools (issue 33)."""
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    x = m.NewIntVar(0, 10, "x")
    m.Maximize(x)
    for seed in (3_000_000_000, 1180591620717411303424):
        out, solver = solve_cpsat(m, time_limit_s=5, seed=seed)
        assert out.status == SolveStatus.OPTIMAL and solver.Value(x) == 10
        assert solver.parameters.random_seed == seed % 2**31


def _hard_knapsack_cpsat():
    """A 120-item, 10-dimension knapsack that CP-SAT cannot prove optimal at once."""
    from ortools.sat.python import cp_model

    rng = np.random.default_rng(5)
    n, m_dim = 120, 10
    w = rng.integers(200, 1000, (m_dim, n))
    v = w.sum(axis=0) // m_dim + rng.integers(0, 20, n)
    cap = w.sum(axis=1) // 2
    model = cp_model.CpModel()
    x = [model.NewBoolVar(f"x{j}") for j in range(n)]
    for i in range(m_dim):
        model.Add(sum(int(w[i, j]) * x[j] for j in range(n)) <= int(cap[i]))
    model.Maximize(sum(int(v[j]) * x[j] for j in range(n)))
    return model


def test_cpsat_time_limit_stops_before_optimality():
    model = _hard_knapsack_cpsat()
    out, _ = solve_cpsat(model, time_limit_s=0.05)
    assert out.status in (SolveStatus.FEASIBLE_AT_TIME_LIMIT, SolveStatus.ERROR)


def test_highs_node_limit_is_a_work_limit_with_the_same_answer_each_time():
    # A work limit stops the solve at the same point on any machine: the same answer twice.
    runs = [solve_highs(_hard_knapsack(), time_limit_s=600, max_nodes=1)[0] for _ in range(2)]
    for out in runs:
        assert out.stopped_by == "work_limit"
        assert out.status in (SolveStatus.FEASIBLE_AT_WORK_LIMIT, SolveStatus.ERROR)
    assert runs[0].status == runs[1].status and runs[0].objective == runs[1].objective


def test_highs_time_limit_is_reported_as_the_safety_stop():
    out, _ = solve_highs(_hard_knapsack(), time_limit_s=0.05)
    assert out.stopped_by == "time_limit"


def test_cpsat_deterministic_time_is_a_work_limit():
    model = _hard_knapsack_cpsat()
    runs = [solve_cpsat(model, time_limit_s=600, max_deterministic_time=0.05)[0]
            for _ in range(2)]
    for out in runs:
        assert out.stopped_by == "work_limit"
        assert out.status in (SolveStatus.FEASIBLE_AT_WORK_LIMIT, SolveStatus.ERROR)
    assert runs[0].objective == runs[1].objective


def _knapsack_highspy(n: int = 60, m: int = 8, seed: int = 3):
    """:func:`_hard_knapsack` in matrix form, loaded in a fresh HiGHS (minimize -value)."""
    import highspy

    from servetune.solvers.drivers import new_highs

    rng = np.random.default_rng(seed)
    w = rng.integers(200, 1000, (m, n))
    v = w.sum(axis=0) // m + rng.integers(0, 20, n)
    cap = w.sum(axis=1) // 2
    highs = new_highs()
    cols = np.arange(n, dtype=np.int32)
    highs.addVars(n, np.zeros(n), np.ones(n))
    highs.changeColsCost(n, cols, -v.astype(float))
    highs.changeColsIntegrality(n, cols, np.full(n, highspy.HighsVarType.kInteger))
    for i in range(m):
        highs.addRow(-highspy.kHighsInf, float(cap[i]), n, cols, w[i].astype(float))
    return highs


def test_highspy_statuses_match_the_pyomo_driver():
    # The same knapsack through both drivers: the same optimum; the node limit and the
    # time limit are reported as solve_highs reports them.
    from servetune.solvers.drivers import solve_highspy

    exact = solve_highspy(_knapsack_highspy(n=12, m=3), time_limit_s=60)
    assert exact.status == SolveStatus.OPTIMAL and exact.stopped_by == ""
    assert -exact.objective == solve_highs(_hard_knapsack(n=12, m=3), time_limit_s=60
                                           )[0].objective
    limited = [solve_highspy(_knapsack_highspy(), time_limit_s=600, max_nodes=1)
               for _ in range(2)]
    for out in limited:
        assert out.stopped_by == "work_limit"
        assert out.status in (SolveStatus.FEASIBLE_AT_WORK_LIMIT, SolveStatus.ERROR)
    assert limited[0].objective == limited[1].objective
    timed = solve_highspy(_knapsack_highspy(), time_limit_s=0.05)
    assert timed.stopped_by == "time_limit"
    assert timed.status in (SolveStatus.FEASIBLE_AT_TIME_LIMIT, SolveStatus.ERROR)


def test_highspy_infeasible():
    import highspy

    from servetune.solvers.drivers import new_highs, solve_highspy

    highs = new_highs()
    highs.addVars(1, np.zeros(1), np.ones(1))
    highs.changeColsIntegrality(1, np.zeros(1, dtype=np.int32),
                                np.full(1, highspy.HighsVarType.kInteger))
    highs.addRow(2.0, highspy.kHighsInf, 1, np.zeros(1, dtype=np.int32), np.ones(1))
    out = solve_highspy(highs, time_limit_s=10)
    assert out.status == SolveStatus.INFEASIBLE and out.objective is None


def test_a_limit_without_a_solution_is_an_error_that_names_the_limit():
    from servetune.solvers.drivers import _status_of

    assert _status_of("time_limit", has_solution=False) == (SolveStatus.ERROR, "time_limit")
    assert _status_of("work_limit", has_solution=False) == (SolveStatus.ERROR, "work_limit")
    assert _status_of("time_limit", has_solution=True) == (
        SolveStatus.FEASIBLE_AT_TIME_LIMIT, "time_limit")
    assert _status_of("work_limit", has_solution=True) == (
        SolveStatus.FEASIBLE_AT_WORK_LIMIT, "work_limit")
    assert _status_of("other", has_solution=True) == (SolveStatus.ERROR, "")
    assert _status_of("infeasible", has_solution=False) == (SolveStatus.INFEASIBLE, "")
