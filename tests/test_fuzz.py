"""Fuzz harness: bad documents of every kind, bad traces of every format and bad benchmark
results go through the real CLI (in-process); each run ends with exit 2 or 3 and exactly
one ``servetune: error:`` line, no traceback and no file written; or, when the mutated
input happens to be valid, exit 0 with its output (see tests/fuzz_inputs.py).

The default run tries a few inputs per target, on a fixed sequence (CI must not flake).
A full run::

    SERVETUNE_FUZZ_EXAMPLES=12000 SERVETUNE_FUZZ_REPORT=fuzz.json \
        .venv/bin/pytest -q -p no:cacheprovider tests/test_fuzz.py

spreads that many inputs over the targets, keeps going past a failure (so that it can
count them), writes the counts and the first failing inputs per target to the report,
and then fails the targets that had any. A crash of the interpreter itself (a segfault
in a library) ends the run with no report; the input that did it is still on disk, in
the newest ``servetune-fuzz-*`` folder of the temporary directory (each case's folder is
removed only after the case).
"""

from __future__ import annotations

import base64
import json
import math
import os
import resource
from pathlib import Path

import pytest
from fuzz_inputs import (
    FAULTS,
    MEMORY_BOUND_BYTES,
    PLACE_FILES,
    POLICY,
    PRINTERS,
    PROFILE_NAME,
    REPO,
    SIM,
    STDOUT_FAULTS,
    TINY_TRACE,
    Case,
    Tally,
    alias_bomb,
    all_targets,
    bound_cases,
    bounded_run,
    fault_cases,
    run_case,
    stdout_fault_run,
    stubbed_work,
)
from hypothesis import HealthCheck, Phase, given, seed, settings

TARGETS = all_targets()
FULL_RUN = int(os.environ.get("SERVETUNE_FUZZ_EXAMPLES", "0"))
PER_TARGET = math.ceil(FULL_RUN / len(TARGETS)) if FULL_RUN else 16
# Another sequence of inputs (to explore further); by default the same inputs on every
# run: CI must not flake.
SEED = os.environ.get("SERVETUNE_FUZZ_SEED")
FUZZ = settings(
    max_examples=PER_TARGET,
    derandomize=SEED is None,
    database=None,
    deadline=None,
    print_blob=True,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: a hang would take hours
    suppress_health_check=list(HealthCheck),
)
TALLY = Tally()


# An input that makes a command allocate without bound is a MemoryError (a failure the
# tally shows), not the machine's OOM killer ending the run.
MEMORY_LIMIT_BYTES = int(float(os.environ.get("SERVETUNE_FUZZ_MEMORY_GB", "8")) * 2**30)


@pytest.fixture(scope="module", autouse=True)
def _stubs_and_report():
    old = resource.getrlimit(resource.RLIMIT_AS)
    hard = old[1]
    soft = MEMORY_LIMIT_BYTES if hard == resource.RLIM_INFINITY else min(MEMORY_LIMIT_BYTES, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    try:
        with stubbed_work():
            yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)
    _write_report()


def _write_report() -> None:
    """The counts so far, to SERVETUNE_FUZZ_REPORT when it is set (after each target, so
    that a run cut short still leaves them)."""
    path = os.environ.get("SERVETUNE_FUZZ_REPORT")
    if path:
        report = {"examples_asked": FULL_RUN or PER_TARGET * len(TARGETS),
                  "per_target_examples": PER_TARGET, **TALLY.report()}
        Path(path).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize("target", TARGETS, ids=[t.name for t in TARGETS])
def test_bad_inputs_fail_in_one_line(target):
    @FUZZ
    @given(case=target.cases())
    def one(case: Case) -> None:
        outcome = run_case(case)
        TALLY.record(target.name, case, target.fuzzed, outcome)
        if not FULL_RUN:  # a full run counts failures instead of stopping at the first
            assert outcome.status != "failed", (outcome.problem, outcome.output,
                                                outcome.detail)

    if SEED is not None:
        one = seed(int(SEED))(one)
    try:
        one()
    finally:
        _write_report()
    assert TALLY.failed(target.name) == 0, TALLY.failures.get(target.name)


# ----------------------------------------------------------------------------- output faults


FAULT_CASES = fault_cases()


@pytest.mark.parametrize("case", FAULT_CASES,
                         ids=[f"{c.fault}:{' '.join(c.argv[:2])}:{i // len(FAULTS)}"
                              for i, c in enumerate(FAULT_CASES)])
