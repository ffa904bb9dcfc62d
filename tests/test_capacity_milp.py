"""The planning MILP against hand-solved instances and a brute-force enumeration oracle."""

from __future__ import annotations

import random

import pytest

from servetune.errors import InfeasibleError
from servetune.models.capacity_milp import CapacityInstance
from servetune.solvers.capacity import solve_capacity
from servetune.solvers.exhaustive import cheapest_plan_cost, routing_feasible


def _inst(**kw) -> CapacityInstance:
    base = dict(
        types=("a", "b"),
        buckets=("short", "long"),
        n_slots=2,
        lam={("short", 0): 10.0, ("long", 0): 2.0, ("short", 1): 4.0, ("long", 1): 1.0},
        mu={("a", "short"): 4.0, ("a", "long"): 0.5, ("b", "short"): 3.0, ("b", "long"): 2.0},
        price={"a": 2.0, "b": 1.0},
        headroom=1.0,
    )
    base.update(kw)
    return CapacityInstance(**base)


def test_hand_solved_two_slots() -> None:
    # b is cheaper per req/s for both buckets (short 1/3 vs 2/4, long 1/2 vs 2/0.5), so
    # everything goes to b: slot 0 needs 10/3 + 2/2 = 4.33 -> 5 replicas, slot 1 needs
    # 4/3 + 1/2 = 1.83 -> 2 replicas; cost (5 + 2) x $1 = $7.
    sol = solve_capacity(_inst())
    assert sol.status == "optimal"
    assert sol.replicas == {("a", 0): 0, ("a", 1): 0, ("b", 0): 5, ("b", 1): 2}
    assert sol.cost == pytest.approx(7.0)
    assert sol.served_share == pytest.approx(1.0)


def test_headroom_and_n_plus_one() -> None:
    # headroom 0.5 doubles the need: slot 0 8.67 -> 9, slot 1 3.67 -> 4 => $13.
    assert solve_capacity(_inst(headroom=0.5)).cost == pytest.approx(13.0)
    # N+1 adds one spare replica to every type in use: 6 + 3 => $9.
    sol = solve_capacity(_inst(n_plus_one=True))
    assert sol.replicas[("b", 0)] == 6 and sol.replicas[("b", 1)] == 3
    assert sol.cost == pytest.approx(9.0)


def test_count_limit_splits_traffic() -> None:
    # b limited to 3 replicas: slot 0 must send part of "short" to a. b carries all of
    # "long" (1 replica-eq) + 2 replicas of short (6 req/s); a takes 4 req/s -> 1 replica.
    sol = solve_capacity(_inst(n_max={"a": None, "b": 3}))
    assert sol.replicas[("b", 0)] == 3 and sol.replicas[("a", 0)] == 1
    assert sol.cost == pytest.approx(3 + 2 + 2)
    for s in range(2):
        for b in ("short", "long"):
            assert sum(sol.routing.get((b, t, s), 0.0) for t in ("a", "b")) == pytest.approx(1)


def test_count_limit_too_low_is_infeasible_with_reason() -> None:
    with pytest.raises(InfeasibleError) as err:
        solve_capacity(_inst(n_max={"a": 1, "b": 2}))
    assert err.value.exit_code == 3
    assert "count limit too low" in err.value.message
    assert "slot 0" in err.value.message
    assert err.value.details["binding"] == "count_limit"


def test_unservable_bucket() -> None:
    mu = {("a", "short"): 4.0, ("a", "long"): 0.0, ("b", "short"): 3.0, ("b", "long"): 0.0}
    with pytest.raises(InfeasibleError, match="no GPU type can serve bucket long"):
        solve_capacity(_inst(mu=mu))


def test_budget_mode_serves_most_within_budget() -> None:
    # $5 buys five b replica-slots (a serves less per dollar). Per replica b serves 3
    # short or 2 long req/s, so short goes first. 4 + 1 replicas: slot 0 serves all 10
    # short (3.33) and 0.67 x 2 = 1.33 long = 11.33; slot 1 serves 3 short: 14.33 in all,
    # more than 3 + 2 (9 + 5 = 14) or 5 + 0 (12).
    sol = solve_capacity(_inst(budget=5.0))
    assert sol.cost <= 5.0 + 1e-9
    served0 = sum(
        f * {"short": 10.0, "long": 2.0}[b] for (b, _t, s), f in sol.routing.items() if s == 0
    )
    served1 = sum(
        f * {"short": 4.0, "long": 1.0}[b] for (b, _t, s), f in sol.routing.items() if s == 1
    )
    assert sol.replicas[("b", 0)] == 4 and sol.replicas[("b", 1)] == 1
    assert served0 == pytest.approx(10 + 4 / 3, abs=1e-6)
    assert served1 == pytest.approx(3.0, abs=1e-6)


# --- brute force: enumerate every replica combination, check routing by an LP ---------


