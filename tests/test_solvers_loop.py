"""The search loop and the baselines, with simulators whose answers are known."""

from __future__ import annotations

import pytest
from optimizer_fixtures import SMALL_SPACE, ThresholdSim, fluid

from servetune.engines import GpuFacts
from servetune.models.fluid import Knobs, knobs_grid
from servetune.schemas.policy import Policy
from servetune.schemas.space import apply_knobs
from servetune.solvers import baselines
from servetune.solvers.loop import find_goodput, search


def make_policy(k: Knobs) -> Policy:
    return apply_knobs(Policy(), k.as_dotted())


@pytest.mark.parametrize("truth,start", [(3.7, 1.0), (3.7, 9.0), (0.05, 1.0), (40.0, 0.3)])
def test_find_goodput_brackets_then_bisects(truth, start):
    k = Knobs(64, 1024)
    sim = ThresholdSim({k: truth * 5.0})
    est = find_goodput(sim, make_policy(k), start_scale=start, rel_tol=0.02)
    assert est.passed
    assert truth / 1.02 <= est.rate_scale <= truth
    assert est.rate_per_s == pytest.approx(est.rate_scale * 5.0)
    assert all(p.meets_slo == (p.rate_scale <= truth) for p in est.points)
    assert len(est.points) == sim.simulations


def test_find_goodput_reports_zero_when_nothing_passes():
    k = Knobs(64, 1024)
    est = find_goodput(ThresholdSim({}), make_policy(k), start_scale=1.0)
    assert not est.passed and est.rate_scale == 0.0


def _truth(fm, points, distort):
    return {k: fm.goodput(k)[0] * distort(k) for k in points}


def test_loop_converges_to_the_true_best_when_the_model_is_right():
    fm = fluid()
    points = knobs_grid(SMALL_SPACE)
    truth = _truth(fm, points, lambda k: 1.0)
    sim = ThresholdSim(truth)
    res = search(fm, points, make_policy, sim, k=2, max_iterations=4, rel_tol=0.02)
    assert res.converged
    assert res.best is not None and res.best.goodput.passed
    assert res.best.goodput.rate_per_s >= max(truth.values()) / 1.02 - 1e-9
    assert len(res.iterations) >= 2
    grid_sims = sum(
        len(find_goodput(ThresholdSim(truth), make_policy(k), start_scale=1.0,
                         factor=2.0).points) for k in points
    )
    assert sim.simulations * 3 < grid_sims


def test_loop_never_returns_a_candidate_the_simulator_rejected():
    fm = fluid()
    points = knobs_grid(SMALL_SPACE)
    ranked = sorted(points, key=lambda k: fm.goodput(k)[0], reverse=True)
    rejected = set(ranked[:3])  # the model's three favourites fail at every rate
    truth = {k: (0.0 if k in rejected else fm.goodput(k)[0] * 0.8) for k in points}
    sim = ThresholdSim(truth)
    res = search(fm, points, make_policy, sim, k=2, max_iterations=5, rel_tol=0.02)
    assert res.best is not None
    assert res.best.knobs not in rejected
    assert res.best.goodput.passed
    tried = {e.knobs for e in res.evaluated}
    assert tried & rejected  # they were proposed, simulated and cut off
    for it in res.iterations:
        assert "candidates" in it
        if not (it.get("screen") or it.get("local_search")):  # rounds of the MILP
            assert "calibration" in it and "milp_statuses" in it


def test_loop_returns_nothing_when_the_simulator_rejects_everything():
    fm = fluid()
    points = knobs_grid(SMALL_SPACE)
    res = search(fm, points, make_policy, ThresholdSim({}), k=2, max_iterations=2)
    assert res.best is None
    assert res.evaluated and not any(e.goodput.passed for e in res.evaluated)


