"""An honest surrogate (issue 12): the loop records how far the fluid model was from the
simulator, and where the recalibrated model misses by more than ``UNSURE_FACTOR`` it
searches the incumbent's grid neighbours by simulation before it stops."""

from __future__ import annotations

import math

import pytest
from optimizer_fixtures import SMALL_SPACE, ThresholdSim, fluid

from servetune.apps.optimize import model_error_meta
from servetune.apps.report import model_error_section
from servetune.io import round_floats
from servetune.models.fluid import Knobs, knobs_grid
from servetune.schemas.policy import Policy
from servetune.schemas.space import apply_knobs
from servetune.search import GoodputResult
from servetune.solvers import baselines
from servetune.solvers.loop import (
    UNSURE_FACTOR,
    Evaluated,
    SimPoint,
    equivalence_key,
    model_error,
    search,
)


def make_policy(k: Knobs) -> Policy:
    return apply_knobs(Policy(), k.as_dotted())


def _wrong_truth(points: list[Knobs]) -> dict[Knobs, float]:
    """A landscape the model gets backwards: the true goodput peaks at the point the
    model likes least (among those it predicts any goodput for) and falls by 0.8 per grid
    step away from it (steps counted on the simulator's own view of the knobs, so points
    it cannot tell apart have the same goodput). One peak: a local search climbs to it."""
    fm = fluid()
    pred = {k: fm.goodput(k)[0] for k in points}
    target = min((k for k in points if pred[k] > 0), key=lambda k: (pred[k], str(k)))
    keys = {k: equivalence_key(k) for k in points}
    axes = [sorted({key[i] for key in keys.values()}, key=lambda v: (v is None, v or 0))
            for i in range(len(keys[target]))]

    def steps(k: Knobs) -> int:
        return sum(abs(axes[i].index(keys[k][i]) - axes[i].index(keys[target][i]))
                   for i in range(len(axes)))

    top = max(pred.values())
    return {k: top * 0.8 ** steps(k) for k in points}


def test_a_wrong_model_still_finds_the_simulated_best():
    """Brute force over the grid is the oracle. The model (never recalibrated: the fake
    simulator measures no latencies) ranks the grid backwards; the MILP rounds and the
    screening stop short of the peak, the model's miss exceeds the factor, and the local
    search by simulation climbs to the oracle's best, with fewer simulations than brute
    force spends."""
    fm = fluid()
    points = knobs_grid(SMALL_SPACE)
    truth = _wrong_truth(points)
    oracle = baselines.grid_search(points, make_policy, ThresholdSim(truth), rel_tol=0.02)
    best_truth = max(truth.values())
    assert oracle.goodput_rate_per_s >= best_truth / 1.02 - 1e-9

    plain = search(fm, points, make_policy, ThresholdSim(truth), k=2, max_iterations=3,
                   rel_tol=0.02, local_simulations=0)
    assert plain.best.goodput.rate_per_s < 0.95 * best_truth  # without it: stuck
    assert plain.model_error["unsure"] and not plain.model_error["fallback"]["ran"]

    sim = ThresholdSim(truth)
    res = search(fm, points, make_policy, sim, k=2, max_iterations=3, rel_tol=0.02,
                 local_simulations=200)
    err = res.model_error
    assert err["unsure"] and err["worst_miss"] > UNSURE_FACTOR
    assert err["fallback"]["ran"] and err["fallback"]["moves"] >= 1
    assert equivalence_key(res.best.knobs) == equivalence_key(oracle.best.knobs)
    assert res.best.goodput.rate_per_s >= oracle.goodput_rate_per_s / 1.02
    assert sim.simulations < oracle.simulations
    assert any(e.label == "local" for e in res.evaluated)
    assert res.iterations[-1].get("local_search") is True
    assert err["candidates"] == len(res.evaluated)


def test_a_sound_model_spends_nothing_on_the_fallback():
    fm = fluid()
    points = knobs_grid(SMALL_SPACE)
    truth = {k: fm.goodput(k)[0] for k in points}
    res = search(fm, points, make_policy, ThresholdSim(truth), k=2, rel_tol=0.02)
    err = res.model_error
    assert not err["unsure"] and err["worst_miss"] <= UNSURE_FACTOR
    assert err["fallback"] == {"ran": False, "simulations": 0, "moves": 0,
                               "worst_miss_before": err["worst_miss"]}
    assert not any(e.label == "local" for e in res.evaluated)


def test_the_local_search_is_bounded_in_simulations():
    fm = fluid()
    points = knobs_grid(SMALL_SPACE)
    truth = _wrong_truth(points)
    res = search(fm, points, make_policy, ThresholdSim(truth), k=2, max_iterations=3,
                 rel_tol=0.02, local_simulations=3)
    fb = res.model_error["fallback"]
    # It starts no neighbourhood (one batch) once 3 simulations are spent; a started
    # batch finishes.
    local = [e for e in res.evaluated if e.label == "local"]
    assert fb["ran"] and local and sum(fb["batches"]) == len(local)
    before_last = local[:len(local) - fb["batches"][-1]]
    assert sum(len(e.goodput.points) for e in before_last) < 3
    assert fb["simulations"] == sum(len(e.goodput.points) for e in local)


