"""The goodput search of servetune.search on synthetic pass/fail thresholds."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetune.search import (
    GoodputResult,
    goodput_search,
    refine_goodput,
    search_scale,
)


class Threshold:
    """passes(scale) exactly at or below ``limit``; records every scale tested."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.calls: list[float] = []

    def __call__(self, scale: float) -> bool:
        self.calls.append(scale)
        return scale <= self.limit


# The two step rules in use: doubling (servetune goodput, capacity, placement) and the
# optimizer's x1.25 step squared after each step.
VARIANTS = {
    "doubling": dict(factor=2.0, accelerate=False, min_scale=1 / 1024, max_scale=1024.0),
    "accelerating": dict(factor=1.25, accelerate=True, min_scale=1 / 256, max_scale=256.0),
}


@settings(max_examples=200, deadline=None)
@given(
    log_limit=st.floats(-5.0, 5.0),
    log_start=st.floats(-5.0, 5.0),
    rel_tol=st.sampled_from([0.005, 0.02, 0.05, 0.2]),
    variant=st.sampled_from(sorted(VARIANTS)),
)
def test_finds_the_threshold_within_tolerance_testing_no_scale_twice(
    log_limit, log_start, rel_tol, variant
):
    passes = Threshold(math.exp(log_limit))
    bracket = search_scale(passes, start=math.exp(log_start), rel_tol=rel_tol,
                           **VARIANTS[variant])
    assert bracket.closed
    assert bracket.lo <= passes.limit < bracket.hi
    assert bracket.hi / bracket.lo <= 1.0 + rel_tol
    assert bracket.scale == bracket.lo
    assert len(passes.calls) == len(set(passes.calls))


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("limit", [0.013, 0.7, 1.0, 3.3, 41.0, 200.0])
def test_agrees_with_brute_force_on_a_grid(variant, limit):
    """The oracle: every scale of a fine geometric grid tested; the search's answer passes
    and is within the tolerance of the highest passing grid scale."""
    rel_tol = 0.02
    params = VARIANTS[variant]
    grid = np.geomspace(params["min_scale"], params["max_scale"], 20001)
    oracle = max(float(s) for s in grid if s <= limit)
    passes = Threshold(limit)
    answer = search_scale(passes, start=1.0, rel_tol=rel_tol, **params).scale
    assert answer <= limit  # it passes
    assert answer * (1.0 + rel_tol) >= oracle
    assert len(passes.calls) < 40  # the point of searching: far fewer tests than the grid


