"""The per-class tier model, its MILP and the reservation CP-SAT (issue 16)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from servetune.models.reserve_cpsat import ReserveInstance
from servetune.models.reserve_cpsat import build_model as build_reserve
from servetune.models.tiers import ClassOption, erlang_wait_quantile, orderings
from servetune.models.tiers_milp import TierChoice
from servetune.profiles.shipped import load_profile
from servetune.schemas.policy import Policy
from servetune.schemas.slo import SLOSet
from servetune.solvers import tiers
from servetune.solvers.drivers import solve_cpsat
from servetune.workloads.trace import from_arrays

SLO = SLOSet.model_validate({"classes": {
    "chat": {"ttft_s": 0.5, "tpot_s": 0.05, "attainment": 0.95},
    "longctx": {"ttft_s": 8.0, "tpot_s": 0.1, "attainment": 0.9},
}})


def mixed_trace(n_chat: int = 2000, n_long: int = 60, span_s: float = 400.0, seed: int = 0):
    rng = np.random.default_rng(seed)
    arrival = np.concatenate([np.sort(rng.uniform(0, span_s, n_chat)),
                              np.sort(rng.uniform(0, span_s, n_long))])
    prompt = np.concatenate([rng.integers(200, 2500, n_chat),
                             np.clip(rng.lognormal(np.log(16000), 0.6, n_long), 4000, 64000)
                             .astype(np.int64)])
    output = np.concatenate([rng.integers(50, 600, n_chat), rng.integers(100, 600, n_long)])
    cls = np.concatenate([np.zeros(n_chat, np.int32), np.ones(n_long, np.int32)])
    return from_arrays(arrival, prompt, output, class_id=cls, class_names=("chat", "longctx"))


@pytest.fixture(scope="module")
def model():
    return tiers.tier_model(mixed_trace(), load_profile("h200-llama-3.1-8b"), SLO)


SMALL_GRID = tiers.shared_grid(Policy(), seqs=(256,), budgets=(1024, 4096, 16384))
SMALL_OPTIONS = tiers.class_options("vllm", chunk_caps=(0, 512, 2048),
                                    caps=((None, 1.0), (None, 0.25), (8, 1.0)))


def test_orderings_are_the_weak_orders():
    # Fubini numbers: 1, 3, 13 weak orders of 1, 2, 3 items.
    assert [len(orderings(n)) for n in (1, 2, 3)] == [1, 3, 13]
    assert orderings(2) == [(0, 0), (0, 1), (1, 0)]


def test_erlang_wait_worked_by_hand():
    # M/M/1, load 0.5: waits with probability 0.5, then Exp(rate (1 - 0.5) / hold).
    assert erlang_wait_quantile(1, 0.5, 1.0, 0.9) == pytest.approx(2.0 * math.log(5.0))
    # M/M/2, offered 1: Erlang B = 0.2, C = 0.2 / (1 - 0.5 + 0.5 * 0.2) = 1/3.
    assert erlang_wait_quantile(2, 1.0, 1.0, 0.9) == pytest.approx(math.log(10.0 / 3.0))
    # The chance of waiting is below 1 - q: the quantile wait is 0.
    assert erlang_wait_quantile(2, 1.0, 1.0, 0.5) == 0.0


def test_priority_shortens_the_high_class_wait(model):
    # at the trace's own rate (5 req/s of chat): at 2x the one H200 no longer keeps up
    # once the engine's host time per sequence is charged, and no ordering is stable
    t = model.terms(1.0, SMALL_GRID[1], {n: SMALL_OPTIONS for n in model.names})
    fcfs = t.wait_factor[("chat", (0, 0))]
    assert fcfs > 0
    assert t.wait_factor[("chat", (0, 1))] < fcfs < t.wait_factor[("chat", (1, 0))]
    assert t.wait_factor[("longctx", (0, 1))] > t.wait_factor[("longctx", (0, 0))]


def test_chunk_cap_shrinks_what_a_class_leaves_for_others(model):
    t = model.terms(1.0, SMALL_GRID[2], {n: SMALL_OPTIONS for n in model.names})
    w0 = t.classes["longctx"].w0
    assert w0[512] < w0[2048] < w0[0]


@pytest.mark.parametrize("scale", [0.5, 1.0, 2.0, 2.1, 2.15, 3.0])
def test_milp_matches_enumeration(model, scale):
    """The oracle: every shared setting x order x option per class, evaluated directly.
    The MILP's margin (its linearisation of order x chunk cap) must be the same."""
    options = {n: SMALL_OPTIONS for n in model.names}
    choice, _ = tiers.solve_at(model, scale, SMALL_GRID, options)
    best_margin, best = tiers.enumerate_best(model, scale, SMALL_GRID, options)
    assert (choice is None) == (best is None)
    if choice is None:
        return
    # (The second stage keeps the margin to 1e-6.)
    assert choice.margin == pytest.approx(best_margin, abs=2e-6)
    ev = model.evaluate(model.terms(scale, choice.shared, options), choice.levels,
                        choice.options)
    assert min(ev.margin, 1.0) == pytest.approx(best_margin, abs=2e-6)
    if best_margin < 0:
        return
    # Second stage: of the assignments that keep the margin, the least TTFT budget spent.
    def spent(g, levels, combo):
        ev = model.evaluate(model.terms(scale, g, options), levels, combo)
        return sum(v / lim for k, (v, lim) in ev.conditions.items() if k.startswith("ttft["))
    keeping = []
    for g in SMALL_GRID:
        t = model.terms(scale, g, options)
        if not t.stable:
            continue
        for levels in orderings(2):
            for a in SMALL_OPTIONS:
                for b in SMALL_OPTIONS:
                    combo = {"chat": a, "longctx": b}
                    e = model.evaluate(t, levels, combo)
                    if (all(t.classes[n].stable[combo[n]] for n in combo)
                            and e.conditions["seats"][0] <= e.conditions["seats"][1]
                            and e.conditions["kv_memory"][0] <= e.conditions["kv_memory"][1]
                            and min(e.margin, 1.0) >= best_margin - 1e-6):
                        keeping.append(spent(g, levels, combo))
    assert spent(choice.shared, choice.levels, choice.options) == pytest.approx(
        min(keeping), rel=1e-4)


