"""The one evaluator: the goodput `optimize` prints (every method) is the goodput
`servetune goodput` gives for the same policy on the same trace or workload, and the
sample and window rules behave as stated."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from servetune.cli import app
from servetune.schemas.base import load_document
from servetune.schemas.slo import SLOSet
from servetune.schemas.space import SearchSpace
from servetune.sim.evaluator import (
    MAX_TRACE_REQUESTS,
    Evaluator,
    base_sample,
    default_requests,
    judged_sample,
    judging_window_s,
)
from servetune.workloads.trace import Trace

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "configs" / "examples" / "azure-conv-synthetic.csv"
WORKLOAD = ROOT / "configs" / "workloads" / "azure-conv-2023.yaml"
PROFILE = ROOT / "gpu_profiles" / "h200-llama-3.1-8b.yaml"
SLO = ROOT / "configs" / "slos" / "mlperf-llama-3.1-8b-server.yaml"
SPACE = SearchSpace(name="tiny", knobs={"batching.max_num_seqs": [32, 256],
                                         "batching.max_num_batched_tokens": [1024, 8192]})
runner = CliRunner()


def evenly(n: int, rate: float) -> Trace:
    """``n`` requests arriving every ``1 / rate`` seconds."""
    return Trace(arrival_s=np.arange(n) / rate, prompt_tokens=np.full(n, 100),
                 output_tokens=np.full(n, 10))


def test_window_is_the_ttft_target_over_three_percent_capped():
    slo = load_document(SLO, SLOSet)  # p99 TTFT 2 s
    assert judging_window_s(slo) == pytest.approx(2.0 / 0.03)
    long = SLOSet(name="long", classes={"default": {"ttft_s": 60.0, "percentile": 99.0}})
    assert judging_window_s(long) == 600.0  # 2000 s, capped
    none = SLOSet(name="tpot", classes={"default": {"tpot_s": 0.1, "percentile": 99.0}})
    assert judging_window_s(none) == 0.0


def test_default_requests_a_whole_trace_a_whole_bootstrap_cycle_or_a_sample():
    """A trace is replayed whole, a block bootstrap by one whole cycle (every request of
    the trace it was fitted to, never the first minutes of it), another workload by 3000
    requests."""
    from servetune.schemas.base import document_from_data
    from servetune.schemas.workload import Workload
    from servetune.workloads.fitting import load_workload

    assert default_requests(evenly(500, 1.0)) == 500
    assert default_requests(evenly(MAX_TRACE_REQUESTS + 7, 1.0)) == MAX_TRACE_REQUESTS
    assert default_requests(evenly(500, 1.0), 120) == 120
    assert default_requests(load_workload(WORKLOAD)) == 3000
    assert len(base_sample(evenly(500, 1.0))) == 500
    boot = document_from_data({
        "apiVersion": "servetune/v1", "kind": "Workload", "name": "boot",
        "classes": {"a": {"arrival": {"process": "poisson", "rate_per_s": 0.2},
                          "prompt_tokens": {"quantiles": [0, 1], "values": [100, 600]},
                          "output_tokens": {"quantiles": [0, 1], "values": [1, 6]}}},
        "block_bootstrap": {
            "block_s": 10.0, "stratum_s": 20.0, "span_s": 35.0, "block_counts": [2, 1, 2, 1],
            "offset_s": [1.0, 4.0, 2.0, 3.0, 9.0, 5.0],
            "prompt_tokens": [100, 200, 300, 400, 500, 600],
            "output_tokens": [1, 2, 3, 4, 5, 6]}}, Workload, "boot.yaml")
    assert default_requests(boot) == 6
    assert sorted(base_sample(boot, seed=4).prompt_tokens.tolist()) == [
        100, 200, 300, 400, 500, 600]


def test_judged_sample_lengthens_in_whole_multiples_at_the_same_rate():
    """Worked by hand: 100 requests at 1 req/s; a 60 s window. At scale 1 they span 99 s:
    no change. At scale 3 (3 req/s) they span 33 s: 181 arrivals are needed, so 200 (two
    base samples) are replayed, compressed to the same 3 req/s. A trace that is the
    source itself cannot grow past its length."""
    source = evenly(1000, 1.0)
    sample = source.head(100)
    same, scale = judged_sample(source, sample, 1.0, 60.0)
    assert same is sample and scale == 1.0
    longer, scale = judged_sample(source, sample, 3.0, 60.0)
    assert len(longer) == 200
    assert (len(longer) - 1) / longer.duration_s * scale == pytest.approx(3.0)
    whole, scale = judged_sample(None, sample, 3.0, 60.0)
    assert whole is sample and scale == 3.0


def _load():
    from servetune.profiles.shipped import load_profile
    from servetune.workloads.formats import load_trace

    trace = load_trace(TRACE).head(400)
    return trace, load_profile(PROFILE), load_document(SLO, SLOSet)


@pytest.mark.parametrize("method", ["milp", "grid", "random", "optuna"])
def test_every_method_prints_the_goodput_goodput_reproduces(method):
    """Each method's printed goodput is exactly what `sim.goodput` (the command's
    function, at its defaults) gives for the written policy on the same trace."""
    from servetune.apps.optimize import optimize
    from servetune.sim import goodput

    if method == "optuna":
        pytest.importorskip("optuna")
    trace, profile, slo = _load()
    result = optimize(trace, profile, slo, SPACE, method=method, compare_defaults=False,
                      budget=12, descent_simulations=40)
    again = goodput(trace, result.policy, profile, slo)
    assert result.summary["goodput_rate_per_s"] == again.rate_per_s > 0
    # the policy file keeps 6 significant digits: within half a unit of the last one
    assert result.policy.metadata["simulated"]["goodput_rate_per_s"] == pytest.approx(
        again.rate_per_s, rel=5e-6)
    evaluation = result.summary["evaluation"]
    assert evaluation["requests"] == 400 and evaluation["tolerance"] == 0.01


def test_a_workloads_goodput_is_reproduced_with_its_requests_and_seed():
    from servetune.apps.optimize import optimize
    from servetune.profiles.shipped import load_profile
    from servetune.sim import goodput
    from servetune.workloads.fitting import load_workload

    workload = load_workload(WORKLOAD)
    profile, slo = load_profile(PROFILE), load_document(SLO, SLOSet)
    result = optimize(workload, profile, slo, SPACE, n_requests=300, seed=2,
                      compare_defaults=False, descent_simulations=30)
    again = goodput(workload, result.policy, profile, slo, n_requests=300, seeds=(2,))
    assert result.summary["goodput_rate_per_s"] == again.rate_per_s > 0
    # the evaluator's own search, on the evaluator of the same source, agrees too
    sim = Evaluator.of(workload, profile, slo, seed=2, n_requests=300)
    assert sim.goodput(result.policy).rate_per_s == again.rate_per_s


def test_the_goodput_command_prints_what_optimize_printed(tmp_path):
    trace_file = tmp_path / "trace.csv"
    lines = TRACE.read_text().splitlines()
    trace_file.write_text("\n".join(lines[:401]) + "\n")
    space = tmp_path / "space.yaml"
    space.write_text("apiVersion: servetune/v1\nkind: SearchSpace\nname: tiny\nknobs:\n"
                     "  batching.max_num_seqs: [32, 256]\n"
                     "  batching.max_num_batched_tokens: [1024, 8192]\n")
    policy = tmp_path / "policy.yaml"
    summary = tmp_path / "summary.json"
    res = runner.invoke(app, ["optimize", "--trace", str(trace_file), "--profile",
                              str(PROFILE), "--slo", str(SLO), "--space", str(space), "-o",
                              str(policy), "--json-out", str(summary), "-q"])
    assert res.exit_code == 0, res.output
    printed = json.loads(summary.read_text())["goodput_rate_per_s"]
    res = runner.invoke(app, ["goodput", "--trace", str(trace_file), "--profile",
                              str(PROFILE), "--slo", str(SLO), "--policy", str(policy),
                              "--json", "-q"])
    assert res.exit_code == 0, res.output
    assert math.isclose(json.loads(res.stdout)["rate_per_s"], printed, rel_tol=1e-12)
