"""Framework usage errors and Ctrl-C are one stderr line each (exit 2 and 130), never a
rich box or a traceback; an interrupted run keeps the previous outputs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from servetune.cli import app
from servetune.sim.compile_notice import NOTICE

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "configs" / "examples" / "azure-conv-synthetic.csv"
POLICY = REPO / "configs" / "policies" / "vllm-serve-defaults.yaml"
PROFILE = REPO / "gpu_profiles" / "h200-llama-3.1-8b.yaml"

runner = CliRunner()


def _one_line(args: list[str], code: int = 2, progress: bool = False) -> str:
    """The one line a run printed (after its ``servetune:`` progress lines, if any)."""
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == code, result.output
    # a cold numba cache adds the compile notice before the first simulation
    lines = [ln for ln in result.output.strip().splitlines() if NOTICE not in ln]
    if progress:
        lines = lines[-1:] if all(ln.startswith("servetune: ") for ln in lines) else lines
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output and "╭" not in result.output
    return lines[0]


@pytest.mark.parametrize(("args", "expected"), [
    (["simulate", "--bogus"], "No such option: --bogus"),
    (["simulate"], "Missing option '--profile'"),
    (["trace", "stats"], "Missing argument"),
    (["nosuch"], "No such command 'nosuch'"),
    (["simulate", "--profile", "x", "--policy", "y", "--requests", "abc"],
     "Invalid value for '--requests'"),
    (["place", "--jobs", "j", "--plan", "p", "--forecast", "f", "-o", "o", "--levels", "1"],
     "Invalid value for '--levels'"),
    (["workload", "fit", "x.csv", "-o"], "requires an argument"),
])
def test_framework_errors_are_one_line(args, expected):
    line = _one_line(args)
    assert line.startswith("servetune: error: ") and expected in line
    assert "--help" in line


def test_unreadable_input_is_one_line(tmp_path):
    line = _one_line(["trace", "stats", tmp_path / "missing.csv"])
    assert line.startswith("servetune: error: ") and "file not found" in line
    line = _one_line(["trace", "stats", tmp_path])
    assert "directory" in line


def test_console_script_prints_one_line():
    """The installed entry point (not CliRunner) behaves the same."""
    proc = subprocess.run([sys.executable, "-c", "from servetune.cli import run; run()",
                           "simulate", "--nope"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "servetune: error: No such option: --nope (Possible options: --columns, --records) "
        "(see servetune simulate --help)"
    ] or (len(proc.stderr.strip().splitlines()) == 1 and "No such option" in proc.stderr)


def test_interrupt_in_a_command_is_one_line_and_exit_130(tmp_path, monkeypatch):
    import servetune.export as export  # the command imports export_policy from it when run

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "export_policy", interrupted)
    out = tmp_path / "vllm.yaml"
    out.write_text("previous\n")
    line = _one_line(["export", "--policy", POLICY, "--engine", "vllm", "-o", out], 130)
    assert line == "servetune: interrupted; previous outputs kept"
    assert out.read_text() == "previous\n"


def test_interrupt_while_writing_keeps_every_previous_output(tmp_path, monkeypatch):
    """simulate writes --json, then --records: an interrupt while the records are written
    puts the previous --json back, so the set on disk is the previous one."""
    from servetune.sim.api import SimResult

    def interrupted(self, path):
        raise KeyboardInterrupt

    monkeypatch.setattr(SimResult, "write_records", interrupted)
    trace = tmp_path / "t.csv"
    shutil.copy(TRACE, trace)
    js, rec = tmp_path / "s.json", tmp_path / "r.csv"
    js.write_text("previous json\n")
    rec.write_text("previous records\n")
    line = _one_line(["simulate", "--trace", trace, "--profile", PROFILE, "--policy", POLICY,
                      "--requests", "200", "--json-out", js, "--records", rec], 130)
    assert line == "servetune: interrupted; previous outputs kept"
    assert js.read_text() == "previous json\n"
    assert rec.read_text() == "previous records\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.csv", "s.json", "t.csv"]


def test_interrupt_in_nightly_keeps_the_previous_outputs(tmp_path, monkeypatch):
    import servetune.apps.nightly as nightly

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(nightly, "optimize_policy", interrupted)
    out = tmp_path / "nightly"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"previous": True}))
    line = _one_line(["nightly", "--trace", TRACE, "--profile", PROFILE, "--slo",
                      REPO / "configs" / "slos" / "mlperf-llama-3.1-8b-server.yaml",
                      "--current", POLICY, "--out-dir", out], 130, progress=True)
    assert line == "servetune: interrupted; previous outputs kept"
    assert json.loads((out / "summary.json").read_text()) == {"previous": True}
    assert [p.name for p in out.iterdir()] == ["summary.json"]


def test_a_reader_that_goes_away_gets_no_traceback():
    """`servetune profile show ... | head`: the pipe closes before the output is written;
    click stops with exit 1 and no message (a traceback here was a bug)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from servetune.cli import run; run()", "profile", "show",
         "h200-llama-3.1-8b"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait() in (0, 1)
    assert "Traceback" not in err


# ------------------------------------------------------- stdout that cannot be written
# (issue 33): a reader that went away ends the command quietly with its own exit code
# and files; a full device or a closed descriptor is one line and exit 2.

SCRIPT = [sys.executable, "-c", "from servetune.cli import run; run()"]
EXAMPLE = Path(__file__).resolve().parents[1] / "configs" / "examples" / "azure-conv-synthetic.csv"


