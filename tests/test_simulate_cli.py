"""`servetune simulate` and `servetune goodput` through typer's CliRunner."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from servetune.cli import app
from servetune.sim.compile_notice import NOTICE

runner = CliRunner()

POLICY = """\
apiVersion: servetune/v1
kind: Policy
name: small
batching:
  max_num_seqs: 8
  max_num_batched_tokens: 512
"""

PROFILE = """\
apiVersion: servetune/v1
kind: Profile
name: tiny-constant
memory:
  kv_blocks_override: 201
  block_size: 16
step_time:
  constant_s: 0.01
"""

SLO = """\
apiVersion: servetune/v1
kind: SLOSet
name: loose
classes:
  default: {ttft_s: 2.0, tpot_s: 0.05, attainment: 0.9}
"""


def azure_rows(n: int, gap_s: float = 0.25) -> str:
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(n):
        t = i * gap_s
        lines.append(f"2023-11-16 18:00:{int(t):02d}.{int(round((t % 1) * 1e7)):07d},"
                     f"{50 + 37 * i % 200},{5 + 11 * i % 40}")
    return "\n".join(lines) + "\n"


@pytest.fixture
def files(tmp_path):
    paths = {
        "trace": tmp_path / "trace.csv",
        "policy": tmp_path / "policy.yaml",
        "profile": tmp_path / "profile.yaml",
        "slo": tmp_path / "slo.yaml",
    }
    paths["trace"].write_text(azure_rows(40))
    paths["policy"].write_text(POLICY)
    paths["profile"].write_text(PROFILE)
    paths["slo"].write_text(SLO)
    return paths


def base_args(files, source="trace"):
    return ["simulate", f"--{source}", str(files[source]), "--profile", str(files["profile"]),
            "--policy", str(files["policy"])]


def one_error_line(result, code=2):
    assert result.exit_code == code, result.output
    # a cold numba cache adds the compile notice before the first simulation
    lines = [ln for ln in result.output.splitlines() if ln.strip() and NOTICE not in ln]
    assert len(lines) == 1 and lines[0].startswith("servetune: error:"), result.output
    assert "Traceback" not in result.output
    return lines[0]


def test_needs_exactly_one_source(files):
    args = ["simulate", "--profile", str(files["profile"]), "--policy", str(files["policy"])]
    assert "exactly one of --trace" in one_error_line(runner.invoke(app, args))
    both = args + ["--trace", str(files["trace"]), "--workload", str(files["policy"])]
    assert "exactly one of --trace" in one_error_line(runner.invoke(app, both))


def test_missing_file_and_bad_policy(files, tmp_path):
    missing = base_args(files)
    missing[2] = str(tmp_path / "nope.csv")
    assert "nope.csv" in one_error_line(runner.invoke(app, missing))
    files["policy"].write_text(POLICY.replace("max_num_seqs: 8", "max_num_seqs: 0"))
    line = one_error_line(runner.invoke(app, base_args(files)))
    assert "max_num_seqs" in line


@pytest.mark.parametrize("window", ["abc", "5:1", "1"])
def test_bad_timeline_window(files, tmp_path, window):
    args = base_args(files) + ["--timeline", str(tmp_path / "t.json"),
                               "--timeline-window", window]
    assert "--timeline-window" in one_error_line(runner.invoke(app, args))
    assert not (tmp_path / "t.json").exists()


def test_unknown_engine(files):
    line = one_error_line(runner.invoke(app, base_args(files) + ["--engine", "magic"]))
    assert "vllm" in line


def test_simulate_writes_all_outputs(files, tmp_path):
    out = {k: tmp_path / f"out.{k}" for k in ("json", "csv", "jsonl", "trace.json")}
    args = base_args(files) + [
        "--slo", str(files["slo"]), "--json-out", str(out["json"]), "--records", str(out["csv"]),
        "--steps", str(out["jsonl"]), "--timeline", str(out["trace.json"]),
        "--timeline-window", "1:4",
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "TTFT" in result.output and "meets SLO" in result.output
    summary = json.loads(out["json"].read_text())
    assert summary["requests"] == 40
    assert summary["completed"] + summary["shed"] + summary["rejected"] == 40
    assert summary["overall"]["attainment"] is not None
    assert isinstance(summary["per_class"]["default"]["meets_slo"], bool)
    assert len(out["csv"].read_text().splitlines()) == 41
    steps = [json.loads(line) for line in out["jsonl"].read_text().splitlines()]
    assert steps[0]["step"] == 0 and summary["steps"] == sum(s.get("repeat", 1) for s in steps)
    timeline = json.loads(out["trace.json"].read_text())
    slices = [e for e in timeline["traceEvents"] if e["ph"] == "X"]
    assert slices and all(e["ts"] <= 4e6 and e["ts"] + e["dur"] >= 1e6 for e in slices)


def test_requests_and_rate_scale(files, tmp_path):
    out = tmp_path / "s.json"
    args = base_args(files) + ["--requests", "10", "--rate-scale", "2", "--json-out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["requests"] == 10


def test_same_inputs_same_records(files, tmp_path):
    for name in ("a.csv", "b.csv"):
        args = base_args(files) + ["--records", str(tmp_path / name)]
        assert runner.invoke(app, args).exit_code == 0
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()


def test_goodput_command(files, tmp_path):
    out = tmp_path / "g.json"
    args = ["goodput", "--trace", str(files["trace"]), "--profile", str(files["profile"]),
            "--policy", str(files["policy"]), "--slo", str(files["slo"]), "--json-out", str(out),
            "--tolerance", "0.05"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["rate_scale"] > 0
    assert data["rate_per_s"] == pytest.approx(data["rate_scale"] * data["base_rate_per_s"])
    passing = [p["rate_scale"] for p in data["points"] if p["meets_slo"]]
    failing = [p["rate_scale"] for p in data["points"] if not p["meets_slo"]]
    assert data["rate_scale"] == max(passing)
    if data["bracketed"]:
        assert min(failing) <= data["rate_scale"] * 1.05 + 1e-12
    again = tmp_path / "g2.json"
    args[-3] = str(again)
    assert runner.invoke(app, args).exit_code == 0
    assert again.read_bytes() == out.read_bytes()


def test_goodput_needs_slo(files):
    args = ["goodput", "--trace", str(files["trace"]), "--profile", str(files["profile"]),
            "--policy", str(files["policy"])]
    result = runner.invoke(app, args)
    assert result.exit_code == 2


def test_parquet_without_pyarrow_fails_before_writing_anything(files, tmp_path, monkeypatch):
    for module in ("pyarrow", "pyarrow.parquet"):  # as if not installed
        monkeypatch.setitem(sys.modules, module, None)
    out = tmp_path / "out"
    args = base_args(files) + ["--json-out", str(out / "s.json"),
                               "--records", str(out / "r.parquet")]
    assert "pyarrow" in one_error_line(runner.invoke(app, args))
    assert not out.exists()


def two_class_workload(tmp_path):
    import numpy as np

    from servetune.workloads.fitting import fit_workload, save_workload
    from servetune.workloads.trace import from_arrays

    rng = np.random.default_rng(0)
    n = 300
    trace = from_arrays(np.cumsum(rng.exponential(0.2, n)), rng.integers(20, 300, n),
                        rng.integers(2, 60, n))
    path = tmp_path / "w.yaml"
    save_workload(fit_workload(trace, split="bands", bands=2, name="two"), path)
    return path


def test_simulate_a_workload_with_progress(files, tmp_path, monkeypatch):
    from servetune.cli import simulate_cmd

    monkeypatch.setattr(simulate_cmd, "PROGRESS_MIN_REQUESTS", 10)
    files["workload"] = two_class_workload(tmp_path)
    out = tmp_path / "s.json"
    args = base_args(files, "workload") + ["--requests", "200", "--seed", "4",
                                           "--json-out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())
    assert summary["requests"] == 200
    assert len(summary["per_class"]) == 2
    assert "per class" in result.output
    assert sum(c["requests"] for c in summary["per_class"].values()) == 200


# ---- regressions found in QA ---------------------------------------------------------


def test_generic_csv_trace_with_a_column_mapping(files, tmp_path):
    generic = tmp_path / "generic.csv"
    generic.write_text("t,in,out,prio,kind,cap\n0,100,10,1,chat,5\n0.5,200,20,0,batch,50\n")
    records = tmp_path / "r.csv"
    args = base_args(files) + ["--records", str(records)]
    args[2] = str(generic)
    assert "--columns" in one_error_line(runner.invoke(app, args))
    mapping = "arrival=t,prompt=in,output=out,priority=prio,class=kind,max_tokens=cap"
    result = runner.invoke(app, args + ["--columns", mapping])
    assert result.exit_code == 0, result.output
    rows = records.read_text().splitlines()[1:]
    assert [row.split(",")[1] for row in rows] == ["chat", "batch"]
    assert [row.split(",")[7] for row in rows] == ["5", "20"]  # output capped by max_tokens
    workload_args = base_args(files) + ["--columns", mapping]
    workload_args[1:3] = ["--workload", str(tmp_path / "any.yaml")]
    assert "--trace only" in one_error_line(runner.invoke(app, workload_args))


@pytest.mark.parametrize("bad", ["steps-dir", "timeline-unwritable", "same-file"])
def test_an_output_error_leaves_no_output_behind(files, tmp_path, bad):
    out_json, records = tmp_path / "s.json", tmp_path / "r.csv"
    args = base_args(files) + ["--json-out", str(out_json), "--records", str(records)]
    if bad == "steps-dir":
        (tmp_path / "d").mkdir()
        args += ["--steps", str(tmp_path / "d")]
    elif bad == "timeline-unwritable":
        (tmp_path / "f").write_text("a file, not a folder")
        args += ["--timeline", str(tmp_path / "f" / "t.json")]
    else:
        args += ["--steps", str(out_json)]
    one_error_line(runner.invoke(app, args))
    assert not out_json.exists() and not records.exists()


def test_a_timeline_window_after_the_run_says_so(files, tmp_path):
    args = base_args(files) + ["--timeline", str(tmp_path / "t.json"),
                               "--timeline-window", "5000:6000"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "after the run ended" in result.stderr