def test_grid_is_the_oracle_and_random_respects_its_budget():
    fm = fluid()
    points = knobs_grid(SMALL_SPACE)
    truth = _truth(fm, points, lambda k: 1.0 - 0.001 * (k.max_num_seqs // 16))
    grid = baselines.grid_search(points, make_policy, ThresholdSim(truth), rel_tol=0.02)
    assert len(grid.evaluated) == len(points)
    assert grid.goodput_rate_per_s >= max(truth.values()) / 1.02 - 1e-9
    rnd = baselines.random_search(points, make_policy, ThresholdSim(truth), budget=20, seed=1)
    assert 20 <= rnd.simulations < 20 + 20  # stops starting searches once the budget is spent
    again = baselines.random_search(points, make_policy, ThresholdSim(truth), budget=20, seed=1)
    assert [e.knobs for e in again.evaluated] == [e.knobs for e in rnd.evaluated]


def test_optuna_baseline_is_optional():
    fm = fluid()
    points = knobs_grid(SMALL_SPACE)
    res = baselines.optuna_search(SMALL_SPACE, points, make_policy,
                                  ThresholdSim(_truth(fm, points, lambda k: 1.0)), budget=15)
    if baselines.optuna_available():
        assert res.best is not None
    else:
        assert res.skipped and res.best is None


def test_engine_default_knobs():
    h200 = GpuFacts("NVIDIA H200", 150_109_880_320, 909_072)
    knobs, rule = baselines.engine_default_knobs("vllm", h200)
    assert knobs == Knobs(1024, 8192) and "not an A100" in rule
    sg, _ = baselines.engine_default_knobs("sglang", h200)
    assert sg.max_num_seqs == 4096 and sg.max_num_batched_tokens == 8192
    with pytest.raises(ValueError, match="trtllm"):
        baselines.engine_default_knobs("trtllm", h200)


def test_find_goodput_prunes_a_policy_that_cannot_beat_the_leader():
    k = Knobs(64, 1024)
    full = find_goodput(ThresholdSim({k: 2.0 * 5.0}), make_policy(k), start_scale=4.0)
    sim = ThresholdSim({k: 2.0 * 5.0})
    pruned = find_goodput(sim, make_policy(k), start_scale=4.0, prune_at=3.0)
    # 4.0 and 3.2 fail above the leader's 3.0; 2.048 (steps grow 1.25, 1.5625) fails below it.
    assert [p.rate_scale for p in pruned.points] == pytest.approx([4.0, 3.2, 4.0 / 1.25**3])
    assert not pruned.passed and len(pruned.points) < len(full.points)
    # A policy that beats the leader is searched to the end.
    better = find_goodput(ThresholdSim({k: 5.0 * 5.0}), make_policy(k), start_scale=4.0,
                          prune_at=3.0, rel_tol=0.02)
    assert 5.0 / 1.02 <= better.rate_scale <= 5.0


def test_each_round_tries_different_batching_shapes():
    """Seats and watermark change nothing until they bind, so a round of near-copies of
    the model's favourite step shape (token budget, chunk cap) would never learn that it
    ranked the shapes wrongly. Here the true best is the model's third shape; with k=2
    the second round must reach it, and no shape is simulated twice unless the model
    ranks the second variant higher."""
    from servetune.solvers.loop import shape_key

    fm = fluid()
    space = {**SMALL_SPACE, "admission.kv_watermark": [0.0, 0.01, 0.02, 0.05]}
    points = knobs_grid(space)
    pred = {k: fm.goodput(k)[0] for k in points}
    best_of_shape: dict[tuple, float] = {}
    for k in points:
        best_of_shape[shape_key(k)] = max(best_of_shape.get(shape_key(k), 0.0), pred[k])
    ranked = sorted(best_of_shape, key=lambda s: -best_of_shape[s])
    target = ranked[2]
    truth = {k: pred[k] * (1.5 if shape_key(k) == target else 0.8) for k in points}
    # The rounds alone: no local search (the model misses the target shape by 1.5x).
    res = search(fm, points, make_policy, ThresholdSim(truth), k=2, max_iterations=4,
                 rel_tol=0.02, local_simulations=0)
    rounds: dict[str, list[tuple]] = {}
    for ev in res.evaluated:
        rounds.setdefault(ev.label, []).append(shape_key(ev.knobs))
    assert len(rounds) >= 2
    for shapes in rounds.values():
        assert len(shapes) == len(set(shapes))
    tried = [shape_key(ev.knobs) for ev in res.evaluated]
    assert len(tried) == len(set(tried))  # the model ranks no second variant higher here
    assert res.best is not None and shape_key(res.best.knobs) == target
    assert res.best.goodput.rate_per_s >= max(truth.values()) / 1.02 - 1e-9


def test_screening_finds_a_shape_the_loop_never_tried_at_one_simulation_per_loser():
    """The model ranks the true best step shape fourth; a loop of one candidate per round
    for two rounds never reaches it. Screening simulates each untried shape once at the
    leader's goodput plus the tolerance: the losers fail there (one simulation each, a
    simulated bound), the winner passes and is searched."""
    from servetune.solvers.loop import shape_key

    fm = fluid()
    points = knobs_grid(SMALL_SPACE)
    pred = {k: fm.goodput(k)[0] for k in points}
    best_of_shape: dict[tuple, float] = {}
    for k in points:
        best_of_shape[shape_key(k)] = max(best_of_shape.get(shape_key(k), 0.0), pred[k])
    ranked = sorted(best_of_shape, key=lambda s: -best_of_shape[s])
    target = ranked[3]
    truth = {k: pred[k] * (1.5 if shape_key(k) == target else 0.8) for k in points}
    sim = ThresholdSim(truth)
    plain = search(fm, points, make_policy, ThresholdSim(truth), k=1, max_iterations=2,
                   rel_tol=0.02, screen=0, local_simulations=0)
    assert shape_key(plain.best.knobs) != target
    res = search(fm, points, make_policy, sim, k=1, max_iterations=2, rel_tol=0.02,
                 screen=len(ranked), local_simulations=0)  # the screening alone
    assert shape_key(res.best.knobs) == target
    assert res.best.goodput.rate_per_s >= max(truth.values()) / 1.02 - 1e-9
    screened = [e for e in res.evaluated if e.label == "screen"]
    losers = [e for e in screened if shape_key(e.knobs) != target]
    assert losers and all(len(e.goodput.points) == 1 for e in losers)
    assert res.iterations[-1].get("screen") is True


def test_refine_goodput_narrows_the_bracket_and_stays_a_lower_bound():
    from servetune.solvers.loop import refine_goodput

    k = Knobs(64, 1024)
    sim = ThresholdSim({k: 3.7 * 5.0})
    est = find_goodput(sim, make_policy(k), start_scale=1.0, rel_tol=0.08)
    assert 3.7 / 1.08 <= est.rate_scale <= 3.7
    before = len(est.points)
    fine = refine_goodput(sim, make_policy(k), est, rel_tol=0.005)
    assert 3.7 / 1.005 <= fine.rate_scale <= 3.7
    assert fine.rate_scale >= est.rate_scale and len(fine.points) > before
    assert len(fine.points) == sim.simulations
    # Nothing passed: nothing to refine.
    none = find_goodput(ThresholdSim({}), make_policy(k), start_scale=1.0)
    assert refine_goodput(ThresholdSim({}), make_policy(k), none, rel_tol=0.01) is none
