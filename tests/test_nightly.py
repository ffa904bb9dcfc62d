"""`servetune nightly` and `servetune report`: user errors, then the whole job end to end on
a tiny trace (written, kept on the second run, deterministic, atomic)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import output_names
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from servetune.apps.nightly import EXIT_CODES, parse_engines
from servetune.cli import app
from servetune.errors import ServetuneError

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
    for code in ("0", "11", "10", "2", "3"):
        assert f"  {code}  " in res.output
    assert "current policy kept" in res.output
    assert "some engines only" in res.output
    assert set(EXIT_CODES) == {0, 11, 10, 2, 3}


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
        (["--sim-engine", "llamacpp"], "--sim-engine 'llamacpp'"),
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
    assert res.exit_code == 2 and "not a folder" in res.output


def test_too_short_trace_exits_2_without_outputs(tmp_path):
    """Two requests "meet" any SLO at any rate (the comparison used to report a goodput of
    ~14,000 req/s and exit 10 on them); nightly and report refuse such a trace."""
    if not TRACE.exists():
        pytest.skip("shipped example trace missing")
    short = tmp_path / "short.csv"
    short.write_text("\n".join(TRACE.read_text().splitlines()[:3]) + "\n")
    out = tmp_path / "out"
    res = runner.invoke(app, nightly_args(out, trace=short))
    assert res.exit_code == 2, res.output
    assert "short.csv: only 2 requests" in res.output and "at least 100" in res.output
    assert not out.exists()
    res = runner.invoke(app, ["report", "--trace", str(short), "--profile", str(PROFILE),
                              "--slo", str(SLO), "--current", str(DEFAULTS), "--new",
                              str(DEFAULTS), "--out-dir", str(out)])
    assert res.exit_code == 2 and "only 2 requests" in res.output
    assert not out.exists()


def test_slo_without_the_traces_class_is_named_before_any_work(tmp_path):
    """An SLO set with classes other than the trace's used to fail only after fitting and
    optimizing, naming the set but not its file."""
    slo = tmp_path / "two.yaml"
    slo.write_text("apiVersion: servetune/v1\nkind: SLOSet\nname: two\nclasses:\n"
                   "  chat: {ttft_s: 2.0, tpot_s: 0.1, percentile: 99}\n"
                   "  batch: {ttft_s: 20.0, tpot_s: 0.2, percentile: 90}\n")
    out = tmp_path / "out"
    args = nightly_args(out)
    args[args.index("--slo") + 1] = str(slo)
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert f"{slo}: classes: no entry for the trace's request class 'default'" in res.output
    assert "optimizing" not in res.output and not out.exists()


def test_out_dir_below_a_file_fails_before_any_work(tmp_path):
    """A file where a parent folder of --out-dir would go is named at once, before the
    inputs are even read (it used to surface only after the whole run)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    res = runner.invoke(app, nightly_args(afile / "sub", trace=tmp_path / "none.csv"))
    assert res.exit_code == 2
    assert "--out-dir" in res.output and f"{afile} is a file" in res.output
    assert "none.csv" not in res.output


# --- end to end on a tiny trace --------------------------------------------------------------

