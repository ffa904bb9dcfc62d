"""``servetune profile fit | check | show | measure | derive`` through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from servetune.cli import app
from servetune.profiles.shipped import SHIPPED_DIR, load_profile

runner = CliRunner()
REPO = Path(__file__).resolve().parents[1]
CALIB = REPO / "gpu_profiles" / "calibration" / "h200"
STEPS = CALIB / "step_graph_llama-3.1-8b.csv"


def _need_calibration() -> None:
    if not STEPS.is_file():
        pytest.skip("shipped calibration CSVs absent")


def test_check_json_shape():
    _need_calibration()
    res = runner.invoke(app, ["profile", "check", "--profile",
                              str(SHIPPED_DIR / "h200-llama-3.1-8b.yaml"),
                              "--measured", str(STEPS), "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert set(data) == {"rows", "median_abs_pct_error", "max_abs_pct_error", "per_row"}
    assert data["rows"] == len(data["per_row"]) == 35
    row = data["per_row"][0]
    for key in ("decode_seqs", "context", "prefill_tokens", "measured_ms", "predicted_ms",
                "error_pct"):
        assert key in row
    assert row["measured_ms"] == pytest.approx(5.1148)
    errors = sorted(abs(r["error_pct"]) for r in data["per_row"])
    assert data["max_abs_pct_error"] == pytest.approx(errors[-1], abs=0.01)
    assert data["median_abs_pct_error"] <= 5.0 and data["max_abs_pct_error"] <= 15.0


def test_check_table_output():
    _need_calibration()
    res = runner.invoke(app, ["profile", "check", "--profile", "h200-llama-3.1-8b",
                              "--measured", str(STEPS)])
    assert res.exit_code == 0, res.output
    assert "35 rows: median abs error" in res.output
    assert "predicted_ms" in res.output


def test_fit_writes_a_profile_that_check_accepts(tmp_path):
    _need_calibration()
    out = tmp_path / "p.yaml"
    res = runner.invoke(app, ["profile", "fit", "--measurements", str(CALIB),
                              "--model", "llama-3.1-8b", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "whole steps: median" in res.output
    p = load_profile(out)
    assert p.calibration.kind == "measured"
    assert {Path(f.path).name for f in p.calibration.files} >= {"linear.csv",
                                                                "step_graph_llama-3.1-8b.csv"}
    # fitting twice gives the same bytes
    out2 = tmp_path / "p2.yaml"
    runner.invoke(app, ["profile", "fit", "--measurements", str(CALIB),
                        "--model", "llama-3.1-8b", "-o", str(out2)])
    assert out.read_bytes() == out2.read_bytes()


def test_fit_missing_column_exits_2_without_output(tmp_path):
    _need_calibration()
    d = tmp_path / "m"
    d.mkdir()
    for f in CALIB.glob("*.csv"):
        (d / f.name).write_text(f.read_text())
    (d / "lm_head.csv").write_text("model,rows,ms\nllama-3.1-8b,1,0.3\n")
    out = tmp_path / "p.yaml"
    res = runner.invoke(app, ["profile", "fit", "--measurements", str(d), "--model",
                              "llama-3.1-8b", "-o", str(out), "--gpu", "h200"])
    assert res.exit_code == 2
    assert "lm_head.csv: missing column 'tokens'" in res.output
    assert "Traceback" not in res.output
    assert not out.exists()


def test_check_bad_csv_is_one_line(tmp_path):
    bad = tmp_path / "steps.csv"
    bad.write_text("model,decode_seqs,context,prefill_tokens,graph_ms\n"
                   "llama-3.1-8b,8,512,0,abc\n")
    res = runner.invoke(app, ["profile", "check", "--profile", "h200-llama-3.1-8b",
                              "--measured", str(bad)])
    assert res.exit_code == 2
    assert "steps.csv: line 2, column 'graph_ms': expected a number" in res.output


def test_show_prints_memory_pool_and_steps():
    res = runner.invoke(app, ["profile", "show", "h200-llama-3.1-8b"])
    assert res.exit_code == 0, res.output
    p = load_profile("h200-llama-3.1-8b")
    assert f"{p.kv_blocks():,} usable blocks" in res.output
    assert "131,072 B/token" in res.output
    assert "prefill 2048" in res.output
    res = runner.invoke(app, ["profile", "show", "h200-llama-3.1-8b", "--json"])
    data = json.loads(res.stdout)
    assert data["memory"]["kv_blocks"] == p.kv_blocks()
    assert len(data["steps"]) >= 6


def test_show_constant_profile(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("apiVersion: servetune/v1\nkind: Profile\nname: c\nmemory:\n"
                 "  kv_blocks_override: 101\nstep_time:\n  constant_s: 0.02\n")
    res = runner.invoke(app, ["profile", "show", str(f)])
    assert res.exit_code == 0, res.output
    assert "100 usable blocks" in res.output and "constant 20.000 ms" in res.output


def test_measure_without_cuda_exits_2(tmp_path):
    res = runner.invoke(app, ["profile", "measure", "-o", str(tmp_path / "out")])
    assert res.exit_code == 2
    assert "CUDA" in res.output
    assert not (tmp_path / "out").exists()


def test_derive_writes_a_derived_profile(tmp_path):
    _need_calibration()
    out = tmp_path / "d.yaml"
    res = runner.invoke(app, ["profile", "derive", "--measurements", str(CALIB), "--model",
                              "llama-3.1-70b", "--gpu", "h100-80gb", "--tp", "8", "-o",
                              str(out)])
    assert res.exit_code == 0, res.output
    p = load_profile(out)
    assert p.calibration.kind == "derived" and p.tensor_parallel == 8
    assert p.step_time.allreduce_s_per_token > 0
    assert any("H100" in s or "h100" in s for s in [p.calibration.source])


# ---- regressions found in QA ---------------------------------------------------------


def test_derive_refuses_a_model_that_does_not_fit_the_gpu(tmp_path):
    # Llama-3.1-70B in bf16 (~131 GiB of weights) on one 48 GB L40S leaves no KV cache:
    # vLLM would not start, so no profile is written.
    _need_calibration()
    out = tmp_path / "d.yaml"
    res = runner.invoke(app, ["profile", "derive", "--measurements", str(CALIB), "--model",
                              "llama-3.1-70b", "--gpu", "l40s", "-o", str(out)])
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "leaves no KV cache" in lines[0] and "tensor parallelism" in lines[0]
    assert not out.exists()


def test_simulate_names_the_profile_that_leaves_no_kv_cache(tmp_path):
    text = (SHIPPED_DIR / "h200-llama-3.1-8b.yaml").read_text()
    prof = tmp_path / "tiny-util.yaml"
    prof.write_text(text.replace("gpu_memory_utilization: 0.92", "gpu_memory_utilization: 0.05"))
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,10,2\n")
    policy = REPO / "configs" / "policies" / "vllm-serve-defaults.yaml"
    res = runner.invoke(app, ["simulate", "--trace", str(trace), "--profile", str(prof),
                              "--policy", str(policy)])
    assert res.exit_code == 2, res.output
    assert "tiny-util.yaml" in res.output and "leaves no KV cache" in res.output


@pytest.mark.parametrize("command", ["fit", "derive", "check", "show", "measure"])
def test_every_profile_command_help_has_an_example(command):
    res = runner.invoke(app, ["profile", command, "--help"])
    assert res.exit_code == 0 and "Example: servetune profile" in res.output
