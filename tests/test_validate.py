"""`servetune validate`: benchmark-result formats, closed-loop replay, calibration round trip."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import output_names
from typer.testing import CliRunner

from servetune.apps import validate as V
from servetune.cli import app
from servetune.errors import ServetuneError
from servetune.profiles.schema import Profile
from servetune.profiles.shipped import load_profile
from servetune.profiles.steptime import COEF_HOST_SEQ, COEF_HOST_STEP
from servetune.schemas.base import document_to_yaml, load_document
from servetune.schemas.policy import Policy
from servetune.sim import simulate
from servetune.sim.compile_notice import NOTICE
from servetune.workloads.bench import load_bench_run, vllm_detailed_result
from servetune.workloads.formats import load_trace
from servetune.workloads.trace import Trace

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "configs/policies/vllm-serve-defaults.yaml"
EXAMPLE = ROOT / "configs/examples/azure-conv-synthetic.csv"
PROFILE = "h200-llama-3.1-8b"
# the "real" engine: host s/step (not overlapped), host s/seq, GPU time scale, and decode
# attention s per context token (the H200 profile charges 28.5 ns: a paged kernel slower)
TRUTH = (2.5e-3, 40e-6, 1.2, 34e-9)
runner = CliRunner()


def one_error_line(result, code=2):
    assert result.exit_code == code, result.output
    # a cold numba cache adds the compile notice before the first simulation
    lines = [ln for ln in result.output.splitlines() if ln.strip() and NOTICE not in ln]
    assert len(lines) == 1 and lines[0].startswith("servetune: error:"), result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.fixture(scope="module")
def policy() -> Policy:
    return load_document(POLICY, Policy)


@pytest.fixture(scope="module")
def profile() -> Profile:
    return load_profile(PROFILE)


def varied_load_trace(n: int = 900) -> Trace:
    """The example trace's first ``n`` requests with a burst at 8x the rate in the middle
    third, and every fourth prompt 8x longer: batches from one to dozens of sequences and
    contexts from a few hundred to tens of thousands of tokens, so the four terms are told
    apart (with the chat prompts alone, attention per context token and host time per
    sequence trade against each other)."""
    tr = load_trace(EXAMPLE).head(n)
    a = tr.arrival_s.copy()
    lo, hi = n // 3, 2 * n // 3
    a[lo:hi] = a[lo] + (a[lo:hi] - a[lo]) / 8
    a[hi:] = a[hi:] - (tr.arrival_s[hi] - a[hi - 1])
    a = np.maximum.accumulate(a)
    prompt = tr.prompt_tokens.copy()
    prompt[::4] *= 8
    return Trace(arrival_s=a, prompt_tokens=prompt, output_tokens=tr.output_tokens)


@pytest.fixture(scope="module")
def measured(tmp_path_factory, policy, profile) -> Path:
    """A vllm bench serve --save-detailed file produced by the simulator with TRUTH."""
    tr = varied_load_trace()
    res = simulate(tr, policy, V.with_step_params(profile, *TRUTH))
    t0 = 5000.0  # perf_counter-like absolute start times
    doc = vllm_detailed_result(
        tr.arrival_s + t0, tr.prompt_tokens, tr.output_tokens,
        res.output.first_token_s + t0, res.output.finish_s + t0, request_rate=5.0,
    )
    path = tmp_path_factory.mktemp("bench") / "vllm-5.0qps-Llama-3.1-8B.json"
    path.write_text(json.dumps(doc))
    return path


# ----------------------------------------------------------------------------- round trip


def test_replay_with_the_true_profile_matches_exactly(measured, policy, profile):
    run = load_bench_run(measured)
    assert run.fmt == "vllm-bench" and len(run) == 900 and not run.closed_loop
    rep = V.replay(run, policy, V.with_step_params(profile, *TRUTH))
    assert V.fit_error(run, rep)["rms_rel"] < 1e-9


def test_calibrate_recovers_the_known_constants(measured, policy, profile):
    run = load_bench_run(measured)
    cal = V.calibrate(run, policy, profile)
    a, b, g, c = (cal.fitted[k] for k in V.PARAMS)
    assert a == pytest.approx(TRUTH[0], rel=0.10)
    assert b == pytest.approx(TRUTH[1], rel=0.30)
    assert g == pytest.approx(TRUTH[2], rel=0.03)
    assert c == pytest.approx(TRUTH[3], rel=0.10)
    assert cal.error_before["rms_rel"] > 0.2
    assert cal.error_after["rms_rel"] < 0.05
    comp = V.compare(run, cal.replay)
    for key in ("ttft_s", "e2e_s"):
        assert abs(comp["metrics"][key]["stat_rel_error"]["mean"]) < 0.03
    # provenance: the file's hash, what was fitted, before/after; no date
    prof = cal.profile
    assert prof.step_time.gpu_time_scale == pytest.approx(g)
    assert prof.step_time.host_s_per_step == pytest.approx(a)
    assert any(f.sha256 == run.sha256 and f.rows == 900 for f in prof.calibration.files)
    assert prof.calibration.fit["validate_before_rms_rel"] > prof.calibration.fit[
        "validate_after_rms_rel"]
    assert any(s.startswith("validate --calibrate") for s in prof.calibration.assumptions)


def test_calibrate_is_the_same_on_processes(measured, policy, profile):
    """The finite-difference replays of a round run side by side: the same fit, the same
    count of simulations, the same corrected profile."""
    from servetune.executor import ProcessExecutor

    run = load_bench_run(measured)
    serial = V.calibrate(run, policy, profile, max_rounds=2)
    with ProcessExecutor(2) as ex:
        parallel = V.calibrate(run, policy, profile, max_rounds=2, executor=ex)
    assert parallel.fitted == serial.fitted and parallel.history == serial.history
    assert parallel.simulations == serial.simulations
    assert document_to_yaml(parallel.profile) == document_to_yaml(serial.profile)


def test_cli_validate_calibrate_report(measured, tmp_path):
    out, rep_dir, js = tmp_path / "p2.yaml", tmp_path / "rep", tmp_path / "v.json"
    result = runner.invoke(app, [
        "validate", "--bench-result", str(measured), "--profile", PROFILE,
        "--policy", str(POLICY), "--report", str(rep_dir), "--json-out", str(js),
        "--calibrate", "-o", str(out),
    ])
    assert result.exit_code == 0, result.output
    assert "calibrated:" in result.output
    names = output_names(rep_dir)
    assert names == ["cdf_e2e.png", "cdf_tpot.png", "cdf_ttft.png", "report.md",
                     "validate.json"]
    md = (rep_dir / "report.md").read_text()
    assert "## Calibration" in md and "| TTFT |" in md
    summary = json.loads(js.read_text())
    before = summary["comparison"]["fit_error"]["rms_rel"]
    after = summary["comparison_calibrated"]["fit_error"]["rms_rel"]
    assert after < 0.1 * before
    corrected = load_document(out, Profile)
    assert corrected.step_time.gpu_time_scale == pytest.approx(TRUTH[2], rel=0.03)
    # the corrected profile replays the run close to the measurement
    args = ["validate", "--bench-result", str(measured), "--profile", str(out),
            "--policy", str(POLICY)]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["comparison"]["fit_error"]["rms_rel"] < 0.05
    dash = runner.invoke(app, [*args, "--json-out", "-"])  # '-' is stdout, as --json
    assert dash.exit_code == 0, dash.output
    assert dash.stdout == result.stdout


# ----------------------------------------------------------------------------- closed loop


def test_closed_loop_sends():
    sends = V.closed_loop_sends(np.zeros(5), np.array([1.0, 2.0, 1.0, 1.0, 5.0]), 2)
    # slots free at 1 (req 0), then 2 (req 1), then 2 + g (req 2, sent at 1 + g); each
    # send is the client's gap g after the finish that freed its slot
    g = V.CLIENT_GAP_S
    np.testing.assert_allclose(sends, [0.0, 0.0, 1.0 + g, 2.0 + g, 2.0 + 2 * g], rtol=0,
                               atol=1e-12)


def exact_closed_loop(tr: Trace, policy, profile, concurrency: int) -> np.ndarray:
    """Send times of a closed-loop client at rate inf, exactly: request m is sent when a
    slot frees, and every completion before that is exact in a simulation of the requests
    sent before it (nothing sent later can act earlier). One simulation per request."""
    n = len(tr)
    sends = np.zeros(n)
    for m in range(concurrency, n):
        prefix = Trace(arrival_s=sends[:m] - sends[0], prompt_tokens=tr.prompt_tokens[:m],
                       output_tokens=tr.output_tokens[:m])
        res = simulate(prefix, policy, profile)
        lat = np.asarray(res.output.finish_s) - prefix.arrival_s
        sends[m] = V.closed_loop_sends(np.zeros(m + 1), np.append(lat, 0.0), concurrency)[m]
    return sends


def test_closed_loop_round_trip(tmp_path, policy, profile):
    tr = load_trace(EXAMPLE).head(60)
    truth = V.with_step_params(profile, *TRUTH)
    sends = exact_closed_loop(tr, policy, truth, 8)
    res = simulate(Trace(arrival_s=sends, prompt_tokens=tr.prompt_tokens,
                         output_tokens=tr.output_tokens), policy, truth)
    t0 = 100.0
    doc = vllm_detailed_result(
        sends + t0, tr.prompt_tokens, tr.output_tokens,
        np.asarray(res.output.first_token_s) + t0, np.asarray(res.output.finish_s) + t0,
        request_rate="inf", max_concurrency=8, queue_s=sends,
    )
    path = tmp_path / "closed.json"
    path.write_text(json.dumps(doc))
    run = load_bench_run(path)
    assert run.closed_loop and run.max_concurrency == 8
    assert run.intended_s is not None and not run.intended_s.any()
    again = V.replay(run, policy, truth)
    assert again.converged
    # ties at step ends (a request sent as another finishes) may join either step
    assert V.fit_error(run, again)["e2e_rms_rel"] < 0.05
    # the default profile is faster: its closed loop sends the later requests sooner
    fast = V.replay(run, policy, profile)
    assert fast.send_s[-1] < run.send_s[-1]
    assert fast.send_s[:8].tolist() == [0.0] * 8


# ----------------------------------------------------------------------------- formats


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_vllm_without_latencies_sums_itls(tmp_path):
    doc = {"request_rate": "inf", "max_concurrency": None,
           "input_lens": [10, 20, 30], "output_lens": [3, 1, 0],
           "ttfts": [0.1, 0.2, 0.0], "itls": [[0.01, 0.02], [], []],
           "errors": ["", "", "timeout"]}
    run = load_bench_run(_write(tmp_path, "r.json", json.dumps(doc)))
    assert run.fmt == "vllm-bench" and len(run) == 2 and run.failed == 1
    assert run.e2e_s.tolist() == pytest.approx([0.13, 0.2])
    assert run.send_s.tolist() == [0.0, 0.0]  # rate inf: all sent at once
    assert any("TTFT + sum of ITLs" in n for n in run.notices)


def test_vllm_start_times_are_rebased_and_sorted(tmp_path):
    doc = {"request_rate": 2.0, "input_lens": [5, 6], "output_lens": [2, 2],
           "ttfts": [0.1, 0.1], "itls": [[0.1], [0.1]], "latencies": [0.3, 0.2],
           "start_times": [1000.5, 1000.0], "errors": ["", ""]}
    run = load_bench_run(_write(tmp_path, "r.json", json.dumps(doc)))
    assert run.send_s.tolist() == [0.0, 0.5]
    assert run.prompt_tokens.tolist() == [6, 5]
    assert run.e2e_s.tolist() == [0.2, 0.3]
    assert run.request_rate == 2.0


def test_sglang_jsonl_last_run_and_nested_details(tmp_path):
    first = {"backend": "sglang", "request_rate": float("inf"), "max_concurrency": 4,
             "input_lens": [1], "output_lens": [2], "ttfts": [0.5], "itls": [[0.1]],
             "errors": [""]}
    second = {"backend": "sglang", "request_rate": float("inf"), "max_concurrency": 8,
              "details": {"input_lens": [100, 200], "output_lens": [4, 2],
                          "ttfts": [0.05, 0.06], "itls": [[0.01] * 3, [0.02]],
                          "errors": ["", ""]}}
    text = json.dumps(first) + "\n" + json.dumps(second) + "\n"  # Infinity, as json.dumps writes
    run = load_bench_run(_write(tmp_path, "sglang.jsonl", text))
    assert run.fmt == "sglang-bench" and len(run) == 2 and run.max_concurrency == 8
    assert run.closed_loop and run.intended_s is not None and run.intended_s.tolist() == [0, 0]
    assert run.e2e_s.tolist() == pytest.approx([0.08, 0.08])
    assert any("several runs" in n for n in run.notices)


def test_sglang_finite_rate_cannot_be_replayed(tmp_path):
    doc = {"backend": "sglang", "request_rate": 4.0, "input_lens": [1], "output_lens": [2],
           "ttfts": [0.5], "itls": [[0.1]], "errors": [""]}
    with pytest.raises(ServetuneError, match="saves no per-request send times.*4 req/s"):
        load_bench_run(_write(tmp_path, "s.jsonl", json.dumps(doc) + "\n"), "sglang-bench")


def _aiperf(start_ns, isl, osl, ttft_ms, lat_ms, error=None):
    rec = {"metadata": {"session_num": 0, "request_start_ns": start_ns,
                        "benchmark_phase": "profiling", "was_cancelled": error is not None},
           "metrics": None if error else {
               "input_sequence_length": {"value": isl, "unit": "tokens"},
               "output_sequence_length": {"value": osl, "unit": "tokens"},
               "time_to_first_token": {"value": ttft_ms, "unit": "ms"},
               "request_latency": {"value": lat_ms, "unit": "ms"}},
           "error": error}
    return json.dumps(rec)


def test_aiperf_profile_export_jsonl(tmp_path):
    lines = [
        _aiperf(1_759_813_207_532_900_363, 550, 9, 255.9, 297.5),
        _aiperf(1_759_813_207_032_900_363, 100, 20, 50.0, 250.0),
        _aiperf(1_759_813_208_000_000_000, 100, 20, 0, 0,
                error={"code": 499, "type": "RequestCancellationError", "message": "x"}),
    ]
    run = load_bench_run(_write(tmp_path, "profile_export.jsonl", "\n".join(lines) + "\n"))
    assert run.fmt == "aiperf" and len(run) == 2 and run.failed == 1
    assert run.send_s.tolist() == pytest.approx([0.0, 0.5])
    assert run.prompt_tokens.tolist() == [100, 550]
    assert run.ttft_s.tolist() == pytest.approx([0.05, 0.2559])
    assert run.e2e_s.tolist() == pytest.approx([0.25, 0.2975])
    closed = load_bench_run(tmp_path / "profile_export.jsonl", max_concurrency=4)
    assert closed.closed_loop and closed.intended_s is None


def test_genai_perf_export_is_refused_with_the_reason(tmp_path):
    doc = {"experiments": [{"experiment": {"mode": "concurrency", "value": 4},
                            "requests": [{"timestamp": 1, "request_inputs": {},
                                          "response_timestamps": [2, 3],
                                          "response_outputs": [{}, {}]}]}]}
    with pytest.raises(ServetuneError, match="genai-perf.*token counts.*AIPerf"):
        load_bench_run(_write(tmp_path, "profile_export.json", json.dumps(doc)))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("doc", "needle"), [
    ({"input_lens": [1, 2], "output_lens": [2]}, "output_lens: has 1 entries but input_lens has 2"),
    ({"input_lens": [1], "output_lens": [2], "itls": [[0.1]], "request_rate": "inf"},
     "ttfts: missing"),
    ({"input_lens": [1, "x"], "output_lens": [2, 2], "ttfts": [0.1, 0.1],
      "itls": [[0.1], [0.1]], "request_rate": "inf"}, "input_lens, request 2"),
    ({"input_lens": [1], "output_lens": [2], "ttfts": [-1], "itls": [[0.1]],
      "request_rate": "inf"}, "ttfts, request 1"),
    ({"input_lens": [1], "output_lens": [2], "ttfts": [0.1], "latencies": [0.05],
      "start_times": [0.0]}, "latencies, request 1: expected seconds >= its TTFT"),
    ({"input_lens": [1], "output_lens": [2], "ttfts": [0.1], "itls": [[0.1]],
      "request_rate": 3.0}, "start_times: the file has no start_times"),
    ({"input_lens": [1], "output_lens": [2], "ttfts": [0.1], "itls": [[0.1]],
      "request_rate": "inf", "max_concurrency": 0}, "max_concurrency: expected"),
])
def test_bad_files_give_one_error_and_no_output(tmp_path, doc, needle):
    bad = _write(tmp_path, "bad.json", json.dumps(doc))
    rep_dir, js = tmp_path / "rep", tmp_path / "out.json"
    result = runner.invoke(app, [
        "validate", "--bench-result", str(bad), "--profile", PROFILE, "--policy", str(POLICY),
        "--report", str(rep_dir), "--json-out", str(js),
    ])
    line = one_error_line(result)
    assert str(bad) in line and needle in line
    assert not rep_dir.exists() and not js.exists()


def test_cli_argument_errors(tmp_path, measured):
    base = ["validate", "--bench-result", str(measured), "--profile", PROFILE,
            "--policy", str(POLICY)]
    assert "--calibrate needs -o" in one_error_line(runner.invoke(app, [*base, "--calibrate"]))
    assert "give it with --calibrate" in one_error_line(
        runner.invoke(app, [*base, "-o", str(tmp_path / "p.yaml")]))
    assert "--bench-format 'nope'" in one_error_line(
        runner.invoke(app, [*base, "--bench-format", "nope"]))
    assert "file not found" in one_error_line(runner.invoke(app, [
        "validate", "--bench-result", str(tmp_path / "missing.json"), "--profile", PROFILE,
        "--policy", str(POLICY)]))
    assert "not valid JSON" in one_error_line(runner.invoke(app, [
        "validate", "--bench-result", str(_write(tmp_path, "t.json", "{oops")),
        "--bench-format", "vllm-bench", "--profile", PROFILE, "--policy", str(POLICY)]))


# ----------------------------------------------------------------------------- gpu_time_scale


def test_gpu_time_scale_multiplies_gpu_terms_only(profile):
    st = profile.step_time
    scaled = st.model_copy(update={"gpu_time_scale": 2.0})
    args = (512.0, 8.0, 8.0, 8000.0, 1000.0)
    coef, _ = st.as_arrays("vllm")
    host_step, host_seq = coef[COEF_HOST_STEP], coef[COEF_HOST_SEQ]
    assert host_seq > 0  # vLLM's default host cost per sequence is charged
    gpu = st.seconds(*args) - host_step - host_seq * args[1]
    assert scaled.seconds(*args) == pytest.approx(2 * gpu + host_step + host_seq * args[1])
    # an uncorrected profile's file has no scale line; a corrected one keeps it
    assert "gpu_time_scale" not in document_to_yaml(profile)
    text = document_to_yaml(V.with_step_params(profile, 1e-3, 1e-5, 1.25))
    assert "gpu_time_scale: 1.25" in text