SPACE = """apiVersion: servetune/v1
kind: SearchSpace
name: tiny
knobs:
  batching.max_num_seqs: [64, 256]
  batching.max_num_batched_tokens: [1024, 8192]
"""
# A deliberately poor production policy: 4 running requests, 512 tokens per step.
POOR = """apiVersion: servetune/v1
kind: Policy
name: poor
batching: {max_num_seqs: 4, max_num_batched_tokens: 512}
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if not PROFILE.exists() or not TRACE.exists():
        pytest.skip("shipped profile or example trace missing")
    d = tmp_path_factory.mktemp("tiny")
    lines = TRACE.read_text().splitlines()
    (d / "trace.csv").write_text("\n".join(lines[:401]) + "\n")  # header + 400 requests
    (d / "space.yaml").write_text(SPACE)
    (d / "poor.yaml").write_text(POOR)
    # A snapshot of the shipped profile, so every run in this module sees the same bytes.
    (d / "profile.yaml").write_bytes(PROFILE.read_bytes())
    return d


def tiny_args(d: Path, out: Path, current: Path, *extra: str) -> list[str]:
    return ["nightly", "--trace", str(d / "trace.csv"), "--profile", str(d / "profile.yaml"),
            "--slo", str(SLO), "--current", str(current), "--out-dir", str(out),
            "--space", str(d / "space.yaml"), "--time-limit", "900", *extra]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {name: (folder / name).read_bytes() for name in output_names(folder)}


@pytest.fixture(scope="module")
def first_run(tiny):
    out = tiny / "out"
    res = runner.invoke(app, tiny_args(tiny, out, tiny / "poor.yaml"))
    return out, res


def test_nightly_writes_new_policy(first_run):
    import yaml

    from servetune.schemas.base import load_document
    from servetune.schemas.policy import Policy

    out, res = first_run
    assert res.exit_code == 0, res.output
    names = set(output_names(out))
    assert names == {"policy.yaml", "vllm.yaml", "sglang.yaml", "report.md", "summary.json",
                     "ttft_cdf.png", "tpot_cdf.png", "kv_queue.png", "goodput.png"}
    policy = load_document(out / "policy.yaml", Policy)
    assert policy.batching.max_num_seqs in (64, 256)
    assert policy.batching.max_num_batched_tokens in (1024, 8192)
    assert policy.metadata["profile"]["gpu_memory_bytes"] > 0
    assert policy.metadata["nightly"]["replaces"] == "poor"
    assert policy.metadata["nightly"]["gain"] >= 0.02
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "new_policy_written" and summary["exit_code"] == 0
    assert summary["new"]["goodput_rate_per_s"] >= 1.02 * summary["current"]["goodput_rate_per_s"]
    for scale in ("1.2x", "1.5x"):
        assert (summary["new"]["runs"][scale]["overall"]["attainment"]
                >= summary["current"]["runs"][scale]["overall"]["attainment"])
    vllm = yaml.safe_load((out / "vllm.yaml").read_text())
    assert vllm["max-num-seqs"] == policy.batching.max_num_seqs
    sglang = yaml.safe_load((out / "sglang.yaml").read_text())
    assert sglang["max-running-requests"] == policy.batching.max_num_seqs
    report = (out / "report.md").read_text()
    assert "New policy written" in report and "| `batching.max_num_seqs` | 4 |" in report
    # The optimizer's model error: its section, and the block the summary carries.
    assert "## How far the optimizer's model was off" in report
    error = summary["optimizer"]["model_error"]
    assert error["candidates"] == len(error["per_candidate"]) > 0
    assert "candidates it simulated" in report
    assert all(ch["reason"].startswith("model:") for ch in summary["changes"]
               if ch["knob"].startswith("batching."))
    # What vllm serve would pick on this GPU, and by which rule.
    assert summary["defaults_rule"].startswith("vllm serve on a GPU with")
    assert "## Engine defaults on this GPU" in report
    for png in ("ttft_cdf.png", "tpot_cdf.png", "kv_queue.png", "goodput.png"):
        assert f"]({png})" in report
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    # no temporary file or lock left; summary.json names no policy kept in production
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == [".generations"]
    assert summary["live_policy"] is None


def test_nightly_gates_each_exported_engine(first_run):
    out, res = first_run
    assert res.exit_code == 0
    summary = json.loads((out / "summary.json").read_text())
    gates = summary["gates"]
    assert [g["engine"] for g in gates] == ["vllm", "sglang"]
    assert all(g["passed"] and g["config_written"] for g in gates)
    for g in gates:
        assert g["goodput_rate_per_s"]["new"] >= 1.02 * g["goodput_rate_per_s"]["current"]
        assert g["kv_blocks"] == 56821  # vLLM's and SGLang's exports reach the tuned pool
    assert summary["new"]["goodput_rate_per_s"] == gates[0]["goodput_rate_per_s"]["new"]
    report = (out / "report.md").read_text()
    assert "## Gate per engine" in report
    assert "| vllm | 56821 |" in report and "| sglang | 56821 |" in report
    assert "`sglang.yaml` written" in report


def test_tgi_gate_simulates_the_pool_tgi_really_gets():
    # The shipped H200 / Llama 3.1 8B profile: M = 150109880320, u = 0.92,
    # W = 16060522496, A = 2874146816 B. The tuned pool (u*M - W - A = 119166420582 B)
    # needs --cuda-memory-fraction (W + A + 119166420582 / 0.9) / M = 1.0082 > 1.0, so TGI
    # runs at 1.0 with 0.9 * (M - W - A) = 118057689907 B: 56294 blocks of 16 tokens x
    # 131072 B (2097152 B each; 56294.29), 56293 usable (servetune keeps vLLM's null block
    # back everywhere), against the tuned 56821 (119166420582 / 2097152 = 56822.98).
    from servetune.apps.nightly import gate_profile
    from servetune.profiles.shipped import load_profile

    profile = load_profile(PROFILE)
    assert profile.kv_blocks() == 56821
    tgi, note = gate_profile(profile, "tgi")
    assert tgi.kv_blocks() == 56293
    assert note is not None and "1.0082" in note and "99.1%" in note
    for engine in ("vllm", "sglang", "trtllm"):
        same, none = gate_profile(profile, engine)
        assert same is profile and none is None


def test_an_engine_whose_gate_fails_gets_no_config(tiny, monkeypatch):
    """vLLM's gate passes, SGLang's fails: policy.yaml and vllm.yaml are written,
    sglang.yaml is not (an earlier run's leaves the live set: it belongs to another
    policy), the exit code is 11 and the report says why."""
    import servetune.apps.nightly as nightly

    real = nightly.decide

    def sglang_fails(comp, min_gain):
        decision = real(comp, min_gain)
        if comp.engine == "sglang":
            return nightly.Decision(False, decision.gain, [
                "goodput 1.000 -> 1.001 req/s (+0.1%) is below the required gain of 2.0%"])
        return decision

    monkeypatch.setattr(nightly, "decide", sglang_fails)
    out = tiny / "partial"
    out.mkdir()
    (out / "sglang.yaml").write_text("yesterday's sglang config\n")
    res = runner.invoke(app, tiny_args(tiny, out, tiny / "poor.yaml"))
    assert res.exit_code == 11, res.output
    names = set(output_names(out))
    assert {"policy.yaml", "vllm.yaml", "report.md", "summary.json"} <= names
    assert "sglang.yaml" not in names
    # the old layout's file is kept in the history, not beside the new policy
    old = out / ".generations" / "000001" / "sglang.yaml"
    assert old.read_text() == "yesterday's sglang config\n"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["live_policy"]["engines"] == ["sglang"]
    assert summary["live_policy"]["name"] == "poor"
    assert summary["live_policy"]["kept_in_folder"] == []
    assert summary["status"] == "new_policy_written_some_engines"
    assert summary["exit_code"] == 11
    assert [(g["engine"], g["passed"]) for g in summary["gates"]] == [
        ("vllm", True), ("sglang", False)]
    assert "sglang.yaml" not in summary["files_written"]
    assert "vllm.yaml" in summary["files_written"]
    report = (out / "report.md").read_text()
    assert "for vllm only" in report and "failed the gate of sglang" in report
    assert "| sglang |" in report and "below the required gain" in report
    assert "(`poor.yaml`, sha256 " in report and "stays in production on sglang." in report
    assert "not written" in report
    policy = (out / "policy.yaml").read_text()
    assert "not_adopted_on:\n    - sglang" in policy or "not_adopted_on: [sglang]" in policy


def test_nightly_rerun_gives_same_files(tiny, first_run):
    out, res = first_run
    assert res.exit_code == 0
    again = tiny / "again"
    res2 = runner.invoke(app, tiny_args(tiny, again, tiny / "poor.yaml"))
    assert res2.exit_code == 0, res2.output
    assert snapshot(again) == snapshot(out)


def test_second_run_with_new_policy_keeps_it(tiny, first_run):
    out, res = first_run
    assert res.exit_code == 0
    kept = tiny / "kept"
    kept.mkdir()
    (kept / "policy.yaml").write_bytes((out / "policy.yaml").read_bytes())
    before = (kept / "policy.yaml").read_bytes()
    # the policy in production is read from outside --out-dir: an input that is one of the
    # files nightly writes is refused (test_no_clobber)
    current = tiny / "in-production.yaml"
    current.write_bytes(before)
    res2 = runner.invoke(app, tiny_args(tiny, kept, current, "--json"))
    assert res2.exit_code == 10, res2.output
    summary = json.loads((kept / "summary.json").read_text())
    assert json.loads(res2.stdout) == summary  # --json prints the summary, nothing else
    assert summary["status"] == "current_kept" and summary["exit_code"] == 10
    assert (kept / "policy.yaml").read_bytes() == before  # untouched
    # it is the policy in production, so it stays in the live set, marked as such
    assert summary["live_policy"]["kept_in_folder"] == ["policy.yaml"]
    assert not (kept / "vllm.yaml").exists()
    assert "Current policy kept" in (kept / "report.md").read_text()


def test_interrupted_run_leaves_previous_outputs(tiny, first_run, monkeypatch):
    import servetune.io as io_mod

    out, res = first_run
    assert res.exit_code == 0
    target = tiny / "interrupted"
    target.mkdir()
    for name in snapshot(out):  # yesterday's outputs, recognisably different
        (target / name).write_bytes(b"previous run's " + name.encode())
    before = snapshot(target)
    steps = []

    def interrupted(step: str) -> None:
        steps.append(step)
        if step.startswith("writing"):
            raise KeyboardInterrupt  # the job is interrupted while writing its files

    monkeypatch.setattr(io_mod, "_pause", interrupted)
    with pytest.raises(KeyboardInterrupt):
        from servetune.apps.nightly import run_nightly

        run_nightly(tiny / "trace.csv", tiny / "profile.yaml", SLO, tiny / "poor.yaml", target,
                    space_path=tiny / "space.yaml", time_limit_s=20)
    # the old layout's files were first adopted as a set of their own, then the new set
    # was interrupted
    assert steps[0] == "swap current -> .generations/000001"
    assert steps[-1] == "writing .generations/000002"
    after = snapshot(target)
    assert set(after) == set(before)  # no half-written or temporary file left behind
    assert after == before  # nothing of the new set is live
    assert [p.name for p in (target / ".generations").iterdir()] == ["000001"]


def test_infeasible_slo_exits_3_with_report(tiny):
    slo = tiny / "impossible.yaml"
    slo.write_text("apiVersion: servetune/v1\nkind: SLOSet\nname: impossible\nclasses:\n"
                   "  default: {tpot_s: 0.0001, percentile: 99}\n")
    out = tiny / "infeasible"
    args = tiny_args(tiny, out, tiny / "poor.yaml")
    args[args.index("--slo") + 1] = str(slo)
    res = runner.invoke(app, args)
    assert res.exit_code == 3, res.output
    assert set(output_names(out)) == {"report.md", "summary.json", "ttft_cdf.png",
                                      "tpot_cdf.png", "kv_queue.png", "goodput.png"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["live_policy"]["name"] == "poor"
    assert summary["live_policy"]["file"] == "poor.yaml"
    assert "`poor` (`poor.yaml`, sha256 " in (out / "report.md").read_text()
    assert summary["status"] == "infeasible" and "TPOT" in summary["reasons"][0]
    assert summary["details"]["binding"] == "tpot[default]"
    assert "new" not in summary and "current" in summary
    report = (out / "report.md").read_text()
    assert "TPOT" in report and "## Why no new policy" in report
    assert "## What changed" not in report


def test_report_command(tiny, first_run):
    out, res = first_run
    assert res.exit_code == 0
    rep = tiny / "report"
    res2 = runner.invoke(app, ["report", "--trace", str(tiny / "trace.csv"), "--profile",
                               str(tiny / "profile.yaml"), "--slo", str(SLO), "--current",
                               str(tiny / "poor.yaml"), "--new", str(out / "policy.yaml"),
                               "--out-dir", str(rep)])
    assert res2.exit_code == 0, res2.output
    assert set(output_names(rep)) == {"report.md", "summary.json", "ttft_cdf.png",
                                      "tpot_cdf.png", "kv_queue.png", "goodput.png"}
    summary = json.loads((rep / "summary.json").read_text())
    first = json.loads((out / "summary.json").read_text())
    assert summary["new"]["goodput_rate_per_s"] == first["new"]["goodput_rate_per_s"]
    # the knob table carries the fluid model's reasons (goodput and binding condition)
    assert summary["changes"][0]["reason"].startswith("model:")
    assert "limited by" in (rep / "report.md").read_text()
    assert "servetune: " in res2.output  # progress lines by default
    quiet = runner.invoke(app, ["report", "--trace", str(tiny / "trace.csv"), "--profile",
                                str(tiny / "profile.yaml"), "--slo", str(SLO), "--current",
                                str(tiny / "poor.yaml"), "--new", str(out / "policy.yaml"),
                                "--out-dir", str(tiny / "report-q"), "-q"])
    assert quiet.exit_code == 0, quiet.output
    assert "servetune: " not in quiet.output


def test_report_reads_a_generic_csv_trace_with_columns(tiny, first_run):
    """The same requests as a generic CSV (seconds, other column names): with --columns
    the report compares the same two policies on the same trace, so the goodputs agree."""
    from datetime import datetime

    out, _ = first_run
    rows = (tiny / "trace.csv").read_text().splitlines()[1:]
    t0 = datetime.fromisoformat(rows[0].split(",")[0][:26])
    generic = ["t,p,o"] + [
        f"{(datetime.fromisoformat(r.split(',')[0][:26]) - t0).total_seconds():.6f},"
        f"{r.split(',')[1]},{r.split(',')[2]}" for r in rows]
    (tiny / "generic.csv").write_text("\n".join(generic) + "\n")

    def report(trace: str, folder: str, *extra: str):
        res = runner.invoke(app, ["report", "--trace", str(tiny / trace), "--profile",
                                  str(tiny / "profile.yaml"), "--slo", str(SLO), "--current",
                                  str(tiny / "poor.yaml"), "--new", str(out / "policy.yaml"),
                                  "--out-dir", str(tiny / folder), "-q", *extra])
        assert res.exit_code == 0, res.output
        return json.loads((tiny / folder / "summary.json").read_text())

    azure = report("trace.csv", "rep-azure")
    generic_run = report("generic.csv", "rep-generic", "--columns",
                         "arrival=t,prompt=p,output=o")
    for policy in ("current", "new"):
        assert generic_run[policy]["goodput_rate_per_s"] == pytest.approx(
            azure[policy]["goodput_rate_per_s"], rel=1e-6)
    bad = runner.invoke(app, ["report", "--trace", str(tiny / "generic.csv"), "--profile",
                              str(tiny / "profile.yaml"), "--slo", str(SLO), "--current",
                              str(tiny / "poor.yaml"), "--new", str(out / "policy.yaml"),
                              "--out-dir", str(tiny / "rep-bad")])
    assert bad.exit_code == 2 and "columns" in bad.output


def test_new_policy_reexports_without_profile(tiny, first_run):
    """policy.yaml carries the profile's memory figures, TensorRT-LLM's conversion included."""
    out, res = first_run
    assert res.exit_code == 0
    for engine in ("trtllm", "tgi"):
        res2 = runner.invoke(app, ["export", "--policy", str(out / "policy.yaml"),
                                   "--engine", engine])
        assert res2.exit_code == 0, res2.output


@given(text=st.text(max_size=30))
@settings(max_examples=100, deadline=None)
def test_parse_engines_only_raises_servetune_errors(text):
    try:
        engines = parse_engines(text)
    except ServetuneError:
        return
    assert engines and set(engines) <= {"vllm", "sglang", "trtllm", "tgi"}


def test_defaults_section_names_the_rule_for_the_gpu():
    from servetune.apps.nightly import defaults_section
    from servetune.profiles.shipped import load_profile
    from servetune.schemas.base import load_document
    from servetune.schemas.policy import Policy

    repo = Path(__file__).resolve().parents[1]
    big = load_document(repo / "configs/policies/vllm-serve-defaults.yaml", Policy)
    text, rule = defaults_section(big, load_profile("a100-80gb-llama-3.1-8b"))
    assert "256 sequences and 2048 batched tokens" in text and "A100" in rule
    assert text.endswith("differs from them.")
    text, _ = defaults_section(big, load_profile("h200-llama-3.1-8b"))
    assert "1024 sequences and 8192 batched tokens" in text and text.endswith("uses these.")


def test_next_run_checks_the_last_runs_promise_on_todays_trace(tiny, first_run):
    """The first run promised its new policy's goodput on its trace; a second run into the
    same folder, on another stretch of traffic and with another policy in production,
    replays that policy on today's trace and reports promised against delivered: the
    number `goodput` gives for that policy on today's trace."""
    import shutil

    from servetune.profiles.shipped import load_profile
    from servetune.schemas.base import load_document
    from servetune.schemas.policy import Policy
    from servetune.schemas.slo import SLOSet
    from servetune.sim import goodput
    from servetune.workloads.formats import load_trace

    out, res = first_run
    assert res.exit_code == 0
    first = json.loads((out / "summary.json").read_text())
    promise = first["promise"]
    assert promise["goodput_rate_per_s"] == first["new"]["goodput_rate_per_s"]
    assert promise["engine"] == "vllm" and promise["trace"] == "trace.csv"
    assert first["last_promise"] is None
    assert "nothing to check yet" in (out / "report.md").read_text()

    today = tiny / "today"
    today.mkdir()
    lines = TRACE.read_text().splitlines()
    (today / "trace.csv").write_text("\n".join([lines[0], *lines[401:801]]) + "\n")
    folder = tiny / "promise"
    shutil.copytree(out, folder, symlinks=True)
    args = tiny_args(tiny, folder, tiny / "poor.yaml")
    args[args.index("--trace") + 1] = str(today / "trace.csv")
    res2 = runner.invoke(app, args)
    assert res2.exit_code in (0, 10, 11), res2.output
    checked = json.loads((folder / "summary.json").read_text())["last_promise"]
    promised_policy = load_document(out / "policy.yaml", Policy)
    expected = goodput(load_trace(today / "trace.csv"), promised_policy,
                       load_profile(tiny / "profile.yaml"), load_document(SLO, SLOSet))
    assert checked["promised_rate_per_s"] == promise["goodput_rate_per_s"]
    assert checked["delivered_rate_per_s"] == pytest.approx(expected.rate_per_s, rel=1e-9)
    report = (folder / "report.md").read_text()
    assert "## Yesterday's promise, checked today" in report
    assert (f"Last run promised {promise['goodput_rate_per_s']:.3f} req/s (on trace.csv, "
            f"vllm); replayed on today's trace it gives {expected.rate_per_s:.3f} req/s"
            in report)


