"""`servetune nightly` and `servetune report`: user errors, then the whole job end to end on
a tiny trace (written, kept on the second run, deterministic, atomic)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from servetune.cli import app
from servetune.errors import ServetuneError
from servetune.nightly import EXIT_CODES, parse_engines

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "configs" / "examples" / "azure-conv-synthetic.csv"
PROFILE = ROOT / "gpu_profiles" / "h200-llama-3.1-8b.yaml"
SLO = ROOT / "configs" / "slos" / "mlperf-llama-3.1-8b-server.yaml"
DEFAULTS = ROOT / "configs" / "policies" / "vllm-serve-defaults.yaml"

runner = CliRunner()


def nightly_args(out: Path, *extra: str, trace: Path = TRACE, current: Path = DEFAULTS):
    return ["nightly", "--trace", str(trace), "--profile", str(PROFILE), "--slo", str(SLO),
            "--current", str(current), "--out-dir", str(out), *extra]


def test_help_documents_exit_codes():
    res = runner.invoke(app, ["nightly", "--help"])
    assert res.exit_code == 0
    for code in ("0", "10", "2", "3"):
        assert f"  {code}  " in res.output
    assert "current policy kept" in res.output
    assert set(EXIT_CODES) == {0, 10, 2, 3}


def test_parse_engines():
    assert parse_engines("vllm, sglang,vllm") == ["vllm", "sglang"]
    with pytest.raises(ServetuneError, match="choose from"):
        parse_engines("vllm,ollama")
    with pytest.raises(ServetuneError, match="at least one"):
        parse_engines(" , ")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--engines", "vllm,ollama"], "'ollama' is not supported"),
        (["--min-gain", "-0.1"], "--min-gain must be a number >= 0"),
    ],
)
def test_bad_options_exit_2_and_write_nothing(tmp_path, extra, message):
    out = tmp_path / "out"
    res = runner.invoke(app, nightly_args(out, *extra))
    assert res.exit_code == 2, res.output
    assert message in res.output
    assert "Traceback" not in res.output
    assert not out.exists()


def test_missing_and_bad_files_exit_2(tmp_path):
    out = tmp_path / "out"
    res = runner.invoke(app, nightly_args(out, trace=tmp_path / "none.csv"))
    assert res.exit_code == 2 and "none.csv" in res.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: servetune/v1\nkind: Policy\nbatching: {max_num_seqs: -3}\n")
    res = runner.invoke(app, nightly_args(out, current=bad))
    assert res.exit_code == 2 and "batching.max_num_seqs" in res.output
    assert not out.exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    res = runner.invoke(app, nightly_args(afile))
    assert res.exit_code == 2 and "not a directory" in res.output
