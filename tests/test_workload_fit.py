"""Fitting workloads to traces and sampling traces from workloads."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from conftest import shared_file, workload_from_yaml_text
from typer.testing import CliRunner

from servetune.cli import app
from servetune.errors import ServetuneError
from servetune.workloads.fitting import (
    QUANTILE_GRID,
    class_stats,
    fit_workload,
    load_workload,
    sample_trace,
)
from servetune.workloads.formats import load_trace
from servetune.workloads.stats import trace_stats
from servetune.workloads.trace import from_arrays

runner = CliRunner()


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _workload(classes: dict) -> object:
    data = {"apiVersion": "servetune/v1", "kind": "Workload", "classes": classes}
    return workload_from_yaml_text(yaml.safe_dump(data, sort_keys=False), "w.yaml")


def _cls(rate: float, cv: float = 1.0, priority: int = 0, windows=None, prompt=(10, 1000),
         output=(1, 100)) -> dict:
    arrival = {"process": "poisson" if cv == 1.0 else "gamma", "rate_per_s": rate,
               "interarrival_cv": cv}
    if windows:
        arrival["windows"] = windows
    return {
        "priority": priority,
        "arrival": arrival,
        "prompt_tokens": {"quantiles": [0, 1], "values": list(prompt)},
        "output_tokens": {"quantiles": [0, 1], "values": list(output)},
    }


# ----------------------------------------------------------------------------- real traces


@pytest.mark.parametrize("process", ["auto", "parametric"])
@pytest.mark.parametrize("name", ["AzureLLMInferenceTrace_conv.csv",
                                  "AzureLLMInferenceTrace_code.csv"])
def test_fit_then_sample_matches_trace(name, process):
    trace = load_trace(shared_file("traces", name))
    want = trace_stats(trace)
    workload = fit_workload(trace, arrival_process=process)
    # auto chooses the block bootstrap on both traces (bursts on code, the longest prompts
    # clustered in time on conv), which keeps the trace's own lengths and gaps
    assert (workload.block_bootstrap is not None) == (process == "auto")
    n = 200_000
    got = trace_stats(sample_trace(workload, n_requests=n, seed=7))
    assert got["requests"] == n
    for key in ("prompt_tokens", "output_tokens"):
        for stat in ("mean", "p50", "p90", "p99"):
            assert _rel(got[key][stat], want[key][stat]) < 0.02, (key, stat)
    # the sample's mean gap is a mean of n renewal gaps: its relative error is about
    # CV/sqrt(n) (0.24% for conv, 2.9% for the CV-13 code trace); allow 3 standard errors
    # and never more slack than the fit's 2% accuracy target on conv
    tol = max(3 * want["interarrival_cv"] / np.sqrt(n), 0.02 if want["interarrival_cv"] < 2
              else 0.0)
    assert _rel(got["rate_per_s"], want["rate_per_s"]) < tol
    # A renewal fit draws the trace's own gaps (10%). The code trace's fit is Markov-
    # modulated: its gaps' CV follows from the levels and the within-window gaps, and runs
    # of idle windows end geometrically, which trims the longest idle gaps (sample CV
    # 11.4-11.8 for the trace's 13.2); class_stats reports the trace's own CV.
    modulated = workload.classes["default"].arrival.modulation is not None
    assert _rel(got["interarrival_cv"], want["interarrival_cv"]) < (0.15 if modulated else 0.1)


@pytest.mark.parametrize("process", ["auto", "parametric"])
def test_conv_acceptance_rate_per_hour_and_class_stats(process):
    trace = load_trace(shared_file("traces", "AzureLLMInferenceTrace_conv.csv"))
    workload = fit_workload(trace, rate_windows_s=300, arrival_process=process)
    stats = class_stats(workload)[0]
    want = trace_stats(trace)
    assert stats.rate_per_s == pytest.approx(want["rate_per_s"])
    assert stats.prompt_p50 == want["prompt_tokens"]["p50"]
    assert stats.prompt_p99 == want["prompt_tokens"]["p99"]
    assert stats.output_max == want["output_tokens"]["max"]
    assert _rel(stats.prompt_mean, want["prompt_tokens"]["mean"]) < 0.002
    sample = sample_trace(workload, n_requests=200_000, seed=3)
    per_hour = np.bincount((sample.arrival_s // 3600).astype(np.int64))[:-1]  # full hours
    assert len(per_hour) >= 9
    assert _rel(per_hour.mean(), want["rate_per_s"] * 3600) < 0.02
    assert _rel(trace_stats(sample)["rate_per_s"], want["rate_per_s"]) < 0.02


def test_prompt_quantile_bands_split_conv():
    trace = load_trace(shared_file("traces", "AzureLLMInferenceTrace_conv.csv"))
    workload = fit_workload(trace, split="prompt-quantiles", bands=3)
    stats = class_stats(workload)
    assert len(stats) == 3
    assert sum(s.rate_per_s for s in stats) == pytest.approx(trace_stats(trace)["rate_per_s"])
    assert all(abs(s.share - 1 / 3) < 0.02 for s in stats)
    assert stats[0].prompt_max < stats[1].prompt_p50 < stats[2].prompt_p50
    assert stats[2].prompt_max == 14050


# ----------------------------------------------------------------------------- sampling


def test_sampling_is_deterministic_and_prefix_stable():
    w = _workload({"a": _cls(5.0, cv=3.0), "b": _cls(1.0, priority=1)})
    one = sample_trace(w, n_requests=5000, seed=11)
    two = sample_trace(w, n_requests=5000, seed=11)
    for col in ("arrival_s", "prompt_tokens", "output_tokens", "class_id", "priority"):
        assert np.array_equal(getattr(one, col), getattr(two, col))
    other = sample_trace(w, n_requests=5000, seed=12)
    assert not np.array_equal(one.prompt_tokens, other.prompt_tokens)
    longer = sample_trace(w, n_requests=200_000, seed=11)
    assert np.array_equal(longer.arrival_s[:5000], one.arrival_s)
    assert np.array_equal(longer.class_id[:5000], one.class_id)


def test_sample_columns_shares_and_priorities():
    w = _workload({"a": _cls(3.0), "b": _cls(1.0, priority=2, prompt=(5, 5))})
    t = sample_trace(w, n_requests=100_000, seed=0)
    assert t.class_names == ("a", "b")
    assert abs((t.class_id == 1).mean() - 0.25) < 0.01
    assert set(t.priority[t.class_id == 1].tolist()) == {2}
    assert set(t.priority[t.class_id == 0].tolist()) == {0}
    assert set(t.prompt_tokens[t.class_id == 1].tolist()) == {5}
    assert t.arrival_s[0] == 0 and np.all(np.diff(t.arrival_s) >= 0)
    assert t.prompt_tokens.min() >= 1 and t.output_tokens.min() >= 1


def test_uniform_lengths_sampled_by_inverse_cdf():
    w = _workload({"a": _cls(1.0, prompt=(1, 1001), output=(1, 3))})
    t = sample_trace(w, n_requests=200_000, seed=5)
    # rint(U(1, 1001)): mean 501, every integer in range, 1 and 1001 half as likely
    assert t.prompt_tokens.mean() == pytest.approx(501, rel=0.005)
    assert t.prompt_tokens.min() == 1 and t.prompt_tokens.max() == 1001
    counts = np.bincount(t.output_tokens)[1:]
    assert counts.tolist() == pytest.approx([50_000, 100_000, 50_000], rel=0.03)


@pytest.mark.parametrize("cv", [1.0, 0.5, 4.0])
def test_gap_cv_and_rate(cv):
    w = _workload({"a": _cls(2.0, cv=cv)})
    t = sample_trace(w, n_requests=200_000, seed=1)
    gaps = np.diff(t.arrival_s)
    assert gaps.mean() == pytest.approx(0.5, rel=3 * cv / np.sqrt(len(gaps)) + 1e-3)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_duration_mode_and_rate_scale():
    w = _workload({"a": _cls(4.0)})
    t = sample_trace(w, duration_s=1000.0, seed=2)
    assert t.arrival_s[-1] <= 1000.0
    assert len(t) == pytest.approx(4000, abs=4 * np.sqrt(4000))
    base = sample_trace(w, n_requests=1000, seed=2)
    fast = sample_trace(w, n_requests=1000, seed=2, rate_scale=2.0)
    np.testing.assert_allclose(fast.arrival_s, base.arrival_s / 2)
    assert np.array_equal(fast.prompt_tokens, base.prompt_tokens)
    both = sample_trace(w, n_requests=10, duration_s=1000.0, seed=2)
    assert len(both) == 10
    default = sample_trace(w, seed=2)  # no duration_s in the workload: one hour
    assert default.arrival_s[-1] <= 3600 and len(default) > 3600 * 4 * 0.9


def test_rate_windows_shape_arrivals():
    windows = {"window_s": 100.0, "rate_multipliers": [3.0, 0.0, 1.0]}
    w = _workload({"a": _cls(50.0, windows=windows)})
    t = sample_trace(w, n_requests=150_000, seed=4)
    phase = (t.arrival_s + 0.02) % 300.0  # the first gap (~0.01 s) was re-based away
    counts = np.histogram(phase, bins=[0, 99, 101, 199, 201, 300])[0]
    assert counts[2] == 0  # the zero-rate window stays empty
    assert counts[0] / counts[4] == pytest.approx(3.0, rel=0.05)
    # the mean rate is rate_per_s: multipliers are normalised to mean 1
    assert len(t) / t.arrival_s[-1] == pytest.approx(50.0, rel=0.02)


def test_sampling_rejections():
    w = _workload({"a": _cls(1.0)})
    with pytest.raises(ServetuneError, match=">= 1"):
        sample_trace(w, n_requests=0)
    with pytest.raises(ServetuneError, match="duration"):
        sample_trace(w, duration_s=-1)
    for bad_scale in (0, 1e-300, 1e300, float("inf")):
        with pytest.raises(ServetuneError, match="rate scale"):
            sample_trace(w, n_requests=5, rate_scale=bad_scale)
    with pytest.raises(ServetuneError, match="rate_per_s.*less than or equal to 1000000"):
        _workload({"a": _cls(1e300)})
    tiny = _workload({"a": _cls(1e-6)})
    with pytest.raises(ServetuneError, match="no requests"):
        sample_trace(tiny, duration_s=1.0)


# ----------------------------------------------------------------------------- fitting


def test_fit_small_trace_by_hand():
    # 5 requests over 8 s: rate (5-1)/8; gaps 2,2,2,2 -> CV 0 (clamped to 0.01, gamma)
    t = from_arrays(np.array([0.0, 2, 4, 6, 8]), np.array([1, 2, 3, 4, 5]),
                    np.array([10, 10, 10, 10, 10]))
    w = fit_workload(t, name="tiny")
    c = w.classes["default"]
    assert c.arrival.rate_per_s == 0.5
    assert c.arrival.process == "gamma" and c.arrival.interarrival_cv == 0.01
    assert c.prompt_tokens.quantiles == [float(q) for q in QUANTILE_GRID]
    s = class_stats(w)[0]
    assert (s.prompt_p50, s.prompt_max, s.output_max) == (3, 5, 10)
    assert s.prompt_quantile(0.25) == 2 and s.prompt_mean == pytest.approx(3, rel=1e-3)
    assert w.duration_s == 8


def test_fit_split_by_class_column_and_priority():
    rng = np.random.default_rng(0)
    n = 4000
    arrival = np.cumsum(rng.exponential(0.1, n))
    cls = (rng.random(n) < 0.25).astype(np.int32)
    prompt = np.where(cls == 1, 5000, 100)
    t = from_arrays(arrival, prompt, np.full(n, 5), class_id=cls,
                    class_names=("chat", "batch"), priority=np.where(cls == 1, 3, 0))
    w = fit_workload(t, split="class")
    assert list(w.classes) == ["chat", "batch"]
    assert w.classes["batch"].priority == 3
    stats = {s.name: s for s in class_stats(w)}
    assert stats["batch"].share == pytest.approx((cls == 1).mean())
    assert stats["batch"].prompt_p50 == 5000 and stats["chat"].prompt_max == 100
    total = sum(s.rate_per_s for s in stats.values())
    assert total == pytest.approx((n - 1) / t.duration_s)
    # thinning a Poisson process leaves Poisson processes
    assert all(s.interarrival_cv == pytest.approx(1, abs=0.06) for s in stats.values())


def test_fit_rate_windows_recovers_step_rate():
    rng = np.random.default_rng(1)
    fast = np.cumsum(rng.exponential(1 / 10, 2000))
    fast = fast[fast < 200]
    slow = 200 + np.cumsum(rng.exponential(1.0, 400))
    slow = slow[slow < 400]
    arrival = np.concatenate([fast, slow])
    t = from_arrays(arrival, np.full(len(arrival), 8), np.full(len(arrival), 2))
    w = fit_workload(t, rate_windows_s=200)
    arr = w.classes["default"].arrival
    m = np.array(arr.windows.rate_multipliers)
    assert m.mean() == pytest.approx(1, abs=1e-3)
    assert m[0] / m[1] == pytest.approx(10, rel=0.15)
    # within windows the process is Poisson; without windows it looks bursty
    assert arr.interarrival_cv == pytest.approx(1, abs=0.1)
    assert arr.process in ("poisson", "gamma")
    plain = fit_workload(t, arrival_process="renewal").classes["default"].arrival
    # a 10x rate step seen as one renewal process has gap CV > 2: empirical gaps
    assert plain.process == "empirical" and plain.interarrival_cv > 2
    # auto sees the step as sustained rate variation: a Markov modulation, whose levels
    # hold the step and whose gap_cv (what class_stats reads) is the gaps' overall CV
    auto = fit_workload(t).classes["default"].arrival
    assert auto.modulation is not None
    assert auto.gaps_cv == pytest.approx(plain.interarrival_cv, rel=1e-3)
    assert max(auto.modulation.levels) > 2 * np.mean(auto.modulation.levels)


def test_fit_rejections():
    one = from_arrays(np.array([0.0]), np.array([1]), np.array([1]))
    with pytest.raises(ServetuneError, match="at least 2 requests"):
        fit_workload(one)
    t = from_arrays(np.array([0.0, 1, 2]), np.array([1, 2, 3]), np.array([1, 1, 1]))
    with pytest.raises(ServetuneError, match="no class column"):
        fit_workload(t, split="class")
    with pytest.raises(ServetuneError, match="unknown split"):
        fit_workload(t, split="colour")
    with pytest.raises(ServetuneError, match="argument `rate_windows_s`"):
        fit_workload(t, rate_windows_s=0)


# ----------------------------------------------------------------------------- CLI


def test_cli_fit_then_show_sample(tmp_path):
    path = shared_file("traces", "AzureLLMInferenceTrace_conv.csv")
    out = tmp_path / "conv.yaml"
    result = runner.invoke(app, ["workload", "fit", str(path), "-o", str(out), "--arrival",
                                 "parametric"])
    assert result.exit_code == 0, result.output
    assert "arrivals: parametric (per class)" in result.output
    assert load_workload(out).classes["default"].arrival.rate_per_s == pytest.approx(5.5301, 1e-4)
    shown = runner.invoke(app, ["workload", "show", str(out), "--sample", "200000", "--seed",
                                "1", "--json"])
    assert shown.exit_code == 0, shown.output
    got = json.loads(shown.stdout)
    assert got["requests"] == 200000
    assert _rel(got["rate_per_s"], 5.530) < 0.02
    assert _rel(got["prompt_tokens"]["mean"], 1154.7) < 0.02
    assert _rel(got["output_tokens"]["mean"], 211.1) < 0.02
    again = runner.invoke(app, ["workload", "show", str(out), "--sample", "200000", "--seed",
                                "1", "--json"])
    assert again.stdout == shown.stdout
    human = runner.invoke(app, ["workload", "show", str(out)])
    assert human.exit_code == 0 and "prompt mean" in human.stdout
    js = runner.invoke(app, ["workload", "show", str(out), "--json"])
    assert json.loads(js.stdout)["classes"][0]["name"] == "default"


def test_cli_fit_bands_and_windows(tmp_path):
    src = tmp_path / "t.csv"
    rows = "\n".join(f"{i * 0.5},{(i % 7) * 100 + 1},{i % 5 + 1}" for i in range(300))
    src.write_text("ts,in,out\n" + rows + "\n")
    out = tmp_path / "w.yaml"
    result = runner.invoke(app, ["workload", "fit", str(src), "-o", str(out), "--columns",
                                 "arrival=ts,prompt=in,output=out", "--split-by",
                                 "prompt-quantiles", "--bands", "2", "--rate-windows", "30"])
    assert result.exit_code == 0, result.output
    w = load_workload(out)
    assert len(w.classes) == 2
    assert all(c.arrival.windows.window_s == 30 for c in w.classes.values())


@pytest.mark.parametrize(
    "args",
    [
        ["workload", "fit", "missing.csv", "-o", "x.yaml"],
        ["workload", "show", "missing.yaml"],
        ["workload", "fit", "{trace}", "-o", "{out}", "--split-by", "colour"],
        ["workload", "fit", "{trace}", "-o", "{out}", "--bands", "0"],
        ["workload", "fit", "{trace}", "-o", "{out}", "--split-by", "prompt-quantiles",
         "--bands", "100000"],
        ["workload", "show", "{bad}", "--sample", "10"],
        ["workload", "show", "{good}", "--sample", "0"],
        ["workload", "show", "{good}", "--rate-scale", "2"],
        ["trace", "stats", "{bad}"],
        ["trace", "stats", "{trace}", "--on-bad-row", "maybe"],
    ],
)
def test_cli_user_errors_exit_2_with_one_line(tmp_path, args):
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,1,1\n"
                     "2023-11-16 18:00:01,2,2\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: servetune/v1\nkind: Workload\nclasses: 3\n")
    good = tmp_path / "good.yaml"
    runner.invoke(app, ["workload", "fit", str(trace), "-o", str(good)])
    out = tmp_path / "out.yaml"
    argv = [a.format(trace=trace, bad=bad, good=good, out=out) for a in args]
    result = runner.invoke(app, argv)
    assert result.exit_code == 2, result.output
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("servetune: error: ")
    assert not out.exists()


@pytest.mark.parametrize("cmd", [["trace", "stats"], ["workload", "fit"], ["workload", "show"]])
def test_help_has_an_example(cmd):
    result = runner.invoke(app, [*cmd, "--help"])
    assert result.exit_code == 0
    assert "Example: servetune " + " ".join(cmd) in " ".join(result.stdout.split())


def test_fit_recovers_the_workload_it_was_sampled_from():
    w = _workload({
        "chat": _cls(4.0, cv=2.0, prompt=(10, 3000), output=(5, 500)),
        "batch": _cls(1.0, priority=1, prompt=(2000, 8000), output=(100, 200)),
    })
    refit = fit_workload(sample_trace(w, n_requests=200_000, seed=9), split="class")
    assert list(refit.classes) == ["chat", "batch"]
    for want, got in zip(class_stats(w), class_stats(refit), strict=True):
        assert got.priority == want.priority
        assert _rel(got.rate_per_s, want.rate_per_s) < 0.02
        assert _rel(got.share, want.share) < 0.01
        for stat in ("prompt_mean", "prompt_p50", "prompt_p99", "output_mean", "output_p99"):
            assert _rel(getattr(got, stat), getattr(want, stat)) < 0.02, stat
    # each class keeps its own burstiness (the other class's arrivals do not mix in)
    assert _rel(refit.classes["chat"].arrival.interarrival_cv, 2.0) < 0.05
    assert refit.classes["batch"].arrival.interarrival_cv == 1.0 or _rel(
        refit.classes["batch"].arrival.interarrival_cv, 1.0) < 0.05