def test_per_class_options_never_lower_the_model_goodput(model):
    one = {n: [ClassOption()] for n in model.names}
    many = {n: SMALL_OPTIONS for n in model.names}
    s_one, _ = tiers.model_goodput(model, SMALL_GRID, one)
    s_many, choice = tiers.model_goodput(model, SMALL_GRID, many)
    assert s_many >= s_one > 0
    assert choice is not None and choice.margin >= 0


def test_reservations_worked_by_hand():
    def solve(seats_total):
        inst = ReserveInstance(names=("a", "b"), seats={"a": 3, "b": 4}, blocks={"a": 0, "b": 0},
                               values={"a": 1.0, "b": 1.0}, max_num_seqs=seats_total,
                               kv_blocks=10)
        cp, r, _ = build_reserve(inst)
        outcome, solver = solve_cpsat(cp, time_limit_s=10)
        assert outcome.status.has_solution
        return solver.Value(r["a"]), solver.Value(r["b"])
    # Room for both demands: each class reserves all of it.
    assert solve(8) == (3, 4)
    # B = 6: b's 4 must fit beside a's reserve (r_a <= 2), a's 3 beside b's (r_b <= 3).
    assert solve(6) == (2, 3)


def test_to_policy_sets_order_caps_and_reservations():
    choice = TierChoice(
        margin=0.1, shared=tiers.Shared(256, 4096),
        levels=(0, 1),
        options={"chat": ClassOption(), "longctx": ClassOption(512, None, 0.25)})
    p = tiers.to_policy(Policy(), choice, ("chat", "longctx"), kv_blocks=1000,
                        reserved={"chat": (20, 300), "longctx": (2, 400)})
    assert p.scheduling == "priority"
    assert p.batching.max_num_seqs == 256 and p.batching.max_num_batched_tokens == 4096
    assert p.classes["chat"].priority == 0 and p.classes["longctx"].priority == 1
    assert p.classes["chat"].reserved_seqs == 20
    assert p.classes["chat"].reserved_kv_fraction == pytest.approx(0.3)
    lc = p.classes["longctx"]
    assert (lc.long_prefill_token_threshold, lc.max_kv_fraction) == (512, 0.25)
    assert lc.reserved_kv_fraction == 0.25  # held to the class's own cap
    # One level: FCFS stays, no priorities.
    flat = tiers.to_policy(Policy(), TierChoice(0.1, tiers.Shared(256, 4096), (0, 0),
                                                choice.options), ("chat", "longctx"), 1000)
    assert flat.scheduling == "fcfs" and flat.classes["longctx"].priority == 0


def test_pools_milp_matches_enumeration():
    """Every partition of the classes into pools x every split of the replicas."""
    from servetune.models.pools_milp import best_by_enumeration, subsets

    rng = np.random.default_rng(7)
    for names in (("a", "b"), ("a", "b", "c")):
        for _ in range(15):
            goodput = {s: float(rng.uniform(0.2, 3.0)) for s in subsets(names)}
            for replicas in (1, 2, 3, 5):
                plan = tiers.route_pools(names, goodput, replicas)
                assert plan.scale == pytest.approx(
                    best_by_enumeration(names, goodput, replicas), rel=1e-6)
                # The plan is what it says: every class once, every replica used.
                assert sorted(c for pool in plan.pools for c in pool) == sorted(names)
                assert sum(plan.pools.values()) == replicas
                assert plan.scale <= min(goodput[p] * n for p, n in plan.pools.items()) + 1e-9