def test_a_failing_output_folder_is_one_line_and_leaves_nothing(case):
    """Every command that writes into its output folder, with that folder read-only or
    full: one error line (or its stubbed work reached before a byte is written), exit 2,
    nothing left there, no traceback."""
    with stubbed_work():
        outcome = run_case(case)
    TALLY.record(case.kind, case, case.files[0][0] if case.files else "", outcome)
    assert outcome.status in ("error", "reached"), (outcome.problem, outcome.output,
                                                   outcome.detail)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
@pytest.mark.parametrize("fault", STDOUT_FAULTS)
@pytest.mark.parametrize("files,argv", PRINTERS, ids=[" ".join(a[:2]) for _, a in PRINTERS])
def test_a_failing_stdout_is_one_line_or_a_quiet_end(files, argv, fault):
    """Every printing command with standard output full or closed: one `stdout:` error
    line and exit 2; with a reader that left: a quiet end with the command's own exit 0."""
    code, err = stdout_fault_run(files, argv, fault)
    assert "Traceback" not in err, err
    if fault == "pipe closed early":
        assert (code, err) == (0, "")
    else:
        assert code == 2, err
        assert len(err.splitlines()) == 1 and err.startswith("servetune: error: stdout: "), err


# ----------------------------------------------------------------------------- the judge


def _case(fuzzed: str, data: bytes, *argv: str, companions=(), writes=None) -> Case:
    return Case("regression", ((fuzzed, data), *companions), tuple(argv), writes)


def test_the_judge_accepts_a_valid_input_and_one_error_line():
    """The harness itself: a valid policy exports (exit 0, file written); a broken one is
    one error line; the stubbed optimizer is reached by a valid space."""
    with stubbed_work():
        ok = run_case(_case("policy.yaml", POLICY, "export", "--policy", "{in}/policy.yaml",
                            "--engine", "vllm", "-o", "{out}/v.yaml", writes="v.yaml"))
        assert ok.status == "ok", ok
        bad = run_case(_case("policy.yaml", b"apiVersion: servetune/v1\nkind: Policy\nx: 1\n",
                             "export", "--policy", "{in}/policy.yaml", "--engine", "vllm",
                             "-o", "{out}/v.yaml"))
        assert bad.status == "error" and bad.exit_code == 2, bad
        assert "x: unknown key" in bad.output


def test_the_judge_flags_two_lines_and_a_written_file(monkeypatch):
    import servetune.export as export  # the command imports export_policy from it when run
    from servetune.errors import ServetuneError

    def noisy(*args, **kwargs):
        print("half a result")
        raise ServetuneError("then an error")

    monkeypatch.setattr(export, "export_policy", noisy)
    out = run_case(_case("policy.yaml", POLICY, "export", "--policy", "{in}/policy.yaml",
                         "--engine", "vllm"))
    assert out.status == "failed" and "2 lines" in out.problem

    def boom(*args, **kwargs):
        raise KeyError("x")

    monkeypatch.setattr(export, "export_policy", boom)
    out = run_case(_case("policy.yaml", POLICY, "export", "--policy", "{in}/policy.yaml",
                         "--engine", "vllm"))
    assert out.status == "failed" and out.problem.startswith("traceback: KeyError")


# ----------------------------------------------------------------------------- regressions
# Inputs the fuzzer found that broke the rule (a hang, a traceback, a warning), kept as
# exact cases: each is now one error line.

SIM_TRACE = (*SIM, "--trace", "{in}/trace.csv", "--policy", "{in}/policy.yaml")
EXPORT = ("export", "--policy", "{in}/policy.yaml", "--engine", "vllm", "-o", "{out}/v.yaml")
VALIDATE = ("validate", "--bench-result", "{in}/result", "--profile", PROFILE_NAME,
            "--policy", "{in}/policy.yaml")


def _expect_error(case: Case, needle: str) -> None:
    with stubbed_work():
        outcome = run_case(case, timeout_s=60)
    assert outcome.status == "error", (outcome.problem, outcome.output, outcome.detail)
    assert needle in outcome.output, outcome.output


def _policy_with(line: str) -> bytes:
    return POLICY.replace(b"apiVersion: servetune/v1", line.encode(), 1)


def test_analias_bomb_is_refused_not_expanded():
    """Found: nine levels of nine aliases under apiVersion hung `export` (the error message
    printed the 9**9-leaf value); any field validated the same way hung too."""
    case = _case("policy.yaml", _policy_with("apiVersion: " + alias_bomb("1", False)), *EXPORT)
    _expect_error(case, "aliases (*name) expand to over 100,000 values")
    meta = POLICY.replace(b"metadata: {}", b"metadata: " + alias_bomb("1", True).encode())
    _expect_error(_case("policy.yaml", meta, *EXPORT), "expand to over 100,000 values")


