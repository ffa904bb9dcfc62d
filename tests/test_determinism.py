"""Budgets are work, not wall time: a slower machine (or a cold numba cache) gives the
same policy bytes, and the wall-clock safety stop, when it fires, is recorded in
``metadata.stopped_by`` and makes ``nightly`` keep the current policy (exit 10).

A slow machine is faked: ``time.perf_counter`` (which every budget check reads) runs
ahead of the real clock, so each simulation appears 10x slower plus a fixed number of
seconds; the simulations themselves are the real ones on small samples."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from test_nightly import POOR, SPACE  # the nightly tests' tiny space and poor policy
from typer.testing import CliRunner

from servetune.cli import app
from servetune.sim.evaluator import Evaluator

REPO = Path(__file__).resolve().parents[1]
WORKLOAD = REPO / "configs" / "workloads" / "azure-conv-2023.yaml"
TRACE = REPO / "configs" / "examples" / "azure-conv-synthetic.csv"
PROFILE = REPO / "gpu_profiles" / "h200-llama-3.1-8b.yaml"
SLO = REPO / "configs" / "slos" / "mlperf-llama-3.1-8b-server.yaml"

pytestmark = pytest.mark.skipif(
    not all(p.exists() for p in (WORKLOAD, TRACE, PROFILE, SLO)),
    reason="shipped workload/trace/profile/SLO files not present",
)

runner = CliRunner()


def slow_down(monkeypatch, *, factor: float = 10.0, extra_s: float = 5.0) -> None:
    """Make every optimizer simulation appear ``factor`` times slower plus ``extra_s``
    seconds to every clock reading the budgets take (a slow machine, in effect)."""
    real = time.perf_counter
    offset = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + offset[0])
    run = Evaluator.run

    def slow_run(self, policy, rate_scale):
        t0 = real()
        out = run(self, policy, rate_scale)
        offset[0] += (factor - 1.0) * (real() - t0) + extra_s
        return out

    monkeypatch.setattr(Evaluator, "run", slow_run)


def _optimize_args(tmp_path: Path, out: str, *extra: str) -> list[str]:
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    return ["optimize", "--workload", str(WORKLOAD), "--profile", str(PROFILE), "--slo",
            str(SLO), "--space", str(space), "--requests", "300", "--quiet", "-o",
            str(tmp_path / out), *extra]


def _metadata(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["metadata"]


@pytest.mark.parametrize("method", ["milp", "grid"])
def test_slow_machine_gives_byte_identical_policy(tmp_path, monkeypatch, method):
    fast = runner.invoke(app, _optimize_args(tmp_path, "fast.yaml", "--method", method))
    assert fast.exit_code == 0, fast.output
    with monkeypatch.context() as m:
        slow_down(m)
        # 5 s more per simulation: the old 60 s wall budget would have cut this search.
        slow = runner.invoke(app, _optimize_args(tmp_path, "slow.yaml", "--method", method,
                                                 "--json-out", str(tmp_path / "slow.json")))
    assert slow.exit_code == 0, slow.output
    summary = json.loads((tmp_path / "slow.json").read_text())
    assert summary["wall_s"] > 60  # it did look slow to the budget checks
    assert (tmp_path / "slow.yaml").read_bytes() == (tmp_path / "fast.yaml").read_bytes()
    assert _metadata(tmp_path / "fast.yaml")["stopped_by"] == (
        "converged" if method == "milp" else "exhausted")


def test_simulation_budget_stops_the_search_deterministically(tmp_path, monkeypatch):
    a = runner.invoke(app, _optimize_args(tmp_path, "a.yaml", "--max-simulations", "3"))
    assert a.exit_code == 0, a.output
    with monkeypatch.context() as m:
        slow_down(m)
        b = runner.invoke(app, _optimize_args(tmp_path, "b.yaml", "--max-simulations", "3"))
    assert b.exit_code == 0, b.output
    assert (tmp_path / "a.yaml").read_bytes() == (tmp_path / "b.yaml").read_bytes()
    assert _metadata(tmp_path / "a.yaml")["stopped_by"] == "simulation_budget"


def test_safety_stop_is_recorded_in_the_policy(tmp_path, monkeypatch):
    slow_down(monkeypatch)
    res = runner.invoke(app, _optimize_args(tmp_path, "p.yaml", "--time-limit", "20",
                                            "--json-out", str(tmp_path / "p.json")))
    assert res.exit_code == 0, res.output
    assert _metadata(tmp_path / "p.yaml")["stopped_by"] == "time_limit"
    summary = json.loads((tmp_path / "p.json").read_text())
    assert summary["stopped_by"] == "time_limit"
    assert any("safety time limit" in w for w in summary["warnings"])


@pytest.fixture
def tiny(tmp_path):
    lines = TRACE.read_text().splitlines()
    (tmp_path / "trace.csv").write_text("\n".join(lines[:401]) + "\n")  # header + 400
    (tmp_path / "space.yaml").write_text(SPACE)
    (tmp_path / "poor.yaml").write_text(POOR)
    return tmp_path


def _nightly_args(d: Path, out: Path, *extra: str) -> list[str]:
    return ["nightly", "--trace", str(d / "trace.csv"), "--profile", str(PROFILE),
            "--slo", str(SLO), "--current", str(d / "poor.yaml"), "--out-dir", str(out),
            "--space", str(d / "space.yaml"), "--engines", "vllm", *extra]


def test_nightly_keeps_the_current_policy_when_the_safety_stop_fires(tiny, monkeypatch):
    slow_down(monkeypatch)
    out = tiny / "out"
    res = runner.invoke(app, _nightly_args(tiny, out, "--time-limit", "20"))
    # Without the slow-down this run writes a new policy (tests/test_nightly.py).
    assert res.exit_code == 10, res.output
    assert not (out / "policy.yaml").exists() and not (out / "vllm.yaml").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "current_kept" and summary["kept_because"] == "time_limit"
    assert summary["optimizer"]["stopped_by"] == "time_limit"
    report = (out / "report.md").read_text()
    assert "safety time limit" in report and "safety stop" in report
