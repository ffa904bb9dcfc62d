"""The one steady-state window rule, as each caller configures it."""

from __future__ import annotations

import pytest

from servetune.schemas.base import document_from_data
from servetune.schemas.slo import SLOSet
from servetune.steady_state import arrivals_in, steady_window_s


def slo(**ttfts: float | None) -> SLOSet:
    classes = {name: ({"ttft_s": t} if t is not None else {"tpot_s": 0.1}) | {"percentile": 99}
               for name, t in ttfts.items()}
    return document_from_data({"apiVersion": "servetune/v1", "kind": "SLOSet",
                               "classes": classes}, SLOSet, "s.yaml")


def test_the_longest_ttft_target_over_the_rate_tolerance():
    # the optimizer: a 3% overload must build a backlog of one TTFT target
    assert steady_window_s(slo(a=2.0, b=0.5), rate_tolerance=0.03) == 2.0 / 0.03
    assert steady_window_s(slo(a=30.0), rate_tolerance=0.03, cap_s=600.0) == 600.0


def test_a_floor_and_a_multiple_of_the_ttft_target():
    # servetune goodput's warning: a minute, or 30 TTFT targets when longer
    assert steady_window_s(slo(a=1.0), floor_s=60.0, ttft_multiple=30.0) == 60.0
    assert steady_window_s(slo(a=4.0), floor_s=60.0, ttft_multiple=30.0) == 120.0


@pytest.mark.parametrize("slo_set", [None, slo(a=None)])
def test_without_a_ttft_target_only_the_floor_counts(slo_set):
    assert steady_window_s(slo_set, floor_s=240.0, rate_tolerance=0.03) == 240.0
    assert steady_window_s(slo_set, rate_tolerance=0.03) == 0.0


def test_no_rate_tolerance_means_no_ttft_term():
    assert steady_window_s(slo(a=2.0), rate_tolerance=0.0) == 0.0


def test_arrivals_in_a_window_round_up():
    assert arrivals_in(27.0, 240.0) == 6480
    assert arrivals_in(0.1, 15.0) == 2
    assert arrivals_in(0.0, 240.0) == 0