def test_a_recursive_alias_is_refused():
    case = _case("policy.yaml", POLICY.replace(b"metadata: {}", b"metadata: &r {a: *r}"),
                 *EXPORT)
    _expect_error(case, "refers to a node that contains it")


def test_aliases_that_reuse_a_little_still_load():
    from servetune.schemas.base import load_yaml

    text = "base: &b {a: 1, b: 2}\nx:\n  <<: *b\n  a: 5\ny: [*b, *b]\n"
    assert load_yaml(text)["y"] == [{"a": 1, "b": 2}] * 2


def _plan_with(old: bytes, new: bytes) -> bytes:
    plan = dict(PLACE_FILES)["plan.yaml"]
    assert old in plan
    return plan.replace(old, new, 1)


PLACE_ARGV = ("place", "--jobs", "{in}/jobs.yaml", "--plan", "{in}/plan.yaml", "--forecast",
              "{in}/forecast.yaml", "-o", "{out}/schedule.yaml", "--cache-dir", "{out}/cache",
              "-q")


@pytest.mark.parametrize(("old", "new", "needle"), [
    # found: a plan's GPU-type policy was validated only when place simulated it (a
    # pydantic traceback), and a non-string input path was a TypeError
    (b"      max_num_seqs: 128\n", b"      max_num_seqs: 128\n      x: 1\n",
     "gpu_types.0.policy: not a valid Policy: batching.x: unknown key"),
    (b"    kind: Policy\n", b"    kind: true\n", "gpu_types.0.policy: not a valid Policy: kind"),
    (b"    path: workload.yaml", b"    path: 1_000", "inputs: workload: expected {path: FILE"),
    # seen while fixing those: sample values place re-samples with
    (b"  requests: 20000", b"  requests: 1000000000000", "sample: requests: expected"),
    (b"  - 2048\n  output_edges", b"  - abc\n  output_edges", "sample: prompt_edges: expected"),
    (b"slot_s: 3600.0", b"slot_s: 0", "slot_s: Input should be greater than 0"),
    (b"engine: vllm", b"engine: vllm2", "engine: Input should be"),
])
def test_a_bad_capacity_plan_is_one_line(old, new, needle):
    files = tuple((n, d) for n, d in PLACE_FILES if n != "plan.yaml")
    _expect_error(_case("plan.yaml", _plan_with(old, new), *PLACE_ARGV, companions=files),
                  needle)


def test_bad_benchmark_results_are_one_line():
    """Found: an AIPerf metric whose unit is a mapping (TypeError), a bench result whose
    backend is not a string (AttributeError)."""
    from fuzz_inputs import bench_seeds

    seeds = bench_seeds()
    aiperf = seeds["aiperf"].replace(b'"unit": "ms"', b'"unit": {"a": [1]}', 1)
    _expect_error(_case("result", aiperf, *VALIDATE, companions=(("policy.yaml", POLICY),)),
                  "metrics.time_to_first_token")
    sglang = (b'{"backend": {}, "request_rate": "inf", "max_concurrency": 2, "input_lens": [], '
              b'"output_lens": [4, 2, 9], "ttfts": [0.05, 0.06, 0.02], "itls": [[0.01], [0.02], '
              b'[0.01]], "errors": ["", "", ""]}\n')
    _expect_error(_case("result", sglang, *VALIDATE, companions=(("policy.yaml", POLICY),)),
                  "input_lens: empty: the run has no requests")


def test_huge_numbers_in_benchmark_results_and_jobs_are_one_line():
    """Found: a token count of 1e400 or 2e22 in an AIPerf record (OverflowError converting
    it), a job of 10**400 requests (OverflowError in place)."""
    from fuzz_inputs import bench_seeds

    aiperf = bench_seeds()["aiperf"]
    for value in (b"1" + b"0" * 400, b"2e+22"):
        bad = aiperf.replace(b'"value": 200, "unit": "tokens"', b'"value": ' + value
                             + b', "unit": "tokens"', 1)
        _expect_error(_case("result", bad, *VALIDATE, "--bench-format", "aiperf",
                            companions=(("policy.yaml", POLICY),)),
                      "metrics.input_sequence_length: expected a whole number >= 1")
    jobs = (REPO / "configs/batch_jobs/nightly.yaml").read_bytes().replace(
        b"requests: 30000", b"requests: 1" + b"0" * 400)
    files = tuple((n, d) for n, d in PLACE_FILES if n != "jobs.yaml")
    _expect_error(_case("jobs.yaml", jobs, *PLACE_ARGV, companions=files),
                  "jobs.2.requests: a whole number beyond")