def _random_instance(rng: random.Random, n_types: int, n_buckets: int) -> CapacityInstance:
    types = tuple(f"t{i}" for i in range(n_types))
    buckets = tuple(f"b{i}" for i in range(n_buckets))
    mu = {}
    for t in types:
        for b in buckets:
            mu[t, b] = 0.0 if rng.random() < 0.15 else round(rng.uniform(0.5, 6.0), 2)
    for b in buckets:  # every bucket has at least one capable type
        if all(mu[t, b] == 0 for t in types):
            mu[types[0], b] = 1.0
    lam = {(b, s): round(rng.uniform(0.2, 8.0), 2) for b in buckets for s in range(2)}
    price = {t: round(rng.uniform(0.5, 4.0), 2) for t in types}
    return CapacityInstance(
        types=types, buckets=buckets, n_slots=2, lam=lam, mu=mu, price=price,
        headroom=rng.choice([1.0, 0.8]), n_plus_one=rng.random() < 0.3,
    )


@pytest.mark.parametrize("seed", range(8))
def test_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    inst = _random_instance(rng, rng.choice([2, 3]), rng.choice([3, 4]))
    sol = solve_capacity(inst)
    assert sol.cost == pytest.approx(cheapest_plan_cost(inst)[0], abs=1e-6)
    # the plan it returns is itself feasible
    for s in range(inst.n_slots):
        n = {t: sol.replicas[t, s] for t in inst.types}
        assert routing_feasible(inst, s, n)


def test_same_inputs_same_plan() -> None:
    inst = _random_instance(random.Random(3), 3, 4)
    a, b = solve_capacity(inst), solve_capacity(inst)
    assert a.replicas == b.replicas and a.routing == b.routing


def test_min_count_and_static() -> None:
    # min 2 replicas of `a` in every slot, already paid for, take what they can.
    # Slot 0: a serves 8 req/s of short; b covers 2 short + 2 long: 2/3 + 1 -> 2.
    # Slot 1: a serves all 4 short (1 replica-eq) and 0.5 long (the other 1); b takes
    # the other 0.5 long: 0.25 -> 1. Long on `a` costs 4x the capacity it costs on `b`.
    sol = solve_capacity(_inst(n_min={"a": 2, "b": 0}))
    assert sol.replicas[("a", 0)] == 2 and sol.replicas[("a", 1)] == 2
    assert sol.replicas[("b", 0)] == 2 and sol.replicas[("b", 1)] == 1
    # static: the same replicas in both slots, sized for the busier one. 5 x b ($5 per
    # slot) ties with 3 x b + 1 x a (b: long + 6 short, a: 4 short), which uses less
    # capacity (4 replica-eq instead of 4.33), so the tie-break picks it.
    sol = solve_capacity(_inst(static=True))
    for t in ("a", "b"):
        assert sol.replicas[(t, 0)] == sol.replicas[(t, 1)]
    assert sol.replicas[("b", 0)] == 3 and sol.replicas[("a", 0)] == 1
    assert sol.cost == pytest.approx(10.0)