def test_same_inputs_same_result():
    fm = fluid()
    points = knobs_grid(SMALL_SPACE)
    truth = _wrong_truth(points)
    runs = []
    for _ in range(2):
        sim = ThresholdSim(truth)
        res = search(fm, points, make_policy, sim, k=2, max_iterations=3, rel_tol=0.02)
        runs.append((sim.simulations, [(e.label, e.knobs) for e in res.evaluated],
                     res.best.knobs, res.best.goodput.rate_per_s, res.model_error))
    assert runs[0] == runs[1]


class _FixedModel:
    """A model whose (recalibrated) goodput per knobs is given."""

    def __init__(self, rates: dict[Knobs, float]) -> None:
        self.rates = rates

    def goodput(self, knobs: Knobs):
        return self.rates[knobs], None, {}


def _ev(label: str, knobs: Knobs, predicted: float, tested: list[tuple[float, bool]]) -> Evaluated:
    points = [SimPoint(r, r, ok, 1.0 if ok else 0.0) for r, ok in tested]
    passing = [r for r, ok in tested if ok]
    best = max(passing, default=0.0)
    est = GoodputResult(best, best, points, base_rate_per_s=1.0)
    return Evaluated(0, knobs, predicted, None, est, None, label=label)


def test_model_error_numbers_by_hand():
    """Four candidates (base rate 1 req/s, so scales are rates):

    - A: predicted 2.0 (recalibrated 2.0); passes 1.0, fails 1.03: ratio 1.0 / 2.0 = 0.5;
      the prediction lies above the bracket: miss 2.0 / 1.03 = 1.94175;
    - B: predicted 1.0 (1.0); passes 1.2, fails 1.236: ratio 1.2, miss 1.2 / 1.0 = 1.2;
    - C: predicted 3.0 as proposed, 1.5 recalibrated; rejected at the bar 1.01 (one
      simulation): no ratio; miss 1.5 / 1.01 = 1.48515 (as proposed 3.0 / 1.01 = 2.9703);
    - D: predicted 0.5 (0.5); rejected at 1.01: the prediction is consistent, miss 1.

    Median ratio (0.5, 1.2) = 0.85; worst ratio 0.5 (|ln 0.5| > |ln 1.2|); worst miss
    1.94175 (A) > 1.5: unsure. As proposed the worst miss is C's 2.9703."""
    a, b, c, d = Knobs(16, 256), Knobs(64, 1024), Knobs(256, 4096), Knobs(64, 4096)
    evaluated = [
        _ev("milp#1", a, 2.0, [(2.0, False), (1.0, True), (1.03, False)]),
        _ev("milp#1", b, 1.0, [(1.0, True), (1.2, True), (1.236, False)]),
        _ev("milp#2", c, 3.0, [(1.01, False)]),
        _ev("screen", d, 0.5, [(1.01, False)]),
    ]
    model = _FixedModel({a: 2.0, b: 1.0, c: 1.5, d: 0.5})
    err = model_error(model, evaluated, factor=1.5)
    assert err["candidates"] == 4 and err["compared"] == 2
    assert err["median_ratio"] == pytest.approx(0.85)
    assert err["worst_ratio"] == pytest.approx(0.5)
    assert err["worst_miss"] == pytest.approx(2.0 / 1.03)
    assert err["worst_miss_label"] == "milp#1"
    assert err["unsure"] is True
    assert err["worst_miss_as_proposed"] == pytest.approx(3.0 / 1.01)
    assert err["worst_miss_label_as_proposed"] == "milp#2"
    rows = err["per_candidate"]
    assert [r["simulated_rate_per_s"] for r in rows] == [1.0, 1.2, 0.0, 0.0]
    assert [r["simulated_upper_rate_per_s"] for r in rows] == [1.03, 1.236, 1.01, 1.01]
    assert [r["ratio"] for r in rows] == pytest.approx([0.5, 1.2, None, None])
    assert [r["miss"] for r in rows] == pytest.approx([2.0 / 1.03, 1.2, 1.5 / 1.01, 1.0])
    assert model_error(model, evaluated, factor=2.0)["unsure"] is False

    # The policy metadata's brief: rounded, no per-candidate rows.
    err["fallback"] = {"ran": True, "simulations": 5, "moves": 1, "from_rate_per_s": 1.2,
                       "to_rate_per_s": 1.3}
    meta = round_floats(model_error_meta(err))
    assert meta == {"median_ratio": 0.85, "worst_ratio": 0.5, "worst_miss": 1.94175,
                    "factor": 1.5, "unsure": True, "local_search_simulations": 5,
                    "near_answer": None}
    # The report's section.
    text = model_error_section(round_floats(err))
    assert "seqs 256, tokens 4096 | 3 | 1.5 | < 1.01 | 1.49x |" in text
    assert "| milp#1 | seqs 16, tokens 256 | 2 | 2 | 1 | 1.94x |" in text
    assert "5 simulations, 1 move(s); best goodput 1.2 -> 1.3 req/s" in text
    assert math.isclose(err["median_ratio"], 0.85)
    assert "no model" in model_error_section(None)
