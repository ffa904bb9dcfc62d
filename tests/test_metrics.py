"""Metrics of a run, worked by hand on five requests (definitions in servetune.sim.metrics)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetune.errors import ServetuneError
from servetune.schemas.slo import SLOSet
from servetune.sim import metrics as M

NAN = float("nan")
# r0 completed, r1 completed with a 1-token output, r2 shed, r3 completed, r4 rejected.
ARRIVAL = np.array([0.0, 1.0, 2.0, 3.0, 4.0])
FIRST = np.array([1.0, 1.5, NAN, 5.0, NAN])
FINISH = np.array([3.0, 1.5, NAN, 9.0, NAN])
OUTPUT = np.array([5, 1, 7, 3, 2])
STATUS = np.array([0, 0, 1, 0, 2], dtype=np.int8)
CLASS = np.array([0, 0, 1, 1, 1], dtype=np.int32)
NAMES = ("a", "b")


def metrics() -> M.RequestMetrics:
    return M.request_metrics(ARRIVAL, FIRST, FINISH, OUTPUT, STATUS, CLASS)


def slo(**cls) -> SLOSet:
    return SLOSet(classes={"default": cls})


def test_per_request_definitions():
    m = metrics()
    np.testing.assert_allclose(m.ttft_s, [1.0, 0.5, NAN, 2.0, NAN])
    np.testing.assert_allclose(m.e2e_s, [3.0, 0.5, NAN, 6.0, NAN])
    # TPOT = (e2e - ttft) / (output - 1); undefined for the 1-token output.
    np.testing.assert_allclose(m.tpot_s, [0.5, NAN, NAN, 2.0, NAN])


def test_distributions_use_numpy_linear_percentiles_over_completed():
    m = metrics()
    ttft = M.distribution(m.ttft_s)  # over [1.0, 0.5, 2.0]
    assert ttft["mean"] == pytest.approx(3.5 / 3)
    assert ttft["p50"] == pytest.approx(1.0)
    assert ttft["p90"] == pytest.approx(1.8)
    assert ttft["p99"] == pytest.approx(1.98)
    tpot = M.distribution(m.tpot_s)  # over [0.5, 2.0]: the 1-token output is left out
    assert tpot["mean"] == pytest.approx(1.25)
    assert tpot["p90"] == pytest.approx(1.85)
    assert M.distribution(np.array([NAN])) == {"mean": None, "p50": None, "p90": None,
                                               "p99": None}


def test_throughput_over_the_run_span():
    m = metrics()
    span = M.run_span_s(ARRIVAL, FINISH)
    assert span == 9.0
    tp = M.throughput(m, span)
    assert tp["throughput_tok_s"] == pytest.approx((5 + 1 + 3) / 9)
    assert tp["throughput_req_s"] == pytest.approx(3 / 9)
    # A run whose last request is rejected after the last finish lasts to that arrival.
    assert M.run_span_s(np.array([0.0, 10.0]), np.array([2.0, NAN])) == 10.0


def test_attainment_counts_shed_and_rejected_as_misses():
    m = metrics()
    target = slo(ttft_s=1.5, tpot_s=1.0, attainment=0.5)
    met = M.slo_met_mask(m, target, NAMES)
    # r0 meets both; r1 meets TTFT and has no TPOT; r2 shed; r3 TTFT 2 > 1.5; r4 rejected.
    assert met.tolist() == [True, True, False, False, False]
    summary = M.group_summary(m, 9.0, None, met)
    assert summary["attainment"] == pytest.approx(0.4)
    assert (summary["requests"], summary["completed"], summary["shed"],
            summary["rejected"]) == (5, 3, 1, 1)
    verdicts = M.slo_verdicts(m, target, NAMES)
    assert verdicts["a"][0] is True and verdicts["a"][1]["attainment"] == 1.0
    assert verdicts["b"][0] is False and verdicts["b"][1]["attainment"] == 0.0
    assert not M.meets_slo(m, target, NAMES)


def test_limits_are_inclusive_and_e2e_is_judged():
    m = metrics()
    met = M.slo_met_mask(m, slo(e2e_s=3.0, attainment=0.1), NAMES)
    assert met.tolist() == [True, True, False, False, False]


def test_percentile_mode_counts_dropped_requests_as_never_served():
    m = metrics()
    # Class a: p99 TTFT over [1.0, 0.5] = 0.995 <= 1.5 holds. Class b: [never, 2.0, never].
    verdicts = M.slo_verdicts(m, slo(ttft_s=1.5, percentile=99), NAMES)
    assert verdicts["a"][0] is True
    assert verdicts["a"][1]["p99_ttft_s"] == pytest.approx(0.995)
    assert verdicts["b"][0] is False
    # Shedding a slow request must not rescue a percentile: all completed at 2.0 fails too,
    # and replacing the shed request by a fast completion is what passes.
    assert not M.meets_slo(m, slo(ttft_s=2.5, percentile=50), NAMES)
    status = STATUS.copy()
    status[[2, 4]] = 0
    first = FIRST.copy()
    first[[2, 4]] = ARRIVAL[[2, 4]] + 0.1
    finish = first + 1.0
    served = M.request_metrics(ARRIVAL, first, finish, OUTPUT, status, CLASS)
    assert M.meets_slo(served, slo(ttft_s=2.5, percentile=50), NAMES)


def test_percentile_mode_tpot_ignores_one_token_outputs():
    m = M.request_metrics(
        np.array([0.0, 0.0]), np.array([0.1, 0.1]), np.array([0.1, 1.1]), np.array([1, 11]),
        np.array([0, 0]),
    )
    ok, judged = M.class_verdict(m, SLOSet(classes={"x": {"tpot_s": 0.1, "percentile": 99}})
                                 .for_class("x"))
    assert ok and judged["p99_tpot_s"] == pytest.approx(0.1)


def test_missing_class_in_slo_set_is_a_clear_error():
    m = metrics()
    two = SLOSet(classes={"a": {"ttft_s": 1, "attainment": 0.9},
                          "c": {"ttft_s": 1, "attainment": 0.9}})
    with pytest.raises(ServetuneError, match="no entry for request class 'b'"):
        M.meets_slo(m, two, NAMES)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0, 100), st.floats(0, 10), st.floats(0, 10), st.integers(1, 50),
            st.sampled_from([0, 0, 0, 1, 2]),
        ),
        min_size=1, max_size=30,
    ),
    st.floats(0.01, 20),
)
def test_attainment_properties(rows, limit):
    arrival = np.sort(np.array([r[0] for r in rows]))
    ttft = np.array([r[1] for r in rows])
    decode = np.array([r[2] for r in rows])
    output = np.array([r[3] for r in rows])
    status = np.array([r[4] for r in rows])
    done = status == 0
    first = np.where(done, arrival + ttft, NAN)
    finish = np.where(done, first + decode, NAN)
    m = M.request_metrics(arrival, first, finish, output, status)
    met = M.slo_met_mask(m, slo(ttft_s=limit, attainment=0.5), ("default",))
    # Only completed requests can meet; a met request is within its limit.
    assert not (met & ~done).any()
    assert (m.ttft_s[met] <= limit).all()
    # Loosening a limit never lowers attainment.
    looser = M.slo_met_mask(m, slo(ttft_s=limit * 2, attainment=0.5), ("default",))
    assert looser.sum() >= met.sum()
    tpot = m.tpot_s[np.isfinite(m.tpot_s)]
    assert (tpot >= 0).all()
    assert all(math.isfinite(v) for v in M.distribution(m.e2e_s).values() if v is not None)


def test_a_class_turns_away_at_most_its_max_rejected_share():
    # Class b: r2 shed, r3 met (TTFT 2 <= 10), r4 rejected: attainment 1/3, 2 of 3 away.
    m = metrics()

    def verdict_b(cap: float) -> tuple[bool, dict]:
        target = slo(ttft_s=10.0, attainment=0.3, max_rejected_share=cap)
        return M.slo_verdicts(m, target, NAMES)["b"]

    assert verdict_b(0.0) == (False, {"attainment": pytest.approx(1 / 3),
                                      "rejected_share": pytest.approx(2 / 3)})
    assert verdict_b(0.66)[0] is False  # allows 1 of 3
    assert verdict_b(2 / 3)[0] is True  # allows 2 of 3
    # Class a turned nobody away: it passes at the default cap of 0.
    assert M.slo_verdicts(m, slo(ttft_s=10.0, attainment=0.3), NAMES)["a"][0] is True


def test_a_p99_met_by_rejecting_fails_unless_the_cap_allows_it():
    # 200 requests served in 0.1 s, one rejected: the p99 TTFT (index 197.01 of 200) is
    # 0.1 s, within 1 s, so only the cap decides.
    n = 200
    arrival = np.arange(n, dtype=float)
    first = arrival + 0.1
    status = np.zeros(n, dtype=np.int8)
    status[7] = M.STATUS_REJECTED
    first[7] = NAN
    m = M.request_metrics(arrival, first, first + 1.0, np.full(n, 11), status)

    def verdict(cap: float) -> tuple[bool, dict]:
        target = SLOSet(classes={"x": {"ttft_s": 1.0, "percentile": 99,
                                       "max_rejected_share": cap}}).for_class("x")
        return M.class_verdict(m, target)

    ok, judged = verdict(0.0)
    assert not ok
    assert judged["p99_ttft_s"] == pytest.approx(0.1)
    assert judged["rejected_share"] == pytest.approx(0.005)
    assert verdict(0.005)[0] is True
    assert verdict(0.004)[0] is False


@pytest.mark.parametrize("cap", [-0.1, 1.5, float("inf"), float("nan")])
def test_max_rejected_share_is_a_share(cap):
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        SLOSet(classes={"x": {"ttft_s": 1.0, "percentile": 99, "max_rejected_share": cap}})