@pytest.mark.parametrize(("change", "needle"), [
    # found by the full run: request_rate 10**400 (OverflowError converting it)
    ({"request_rate": 10**400}, "request_rate: expected a number > 0"),
    # found by hand next to it: ITLs that add up to inf broke the report (a TypeError)
    ({"latencies": None, "itls": [[1e308, 1e308]] * 4}, "itls, request 1: the gaps add up"),
])
def test_huge_numbers_in_a_vllm_bench_result_are_one_line(change, needle):
    from fuzz_inputs import bench_seeds

    doc = {**json.loads(bench_seeds()["vllm-bench"]), **change}
    doc = {k: v for k, v in doc.items() if v is not None}
    _expect_error(_case("result", json.dumps(doc).encode(), *VALIDATE,
                        companions=(("policy.yaml", POLICY),)), needle)


def test_an_infinite_count_in_measured_steps_is_one_line():
    """Found by an exploring run (SERVETUNE_FUZZ_SEED=1): decode_seqs -inf in a whole-step
    CSV (OverflowError from int(inf) in `profile check`)."""
    lines = (REPO / "gpu_profiles/calibration/h200/step_graph_llama-3.1-8b.csv"
             ).read_text().splitlines()[:4]
    lines[2] = lines[2].replace(",1,2048,", ",-inf,2048,")
    case = _case("steps.csv", ("\ufeff" + "\n".join(lines)).encode(), "profile", "check",
                 "--profile", PROFILE_NAME, "--measured", "{in}/steps.csv", "--json")
    _expect_error(case, "line 3, column 'decode_seqs': expected an integer (got '-inf')")


# A gzipped BurstGPT trace whose rows the fuzzer garbled (SERVETUNE_FUZZ_SEED=2).
GARBLED_BURSTGPT = base64.b64decode(
    "H4sIAAAAAAACA+1bMUvDQBTeH9x/6OR0lkvaWDpKBxFUimSXgqEW21w1UXAUujiLmwiOTi4uUnBIf45j/4Cx"
    "UhFdMpyX710yNHBpSB6Pd++97/vehaNJlKSDyVTu6+NoLA+js4v8RiPVp1Gc5MtkquMkWq9DnQ7G68WeHjbC"
    "q2kkKGgq2TsZpDv9UHpKSV9JL//1dHwZnSeDdKTjxlgPyWsGMn9msy0DJTsy6Mjucvb0spFkj9nDYv4+fxXU"
    "afrB98u22kqq1fX3uwR1849+vayl8m+2PV+2Pi9/nuz+tM6XnvRacru/u/rPnOWFDS9sNxkwXBTxeUHLC3vc"
    "iOHm7DYUKoTscmHJ5cajnEy43GRiMRLl4BkRzunCptOFwWROeNncfCEykhXZ1n6TlQisZ/kHj5OlYLGazs3W"
    "frudIrbp1ioR4g4FzInYNRSs47JbhvBSi2DccREyKMJrFu1if7aW880uZXAWfHkictHl5DwZihcr0C2uJbKl"
    "LkJmW9wyCAsCE1nwUjko1VIrW7Y5f0Fo+xMbO6O1LFXfn8RWweVLnLtfQeFE8ypwW5zlZ4e7XMsglIAJCzCP"
    "U82bc3V6CQ1X1YdDoBERY+BvTe9nO0pU80TQky1oij9bAhp0OgQPh7KlW6B1FsF12M/aoD9n6E+goAivW8SO"
    "mGrLuPU5ItsMF99ZIr5iC97BkDKiHI4PJecFLrRk7rrdotLFs8YUsKcqyWUAypmVc35QvhLYGQ86ww3NuX/C"
    "v7Dh2e1itny7uTvIro+y5+yeJ6MLp6HDiaJcBRfb9fQDK5rq0edIAAA="
)


def test_a_fit_whose_shifts_leave_no_spread_is_one_line():
    """Found by an exploring run: `workload fit --split-by class --rate-windows 1` on this
    trace divided by zero (the length shifts took all the variance within windows)."""
    case = _case("trace", GARBLED_BURSTGPT, "workload", "fit", "{in}/trace", "-o",
                 "{out}/w.yaml", "--split-by", "class", "--rate-windows", "1",
                 "--on-bad-row", "skip", companions=(("policy.yaml", POLICY),))
    _expect_error(case, "cannot fit a workload: length_shift.prompt: the shifts' variance")


