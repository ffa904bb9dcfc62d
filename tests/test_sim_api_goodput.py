"""Goodput search: bracketing then geometric bisection, on synthetic monotone verdicts."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetune.errors import ServetuneError
from servetune.sim.goodput import goodput_search, search_rate_scale, seeds_for


def threshold(limit):
    calls = []

    def passes(x):
        calls.append(x)
        return x <= limit

    return passes, calls


@settings(max_examples=100, deadline=None)
@given(st.floats(1.0 / 1000, 1000.0), st.sampled_from([0.001, 0.01, 0.05]))
def test_finds_the_threshold_within_tolerance(limit, tol):
    passes, calls = threshold(limit)
    scale, bracketed = search_rate_scale(passes, rel_tol=tol)
    assert bracketed
    assert scale <= limit < scale * (1 + tol)
    # Bracketing doubles or halves: log2 of the distance; bisection: log2(log(2)/log(1+tol)).
    assert len(calls) <= 12 + 12


def test_start_above_threshold_halves_then_bisects():
    passes, calls = threshold(0.3)
    scale, _ = search_rate_scale(passes, rel_tol=0.01)
    assert calls[:3] == [1.0, 0.5, 0.25]
    assert 0.3 / 1.01 <= scale <= 0.3


def test_scale_limits():
    never, _ = threshold(-1.0)
    assert search_rate_scale(never, min_scale=1 / 8) == (0.0, False)
    always, calls = threshold(float("inf"))
    assert search_rate_scale(always, max_scale=16.0) == (16.0, False)
    assert calls == [1.0, 2.0, 4.0, 8.0, 16.0]


def test_points_are_recorded_once_each_and_deterministic():
    def evaluate(x):
        return x <= 3.7, {"attainment": min(1.0, 3.7 / x)}

    a = goodput_search(evaluate, base_rate_per_s=2.0, rel_tol=0.01)
    b = goodput_search(evaluate, base_rate_per_s=2.0, rel_tol=0.01)
    assert a.to_dict() == b.to_dict()
    assert a.rate_per_s == pytest.approx(2.0 * a.rate_scale)
    scales = [p["rate_scale"] for p in a.points]
    assert len(scales) == len(set(scales))
    assert scales[:3] == [1.0, 2.0, 4.0]
    for p in a.points:
        assert p["meets_slo"] == (p["rate_scale"] <= 3.7)
        assert p["rate_per_s"] == pytest.approx(2.0 * p["rate_scale"])
    best = max(p["rate_scale"] for p in a.points if p["meets_slo"])
    assert a.rate_scale == best


def test_bad_arguments():
    with pytest.raises(ServetuneError):
        search_rate_scale(lambda x: True, rel_tol=0)
    with pytest.raises(ServetuneError):
        search_rate_scale(lambda x: True, start=2.0, max_scale=1.0)
    with pytest.raises(ServetuneError, match="argument `n_seeds`"):
        seeds_for(0)
    assert seeds_for(3, 5) == (5, 6, 7)
    assert len(seeds_for(1000)) == 1000
    with pytest.raises(ServetuneError, match="between 1 and 1000"):
        seeds_for(1_000_000_000)  # refused before anything is built (it once took 24 GB)
