"""The real Azure 2023 traces (read from ../shared/traces when present): statistics equal
reference figures for the published files."""

from __future__ import annotations

import json

import pytest
from conftest import shared_file
from typer.testing import CliRunner

from servetune.cli import app
from servetune.workloads.formats import load_trace
from servetune.workloads.stats import trace_stats

# Reference figures for the published files: count, span, rate, inter-arrival CV, length
# (mean, p50, p99, max) and minimum lengths
EXPECTED = {
    "AzureLLMInferenceTrace_conv.csv": dict(
        requests=19366, duration_s=3501.7, rate=5.530, cv=1.09,
        prompt=(1154.7, 1020, 4142, 14050), output=(211.1, 129, 601, 1000),
        prompt_min=2, output_min=7,
    ),
    "AzureLLMInferenceTrace_code.csv": dict(
        requests=8819, duration_s=3435.9, rate=2.567, cv=13.15,
        prompt=(2047.8, 1469, 7436, 7437), output=(27.9, 13, 251.5, 1899),
        prompt_min=3, output_min=6,
    ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_real_trace_statistics(name):
    trace = load_trace(shared_file("traces", name))
    exp = EXPECTED[name]
    stats = trace_stats(trace)
    assert stats["requests"] == exp["requests"]
    assert round(stats["duration_s"], 1) == exp["duration_s"]
    # (rows-1)/span as the README defines it. Its code figure 2.567 is rows/span (2.5667);
    # (rows-1)/span is 2.5664, so compare to within the README's last digit.
    assert stats["rate_per_s"] == pytest.approx((exp["requests"] - 1) / stats["duration_s"])
    assert abs(stats["rate_per_s"] - exp["rate"]) <= 1e-3
    assert round(stats["interarrival_cv"], 2) == exp["cv"]
    for key, (mean, p50, p99, mx) in (("prompt_tokens", exp["prompt"]),
                                      ("output_tokens", exp["output"])):
        s = stats[key]
        assert round(s["mean"], 1) == mean
        assert s["p50"] == p50
        assert round(s["p99"], 1) == p99
        assert s["max"] == mx
    assert trace.prompt_tokens.min() == exp["prompt_min"]
    assert trace.output_tokens.min() == exp["output_min"]
    assert trace.notices == ()


def test_cli_trace_stats_conv_acceptance():
    path = shared_file("traces", "AzureLLMInferenceTrace_conv.csv")
    result = CliRunner().invoke(app, ["trace", "stats", str(path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == {"requests", "duration_s", "rate_per_s", "interarrival_cv",
                         "prompt_tokens", "output_tokens"}
    assert set(data["prompt_tokens"]) == {"mean", "p50", "p90", "p99", "max"}
    assert data["requests"] == 19366
    assert f"{data['rate_per_s']:.2f}" == "5.53"
    assert f"{data['prompt_tokens']['mean']:.1f}" == "1154.7"
    assert f"{data['output_tokens']['mean']:.1f}" == "211.1"
    human = CliRunner().invoke(app, ["trace", "stats", str(path)])
    assert human.exit_code == 0
    assert "19,366 requests" in human.stdout and "1,154.7" in human.stdout