def test_a_closed_pipe_ends_quietly_and_the_files_stand(tmp_path):
    import os

    policy = Path(__file__).resolve().parents[1] / "configs/policies/vllm-serve-defaults.yaml"
    for args in (["trace", "stats", str(EXAMPLE), "--json"],
                 ["export", "--policy", str(policy), "--engine", "vllm", "-o",
                  str(tmp_path / "v.yaml"), "--json"]):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first line
        try:
            proc = subprocess.run([*SCRIPT, *args], stdout=write, stderr=subprocess.PIPE,
                                  text=True, timeout=120)
        finally:
            os.close(write)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == ""
    assert (tmp_path / "v.yaml").read_text().startswith("#")  # the config was written


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
def test_a_full_stdout_is_one_line_and_exit_2():
    with open("/dev/full", "w") as full:
        proc = subprocess.run([*SCRIPT, "trace", "stats", str(EXAMPLE), "--json"],
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "servetune: error: stdout: No space left on device; what the command printed there "
        "is lost"]


def test_a_closed_stdout_is_one_line_and_exit_2():
    import os

    proc = subprocess.run([*SCRIPT, "trace", "stats", str(EXAMPLE)],
                          stderr=subprocess.PIPE, text=True, timeout=120,
                          preexec_fn=lambda: os.close(1))  # noqa: PLW1509 - the point
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "servetune: error: stdout: Bad file descriptor; what the command printed there is "
        "lost"]


def test_an_output_where_nothing_can_be_written_is_refused_before_the_work(tmp_path,
                                                                            monkeypatch):
    """A read-only file system (or a folder without write permission) gave a traceback
    after the work, from the rollback of the files written so far (issue 33). Now the
    output's folder is checked first. Root may write anywhere on a writable file system,
    so the test makes os.access say no for that folder, as a read-only mount does."""
    from typer.testing import CliRunner

    import servetune.io as io_mod
    from servetune.cli import app

    locked = tmp_path / "ro"
    locked.mkdir()
    real_access = io_mod.os.access
    monkeypatch.setattr(io_mod.os, "access",
                        lambda path, mode: Path(path) != locked and real_access(path, mode))
    policy = Path(__file__).resolve().parents[1] / "configs/policies/vllm-serve-defaults.yaml"
    runner = CliRunner()
    for args in (["simulate", "--trace", str(EXAMPLE), "--profile", "h200-llama-3.1-8b",
                  "--policy", str(policy), "--records", str(locked / "r.csv")],
                 ["export", "--policy", str(policy), "--engine", "vllm", "-o",
                  str(locked / "sub" / "v.yaml")],
                 ["report", "--trace", str(EXAMPLE), "--profile", "h200-llama-3.1-8b",
                  "--slo", str(policy.parents[1] / "slos/mlperf-llama-3.1-8b-server.yaml"),
                  "--current", str(policy), "--new", str(policy), "--out-dir",
                  str(locked / "rep")]):
        res = runner.invoke(app, args)
        assert res.exit_code == 2, res.output
        assert f"{locked} cannot be written (read-only or no permission)" in res.output
    assert list(locked.iterdir()) == []


# ------------------------------------------------- sizes past what a machine holds (issue 33)

ROOT = Path(__file__).resolve().parents[1]
SIM = ["simulate", "--workload", str(ROOT / "configs/workloads/azure-conv-2023.yaml"),
       "--profile", "h200-llama-3.1-8b", "--policy",
       str(ROOT / "configs/policies/vllm-serve-defaults.yaml")]


@pytest.mark.parametrize("args, message", [
    ([*SIM, "--requests", "100000000"], "would draw about 1e+08 requests (more than "
     "10,000,000)"),
    (["workload", "show", str(ROOT / "configs/workloads/azure-conv-2023.yaml"), "--sample",
      "100000000", "--json"], "more than 10,000,000"),
    (["goodput", *SIM[1:], "--slo", str(ROOT / "configs/slos/mlperf-llama-3.1-8b-server.yaml"),
      "--requests", "100000000"], "more than 10,000,000"),
    ([*SIM, "--requests", "100", "--replicas", "5000"], "less than or equal to 1024"),
    ([*SIM, "--requests", "100", "--disagg", "50000:50000"], "100,000 replicas; at most 1,024"),
])
def test_sizes_past_the_bound_are_refused_up_front(args, message):
    """Each ran for minutes and took 9-13 GB; now one line and exit 2, at once."""
    from typer.testing import CliRunner

    from servetune.cli import app

    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output


def test_a_sweep_past_ten_thousand_jobs_is_refused_before_any_job(tmp_path):
    from typer.testing import CliRunner

    from servetune.cli import app

    sweep = tmp_path / "big.yaml"
    sweep.write_text(
        "apiVersion: servetune/v1\nkind: Sweep\nname: big\nproducts:\n  - command: optimize\n"
        f"    profiles: [h200-llama-3.1-8b]\n"
        f"    workloads: [{ROOT / 'configs/workloads/azure-conv-2023.yaml'}]\n"
        f"    slos: [{ROOT / 'configs/slos/mlperf-llama-3.1-8b-server.yaml'}]\n"
        f"    seeds: [{', '.join(str(i) for i in range(10_001))}]\n")
    res = CliRunner().invoke(app, ["sweep", str(sweep), "--out-dir", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert "expands to 10,001 jobs, more than 10,000" in res.output
    assert not (tmp_path / "out").exists()
