"""No command writes over one of its own inputs, a device node or through a link's name:
every output path is checked against the run's inputs before any work (io.check_outputs)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from servetune.cli import app
from servetune.errors import ServetuneError
from servetune.io import check_outputs, commit_files, write_text_atomic

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "configs" / "examples" / "azure-conv-synthetic.csv"
POLICY = REPO / "configs" / "policies" / "vllm-serve-defaults.yaml"
PROFILE = REPO / "gpu_profiles" / "h200-llama-3.1-8b.yaml"
SLO = REPO / "configs" / "slos" / "mlperf-llama-3.1-8b-server.yaml"
WORKLOAD = REPO / "configs" / "workloads" / "azure-conv-2023.yaml"
FORECAST = REPO / "configs" / "forecasts" / "azure-conv-diurnal-100.yaml"
FLEET = REPO / "configs" / "fleets" / "cloud-4types.yaml"
JOBS = REPO / "configs" / "batch_jobs" / "nightly.yaml"

runner = CliRunner()


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """Copies of the inputs in a scratch folder (the test may try to overwrite them)."""
    out = {}
    for key, src in (("trace", TRACE), ("policy", POLICY), ("profile", PROFILE), ("slo", SLO),
                     ("workload", WORKLOAD), ("forecast", FORECAST), ("fleet", FLEET),
                     ("jobs", JOBS)):
        out[key] = tmp_path / src.name
        shutil.copy(src, out[key])
    out["plan"] = tmp_path / "plan.yaml"
    out["plan"].write_text("kind: CapacityPlan\n")
    return out


def _refused(args: list[str], victim: Path) -> str:
    before = victim.read_bytes()
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert victim.read_bytes() == before
    return lines[0]


def test_simulate_refuses_each_output_that_is_an_input(files):
    base = ["simulate", "--trace", files["trace"], "--profile", files["profile"],
            "--policy", files["policy"]]
    line = _refused([*base, "--json-out", files["trace"]], files["trace"])
    assert "--json-out" in line and "--trace" in line and "destroy the input" in line
    line = _refused([*base, "--records", files["trace"]], files["trace"])
    assert "--records" in line
    line = _refused([*base, "--json-out", files["policy"]], files["policy"])
    assert "--policy" in line
    line = _refused([*base, "--steps", files["profile"]], files["profile"])
    assert "--profile" in line


def test_simulate_refuses_a_hard_link_and_a_symlink_to_an_input(files, tmp_path):
    base = ["simulate", "--trace", files["trace"], "--profile", files["profile"],
            "--policy", files["policy"]]
    hard = tmp_path / "hard.json"
    os.link(files["trace"], hard)
    _refused([*base, "--json-out", hard], files["trace"])
    soft = tmp_path / "soft.json"
    soft.symlink_to(files["policy"])
    _refused([*base, "--json-out", soft], files["policy"])
    assert soft.is_symlink()


def test_goodput_refuses_an_input_as_json(files):
    _refused(["goodput", "--workload", files["workload"], "--profile", files["profile"],
              "--policy", files["policy"], "--slo", files["slo"], "--json-out", files["slo"]],
             files["slo"])


def test_workload_fit_refuses_its_trace(files):
    line = _refused(["workload", "fit", files["trace"], "-o", files["trace"]], files["trace"])
    assert "TRACE" in line


def test_export_refuses_its_policy(files):
    line = _refused(["export", "--policy", files["policy"], "--engine", "vllm", "-o",
                     files["policy"]], files["policy"])
    assert "-o/--output" in line and "--policy" in line


def test_optimize_refuses_its_workload_and_job(files, tmp_path):
    _refused(["optimize", "--workload", files["workload"], "--profile", files["profile"],
              "--slo", files["slo"], "-o", files["workload"]], files["workload"])
    _refused(["optimize", "--workload", files["workload"], "--profile", files["profile"],
              "--slo", files["slo"], "-o", tmp_path / "p.yaml", "--json-out", files["slo"]],
             files["slo"])


def test_place_and_plan_refuse_their_inputs(files, tmp_path):
    _refused(["place", "--jobs", files["jobs"], "--plan", files["plan"], "--forecast",
              files["forecast"], "-o", files["plan"]], files["plan"])
    _refused(["plan", "--workload", files["workload"], "--forecast", files["forecast"],
              "--fleet", files["fleet"], "--slo", files["slo"], "-o", files["fleet"]],
             files["fleet"])
    # a --report folder that would receive a file named like an input in it
    rep = tmp_path / "rep"
    rep.mkdir()
    plan_json = rep / "plan.json"
    plan_json.write_text("{}")
    line = _refused(["plan", "--workload", plan_json, "--forecast", files["forecast"],
                     "--fleet", files["fleet"], "--slo", files["slo"], "-o",
                     tmp_path / "out.yaml", "--report", rep], plan_json)
    assert "--report" in line


def test_validate_refuses_its_inputs(files, tmp_path):
    bench = tmp_path / "r.json"
    bench.write_text("{}")
    _refused(["validate", "--bench-result", bench, "--profile", files["profile"], "--policy",
              files["policy"], "--json-out", bench], bench)


def test_nightly_refuses_an_input_among_the_files_it_writes(files, tmp_path):
    out = tmp_path / "nightly"
    out.mkdir()
    current = out / "policy.yaml"
    shutil.copy(files["policy"], current)
    line = _refused(["nightly", "--trace", files["trace"], "--profile", files["profile"],
                     "--slo", files["slo"], "--current", current, "--out-dir", out], current)
    assert "--out-dir" in line and "--current" in line
    report = out / "summary.json"
    report.write_text("{}")
    _refused(["report", "--trace", report, "--profile", files["profile"], "--slo",
              files["slo"], "--current", files["policy"], "--new", files["policy"],
              "--out-dir", out], report)


def test_profile_fit_refuses_a_measurement_file(tmp_path):
    m = tmp_path / "m"
    m.mkdir()
    (m / "linear.csv").write_text("x\n")
    _refused(["profile", "fit", "--measurements", m, "--model", "llama-3.1-8b", "-o",
              m / "linear.csv"], m / "linear.csv")


def test_device_nodes_are_refused_and_never_replaced():
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full")
    with pytest.raises(ServetuneError, match="not a regular file"):
        check_outputs({"--json": "/dev/full"})
    with pytest.raises(ServetuneError, match="not a regular file"):
        write_text_atomic("/dev/full", "x")
    assert Path("/dev/full").is_char_device()
    check_outputs({"--json": "-"})  # stdout is fine


def test_writes_go_through_a_symlink_to_its_target(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    write_text_atomic(link, "new")
    assert link.is_symlink() and target.read_text() == "new"


def test_an_output_folder_refuses_a_users_link_at_an_output_name(tmp_path):
    """An output folder's names are links into its live output set: a user's own link
    there (to a deploy location, say) would silently stop being updated, so it is refused,
    before any work and at the commit, and left as it was."""
    target = tmp_path / "real.json"
    target.write_text("old")
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").symlink_to(target)
    with pytest.raises(ServetuneError, match="that servetune did not make"):
        check_outputs({}, out_dirs={"--out-dir": (out, ["summary.json"])})
    with pytest.raises(ServetuneError, match="that servetune did not make"):
        commit_files(out, [("summary.json", b"committed")])
    assert (out / "summary.json").is_symlink() and target.read_text() == "old"
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


def test_check_outputs_skips_shipped_names_and_missing_inputs(tmp_path):
    check_outputs({"-o": tmp_path / "a.yaml"},
                  {"--profile": "h200-llama-3.1-8b", "--trace": tmp_path / "missing.csv"})
