"""The comparison report and the nightly decision rule, on hand-built simulation results
whose every metric is known (TTFT, TPOT, attainment worked by hand)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import output_names

from servetune.apps.nightly import decide, same_knobs
from servetune.apps.report import (
    Comparison,
    PolicyEvaluation,
    Verdict,
    build_report,
    knob_changes,
    write_report,
)
from servetune.schemas.policy import Policy
from servetune.schemas.slo import SLOSet
from servetune.sim import SimResult
from servetune.sim.goodput import GoodputResult
from servetune.workloads.trace import from_arrays

ARRIVALS = np.array([0.0, 1.0, 2.0, 3.0])
OUTPUT_TOKENS = np.array([11, 11, 11, 11])
SLO = SLOSet.model_validate({
    "apiVersion": "servetune/v1", "kind": "SLOSet", "name": "hand",
    "classes": {"default": {"ttft_s": 1.0, "tpot_s": 0.1, "attainment": 0.9}},
})


def trace():
    return from_arrays(ARRIVALS, np.array([100, 200, 300, 400]), OUTPUT_TOKENS)


def run(ttft: list[float], tpot: float = 0.05, status=(0, 0, 0, 0), tr=None) -> SimResult:
    """A finished run: request i's first token at arrival + ttft[i], then 10 more tokens
    every ``tpot`` seconds."""
    ttft_a = np.array(ttft, dtype=float)
    first = ARRIVALS + ttft_a
    finish = first + (OUTPUT_TOKENS - 1) * tpot
    st = np.array(status, dtype=np.int8)
    first = np.where(st == 0, first, np.nan)
    finish = np.where(st == 0, finish, np.nan)
    t = np.linspace(0.0, 4.0, 5)
    output = SimpleNamespace(
        admitted_s=ARRIVALS.copy(), first_token_s=first, finish_s=finish,
        preemptions=np.zeros(4, dtype=np.int32), status=st,
        reason=np.zeros(4, dtype=np.int8), steps=40, kv_blocks_total=100,
        kv_util_mean=0.25, kv_util_peak=0.5,
        series={"t_s": t, "kv_util": t / 8.0, "waiting": np.array([0, 1, 0, 1, 0]),
                "running": np.array([1, 1, 2, 1, 0])},
    )
    return SimResult(trace=tr if tr is not None else trace(), output=output)


def gp(rate: float, points: list[tuple[float, bool, float]]) -> GoodputResult:
    base = 1.0
    return GoodputResult(
        rate_scale=rate / base, rate_per_s=rate, base_rate_per_s=base,
        points=[{"rate_scale": r / base, "rate_per_s": r, "meets_slo": ok, "attainment": a}
                for r, ok, a in points],
    )


def policy(name: str, **batching) -> Policy:
    return Policy.model_validate({"apiVersion": "servetune/v1", "kind": "Policy", "name": name,
                                  "batching": batching})


CURRENT = policy("current-pol", max_num_seqs=1024, max_num_batched_tokens=8192)
NEW = policy("new-pol", max_num_seqs=128, max_num_batched_tokens=2048)


def comparison(new_gp: float = 2.0, new_stress_ttft: float = 0.2) -> Comparison:
    cur = PolicyEvaluation(
        "current", CURRENT,
        {1.0: run([0.5] * 4), 1.2: run([0.6] * 4), 1.5: run([0.9, 0.9, 0.9, 1.5])},
        gp(1.0, [(1.0, True, 1.0), (2.0, False, 0.75), (1.4, False, 0.8)]),
    )
    new = PolicyEvaluation(
        "new", NEW,
        {1.0: run([0.2] * 4, tpot=0.04), 1.2: run([0.25] * 4),
         1.5: run([new_stress_ttft] * 4)},
        gp(new_gp, [(1.0, True, 1.0), (2.0, True, 1.0), (4.0, False, 0.5)]),
    )
    return Comparison(trace=trace(), slo=SLO, profile_name="hand-profile", engine="vllm",
                      scales=(1.0, 1.2, 1.5), current=cur, new=new)


# --- knob changes ----------------------------------------------------------------------------

def test_knob_changes_with_reasons():
    changes = knob_changes(CURRENT, NEW, {"batching.max_num_seqs": "tpot[default] binds"})
    assert changes == [
        {"knob": "batching.max_num_seqs", "current": 1024, "new": 128,
         "reason": "tpot[default] binds"},
        {"knob": "batching.max_num_batched_tokens", "current": 8192, "new": 2048, "reason": ""},
    ]
    assert knob_changes(CURRENT, CURRENT) == []


def test_knob_changes_section_reason_and_class_priority():
    a = Policy(classes={"chat": {"priority": 0}})
    b = Policy(long_requests={"threshold_tokens": 4096}, classes={"chat": {"priority": 1}})
    changes = knob_changes(a, b, {"long_requests": "lane keeps short TTFT"})
    assert changes[0]["knob"] == "long_requests.threshold_tokens"
    assert changes[0]["reason"] == "lane keeps short TTFT"
    assert changes[1] == {"knob": "classes.chat.priority", "current": 0, "new": 1, "reason": ""}


# --- the decision rule -----------------------------------------------------------------------

def test_decide_writes_when_better_and_no_worse_under_stress():
    d = decide(comparison(new_gp=2.0), 0.02)
    assert d.write_new and d.gain == pytest.approx(1.0)


def test_decide_keeps_below_margin():
    d = decide(comparison(new_gp=1.01), 0.02)  # +1% < 2%
    assert not d.write_new and d.gain == pytest.approx(0.01)
    assert any("below the required gain" in r for r in d.reasons)
    assert decide(comparison(new_gp=1.01), 0.0).write_new  # no margin: +1% suffices


def test_decide_keeps_when_stress_attainment_drops():
    # current at 1.5x: 3 of 4 meet TTFT <= 1 s (0.75); new with TTFT 1.2 s: 0 of 4
    d = decide(comparison(new_gp=2.0, new_stress_ttft=1.2), 0.02)
    assert not d.write_new
    assert any("+50% rate would drop from 0.7500 to 0.0000" in r for r in d.reasons)


def test_decide_keeps_identical_policy():
    comp = comparison()
    comp.new.policy = CURRENT.model_copy(update={"name": "renamed", "metadata": {"x": 1}})
    assert same_knobs(comp.current.policy, comp.new.policy)
    assert not decide(comp, 0.0).write_new


# --- the report ------------------------------------------------------------------------------

def test_report_contents_by_hand(tmp_path):
    comp = comparison()
    files = build_report(comp, Verdict("New policy written.", ["goodput doubled"]),
                         reasons={"batching.max_num_seqs": "TPOT limit binds"},
                         inputs={"trace": "t.csv"})
    md = files.markdown
    assert md.startswith("# servetune policy report\n")
    assert "**New policy written.**" in md and "- goodput doubled" in md
    assert "| Goodput (highest rate meeting the SLOs) | 1.00 req/s | 2.00 req/s |" in md
    # TTFT 0.5 s vs 0.2 s for every request; TPOT 50 ms vs 40 ms
    assert "| TTFT p50 / p99 at trace rate | 500 ms / 500 ms | 200 ms / 200 ms |" in md
    assert "| TPOT p50 / p99 at trace rate | 50 ms / 50 ms | 40 ms / 40 ms |" in md
    # at +50%: current 3 of 4 within TTFT 1 s (0.75 < 0.9 target: misses), new all
    assert "| SLO attainment at +50% rate (1.5x) | 0.75 (misses) | 1 (meets) |" in md
    assert "| `batching.max_num_seqs` | 1024 | 128 | TPOT limit binds |" in md
    assert "| `batching.max_num_batched_tokens` | 8192 | 2048 | no binding" in md
    for name in files.figures:
        assert f"]({name})" in md
        assert files.figures[name].startswith(b"\x89PNG\r\n\x1a\n")
    s = files.summary
    assert s["current"]["goodput_rate_per_s"] == 1.0 and s["new"]["goodput_rate_per_s"] == 2.0
    assert s["current"]["runs"]["1.5x"]["overall"]["attainment"] == 0.75
    assert "sim_wall_s" not in s["new"]["runs"]["1x"]
    written = write_report(files, tmp_path / "out")
    assert output_names(tmp_path / "out") == sorted(
        [*files.figures, "report.md", "summary.json"])
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == s
    assert len(written) == len(files.figures) + 2


def test_report_is_deterministic():
    a = build_report(comparison(), Verdict("v"))
    b = build_report(comparison(), Verdict("v"))
    assert a.markdown == b.markdown
    assert a.figures == b.figures
    assert a.summary == b.summary


def test_report_handles_shed_requests_and_missing_series():
    comp = comparison()
    shed = run([0.5] * 4, status=(0, 1, 0, 1))
    shed.output.series = {}
    comp.current.runs[1.0] = shed
    files = build_report(comp, Verdict("v"))
    assert files.summary["current"]["runs"]["1x"]["shed"] == 2
    assert files.summary["current"]["runs"]["1x"]["overall"]["attainment"] == 0.5
    assert files.figures["kv_queue.png"].startswith(b"\x89PNG")


def test_report_with_capacity_runs():
    comp = comparison()
    comp.capacity_scale = 2.0
    comp.current.runs[2.0] = run([0.9, 1.2, 1.5, 0.4])
    comp.new.runs[2.0] = run([0.3] * 4)
    files = build_report(comp, Verdict("v"))
    assert files.summary["current"]["runs"]["2x"]["overall"]["attainment"] == 0.5
    assert files.summary["new"]["runs"]["2x"]["overall"]["attainment"] == 1.0
    # two columns of panels: wider than the one-column figure
    one = build_report(comparison(), Verdict("v")).figures["kv_queue.png"]
    assert files.figures["kv_queue.png"] != one


def test_report_of_the_current_policy_alone():
    comp = comparison()
    comp.new = None
    files = build_report(comp, Verdict("Infeasible."))
    md = files.markdown
    assert "| | current: `current-pol` |\n|---|---|\n" in md
    assert "| TTFT p50 / p99 at trace rate | 500 ms / 500 ms |" in md
    assert "## What changed" not in md and "no new policy to compare" in md
    assert "new" not in files.summary and files.summary["changes"] == []
    assert set(files.figures) == {"ttft_cdf.png", "tpot_cdf.png", "kv_queue.png",
                                  "goodput.png"}


def test_per_class_rows_for_a_two_class_trace():
    tr = from_arrays(ARRIVALS, np.array([100, 200, 300, 400]), OUTPUT_TOKENS,
                     class_id=np.array([0, 1, 0, 1], dtype=np.int32),
                     class_names=("chat", "batch"))
    comp = comparison()
    comp.trace = tr
    # chat (requests 0 and 2) within TTFT 1 s, batch (1 and 3) not, for the current policy
    for scale in (1.0, 1.2, 1.5):
        comp.current.runs[scale] = run([0.5, 1.5, 0.5, 1.5], tr=tr)
        comp.new.runs[scale] = run([0.2] * 4, tr=tr)
    md = build_report(comp, Verdict("v")).markdown
    assert "Per request class:" in md
    assert ("| `chat` | TTFT <= 1 s, TPOT <= 0.1 s (0.9 of requests) | attainment 1, p99 TTFT "
            "500 ms, p99 TPOT 50 ms | attainment 1, p99 TTFT 200 ms") in md
    assert ("| `batch` | TTFT <= 1 s, TPOT <= 0.1 s (0.9 of requests) | attainment 0, p99 "
            "TTFT 1.5 s") in md


def test_log_axis_labels_every_part_of_a_goodput_range():
    """The goodput search often spans 5-45 req/s; with 1-2-5 ticks nothing past 20 was
    labelled, so the points at 25-45 req/s could not be read off the plot."""
    from servetune.apps.report import _plain_log_axis, pyplot

    plt = pyplot()
    fig, ax = plt.subplots()
    ax.plot([5.4, 45.0], [1.0, 0.1])
    _plain_log_axis(ax)
    fig.canvas.draw()
    lo, hi = ax.get_xlim()
    labels = {t.get_text() for t in ax.get_xticklabels()
              if t.get_text() and lo <= t.get_position()[0] <= hi}
    plt.close(fig)
    assert {"10", "20", "30"} <= labels