def test_pools_worked_by_hand():
    # Together one replica serves 1.0x; apart, a's replica 1.5x and b's 4x. On two
    # replicas: together 2.0x, apart min(1.5, 4) = 1.5x -> together. On three: together
    # 3.0x; apart with a on two replicas min(3.0, 4.0) = 3.0x (a tie: the fewest pools win).
    g = {("a",): 1.5, ("b",): 4.0, ("a", "b"): 1.0}
    assert tiers.route_pools(("a", "b"), g, 2).pools == {("a", "b"): 2}
    three = tiers.route_pools(("a", "b"), g, 3)
    assert three.scale == pytest.approx(3.0) and three.pools == {("a", "b"): 3}
    # Four replicas: together 4.0x, apart a on 3 = 4.5x and b on 1 = 4.0x -> 4.0 tie again;
    # with b at 5x apart, (a on 3, b on 1) = 4.5x beats together.
    g[("b",)] = 5.0
    assert tiers.route_pools(("a", "b"), g, 4).pools == {("a",): 3, ("b",): 1}


def test_single_class_recalibration_sees_an_attainment_tier_bind():
    """A class judged by attainment has no percentile in its verdict: the loop reads its
    measured q-quantile. Just above the goodput chat's q-quantile TTFT broke its limit,
    so the TTFT factor makes the model's prediction at the goodput equal the limit."""
    from servetune.models.fluid import (
        Calibration,
        FluidModel,
        Knobs,
        LoadModel,
        Platform,
        targets_for,
    )
    from servetune.search import GoodputResult
    from servetune.solvers.loop import Evaluated, SimPoint, recalibrate

    trace = mixed_trace()
    load = LoadModel.from_trace(trace)
    fluid = FluidModel(load, Platform.from_profile(load_profile("h200-llama-3.1-8b")),
                       targets_for(load, SLO))
    knobs = Knobs(max_num_seqs=256, max_num_batched_tokens=4096)
    rate = 0.5 * load.rate_per_s
    predicted = fluid.evaluate(knobs, rate)["ttft_q_s"]["chat"]
    ok = SimPoint(0.5, rate, True, 0.97, measured={})
    fail = SimPoint(0.55, 1.1 * rate, False, 0.9, measured={"ttft[chat]": 0.9},
                    judged={"chat": {"attainment": 0.9, "rejected_share": 0.0}})
    est = GoodputResult(0.5, rate, points=[ok, fail], base_rate_per_s=load.rate_per_s)
    cal = recalibrate(fluid, [Evaluated(0, knobs, rate, None, est)], Calibration())
    assert cal.ttft == pytest.approx(0.5 / predicted, rel=1e-9)
    assert cal.tpot == 1.0  # TPOT did not break, and nothing was measured for it


def test_optimize_runs_the_tiered_search_and_keeps_it_only_when_better():
    """The tiered stage of ``optimize`` on a small two-tier trace: a stage keeps its best
    simulated round only when that beats the single-class policy, and a per-class policy
    is returned only from its rounds; ``per_class=False`` skips the stage. Either way the
    goodput printed is the evaluator's for the policy returned, and never below the
    single-class answer's (beyond the evaluator's 1%)."""
    from servetune.apps.optimize import optimize
    from servetune.sim.evaluator import Evaluator

    trace = mixed_trace(n_chat=800, n_long=25, span_s=160.0)
    profile = load_profile("h200-llama-3.1-8b")
    res = optimize(trace, profile, SLO, compare_defaults=False, max_iterations=2,
                   n_requests=len(trace))
    infos = [i["tiers"] for i in res.summary["iterations"] if "tiers" in i]
    assert infos
    for info in infos:  # a stage keeps its rounds only when one beat the single class
        best_round = max(r["simulated_rate_per_s"] for r in info["rounds"])
        if info["kept"]:
            assert best_round > info["single_class_goodput_rate_per_s"]
        assert "ttft[chat]" in info.get("what_binds", {"ttft[chat]": None})
    if res.policy.classes:  # a per-class round won: kept by its stage, or by the final
        # judging of the leaders, which sees every simulated candidate within 1%
        assert any(info["rounds"] for info in infos)
        assert set(res.summary["classes"]) == {"chat", "longctx"}
    judge = Evaluator.of(trace, profile, SLO)
    assert res.summary["goodput_rate_per_s"] == judge.goodput(res.policy).rate_per_s
    flat = optimize(trace, profile, SLO, compare_defaults=False, max_iterations=2,
                    n_requests=len(trace), per_class=False)
    assert not any("tiers" in i for i in flat.summary["iterations"])
    assert not flat.policy.classes
    assert res.summary["goodput_rate_per_s"] >= flat.summary["goodput_rate_per_s"] / 1.01
