"""Two-timescale workloads: a slow periodic rate profile (chosen by auto) with Markov
bursts in its operational time, and the length mix following the slow windows."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from servetune.cli.root import app
from servetune.errors import ServetuneError
from servetune.schemas.base import document_from_data
from servetune.schemas.workload import Workload
from servetune.workloads.fitting import (
    auto_slow_window_s,
    class_stats,
    dispersion,
    fit_workload,
    load_workload,
    sample_trace,
    save_workload,
    window_counts,
)
from servetune.workloads.trace import Trace, from_arrays

SPAN = 3600.0


def _ramp_with_bursts(seed: int = 0) -> np.ndarray:
    """Poisson arrivals at rate ramp(t) * level: the ramp rises linearly from 1 to 4 req/s
    over the hour, the level switches between 0.3 and 1.7 (a geometric number of 5 s
    windows, mean 5)."""
    rng = np.random.default_rng(seed)
    w, level, out = 5.0, 0, []
    for i in range(int(SPAN / w)):
        if rng.random() < 0.2:
            level = 1 - level
        rate = (1.0 + 3.0 * i * w / SPAN) * (0.3, 1.7)[level]
        out.append(i * w + np.sort(rng.random(rng.poisson(rate * w))) * w)
    return np.concatenate(out)


def _trace(arrival: np.ndarray, prompt: np.ndarray | None = None,
           output: np.ndarray | None = None) -> Trace:
    n = len(arrival)
    rng = np.random.default_rng(1)
    if prompt is None:
        prompt = rng.integers(50, 2000, n)
    if output is None:
        output = rng.integers(5, 500, n)
    return from_arrays(arrival - arrival[0], prompt, output)


def _drifting_lengths(seed: int = 2) -> Trace:
    """A stationary Poisson hour whose log prompt length rises in steps (normal-score
    mean -0.6 .. +0.6 over 6 ten-minute stretches) and whose outputs do not drift."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / 3.0, int(SPAN * 3)))
    t = t[t < SPAN]
    step = np.minimum((t // 600).astype(int), 5)
    mu = np.linspace(-0.6, 0.6, 6)[step]
    prompt = np.maximum(np.rint(np.exp(6.0 + 0.8 * (mu + rng.standard_normal(len(t))))), 1)
    output = rng.integers(5, 500, len(t))
    return _trace(t, prompt.astype(np.int64), output)


def _window_means(trace: Trace, w: float, k: int) -> np.ndarray:
    i = np.minimum((trace.arrival_s // w).astype(int), k - 1)
    return np.array([trace.prompt_tokens[i == j].mean() for j in range(k)])


RAMP = _trace(_ramp_with_bursts())
RAMP_FIT = fit_workload(RAMP, name="ramp", arrival_process="parametric")


def test_ramp_with_bursts_fits_both_timescales():
    arrival = RAMP_FIT.classes["default"].arrival
    assert arrival.windows is not None and arrival.modulation is not None
    assert len(arrival.windows.rate_multipliers) == 12  # 12 x (span / 12 <= 5 min)
    m = np.array(arrival.windows.rate_multipliers)
    assert np.corrcoef(np.arange(len(m)), m)[0, 1] > 0.8  # the ramp (under the bursts)
    assert m[-1] / m[0] > 2.0
    # class_stats reports the trace's own gap CV, not the operational time's
    gaps = np.diff(RAMP.arrival_s)
    assert class_stats(RAMP_FIT)[0].interarrival_cv == pytest.approx(
        gaps.std() / gaps.mean(), rel=1e-3)


def test_ramp_sample_reproduces_profile_and_burst_dispersion():
    stationary = fit_workload(RAMP, rate_windows_s=None, arrival_process="parametric")
    want_profile = window_counts(RAMP.arrival_s, 300.0)
    fast = RAMP_FIT.classes["default"].arrival.modulation.window_s
    want_fast = dispersion(window_counts(RAMP.arrival_s, fast))
    got_profile, got_fast, old_profile = [], [], []
    # Samples over the trace's span, so that each has every window; 12 seeds: the mean of
    # 4 strayed by 11-23% in one window by the draw alone, of 12 by 10%, of 40 by 6%.
    def profile_of(sample: Trace) -> np.ndarray:
        counts = window_counts(sample.arrival_s, 300.0)[: len(want_profile)]
        return np.pad(counts, (0, len(want_profile) - len(counts)))

    for seed in range(12):
        s = sample_trace(RAMP_FIT, duration_s=RAMP.duration_s, seed=seed)
        got_profile.append(profile_of(s))
        got_fast.append(dispersion(window_counts(s.arrival_s, fast)))
        old = sample_trace(stationary, duration_s=RAMP.duration_s, seed=seed)
        old_profile.append(profile_of(old))
    profile = np.mean(got_profile, axis=0)
    # the slow profile: each 5-min window's mean count within 15% of the trace's
    assert np.max(np.abs(profile / want_profile[: len(profile)] - 1)) < 0.15
    # the stationary fit loses the ramp
    old = np.mean(old_profile, axis=0)
    assert np.corrcoef(np.arange(len(old)), old)[0, 1] < 0.8
    # the bursts inside it: dispersion of counts at the burst window within 25%
    assert np.median(got_fast) == pytest.approx(want_fast, rel=0.25)


def test_length_shift_recovered_per_window():
    trace = _drifting_lengths()
    w = fit_workload(trace, arrival_process="parametric")
    cls = w.classes["default"]
    assert cls.arrival.windows is not None
    assert len(set(cls.arrival.windows.rate_multipliers)) == 1  # no rate drift: flat
    shift = cls.length_shift
    assert shift is not None and shift.prompt is not None
    assert shift.output is None  # outputs do not drift
    d = np.array(shift.prompt)
    assert np.all(np.diff(d[::2]) > 0) and d[-1] - d[0] > 0.8  # rises over the hour
    k = len(d)
    window_s = cls.arrival.windows.window_s
    want = _window_means(trace, window_s, k)
    got = np.mean([_window_means(sample_trace(w, n_requests=len(trace), seed=s), window_s, k)
                   for s in range(3)], axis=0)
    assert np.max(np.abs(got / want - 1)) < 0.1
    # the marginal stays the fitted one: overall mean within 3%
    s = sample_trace(w, n_requests=len(trace), seed=0)
    assert s.prompt_tokens.mean() == pytest.approx(trace.prompt_tokens.mean(), rel=0.03)


def test_auto_keeps_the_simple_fit_on_a_short_stationary_trace():
    rng = np.random.default_rng(3)
    t = np.cumsum(rng.exponential(1 / 3.0, 1800))  # ~10 minutes
    w = fit_workload(_trace(t))
    cls = w.classes["default"]
    assert cls.arrival.windows is None and cls.length_shift is None
    assert auto_slow_window_s(len(t), float(t[-1] - t[0])) is None
    # an hour of stationary Poisson traffic: windows possible, but nothing drifts
    t = np.cumsum(rng.exponential(1 / 3.0, 10_800))
    assert auto_slow_window_s(len(t), float(t[-1] - t[0])) is not None
    cls = fit_workload(_trace(t)).classes["default"]
    assert cls.arrival.windows is None and cls.length_shift is None


def test_fixed_and_none_windows():
    w = fit_workload(RAMP, rate_windows_s=600.0).classes["default"].arrival
    assert w.windows is not None and w.windows.window_s == 600.0
    for off in (None, "none"):
        assert fit_workload(RAMP, rate_windows_s=off).classes["default"].arrival.windows is None
    with pytest.raises(ServetuneError, match="auto, none or a window length"):
        fit_workload(RAMP, rate_windows_s="daily")


def test_yaml_round_trip(tmp_path):
    w = fit_workload(_drifting_lengths(), name="drift", arrival_process="parametric")
    for workload in (RAMP_FIT, w):
        path = tmp_path / f"{workload.name}.yaml"
        save_workload(workload, path)
        assert load_workload(path) == workload


def test_deterministic_and_rate_scale_compresses_the_profile():
    w = fit_workload(_drifting_lengths(), arrival_process="parametric")
    for workload in (RAMP_FIT, w):
        a = sample_trace(workload, n_requests=4000, seed=7)
        b = sample_trace(workload, n_requests=4000, seed=7)
        np.testing.assert_array_equal(a.arrival_s, b.arrival_s)
        np.testing.assert_array_equal(a.prompt_tokens, b.prompt_tokens)
        fast = sample_trace(workload, n_requests=4000, seed=7, rate_scale=2.0)
        np.testing.assert_allclose(fast.arrival_s, a.arrival_s / 2.0, rtol=1e-9, atol=1e-9)
        np.testing.assert_array_equal(fast.prompt_tokens, a.prompt_tokens)
        np.testing.assert_array_equal(fast.output_tokens, a.output_tokens)


DRIFT_FIT = fit_workload(_drifting_lengths(), name="drift", arrival_process="parametric")


@settings(max_examples=10, deadline=None)
@given(short=st.integers(1, 3000), extra=st.integers(1, 5000), seed=st.integers(0, 2**32))
def test_shorter_sample_is_a_prefix(short, extra, seed):
    for w in (RAMP_FIT, DRIFT_FIT):
        a = sample_trace(w, n_requests=short, seed=seed)
        b = sample_trace(w, n_requests=short + extra, seed=seed)
        np.testing.assert_array_equal(a.arrival_s, b.arrival_s[:short])
        np.testing.assert_array_equal(a.prompt_tokens, b.prompt_tokens[:short])
        np.testing.assert_array_equal(a.output_tokens, b.output_tokens[:short])


def _doc(arrival_extra: dict, shift: dict | None) -> dict:
    cls = {
        "arrival": {"process": "poisson", "rate_per_s": 2.0, **arrival_extra},
        "prompt_tokens": {"quantiles": [0, 1], "values": [10, 20]},
        "output_tokens": {"quantiles": [0, 1], "values": [1, 5]},
    }
    if shift is not None:
        cls["length_shift"] = shift
    return {"apiVersion": "servetune/v1", "kind": "Workload", "name": "x",
            "classes": {"default": cls}}


WINDOWS = {"windows": {"window_s": 60.0, "rate_multipliers": [1.0, 2.0, 1.0]}}


def test_hand_written_two_timescale_workload_samples():
    doc = _doc({**WINDOWS, "modulation": {"window_s": 2.0, "levels": [0.5, 1.5],
                                          "transitions": [[0.9, 0.1], [0.1, 0.9]]}},
               {"prompt": [-0.5, 0.5, 0.0]})
    w = document_from_data(doc, Workload, "x")
    s = sample_trace(w, duration_s=7200.0, seed=0)
    phase = (s.arrival_s % 180.0) // 60.0
    counts = np.bincount(phase.astype(int), minlength=3)
    assert counts[1] / counts[0] == pytest.approx(2.0, rel=0.15)
    means = [s.prompt_tokens[phase == j].mean() for j in range(3)]
    assert means[0] < means[2] < means[1]


@pytest.mark.parametrize(
    ("arrival_extra", "shift", "match"),
    [
        ({}, {"prompt": [0.1, 0.2]}, "arrival has no windows"),
        (WINDOWS, {"prompt": [0.1, 0.2]}, "has 2 entries but arrival.windows has 3"),
        (WINDOWS, {"output": [0.1, 0.2, 0.3, 0.4]}, "length_shift.output has 4 entries"),
        (WINDOWS, {}, "needs prompt and/or output shifts"),
        (WINDOWS, {"prompt": [0.0, 9.0, 0.0]}, "within \\+-5"),
        (WINDOWS, {"prompt": [float("nan"), 0.0, 0.0]}, "finite"),
        (WINDOWS, {"prompt": [-2.0, 2.0, -2.0]}, "variance .* must be < 1"),
        (WINDOWS, {"prompt": [0.0, 0.0, 0.0], "typo": 1}, "typo"),
    ],
)
def test_validation_errors(arrival_extra, shift, match):
    with pytest.raises(ServetuneError, match=match):
        document_from_data(_doc(arrival_extra, shift), Workload, "x")


def test_cli_rate_windows_option(tmp_path):
    src = tmp_path / "t.csv"
    src.write_text("ts,in,out\n" + "\n".join(
        f"{t:.4f},{p},{o}" for t, p, o in zip(RAMP.arrival_s, RAMP.prompt_tokens,
                                              RAMP.output_tokens, strict=True)) + "\n")
    runner = CliRunner()
    base = ["workload", "fit", str(src), "--columns", "arrival=ts,prompt=in,output=out",
            "--arrival", "parametric"]
    for setting, has_windows in (("auto", True), ("none", False), ("600", True)):
        out = tmp_path / f"{setting}.yaml"
        result = runner.invoke(app, [*base, "-o", str(out), "--rate-windows", setting])
        assert result.exit_code == 0, result.output
        assert (load_workload(out).classes["default"].arrival.windows is not None) == has_windows
    bad = runner.invoke(app, [*base, "-o", str(tmp_path / "x.yaml"), "--rate-windows", "hourly"])
    assert bad.exit_code != 0 and "--rate-windows must be auto, none" in bad.output


def test_within_window_correlation_when_the_shifts_carry_all_the_variance():
    """Found by the fuzz harness (a trace with one length per window): shifts of +-1 in
    two equal windows carry the whole score variance, a = 0, and there is nothing within
    a window to couple; this was a ZeroDivisionError."""
    from servetune.schemas.workload import LengthShift
    from servetune.workloads.fitting import within_window_correlation

    shift = LengthShift(prompt=[1.0, -1.0], output=[1.0, -1.0])
    window = np.array([0, 0, 1, 1])
    assert within_window_correlation(0.5, window, shift) == 0.0
    assert within_window_correlation(None, window, shift) is None