def test_report_and_nightly_take_a_shipped_profile_by_name(tiny, first_run, tmp_path):
    """A bare shipped name is the shipped file: it is loaded, and hashed for the
    provenance like a path (it used to crash in sha256_file after the work)."""
    out, res = first_run
    assert res.exit_code == 0
    args = ["--trace", str(tiny / "trace.csv"), "--profile", "h200-llama-3.1-8b",
            "--slo", str(SLO), "--current", str(tiny / "poor.yaml")]
    rep = runner.invoke(app, ["report", *args, "--new", str(out / "policy.yaml"),
                              "--out-dir", str(tmp_path / "report"), "-q"])
    assert rep.exit_code == 0, rep.output
    assert "h200-llama-3.1-8b.yaml (sha256 " in (tmp_path / "report" / "report.md").read_text()
    night = runner.invoke(app, ["nightly", *args, "--out-dir", str(tmp_path / "night"),
                                "--space", str(tiny / "space.yaml"), "--engines", "vllm",
                                "--max-simulations", "10", "-q"])
    assert night.exit_code in (0, 10), night.output
    summary = json.loads((tmp_path / "night" / "summary.json").read_text())
    assert summary["inputs"]["profile"].startswith("h200-llama-3.1-8b.yaml (sha256 ")


def test_the_gates_fallback_is_the_best_candidate_without_a_lane():
    from servetune.apps.nightly import best_without_lane
    from servetune.models.fluid import Knobs
    from servetune.schemas.policy import Policy
    from servetune.search import GoodputResult
    from servetune.solvers.loop import Evaluated

    def ev(rate: float, lane: int | None, seqs: int, passed: bool = True) -> Evaluated:
        policy = Policy.model_validate({
            "batching": {"max_num_seqs": seqs},
            "long_requests": {"threshold_tokens": lane, "reserved_seqs": 1 if lane else 0,
                              "max_seqs": 1 if lane else None}})
        points = [{"rate_scale": rate, "meets_slo": passed}]
        est = GoodputResult(rate if passed else 0.0, rate if passed else 0.0, points, 1.0)
        return Evaluated(0, Knobs.from_policy(policy), 0.0, None, est, policy)

    answer = ev(3.0, 4096, 256).policy.model_copy(update={
        "name": "servetune-milp", "metadata": {"method": "milp", "simulated": {"x": 1}}})
    evaluated = [ev(3.0, 4096, 256), ev(2.5, None, 64), ev(2.8, None, 128),
                 ev(9.0, None, 512, passed=False), ev(2.9, 8192, 128)]
    plain = best_without_lane(answer, evaluated)
    assert plain is not None and plain.batching.max_num_seqs == 128
    assert not plain.long_requests.enabled and plain.name == "servetune-milp"
    assert "simulated" not in plain.metadata and plain.metadata["method"] == "milp"
    assert "2.800 req/s" in plain.metadata["fallback"]
    assert best_without_lane(evaluated[1].policy, evaluated) is None  # no lane: no fallback
    assert best_without_lane(answer, evaluated[:1]) is None  # nothing without one passed
