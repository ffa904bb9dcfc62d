"""The empirical (quantile-knot) inter-arrival process: fitting, sampling, schema."""

from __future__ import annotations

import math

import numpy as np
import pytest
import yaml
from conftest import REPO, shared_file, workload_from_yaml_text
from typer.testing import CliRunner

from servetune.cli import app
from servetune.errors import ServetuneError
from servetune.schemas.workload import knot_moments
from servetune.workloads.fitting import (
    EMPIRICAL_CV_THRESHOLD,
    GAP_QUANTILE_GRID,
    class_stats,
    fit_workload,
    load_workload,
    sample_trace,
    save_workload,
    workload_to_yaml,
)
from servetune.workloads.formats import load_trace
from servetune.workloads.stats import trace_stats
from servetune.workloads.trace import from_arrays

runner = CliRunner()
N_SAMPLE = 200_000
N_QUANTILE_SAMPLE = 1_000_000
GAP_QUANTILES = (0.10, 0.50, 0.90, 0.99)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _workload(arrival: dict) -> object:
    data = {
        "apiVersion": "servetune/v1",
        "kind": "Workload",
        "classes": {
            "a": {
                "arrival": arrival,
                "prompt_tokens": {"quantiles": [0, 1], "values": [10, 10]},
                "output_tokens": {"quantiles": [0, 1], "values": [5, 5]},
            }
        },
    }
    return workload_from_yaml_text(yaml.safe_dump(data, sort_keys=False), "w.yaml")


def _empirical(rate: float, quantiles: list, values: list, **extra) -> object:
    return _workload({"process": "empirical", "rate_per_s": rate,
                      "interarrival_gaps": {"quantiles": quantiles, "values": values}, **extra})


@pytest.fixture(scope="module")
def code_trace():
    return load_trace(shared_file("traces", "AzureLLMInferenceTrace_code.csv"))


# ----------------------------------------------------------------------------- real trace


def test_code_trace_fit_reproduces_gap_distribution(code_trace):
    want_gaps = np.diff(code_trace.arrival_s)
    want = trace_stats(code_trace)
    # the renewal fit (auto adds a Markov modulation on this trace: test_arrival_bursts.py)
    workload = fit_workload(code_trace, arrival_process="renewal", rate_windows_s=None)
    arrival = workload.classes["default"].arrival
    assert want["interarrival_cv"] > EMPIRICAL_CV_THRESHOLD
    assert arrival.process == "empirical"
    assert arrival.interarrival_gaps.quantiles == [float(q) for q in GAP_QUANTILE_GRID]
    # the rate is the trace's, and the knots (Hazen positions) keep the CV within 1%
    assert arrival.rate_per_s == pytest.approx(want["rate_per_s"], rel=1e-12)
    assert _rel(arrival.interarrival_cv, want["interarrival_cv"]) < 0.01
    assert class_stats(workload)[0].interarrival_cv == arrival.interarrival_cv

    sample = sample_trace(workload, n_requests=N_QUANTILE_SAMPLE, seed=7)
    gaps = np.diff(sample.arrival_s)
    # A sample quantile's standard error is sqrt(p(1-p)/n) * Q'(p), Q' the slope of the
    # quantile function (from the knots): 0.3% (p50) to 1.7% (p99, where Q is steep) at
    # n = 1M. Allow 3 of them plus 1% for the knots (Hazen positions versus numpy's
    # linear ones, and the interpolation between knots).
    knots = arrival.interarrival_gaps
    for p, got, ref in zip(GAP_QUANTILES, np.quantile(gaps, GAP_QUANTILES),
                           np.quantile(want_gaps, GAP_QUANTILES), strict=True):
        slope = (np.interp(p + 0.0025, knots.quantiles, knots.values)
                 - np.interp(p - 0.0025, knots.quantiles, knots.values)) / 0.005
        rel_se = np.sqrt(p * (1 - p) / len(gaps)) * slope / np.interp(
            p, knots.quantiles, knots.values)
        assert rel_se < 0.02
        assert _rel(got, ref) < 3 * rel_se + 0.01, (p, got, ref, rel_se)
    gaps = gaps[:N_SAMPLE]
    sample = sample.head(N_SAMPLE + 1)
    # Mean gap: standard error CV/sqrt(n) = 2.9% at CV 13 and n = 200k; allow 3 of them.
    stats = trace_stats(sample)
    assert _rel(stats["rate_per_s"], want["rate_per_s"]) < 3 * 13.1 / np.sqrt(N_SAMPLE)
    # Sample CV: delta-method standard error from the knots' moments is 1.3% at n = 200k;
    # allow 3 of them plus the knots' 1% from the trace's CV.
    assert _rel(stats["interarrival_cv"], want["interarrival_cv"]) < 3 * 0.013 + 0.01
    # No simultaneous arrivals where the trace has none, and the trace's share of sub-ms
    # gaps (17%), where a gamma with CV 13 makes 94%.
    assert np.mean(gaps == 0) <= np.mean(want_gaps == 0) + 1e-3
    assert abs(np.mean(gaps < 1e-3) - np.mean(want_gaps < 1e-3)) < 0.01


