"""SimResult's summary JSON and per-request records, on a hand-made engine output."""

from __future__ import annotations

import csv
import io
import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from servetune.errors import ServetuneError
from servetune.schemas.slo import SLOSet
from servetune.sim import SimResult, prepare_trace
from servetune.sim.records import COLUMNS, record_columns, records_csv
from servetune.workloads.trace import from_arrays

NAN = float("nan")


def hand_made():
    trace = from_arrays(
        np.array([0.0, 1.0, 2.0, 3.0, 4.0]), np.array([10, 20, 30, 40, 50_000]),
        np.array([5, 1, 7, 3, 2]),
        class_id=np.array([0, 0, 1, 1, 1], dtype=np.int32), class_names=("chat", "batch"),
    )
    output = SimpleNamespace(
        admitted_s=np.array([0.5, 1.0, NAN, 4.0, NAN]),
        first_token_s=np.array([1.0, 1.5, NAN, 5.0, NAN]),
        finish_s=np.array([3.0, 1.5, NAN, 9.0, NAN]),
        preemptions=np.array([0, 0, 0, 2, 0], dtype=np.int32),
        status=np.array([0, 0, 1, 0, 2], dtype=np.int8),
        reason=np.array([0, 0, 1, 0, 2], dtype=np.int8),
        steps=42, kv_blocks_total=100, kv_util_mean=0.25, kv_util_peak=0.75, sim_end_s=9.0,
        series={}, step_log=None,
    )
    return SimResult(trace=trace, output=output, sim_wall_s=0.01)


def test_summary_has_its_documented_shape_and_hand_values():
    r = hand_made()
    slo = SLOSet(classes={"default": {"ttft_s": 1.5, "tpot_s": 1.0, "attainment": 0.5}})
    s = r.summary(slo)
    assert list(s) == ["requests", "completed", "shed", "rejected", "steps", "sim_wall_s",
                       "overall", "per_class", "kv", "preemptions"]
    assert (s["requests"], s["completed"], s["shed"], s["rejected"]) == (5, 3, 1, 1)
    assert s["steps"] == 42 and s["preemptions"] == 2
    assert s["kv"] == {"mean_util": 0.25, "peak_util": 0.75}
    o = s["overall"]
    assert list(o) == ["ttft_s", "tpot_s", "e2e_s", "throughput_tok_s", "throughput_req_s",
                       "attainment", "value_served_per_s"]
    assert list(o["ttft_s"]) == ["mean", "p50", "p90", "p99"]
    assert o["ttft_s"]["p50"] == pytest.approx(1.0)
    assert o["tpot_s"]["mean"] == pytest.approx(1.25)
    assert o["e2e_s"]["mean"] == pytest.approx((3 + 0.5 + 6) / 3)
    assert o["throughput_tok_s"] == pytest.approx(9 / 9)
    assert o["attainment"] == pytest.approx(0.4)
    assert set(s["per_class"]) == {"chat", "batch"}
    chat, batch = s["per_class"]["chat"], s["per_class"]["batch"]
    assert chat["attainment"] == 1.0 and chat["meets_slo"] is True
    assert (batch["requests"], batch["shed"], batch["rejected"], batch["preemptions"]) == (
        3, 1, 1, 2)
    assert batch["meets_slo"] is False
    assert not r.meets_slo(slo)
    # JSON-able without NaN; no SLO means null attainment.
    json.dumps(s, allow_nan=False)
    assert r.summary()["overall"]["attainment"] is None
    assert "meets_slo" not in r.summary()["per_class"]["chat"]


def test_records_csv_round_trips_exactly():
    r = hand_made()
    cols = record_columns(r.trace, r.output, ("", "queue full", "prompt larger than KV pool"))
    text = records_csv(cols).decode()
    rows = list(csv.DictReader(io.StringIO(text)))
    assert tuple(rows[0]) == COLUMNS and len(rows) == 5
    assert rows[0]["class"] == "chat" and rows[3]["class"] == "batch"
    assert [row["status"] for row in rows] == ["completed", "completed", "shed", "completed",
                                               "rejected"]
    assert rows[2]["reason"] == "queue full" and rows[4]["reason"] == "prompt larger than KV pool"
    assert rows[0]["reason"] == ""
    assert rows[2]["finish_s"] == "" and rows[2]["ttft_s"] == ""
    assert float(rows[3]["tpot_s"]) == 2.0 and rows[1]["tpot_s"] == ""
    assert int(rows[3]["preemptions"]) == 2
    back = np.array([float(row["arrival_s"]) for row in rows])
    assert np.array_equal(back, r.trace.arrival_s)
    assert records_csv(cols) == text.encode()