def test_a_number_beyond_int64_in_a_profile_is_one_line():
    """Found by an exploring run: kv_blocks_override: 10**400 (OverflowError in export)."""
    big = (REPO / "tests/fuzz_data/place/big.yaml").read_bytes().replace(
        b"kv_blocks_override: 2000", b"kv_blocks_override: 1" + b"0" * 400)
    case = _case("profile.yaml", big, "export", "--policy", "{in}/policy.yaml", "--engine",
                 "vllm", "--profile", "{in}/profile.yaml", "-o", "{out}/v.yaml",
                 companions=(("policy.yaml", POLICY),))
    _expect_error(case, "memory.kv_blocks_override: a whole number beyond")
    case = _case("profile.yaml", big.replace(b"1" + b"0" * 400, b"1" + b"0" * 12), "export",
                 "--policy", "{in}/policy.yaml", "--engine", "vllm", "--profile",
                 "{in}/profile.yaml", companions=(("policy.yaml", POLICY),))
    _expect_error(case, "memory.kv_blocks_override: Input should be less than or equal to")


@pytest.mark.parametrize(("cut", "needle"), [
    # found: a profile cut short before step_time was read with every step taking 0 s;
    # `profile show` divided by zero (a RuntimeWarning and "inf" tokens/s)
    (b"parallelism:", "step_time: a one-token step would take 0 s"),
])
def test_a_profile_without_a_step_time_is_refused(cut, needle):
    text = (REPO / "gpu_profiles/h100-80gb-llama-3.1-70b-tp4.yaml").read_bytes()
    case = _case("profile.yaml", text[: text.index(cut)], "profile", "show", "{in}/profile.yaml")
    _expect_error(case, needle)
    tiny = text.replace(b"constant_s: null", b"constant_s: 1.0e-320")
    _expect_error(_case("profile.yaml", tiny, "profile", "show", "{in}/profile.yaml"),
                  "would take 1e-320 s")


def test_sim_trace_runs_with_the_shipped_profile():
    """The companion files of the simulate targets are valid on their own."""
    case = _case("policy.yaml", POLICY, *SIM_TRACE, companions=(("trace.csv", TINY_TRACE),))
    with stubbed_work():
        assert run_case(case).status == "ok"


def test_a_huge_search_space_is_one_line(tmp_path):
    """Found by an exploring run (SERVETUNE_FUZZ_SEED=2): a 4 MiB space file made nightly
    build a MILP over every combination and give no answer in 30 s. Now the space's size
    is bounded in the schema: one line naming the count and the limit."""
    from servetune.errors import ServetuneError
    from servetune.schemas.base import load_document
    from servetune.schemas.space import MAX_SPACE_POINTS, MAX_VALUES_PER_KNOB, SearchSpace

    many = tmp_path / "many.yaml"
    many.write_text("apiVersion: servetune/v1\nkind: SearchSpace\nknobs:\n"
                    f"  batching.max_num_seqs: {list(range(1, MAX_VALUES_PER_KNOB + 2))}\n")
    with pytest.raises(ServetuneError, match="1,001 values; at most 1,000"):
        load_document(many, SearchSpace)
    grid = tmp_path / "grid.yaml"
    grid.write_text("apiVersion: servetune/v1\nkind: SearchSpace\nknobs:\n"
                    f"  batching.max_num_seqs: {list(range(1, 401))}\n"
                    f"  batching.max_num_batched_tokens: {list(range(1000, 1301))}\n")
    with pytest.raises(ServetuneError, match="120,400 combinations"):
        load_document(grid, SearchSpace)
    assert 400 * 250 <= MAX_SPACE_POINTS


# ----------------------------------------------------------------------------- resource bounds
@pytest.mark.slow
@pytest.mark.parametrize("case", bound_cases(), ids=lambda c: c[0])
def test_the_largest_accepted_size_runs_in_bounded_memory(case):
    """Every size flag at its largest accepted value (and the most replicas the cluster
    state bound admits) runs to completion under MEMORY_BOUND_BYTES; a sweep of the most
    jobs a file may hold says how many it runs before the first, and stops cleanly on
    Ctrl-C (benchmarks/RESULTS.md, "Resource bounds", has the measured peaks)."""
    what, argv, stop_after_s = case
    code, peak, _, stderr = bounded_run(argv, stop_after_s)
    assert peak < MEMORY_BOUND_BYTES, (what, peak)
    if stop_after_s:
        assert code == 130, (what, stderr[-2000:])
        assert stderr.splitlines()[0].endswith("10,000 jobs"), stderr[:500]
    else:
        assert code == 0, (what, stderr[-2000:])
        assert "Traceback" not in stderr
