"""Markov-modulated arrivals: fitted from windowed counts, chosen by auto, sampled
deterministically, validated with clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetune.errors import ServetuneError
from servetune.schemas.base import document_from_data
from servetune.schemas.workload import Workload
from servetune.workloads.fitting import (
    class_stats,
    dispersion,
    fit_workload,
    load_workload,
    sample_trace,
    save_workload,
    window_counts,
)
from servetune.workloads.trace import from_arrays


def _trace(arrival: np.ndarray):
    n = len(arrival)
    return from_arrays(arrival, np.full(n, 100), np.full(n, 10))


def _two_level(seed: int = 0, n_windows: int = 300, w: float = 20.0) -> np.ndarray:
    """Poisson arrivals whose rate switches between 0.5/s and 5/s, holding each level for
    a geometric number of 20 s windows (mean 5)."""
    rng = np.random.default_rng(seed)
    level, out = 0, []
    for i in range(n_windows):
        if rng.random() < 0.2:
            level = 1 - level
        rate = (0.5, 5.0)[level]
        k = rng.poisson(rate * w)
        out.append(i * w + np.sort(rng.random(k)) * w)
    return np.concatenate(out)


def _poisson(seed: int = 0, n: int = 4000, rate: float = 3.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.cumsum(rng.exponential(1 / rate, n))


def test_two_level_switching_keeps_the_count_dispersion():
    trace = _trace(_two_level())
    auto = fit_workload(trace, arrival_process="parametric")
    renewal = fit_workload(trace, arrival_process="renewal")
    assert auto.classes["default"].arrival.modulation is not None
    want = {w: dispersion(window_counts(trace.arrival_s, w)) for w in (10.0, 40.0)}
    for w, target in want.items():
        got = np.median([dispersion(window_counts(
            sample_trace(auto, n_requests=len(trace), seed=s).arrival_s, w)) for s in range(5)])
        old = np.median([dispersion(window_counts(
            sample_trace(renewal, n_requests=len(trace), seed=s).arrival_s, w))
            for s in range(5)])
        assert 0.6 < got / target < 1.5, (w, got, target)
        assert old / target < 0.5, (w, old, target)  # i.i.d. gaps lose the bursts


def test_class_stats_reads_the_gaps_overall_cv_and_mean_rate():
    trace = _trace(_two_level(1))
    w = fit_workload(trace, arrival_process="parametric")
    s = class_stats(w)[0]
    gaps = np.diff(trace.arrival_s)
    assert s.rate_per_s == pytest.approx((len(trace) - 1) / trace.duration_s)
    assert s.interarrival_cv == pytest.approx(gaps.std() / gaps.mean(), rel=1e-3)
    sample = sample_trace(w, n_requests=200_000, seed=3)
    rate = (len(sample) - 1) / sample.duration_s
    assert rate == pytest.approx(s.rate_per_s, rel=0.05)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_keeps_the_renewal_fit_on_a_poisson_trace(seed):
    arrival = fit_workload(_trace(_poisson(seed))).classes["default"].arrival
    assert arrival.modulation is None and arrival.process in ("poisson", "gamma")


def test_round_trip_and_determinism(tmp_path):
    w = fit_workload(_trace(_two_level(2)), name="bursts", arrival_process="parametric")
    path = tmp_path / "w.yaml"
    save_workload(w, path)
    back = load_workload(path)
    assert back == w
    assert len(path.read_text()) < 8000  # a few levels, not the gap sequence
    a = sample_trace(back, n_requests=5000, seed=11)
    b = sample_trace(w, n_requests=5000, seed=11)
    np.testing.assert_array_equal(a.arrival_s, b.arrival_s)
    c = sample_trace(w, n_requests=5000, seed=12)
    assert not np.array_equal(a.arrival_s, c.arrival_s)


@settings(max_examples=15, deadline=None)
@given(short=st.integers(1, 3000), extra=st.integers(1, 80_000), seed=st.integers(0, 2**32))
def test_shorter_sample_is_a_prefix(short, extra, seed):
    w = _BURSTS
    a = sample_trace(w, n_requests=short, seed=seed)
    b = sample_trace(w, n_requests=short + extra, seed=seed)
    np.testing.assert_array_equal(a.arrival_s, b.arrival_s[:short])
    np.testing.assert_array_equal(a.prompt_tokens, b.prompt_tokens[:short])


_BURSTS = fit_workload(_trace(_two_level(4)), name="bursts", arrival_process="parametric")


def test_rate_scale_compresses_time():
    a = sample_trace(_BURSTS, n_requests=3000, seed=5)
    b = sample_trace(_BURSTS, n_requests=3000, seed=5, rate_scale=2.0)
    np.testing.assert_allclose(b.arrival_s, a.arrival_s / 2.0, rtol=1e-9, atol=1e-9)


def _doc(modulation: dict) -> dict:
    return {
        "apiVersion": "servetune/v1", "kind": "Workload", "name": "x",
        "classes": {"default": {
            "arrival": {"process": "poisson", "rate_per_s": 2.0, "modulation": modulation},
            "prompt_tokens": {"quantiles": [0, 1], "values": [10, 20]},
            "output_tokens": {"quantiles": [0, 1], "values": [1, 5]},
        }},
    }


GOOD = {"window_s": 5.0, "levels": [0.0, 2.0], "transitions": [[0.8, 0.2], [0.3, 0.7]]}


@pytest.mark.parametrize(("change", "words"), [
    ({"transitions": [[0.8, 0.1], [0.3, 0.7]]}, "transitions row 0 sums to 0.9"),
    ({"transitions": [[1.0]]}, "transitions must be a 2 x 2 matrix"),
    ({"levels": [0.0, -1.0]}, "levels must be finite and >= 0"),
    ({"levels": [0.0, 0.0]}, "at least one level with a rate > 0"),
    ({"window_s": 0}, "window_s"),
    ({"transitions": [[1.0, 0.0], [1.0, 0.0]]}, "spends all its time at levels with rate 0"),
    # two closed classes: half the time in each, but a sample started at level 0 would
    # wait for ever
    ({"transitions": [[1.0, 0.0], [0.0, 1.0]]}, "level 0 has rate 0 and its transitions "
     "never lead to a level with a positive rate"),
])
def test_bad_modulation_gives_one_clear_error(change, words):
    with pytest.raises(ServetuneError) as err:
        document_from_data(_doc({**GOOD, **change}), Workload, "w.yaml")
    text = str(err.value)
    assert words in text and "modulation" in text


def test_hand_written_modulation_gets_a_mixture_cv():
    w = document_from_data(_doc(GOOD), Workload, "w.yaml")
    mod = w.classes["default"].arrival.modulation
    # all arrivals come at level 2 (relative to the stationary mean): poisson there, CV 1
    assert mod.gap_cv == pytest.approx(1.0, abs=1e-3)
    assert class_stats(w)[0].interarrival_cv == mod.gap_cv
    # the sampled rate's spread over seeds is 5.6% at 20,000 requests (60 seeds), 1.3% at
    # 200,000 (10 seeds): this checks the mean rate to within about 3 of those
    s = sample_trace(w, n_requests=200_000, seed=0)
    assert (len(s) - 1) / s.duration_s == pytest.approx(2.0, rel=0.04)


def test_modulated_with_rate_windows_is_allowed():
    w = fit_workload(_trace(_two_level()), rate_windows_s=600, arrival_process="modulated")
    arrival = w.classes["default"].arrival
    assert arrival.windows is not None and arrival.modulation is not None
    with pytest.raises(ServetuneError, match="rate_windows_s"):
        fit_workload(_trace(_two_level()), rate_windows_s="hourly")


def _level_path(levels, transitions, *, rate=1.0, window_s=1.0, seed=0):
    from servetune.schemas.workload import RateModulation
    from servetune.workloads.fitting import _LevelPath

    mod = RateModulation(window_s=window_s, levels=levels, transitions=transitions)
    return _LevelPath(mod, rate, np.random.SeedSequence(seed))


def test_level_path_worked_by_hand():
    # Levels 0 and 2 alternating every 1 s window (stationary (1/2, 1/2), mean rate 1).
    # Started at level 2, operational time passes at 2 per second in windows 0, 2, 4...:
    # 0.5 -> 0.25 s, 1 -> 0.5 s, 2 -> 1 s (the end of window 0; window 1 is silent),
    # 2.5 -> 2.25 s, 3 -> 2.5 s. Started at level 0, everything is one window later.
    firsts = set()
    for seed in range(8):
        path = _level_path([0.0, 2.0], [[0.0, 1.0], [1.0, 0.0]], seed=seed)
        got = path.seconds(np.array([0.5, 1.0, 2.0, 2.5, 3.0])).tolist()
        first = path.run_levels[0]
        firsts.add(first)
        want = [0.25, 0.5, 1.0, 2.25, 2.5] if first == 1 else [1.25, 1.5, 2.0, 3.25, 3.5]
        assert got == pytest.approx(want)
        assert path.run_windows[: 3] == [1.0, 1.0, 1.0]
    assert firsts == {0, 1}  # both starts occur


def test_level_path_holding_times_and_shares_follow_the_chain():
    # A sticky chain: level a is held Geometric(1 - P[a][a]) windows (means 10 and 4), and
    # the share of windows at each level is the stationary distribution.
    p = [[0.9, 0.1], [0.25, 0.75]]
    path = _level_path([0.0, 1.0], p, seed=3)
    path.seconds(np.array([20_000.0]))
    levels = np.array(path.run_levels)
    windows = np.array(path.run_windows)
    assert np.all(levels[1:] != levels[:-1])  # a run ends with a jump to another level
    assert windows[levels == 0].mean() == pytest.approx(10.0, rel=0.05)
    assert windows[levels == 1].mean() == pytest.approx(4.0, rel=0.05)
    # pi solves pi_0 * 0.1 = pi_1 * 0.25: pi = (5/7, 2/7)
    share_0 = windows[levels == 0].sum() / windows.sum()
    assert share_0 == pytest.approx(5 / 7, abs=0.01)


def test_a_quiet_level_held_for_thousands_of_windows_samples_at_once():
    # Found by a property run: 0.000015 req/s in 60 s windows, a silent level held for
    # 2,450 windows on average. Sampling covers 65,536 gaps at a time: 72 million windows
    # here, which the old path drew one by one (it ran for hours); as runs they are
    # 59,460 steps.
    w = document_from_data(_doc({"window_s": 60.0, "levels": [0.0, 2043.48],
                                 "transitions": [[0.999592, 0.000408], [0.833333, 0.166667]]}),
                           Workload, "w.yaml")
    w.classes["default"].arrival.rate_per_s = 1.5e-5
    s = sample_trace(w, n_requests=100, seed=0)
    assert len(s) == 100
    # bursts: most gaps are inside a busy window, a few span a quiet stretch
    gaps = np.diff(s.arrival_s)
    assert np.median(gaps) < 60.0 < gaps.max()
