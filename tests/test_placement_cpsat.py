"""The background-job placement model: hand-solved cases and a brute-force oracle."""

from __future__ import annotations

import random

import pytest

from servetune.models.placement_cpsat import (
    PlacementInstance,
    PlacementJob,
    explain_unplaced,
)
from servetune.solvers.exhaustive import best_placement_value
from servetune.solvers.placement import solve_placement


def _hand_instance() -> PlacementInstance:
    cap = {
        ("a", 0): 2, ("a", 1): 2, ("a", 2): 0, ("a", 3): 3,
        ("b", 0): 1, ("b", 1): 0, ("b", 2): 1, ("b", 3): 1,
    }
    jobs = (
        PlacementJob("j1", work=4, release_slot=0, deadline_slot=1, value=5),
        PlacementJob("j2", work=3, release_slot=0, deadline_slot=3, value=3),
        PlacementJob("j3", work=5, release_slot=2, deadline_slot=3, value=4, preemptible=False),
        PlacementJob("j4", work=2, release_slot=3, deadline_slot=2, value=9),
    )
    return PlacementInstance(types=("a", "b"), n_slots=4, cap=cap, jobs=jobs)


def test_hand_solved() -> None:
    inst = _hand_instance()
    sol = solve_placement(inst)
    # j4's window is empty; j3 needs 5 units in one run on one type but type a offers
    # 0 + 3 and b 1 + 1 in slots 2-3. j1 (4 units in slots 0-1, 5 spare) and j2 fit:
    # value 5 + 3 = 8. j2 cannot finish before slot 3: slots 0-2 hold 6 units, j1 takes 4.
    assert sol.value == 8
    assert sol.jobs["j1"].done and sol.jobs["j2"].done
    assert not sol.jobs["j3"].done and not sol.jobs["j4"].done
    assert sol.jobs["j1"].finish_slot == 1 and sol.jobs["j2"].finish_slot == 3
    assert "unbroken run" in explain_unplaced(inst, sol, "j3")
    assert "no whole slot" in explain_unplaced(inst, sol, "j4")
    # capacity never exceeded, work exactly complete
    for (t, s), c in inst.cap.items():
        assert sum(p.work.get((t, s), 0) for p in sol.jobs.values()) <= c
    for j in inst.jobs:
        assert sum(sol.jobs[j.id].work.values()) == (j.work if sol.jobs[j.id].done else 0)


def test_value_beats_count() -> None:
    # one slot of 4 units: two small jobs worth 1 each, or one big job worth 3.
    jobs = (
        PlacementJob("s1", 2, 0, 0, 1), PlacementJob("s2", 2, 0, 0, 1),
        PlacementJob("big", 4, 0, 0, 3),
    )
    sol = solve_placement(PlacementInstance(("a",), 1, {("a", 0): 4}, jobs))
    assert sol.value == 3 and sol.jobs["big"].done
    assert "crowded out" in explain_unplaced(
        PlacementInstance(("a",), 1, {("a", 0): 4}, jobs), sol, "s1"
    )


def test_finishes_early_when_value_allows() -> None:
    jobs = (PlacementJob("j", 2, 0, 3, 1),)
    cap = {("a", s): 2 for s in range(4)}
    sol = solve_placement(PlacementInstance(("a",), 4, cap, jobs))
    assert sol.jobs["j"].finish_slot == 0


def test_non_preemptible_stays_on_one_type_contiguously() -> None:
    cap = {("a", 0): 1, ("a", 1): 1, ("a", 2): 1, ("b", 0): 2, ("b", 1): 0, ("b", 2): 2}
    jobs = (PlacementJob("np", 3, 0, 2, 1, preemptible=False),)
    sol = solve_placement(PlacementInstance(("a", "b"), 3, cap, jobs))
    # b has 4 units but a gap in slot 1; only a's unbroken run 0-2 works.
    assert sol.jobs["np"].done
    assert set(t for t, _s in sol.jobs["np"].work) == {"a"}
    # preemptible, the same job could finish in slot 0 + ... b and a together
    jobs_p = (PlacementJob("p", 3, 0, 2, 1, preemptible=True),)
    sol_p = solve_placement(PlacementInstance(("a", "b"), 3, cap, jobs_p))
    assert sol_p.jobs["p"].finish_slot == 0


# --- brute force: every subset of preemptible jobs, feasibility by EDF ---------------


@pytest.mark.parametrize("seed", range(10))
def test_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    types = ("a", "b")[: rng.choice([1, 2])]
    n_slots = rng.randint(3, 6)
    cap = {(t, s): rng.randint(0, 4) for t in types for s in range(n_slots)}
    jobs = []
    for i in range(rng.randint(3, 7)):
        r = rng.randint(0, n_slots - 1)
        d = rng.randint(r, n_slots - 1)
        jobs.append(PlacementJob(f"j{i}", rng.randint(1, 8), r, d, rng.randint(1, 9)))
    inst = PlacementInstance(types, n_slots, cap, tuple(jobs))
    sol = solve_placement(inst)
    assert sol.status == "optimal"
    assert sol.value == best_placement_value(inst)
    for (t, s), c in cap.items():
        assert sum(p.work.get((t, s), 0) for p in sol.jobs.values()) <= c
    for j in jobs:
        p = sol.jobs[j.id]
        assert all(j.release_slot <= s <= j.deadline_slot for _t, s in p.work)


def test_deterministic() -> None:
    a = solve_placement(_hand_instance())
    b = solve_placement(_hand_instance())
    assert {k: v.work for k, v in a.jobs.items()} == {k: v.work for k, v in b.jobs.items()}


def test_priority_weight_orders_finish() -> None:
    # two equal jobs, room for one per slot: the heavier weight (higher priority) goes first
    cap = {("a", 0): 2, ("a", 1): 2}
    jobs = (PlacementJob("low", 2, 0, 1, 1, weight=1), PlacementJob("high", 2, 0, 1, 1, weight=2))
    sol = solve_placement(PlacementInstance(("a",), 2, cap, jobs))
    assert sol.jobs["high"].finish_slot == 0 and sol.jobs["low"].finish_slot == 1