def test_moment_matched_gamma_is_what_went_wrong(code_trace):
    gamma = fit_workload(code_trace, arrival_process="gamma",
                         rate_windows_s=None).classes["default"].arrival
    assert gamma.process == "gamma" and gamma.interarrival_cv == pytest.approx(13.15, abs=0.01)
    w = fit_workload(code_trace, arrival_process="gamma", rate_windows_s=None)
    gaps = np.diff(sample_trace(w, n_requests=50_000, seed=1).arrival_s)
    assert np.mean(gaps < 1e-3) > 0.8  # versus the trace's 17%


def test_rate_windows_fit_gaps_after_removing_the_window_rate(code_trace):
    plain = fit_workload(code_trace, arrival_process="renewal",
                         rate_windows_s=None).classes["default"].arrival
    windowed = fit_workload(code_trace, rate_windows_s=60,
                            arrival_process="renewal").classes["default"].arrival
    m = np.array(windowed.windows.rate_multipliers)
    assert len(m) == 58 and m.mean() == pytest.approx(1, abs=1e-3)
    # the windows explain part of the burstiness (idle minutes); the rest stays empirical
    assert windowed.process == "empirical"
    assert 2 < windowed.interarrival_cv < plain.interarrival_cv / 1.5
    # operational-time gaps by hand: Lambda(t) over the same windows, scaled to mean 1
    t = code_trace.arrival_s
    edges = np.minimum((t // 60).astype(int), 57)
    rates = np.bincount(edges, minlength=58) / np.r_[np.full(57, 60.0), t[-1] - 57 * 60]
    rel = rates / rates.mean()
    lam = np.r_[0, np.cumsum(rel * 60)][edges] + (t - edges * 60) * rel[edges]
    op_gaps = np.diff(lam) / np.diff(lam).mean()
    got = np.interp(0.5, windowed.interarrival_gaps.quantiles, windowed.interarrival_gaps.values)
    _, cv_knots = knot_moments(windowed.interarrival_gaps.quantiles,
                               windowed.interarrival_gaps.values)
    assert got == pytest.approx(np.quantile(op_gaps, 0.5), rel=0.02)
    assert cv_knots == pytest.approx(op_gaps.std(), rel=0.02)


def test_shipped_code_workload_is_empirical_and_matches_a_fresh_fit(code_trace):
    shipped = load_workload(REPO / "configs/workloads/azure-code-2023.yaml")
    # shipped before Markov modulation: the renewal fit (the old automatic choice)
    fresh = fit_workload(code_trace, name="azure-code-2023", arrival_process="renewal",
                          rate_windows_s=None)
    assert shipped.classes == fresh.classes  # the header's command reproduces the numbers
    assert shipped.classes["default"].arrival.process == "empirical"
    text = (REPO / "configs/workloads/azure-code-2023.yaml").read_text()
    assert "servetune workload fit ../shared/traces/AzureLLMInferenceTrace_code.csv" in text


def test_conv_trace_stays_gamma():
    trace = load_trace(shared_file("traces", "AzureLLMInferenceTrace_conv.csv"))
    arrival = fit_workload(trace, arrival_process="renewal",
                           rate_windows_s=None).classes["default"].arrival
    assert arrival.process == "gamma" and arrival.interarrival_cv == pytest.approx(1.094, 1e-3)
    shipped = load_workload(REPO / "configs/workloads/azure-conv-2023.yaml")
    assert shipped.classes["default"].arrival == arrival
    forced = fit_workload(trace, arrival_process="empirical",
                          rate_windows_s=None).classes["default"].arrival
    assert forced.process == "empirical"
    assert forced.interarrival_cv == pytest.approx(1.094, rel=0.01)


# ----------------------------------------------------------------------------- sampling


def test_inverse_cdf_by_hand():
    # knots (0,0) (0.5,1) (1,3): mean 0.5*0.5 + 0.5*2 = 1.25, so unit-mean gaps are
    # interp(u, [0, .5, 1], [0, .8, 2.4]); at rate 4: p25 = 0.4/4, p75 = 1.6/4
    w = _empirical(4.0, [0, 0.5, 1], [0, 1, 3])
    arrival = w.classes["a"].arrival
    mean, cv = knot_moments([0, 0.5, 1], [0, 1, 3])
    assert mean == pytest.approx(1.25)
    # E[X^2] = 0.5*(0+0+1)/3 + 0.5*(1+3+9)/3 = 7/3
    assert cv == pytest.approx(np.sqrt(7 / 3 / 1.25**2 - 1))
    assert arrival.interarrival_cv == round(cv, 4)
    gaps = np.diff(sample_trace(w, n_requests=N_SAMPLE, seed=3).arrival_s)
    assert gaps.mean() == pytest.approx(0.25, rel=0.01)
    assert np.quantile(gaps, [0.25, 0.5, 0.75]) == pytest.approx([0.1, 0.2, 0.4], rel=0.01)
    assert gaps.max() <= 2.4 / 4 + 1e-12
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.01)


def test_zero_gap_knots_make_simultaneous_arrivals():
    # 30% of gaps exactly 0 (a batch submitter), the rest uniform
    w = _empirical(1.0, [0, 0.3, 1], [0, 0, 1])
    gaps = np.diff(sample_trace(w, n_requests=100_000, seed=2).arrival_s)
    assert np.mean(gaps == 0) == pytest.approx(0.3, abs=0.005)
    assert gaps.mean() == pytest.approx(1.0, rel=0.01)


def test_rate_scale_divides_empirical_arrivals():
    w = _empirical(2.0, [0, 0.9, 1], [0.1, 0.5, 20])
    base = sample_trace(w, n_requests=2000, seed=5)
    fast = sample_trace(w, n_requests=2000, seed=5, rate_scale=3.0)
    np.testing.assert_allclose(fast.arrival_s, base.arrival_s / 3.0, rtol=1e-12)
    assert np.array_equal(fast.prompt_tokens, base.prompt_tokens)
    longer = sample_trace(w, n_requests=20_000, seed=5)
    assert np.array_equal(longer.arrival_s[:2000], base.arrival_s)  # prefix-stable


def test_windows_shape_empirical_arrivals():
    windows = {"window_s": 100.0, "rate_multipliers": [3.0, 0.0, 1.0]}
    w = _empirical(50.0, [0, 0.5, 0.99, 1], [0.0, 0.3, 3.0, 30.0], windows=windows)
    t = sample_trace(w, n_requests=150_000, seed=4)
    phase = t.arrival_s % 300.0
    counts = np.histogram(phase, bins=[0, 99, 101, 199, 201, 300])[0]
    assert counts[2] == 0  # the zero-rate window stays empty
    assert counts[0] / counts[4] == pytest.approx(3.0, rel=0.05)
    assert len(t) / t.arrival_s[-1] == pytest.approx(50.0, rel=0.03)


# ----------------------------------------------------------------------------- fitting


def test_fit_choice_and_forcing():
    rng = np.random.default_rng(0)
    # bursty: a lognormal with sigma 2 has CV sqrt(e^4 - 1) = 7.3
    bursty = np.r_[0, np.cumsum(rng.lognormal(0, 2, 5000))]
    t = from_arrays(bursty, np.full(len(bursty), 3), np.full(len(bursty), 2))
    assert fit_workload(t).classes["default"].arrival.process == "empirical"
    assert fit_workload(t, arrival_process="gamma").classes["default"].arrival.process == "gamma"
    assert (fit_workload(t, arrival_process="poisson").classes["default"].arrival.process
            == "poisson")
    # too few gaps to trust knots: gamma, even when bursty
    few = from_arrays(bursty[:50], np.full(50, 3), np.full(50, 2))
    assert fit_workload(few).classes["default"].arrival.process == "gamma"
    with pytest.raises(ServetuneError, match="argument `arrival_process` must be one of"):
        fit_workload(t, arrival_process="hawkes")
    # the knots are the gaps' quantiles (Hazen positions) up to one scale, with mean 1
    knots = fit_workload(t).classes["default"].arrival.interarrival_gaps
    assert knot_moments(knots.quantiles, knots.values)[0] == pytest.approx(1, rel=1e-5)
    gaps = np.diff(bursty)
    ratios = np.interp(GAP_QUANTILE_GRID, knots.quantiles, knots.values) / np.quantile(
        gaps, GAP_QUANTILE_GRID, method="hazen")
    assert ratios == pytest.approx(np.full(len(ratios), ratios[100]), rel=1e-5)


def test_cli_fit_arrival_option(tmp_path):
    src = tmp_path / "t.csv"
    rows = "\n".join(f"{i * 0.5 + (i % 3) * 0.1},{i % 7 + 1},{i % 5 + 1}" for i in range(300))
    src.write_text("ts,in,out\n" + rows + "\n")
    out = tmp_path / "w.yaml"
    result = runner.invoke(app, ["workload", "fit", str(src), "-o", str(out), "--columns",
                                 "arrival=ts,prompt=in,output=out", "--arrival", "empirical"])
    assert result.exit_code == 0, result.output
    assert load_workload(out).classes["default"].arrival.process == "empirical"
    shown = runner.invoke(app, ["workload", "show", str(out)])
    assert shown.exit_code == 0 and "empirical CV" in shown.stdout
    bad = runner.invoke(app, ["workload", "fit", str(src), "-o", str(tmp_path / "x.yaml"),
                              "--columns", "arrival=ts,prompt=in,output=out", "--arrival", "x"])
    assert bad.exit_code == 2 and "--arrival must be one of" in bad.stderr
    assert not (tmp_path / "x.yaml").exists()


# ----------------------------------------------------------------------------- schema


def test_empirical_round_trip(tmp_path, code_trace):
    w = fit_workload(code_trace.head(2000), name="rt", arrival_process="renewal")
    assert w.classes["default"].arrival.process == "empirical"
    path = tmp_path / "w.yaml"
    save_workload(w, path)
    again = load_workload(path)
    assert again == w
    assert workload_to_yaml(again) == path.read_text()
    assert "interarrival_gaps:" in path.read_text()


def test_old_gamma_workload_still_loads_and_samples():
    # the arrival section of the azure-code-2023.yaml shipped before the empirical process
    w = _workload({"process": "gamma", "rate_per_s": 2.5663950258507633,
                   "interarrival_cv": 13.1513})
    assert w.classes["a"].arrival.interarrival_gaps is None
    assert class_stats(w)[0].interarrival_cv == 13.1513
    t = sample_trace(w, n_requests=1000, seed=0)
    assert len(t) == 1000


@pytest.mark.parametrize(
    ("arrival", "needle"),
    [
        ({"process": "empirical", "rate_per_s": 1.0}, "needs interarrival_gaps"),
        ({"process": "gamma", "rate_per_s": 1.0, "interarrival_cv": 2.0,
          "interarrival_gaps": {"quantiles": [0, 1], "values": [0, 2]}},
         "applies to process: empirical only"),
        ({"process": "empirical", "rate_per_s": 1.0, "interarrival_cv": 3.0,
          "interarrival_gaps": {"quantiles": [0, 1], "values": [0, 2]}},
         "disagrees with the CV of interarrival_gaps (0.5774)"),
        ({"process": "empirical", "rate_per_s": 1.0,
          "interarrival_gaps": {"quantiles": [0, 1], "values": [-1, 2]}},
         "interarrival_gaps.values"),
        ({"process": "empirical", "rate_per_s": 1.0,
          "interarrival_gaps": {"quantiles": [0, 1], "values": [2, 1]}}, "non-decreasing"),
        ({"process": "empirical", "rate_per_s": 1.0,
          "interarrival_gaps": {"quantiles": [0, 1], "values": [0, 0]}}, "must not all be 0"),
        ({"process": "empirical", "rate_per_s": 1.0,
          "interarrival_gaps": {"quantiles": [0, 0.5], "values": [0, 1]}}, "start at 0"),
        ({"process": "empirical", "rate_per_s": 1.0,
          "interarrival_gaps": {"quantiles": [0, 0.5, 1], "values": [0, 1]}},
         "one value per quantile"),
    ],
)
def test_empirical_rejections_name_the_field(arrival, needle):
    with pytest.raises(ServetuneError) as err:
        _workload(arrival)
    assert err.value.message.startswith("w.yaml: ")
    assert "classes.a.arrival" in err.value.message
    assert needle in err.value.message
    assert "\n" not in err.value.message


def test_given_cv_that_agrees_is_kept():
    # uniform(0, 2): CV 1/sqrt(3) = 0.57735; a value within 1% is accepted as written
    w = _empirical(1.0, [0, 1], [0, 2], interarrival_cv=0.58)
    assert w.classes["a"].arrival.interarrival_cv == 0.58


def test_knot_moments_do_not_underflow_at_tiny_scales():
    # Found by hypothesis: knots near 1e-286 made mean**2 underflow to 0 (ZeroDivisionError).
    for scale in (1e-286, 1.0, 1e280):
        mean, cv = knot_moments([0.0, 1.0], [0.0, 2.0 * scale])
        assert mean == pytest.approx(scale)
        assert cv == pytest.approx(1 / math.sqrt(3))  # uniform on [0, 2s]: sd/mean