def test_write_records_csv_and_parquet(tmp_path):
    r = hand_made()
    r.write_records(tmp_path / "r.csv")
    assert (tmp_path / "r.csv").read_text().startswith("request_id,class,arrival_s")
    pq = pytest.importorskip("pyarrow.parquet")
    r.write_records(tmp_path / "r.parquet")
    table = pq.read_table(tmp_path / "r.parquet")
    assert table.num_rows == 5 and table.column_names == list(COLUMNS)


def test_parquet_records_without_pyarrow_fail_and_write_nothing(tmp_path, monkeypatch):
    for module in ("pyarrow", "pyarrow.parquet"):  # as if not installed
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ServetuneError, match="pyarrow"):
        hand_made().write_records(tmp_path / "r.parquet")
    assert not (tmp_path / "r.parquet").exists()


def test_step_log_needed_for_steps_and_timeline(tmp_path):
    r = hand_made()
    with pytest.raises(ServetuneError, match="step_log=True"):
        r.write_steps(tmp_path / "s.jsonl")


def test_prepare_trace_replay_options():
    trace = from_arrays(np.arange(10.0), np.full(10, 5), np.full(10, 2))
    assert len(prepare_trace(trace, n_requests=4)) == 4
    scaled = prepare_trace(trace, rate_scale=2.0)
    assert scaled.arrival_s[-1] == 4.5
    # duration_s cuts in simulated (scaled) seconds: arrivals 0, 0.5, ..., 2.5 < 3.
    assert len(prepare_trace(trace, rate_scale=2.0, duration_s=3.0)) == 6
    assert len(prepare_trace(trace, n_requests=3, rate_scale=0.5, duration_s=100)) == 3
    for bad in ({"rate_scale": 0}, {"rate_scale": float("nan")}, {"rate_scale": 1e300},
                {"rate_scale": 1e-300}, {"n_requests": 0}, {"duration_s": -1.0}):
        with pytest.raises(ServetuneError):
            prepare_trace(trace, **bad)
    with pytest.raises(ServetuneError, match="Trace or a Workload"):
        prepare_trace("trace.csv")


def test_public_api_reexports_the_engine():
    from servetune.sim import (
        GoodputResult,
        SimResult,
        engine,
        goodput,
        run_engine,
        simulate,
    )

    assert run_engine is engine.run_engine
    assert callable(simulate) and callable(goodput)
    assert SimResult and GoodputResult


def test_tpot_and_throughput_count_the_tokens_max_tokens_lets_out():
    # Request 0 has 10 output tokens in the trace but max_tokens 5: the engine stops
    # after 5, so its TPOT is (e2e - TTFT) / 4 and it adds 5 tokens to the throughput.
    trace = from_arrays(np.array([0.0, 0.0]), np.array([10, 10]), np.array([10, 3]),
                        max_tokens=np.array([5, 8]))
    output = SimpleNamespace(
        admitted_s=np.array([0.0, 0.0]), first_token_s=np.array([1.0, 1.0]),
        finish_s=np.array([5.0, 3.0]), preemptions=np.array([0, 0], dtype=np.int32),
        status=np.array([0, 0], dtype=np.int8), reason=np.array([0, 0], dtype=np.int8),
        steps=5, kv_blocks_total=10, kv_util_mean=0.1, kv_util_peak=0.2, sim_end_s=5.0,
        series={}, step_log=None,
    )
    r = SimResult(trace=trace, output=output, sim_wall_s=0.0)
    assert r.metrics.tpot_s.tolist() == [1.0, 1.0]
    assert r.summary()["overall"]["throughput_tok_s"] == pytest.approx(8 / 5)
    rows = list(csv.DictReader(io.StringIO(records_csv(
        record_columns(r.trace, r.output, ())).decode())))
    assert [row["output_tokens"] for row in rows] == ["5", "3"]
    assert [float(row["tpot_s"]) for row in rows] == [1.0, 1.0]
