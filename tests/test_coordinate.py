"""Coordinate descent by simulation (solvers/coordinate.py): the axes it builds from the
data, its starts, and that it finds what brute force finds where the truth is known."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetune.models.fluid import Knobs
from servetune.schemas.policy import Policy
from servetune.schemas.space import apply_knobs
from servetune.search import SimPoint
from servetune.solvers import coordinate
from servetune.solvers.loop import Evaluated, find_goodput

AXES = {
    "batching.max_num_seqs": [16, 64, 256],
    "batching.max_num_batched_tokens": [256, 1024, 4096],
    "batching.long_prefill_token_threshold": [0, 512],
    coordinate.LANE: [None, *((t, s) for t in (1000, 2000) for s in (1, 2, 3, 4))],
}


def make_policy(point: dict) -> Policy:
    return apply_knobs(Policy(), coordinate.dotted_of(point))


@dataclass
class TruthSim:
    """A simulator whose policy passes exactly up to a known goodput (req/s)."""

    truth: callable
    base_rate_per_s: float = 1.0
    simulations: int = 0
    simulation_s: float = 0.0

    def run(self, policy: Policy, rate_scale: float) -> SimPoint:
        self.simulations += 1
        ok = rate_scale * self.base_rate_per_s <= self.truth(policy)
        return SimPoint(rate_scale, rate_scale * self.base_rate_per_s, ok, 1.0 if ok else 0.5)


# Each axis's factor, unimodal, best at seqs 64, tokens 1024, chunk 512, lane 2000 with
# 2 seats: the truth is their product, so the best point is known without a search.
FACTORS = {
    "batching.max_num_seqs": {16: 0.6, 64: 1.0, 256: 0.8},
    "batching.max_num_batched_tokens": {256: 0.5, 1024: 1.0, 4096: 0.9},
    "batching.long_prefill_token_threshold": {0: 0.9, 512: 1.0},
}


def separable(policy: Policy) -> float:
    knobs = policy.knobs()
    value = 10.0
    for path, factor in FACTORS.items():
        value *= factor[knobs[path]]
    lr = policy.long_requests
    if lr.threshold_tokens is not None:
        value *= {1000: 0.95, 2000: 1.2}[lr.threshold_tokens] * {
            1: 0.9, 2: 1.0, 3: 0.97, 4: 0.93}[lr.max_seqs]
    return value


def start_at(sim: TruthSim, point: dict) -> Evaluated:
    policy = make_policy(point)
    est = find_goodput(sim, policy, start_scale=1.0, factor=2.0, rel_tol=0.01)
    return Evaluated(-1, Knobs.from_policy(policy), float("nan"), None, est, policy)


def brute_force() -> float:
    best = 0.0
    for values in itertools.product(*AXES.values()):
        try:
            best = max(best, separable(make_policy(dict(zip(AXES, values, strict=True)))))
        except ValueError:
            continue
    return best


def test_lane_axis_pairs_the_quantiles_rounded_up_to_16_tokens_with_1_to_4_seats():
    tokens = np.arange(1, 1001)  # quantile q (linear) = 1 + 999 q
    lanes = coordinate.lane_axes(tokens)[coordinate.LANE]
    # p80 800.2 -> 816, p90 900.1 -> 912, p95 950.05 -> 960, p99 990.01 -> 992,
    # p99.9 999.001 -> 1008; each with 1, 2, 3 and 4 seats: 20 pairs and off
    assert lanes[0] is None and len(lanes) == 21
    assert sorted({t for t, _ in lanes[1:]}) == [816, 912, 960, 992, 1008]
    assert lanes[1:5] == [(816, 1), (816, 2), (816, 3), (816, 4)]
    assert coordinate.lane_axes(np.full(50, 300))[coordinate.LANE] == [
        None, (304, 1), (304, 2), (304, 3), (304, 4)]


def test_a_lane_point_sets_its_seats_and_an_off_lane_none():
    on = coordinate.dotted_of({coordinate.LANE: (2000, 3)})
    assert on == {"long_requests.threshold_tokens": 2000, "long_requests.reserved_seqs": 3,
                  "long_requests.max_seqs": 3}
    off = coordinate.dotted_of({coordinate.LANE: None})
    assert off == {"long_requests.threshold_tokens": None, "long_requests.reserved_seqs": 0,
                   "long_requests.max_seqs": None}
    point = {"batching.max_num_seqs": 64, "batching.max_num_batched_tokens": 1024,
             "batching.long_prefill_token_threshold": 512, coordinate.LANE: (2000, 3)}
    assert coordinate.point_of(make_policy(point), AXES) == point


def test_points_the_simulator_cannot_tell_apart_share_a_key():
    a = {"batching.max_num_batched_tokens": 1024, "batching.long_prefill_token_threshold": 0,
         coordinate.LANE: None}
    assert coordinate.point_key(a) == coordinate.point_key(
        {**a, "batching.long_prefill_token_threshold": 2048})
    assert coordinate.point_key(a) != coordinate.point_key(
        {**a, "batching.long_prefill_token_threshold": 512})
    assert coordinate.point_key(a) != coordinate.point_key({**a, coordinate.LANE: (1000, 1)})


def test_snapped_starts_stay_on_the_axes():
    axes = {"batching.max_num_seqs": [4, 8], "admission.max_queued_requests": [None, 2048]}
    point = {"batching.max_num_seqs": 1024, "admission.max_queued_requests": 100}
    assert coordinate.snapped(point, axes) == {"batching.max_num_seqs": 8,
                                               "admission.max_queued_requests": 2048}
    assert coordinate.snapped({"batching.max_num_seqs": 5}, axes)["batching.max_num_seqs"] == 4


@given(n=st.integers(1, 12), seed=st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_the_design_is_a_latin_hypercube(n, seed):
    """Each axis's values are cut into n strata with one point in each: an axis of n
    values gets each value exactly once; an axis of one value, that value throughout;
    the same seed, the same points."""
    axes = {"a": list(range(n)), "b": ["only"], "c": list(range(2 * n))}
    points = coordinate.design(axes, n, seed)
    assert sorted(p["a"] for p in points) == list(range(n))
    assert {p["b"] for p in points} == {"only"}
    assert sorted(p["c"] // 2 for p in points) == list(range(n))
    assert points == coordinate.design(axes, n, seed)


def test_descent_finds_the_brute_force_optimum_of_a_separable_truth():
    """From the worst corner, with no other start, the lines reach the best point of the
    whole grid (a product of unimodal factors has no other local optimum)."""
    sim = TruthSim(separable)
    worst = {"batching.max_num_seqs": 16, "batching.max_num_batched_tokens": 256,
             "batching.long_prefill_token_threshold": 0, coordinate.LANE: None}
    start = start_at(sim, worst)
    result = coordinate.descend(sim, AXES, make_policy, start, [], budget=1000,
                                rel_tol=0.01)
    top = max((e for e in [start, *result.evaluated] if e.goodput.passed),
              key=lambda e: e.goodput.rate_per_s)
    assert top.goodput.rate_per_s == pytest.approx(brute_force(), rel=0.011)
    assert top.policy.long_requests.threshold_tokens == 2000
    assert top.policy.long_requests.max_seqs == 2
    assert result.stopped_by == "" and result.moves >= 4


def test_a_better_start_is_descended_from_too():
    """The incumbent sits at a local optimum of a truth with two peaks; a start near the
    other, higher peak is simulated and descended from, so the answer is the higher."""
    def two_peaks(policy: Policy) -> float:
        seqs = policy.batching.max_num_seqs
        tokens = policy.batching.max_num_batched_tokens
        return {(16, 256): 5.0, (256, 4096): 9.0}.get((seqs, tokens), 1.0)

    axes = {"batching.max_num_seqs": [16, 64, 256],
            "batching.max_num_batched_tokens": [256, 1024, 4096]}
    sim = TruthSim(two_peaks)
    start = start_at(sim, {"batching.max_num_seqs": 16, "batching.max_num_batched_tokens": 256})
    near = {"batching.max_num_seqs": 256, "batching.max_num_batched_tokens": 1024}
    result = coordinate.descend(sim, axes, make_policy, start, [near], budget=1000,
                                rel_tol=0.01)
    top = max((e for e in [start, *result.evaluated] if e.goodput.passed),
              key=lambda e: e.goodput.rate_per_s)
    assert top.goodput.rate_per_s == pytest.approx(9.0, rel=0.011)
    assert [s["point"] for s in result.starts][1] == near


def test_descent_stops_on_its_simulation_budget():
    sim = TruthSim(separable)
    start = start_at(sim, {"batching.max_num_seqs": 16, "batching.max_num_batched_tokens": 256,
                           "batching.long_prefill_token_threshold": 0,
                           coordinate.LANE: None})
    result = coordinate.descend(sim, AXES, make_policy, start, [], budget=3, rel_tol=0.01)
    assert result.stopped_by == "simulation_budget"
    # one batch (the start's lines) ran; none began once the budget was spent
    assert 3 <= result.simulations <= 3 + sum(len(v) for v in AXES.values()) * 14
    assert len(result.evaluated) <= sum(len(v) - 1 for v in AXES.values())
    assert result.starts == [{"point": result.starts[0]["point"],
                              "rate_per_s": start.goodput.rate_per_s}]