@pytest.mark.parametrize("max_evaluations", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_respects_the_evaluation_budget(max_evaluations, variant):
    passes = Threshold(37.0)
    bracket = search_scale(passes, start=0.01, rel_tol=0.001,
                           max_evaluations=max_evaluations, **VARIANTS[variant])
    assert len(passes.calls) == max_evaluations
    assert bracket.scale <= 37.0  # whatever it found passes


def test_pruning_stops_at_the_first_failure_at_or_below_the_bound():
    passes = Threshold(2.0)
    bracket = search_scale(passes, start=8.0, rel_tol=0.01, factor=1.25, accelerate=True,
                           prune_at=3.0)
    # 8, 6.4 and 4.096 fail above the bound; 1.6777216 passes below it; bisection then
    # stops at the first failing midpoint at or below 3.0
    failing_at_or_below = [s for s in passes.calls if s <= 3.0 and s > 2.0]
    assert failing_at_or_below == [passes.calls[-1]]
    assert bracket.hi <= 3.0 and bracket.hi / bracket.lo > 1.01  # cut short: a lower bound


def test_pruning_a_policy_that_fails_at_the_bound_costs_one_test():
    passes = Threshold(2.0)
    bracket = search_scale(passes, start=3.0, rel_tol=0.01, prune_at=3.0)
    assert passes.calls == [3.0]
    assert bracket.scale == 0.0 and not bracket.closed


def test_pruning_changes_nothing_when_the_answer_is_above_the_bound():
    full, pruned = Threshold(10.0), Threshold(10.0)
    a = search_scale(full, start=4.0, rel_tol=0.01, factor=1.25, accelerate=True)
    b = search_scale(pruned, start=4.0, rel_tol=0.01, factor=1.25, accelerate=True,
                     prune_at=3.0)
    assert full.calls == pruned.calls and a == b


def test_scale_limits_end_the_search_unbracketed():
    always = search_scale(lambda s: True, max_scale=16.0)
    assert always.scale == 16.0 and not always.closed
    never = search_scale(lambda s: False, min_scale=1 / 8)
    assert never.scale == 0.0 and not never.closed


def test_start_outside_the_limits_is_clamped():
    passes = Threshold(5.0)
    search_scale(passes, start=1e6, max_scale=64.0)
    assert passes.calls[0] == 64.0


def test_rejects_a_search_that_cannot_end():
    with pytest.raises(ValueError):
        search_scale(lambda s: True, rel_tol=0.0)
    with pytest.raises(ValueError):
        search_scale(lambda s: True, factor=1.0)


def test_the_sequences_callers_rely_on_are_kept():
    """Byte-identical outputs need identical simulated scales, in the same order."""
    doubling = Threshold(3.3)
    search_scale(doubling, rel_tol=0.05)
    assert doubling.calls == [1.0, 2.0, 4.0, 2.8284271247461903, 3.3635856610148585,
                              3.084421650815882, 3.220980663898509]
    accelerating = Threshold(3.3)
    search_scale(accelerating, rel_tol=0.05, factor=1.25, accelerate=True,
                 max_evaluations=14, min_scale=1 / 256, max_scale=256.0)
    assert accelerating.calls == [1.0, 1.25, 1.953125, 4.76837158203125, 3.0517578125,
                                  3.814697265625, 3.4119689598080285, 3.226841013917737,
                                  3.318114129701205]


def _point(limit: float):
    def evaluate(scale: float) -> dict:
        return {"rate_scale": scale, "meets_slo": scale <= limit}
    return evaluate


def test_goodput_search_records_every_point_in_order():
    res = goodput_search(_point(3.3), base_rate_per_s=2.0, rel_tol=0.05)
    assert [p["rate_scale"] for p in res.points] == [
        1.0, 2.0, 4.0, 2.8284271247461903, 3.3635856610148585, 3.084421650815882,
        3.220980663898509,
    ]
    assert res.rate_scale == 3.220980663898509
    assert res.rate_per_s == res.rate_scale * 2.0
    assert res.best_point["rate_scale"] == res.rate_scale and res.passed and res.bracketed


def test_goodput_search_reads_attribute_points_too():
    class Point:
        def __init__(self, scale: float) -> None:
            self.rate_scale = scale
            self.meets_slo = scale <= 0.3

    res = goodput_search(Point, base_rate_per_s=1.0, rel_tol=0.05)
    assert res.best_point.rate_scale == res.rate_scale <= 0.3


def test_refine_narrows_the_bracket_and_stays_a_lower_bound():
    coarse = goodput_search(_point(3.3), base_rate_per_s=2.0, rel_tol=0.2)
    fine = refine_goodput(_point(3.3), coarse, rel_tol=0.001, max_evaluations=30)
    assert coarse.rate_scale <= fine.rate_scale <= 3.3
    assert 3.3 / fine.rate_scale < 1.001
    assert fine.points[: len(coarse.points)] == coarse.points
    assert fine.rate_per_s == fine.rate_scale * 2.0
    tested = [p["rate_scale"] for p in fine.points]
    assert len(tested) == len(set(tested))
    capped = refine_goodput(_point(3.3), coarse, rel_tol=0.001, max_evaluations=2)
    assert len(capped.points) == len(coarse.points) + 2


def test_refine_leaves_a_search_without_a_bracket_alone():
    nothing = goodput_search(_point(0.0), base_rate_per_s=1.0, min_scale=1 / 8)
    assert refine_goodput(_point(0.0), nothing, rel_tol=0.01) is nothing
    everything = goodput_search(_point(1e9), base_rate_per_s=1.0, max_scale=8.0)
    assert refine_goodput(_point(1e9), everything, rel_tol=0.01) is everything


def test_result_serialises_as_servetune_goodput_writes_it():
    res = GoodputResult(1.5, 3.0, [{"rate_scale": 1.5, "meets_slo": True}], 2.0)
    assert list(res.to_dict()) == ["rate_scale", "rate_per_s", "base_rate_per_s", "bracketed",
                                   "warnings", "points"]