def test_repeated_slots_are_solved_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A day that repeats slot rates gives the plan slot by slot, solving each distinct
    slot once (the same MILP would give the same answer)."""
    from servetune.solvers import capacity as C

    calls = []
    real = C._solve_milp
    monkeypatch.setattr(C, "_solve_milp", lambda m, t: calls.append(1) or real(m, t))
    rates = [(10.0, 2.0), (4.0, 1.0), (10.0, 2.0), (4.0, 1.0), (10.0, 2.0)]
    lam = {}
    for s, (short, long) in enumerate(rates):
        lam["short", s], lam["long", s] = short, long
    sol = solve_capacity(_inst(n_slots=5, lam=lam))
    assert len(calls) == 2
    # the hand-solved answer of test_hand_solved_two_slots, slot by slot
    assert [sol.replicas["b", s] for s in range(5)] == [5, 2, 5, 2, 5]
    assert all(sol.replicas["a", s] == 0 for s in range(5))
    assert sol.cost == pytest.approx(19.0)
    for s in range(5):
        assert sol.routing["short", "b", s] == pytest.approx(1.0)


def test_oracle_checks_every_bucket_past_an_idle_unservable_one() -> None:
    """The enumeration oracle's routing check used to return "feasible" as soon as it met a
    bucket no type can serve with rate 0, skipping the buckets after it."""
    lam = {("short", 0): 10.0, ("long", 0): 2.0, ("idle", 0): 0.0}
    mu = {("a", "short"): 4.0, ("a", "long"): 0.5, ("b", "short"): 3.0, ("b", "long"): 2.0,
          ("a", "idle"): 0.0, ("b", "idle"): 0.0}
    inst = _inst(buckets=("short", "idle", "long"), n_slots=1, lam=lam, mu=mu)
    assert not routing_feasible(inst, 0, {"a": 0, "b": 0})
    assert routing_feasible(inst, 0, {"a": 0, "b": 5})


def test_idle_unservable_bucket_is_not_infeasible() -> None:
    """A bucket no type can serve but with no traffic needs no routing: the plan is the
    one without it (this used to end "infeasible: count limit too low ... 0 req/s")."""
    lam = {("short", 0): 10.0, ("long", 0): 2.0, ("idle", 0): 0.0}
    mu = {("a", "short"): 4.0, ("a", "long"): 0.5, ("b", "short"): 3.0, ("b", "long"): 2.0,
          ("a", "idle"): 0.0, ("b", "idle"): 0.0}
    sol = solve_capacity(_inst(buckets=("short", "idle", "long"), n_slots=1, lam=lam, mu=mu))
    assert sol.replicas == {("a", 0): 0, ("b", 0): 5}  # as in test_hand_solved_two_slots
    assert sol.cost == pytest.approx(5.0)
    assert not any(b == "idle" for b, _t, _s in sol.routing)


def _unit_inst(**kw) -> CapacityInstance:
    # One GPU type g ($1 per replica-hour) as an aggregated unit `g` and a 1:1 unit `g@1:1`
    # (2 replicas, $2): per GPU the unit serves "long" 3x better (6/2 = 3 vs 1) and "short"
    # worse (6/2 = 3 vs 4). Type `b` ($5) is aggregated only.
    base = dict(
        types=("g", "g@1:1", "b"),
        buckets=("short", "long"),
        n_slots=1,
        lam={("short", 0): 8.0, ("long", 0): 6.0},
        mu={("g", "short"): 4.0, ("g", "long"): 1.0, ("g@1:1", "short"): 6.0,
            ("g@1:1", "long"): 6.0, ("b", "short"): 4.0, ("b", "long"): 1.0},
        price={"g": 1.0, "g@1:1": 2.0, "b": 5.0},
        unit_type={"g": "g", "g@1:1": "g", "b": "b"},
        unit_size={"g": 1, "g@1:1": 2, "b": 1},
    )
    base.update(kw)
    return CapacityInstance(**base)


def test_units_pick_disaggregated_for_long_and_aggregated_for_short() -> None:
    # short on g: 8/4 = 2 replicas ($2); long on one 1:1 unit: 6/6 = 1 unit ($2) -> $4.
    # (all aggregated: 2 + 6 = 8 replicas, $8; all on 1:1 units: 14/6 -> 3 units, $6)
    sol = solve_capacity(_unit_inst())
    assert sol.replicas == {("g", 0): 2, ("g@1:1", 0): 1, ("b", 0): 0}
    assert sol.cost == pytest.approx(4.0)
    assert sol.routing == {("short", "g", 0): 1.0, ("long", "g@1:1", 0): 1.0}
    inst = _unit_inst()
    assert inst.gpu_types() == ("g", "b")
    assert inst.type_replicas(sol, "g", 0) == 4  # 2 aggregated + 1 unit of 2


def test_shared_type_limit_binds_across_units() -> None:
    # At most 3 replicas of g over both its units: 2 + 2 no longer fits. Best: 1 aggregated
    # replica (short 4 req/s) + one 1:1 unit (long 6 req/s) = 3 replicas of g, and the other
    # 4 req/s of short on one b replica ($5): $8. (3 aggregated g: short 8 = 2 replicas, 1
    # left for 1 req/s of long, the other 5 on b: 5 x $5; far dearer.)
    sol = solve_capacity(_unit_inst(type_max={"g": 3, "b": None}))
    assert sol.replicas == {("g", 0): 1, ("g@1:1", 0): 1, ("b", 0): 1}
    assert sol.cost == pytest.approx(8.0)
    assert _unit_inst().type_replicas(sol, "g", 0) == 3
    # too low a shared limit is infeasible and names the GPU type's limit, not a unit's
    with pytest.raises(InfeasibleError, match="g: max 1 replicas") as err:
        solve_capacity(_unit_inst(type_max={"g": 1, "b": 0}))
    assert err.value.details["limits"] == {"g": 1, "b": 0}


def test_shared_type_floor() -> None:
    # min 5 replicas of g: the $4 plan has 4; one more aggregated replica is the cheapest fix
    sol = solve_capacity(_unit_inst(type_min={"g": 5}))
    assert _unit_inst().type_replicas(sol, "g", 0) == 5
    assert sol.cost == pytest.approx(5.0)


def test_equal_cost_plans_prefer_the_unit_using_fewer_replicas() -> None:
    # 7 req/s of short: 2 aggregated replicas (1.75 replicas of capacity used) or one 1:1
    # unit (7/7 of a 2-replica unit = 2 replicas used) cost the same $2; the tie-break
    # counts capacity in replicas, so the aggregated replicas win
    sol = solve_capacity(_unit_inst(
        lam={("short", 0): 7.0, ("long", 0): 0.0},
        mu={("g", "short"): 4.0, ("g", "long"): 1.0, ("g@1:1", "short"): 7.0,
            ("g@1:1", "long"): 6.0, ("b", "short"): 4.0, ("b", "long"): 1.0}))
    assert sol.replicas == {("g", 0): 2, ("g@1:1", 0): 0, ("b", 0): 0}
