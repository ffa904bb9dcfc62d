"""A session column in generic CSV / JSON Lines traces: the chain ids it makes (hand-worked),
its errors, and a fitted chat workload whose samples keep the trace's reuse."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from servetune.cli.root import app
from servetune.errors import ServetuneError
from servetune.workloads.fitting import fit_workload, load_workload, sample_trace
from servetune.workloads.formats import load_trace
from servetune.workloads.reuse import reuse_stats
from servetune.workloads.sessions import SESSION_BLOCK_TOKENS, session_prefix_ids
from servetune.workloads.trace import Trace

COLUMNS = "arrival=ts,prompt=in,output=out,session=conv"


def ids_of(trace: Trace) -> list[list[int]]:
    o, f = trace.prefix_offsets, trace.prefix_block_ids
    assert o is not None and f is not None
    return [f[o[i]:o[i + 1]].tolist() for i in range(len(trace))]


# Session A, 16-token blocks over prompt + output:
#   turn 1: prompt 40 + output 10 = 50 tokens: 4 ids (the 4th partial): 0 1 2 3
#   turn 2: prompt 70 >= 50 shares 50 tokens = 3 whole blocks; 90 tokens: 6 ids
#   turn 3: prompt 100 >= 90 shares 90 tokens = 5 whole blocks; 105 tokens: 7 ids
# Session B: turn 1: 25 tokens: 2 ids; turn 2's prompt (10) is shorter than that context,
# so it shares its own 10 tokens, no whole block: a new id.
ROWS = [(0, 40, 10, "A"), (1, 20, 5, "B"), (2, 70, 20, "A"), (3, 100, 5, "A"), (4, 10, 3, "B")]
IDS = [[0, 1, 2, 3], [4, 5], [0, 1, 2, 6, 7, 8], [0, 1, 2, 6, 7, 9, 10], [11]]


def write_csv(path, rows) -> str:
    path.write_text("ts,in,out,conv\n" + "".join(f"{t},{p},{o},{c}\n" for t, p, o, c in rows))
    return str(path)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps({"ts": t, "in": p, "out": o, "conv": c}) + "\n"
                            for t, p, o, c in rows))
    return str(path)


def test_hand_worked_three_turn_session_csv_and_jsonl(tmp_path):
    for path in (write_csv(tmp_path / "t.csv", ROWS), write_jsonl(tmp_path / "t.jsonl", ROWS)):
        trace = load_trace(path, columns=COLUMNS)
        assert trace.prefix_block_tokens == SESSION_BLOCK_TOKENS == 16
        assert ids_of(trace) == IDS, path
    s = reuse_stats(trace)
    assert s.covers_output
    assert s.parent.tolist() == [-1, -1, 0, 2, -1]  # B's 2nd turn shares no block
    assert s.growth_tokens().tolist() == [20, 10]  # 70 - 50, 100 - 90: the user's text


def test_turns_follow_arrival_not_file_order(tmp_path):
    shuffled = [ROWS[3], ROWS[0], ROWS[4], ROWS[2], ROWS[1]]
    trace = load_trace(write_csv(tmp_path / "t.csv", shuffled), columns=COLUMNS)
    assert trace.arrival_s.tolist() == [0, 1, 2, 3, 4]
    assert ids_of(trace) == IDS


def test_equal_times_keep_file_order():
    # two turns at the same time: the first in the file is turn 1
    offsets, ids = session_prefix_ids(np.array([0, 0]), np.array([5.0, 5.0]),
                                      np.array([16, 40]), np.array([16, 1]), block_tokens=16)
    assert offsets.tolist() == [0, 2, 5] and ids.tolist() == [0, 1, 0, 1, 2]


def test_integer_and_text_ids_name_one_session(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"ts": 0, "in": 32, "out": 1, "conv": 7}\n'
                    '{"ts": 1, "in": 40, "out": 1, "conv": "7"}\n')
    assert ids_of(load_trace(str(path), columns=COLUMNS)) == [[0, 1, 2], [0, 1, 3]]


@pytest.mark.parametrize(("fmt", "body", "words"), [
    ("csv", "ts,in,out,conv\n0,40,10,A\n1,20,5,\n",
     "row 2 (line 3): conv: expected a session id (text or a number), not empty, got ''"),
    ("csv", "ts,in,out,conv\n0,40,10,A\n1,20,5,   \n",
     "row 2 (line 3): conv: expected a session id"),
    ("jsonl", '{"ts": 0, "in": 4, "out": 1, "conv": "A"}\n{"ts": 1, "in": 4, "out": 1, '
     '"conv": null}\n', "row 2: conv: expected a session id (text or an integer), not empty, "
     "got None"),
    ("jsonl", '{"ts": 0, "in": 4, "out": 1, "conv": true}\n', "row 1: conv: expected a "
     "session id"),
    ("jsonl", '{"ts": 0, "in": 4, "out": 1, "conv": [1]}\n', "row 1: conv: expected a "
     "session id"),
    ("jsonl", '{"ts": 0, "in": 4, "out": 1}\n', "row 1: missing key 'conv'"),
    ("csv", "ts,in,out,chat\n0,40,10,A\n", "no column 'conv' for session; the header has ts, "
     "in, out, chat"),
])
def test_bad_session_values_are_one_clear_line(tmp_path, fmt, body, words):
    path = tmp_path / f"t.{fmt}"
    path.write_text(body)
    with pytest.raises(ServetuneError) as err:
        load_trace(str(path), columns=COLUMNS)
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{path}: ") and words in text


def test_skipped_bad_session_rows_leave_the_rest(tmp_path):
    path = write_csv(tmp_path / "t.csv", [*ROWS[:2], (1.5, 9, 9, "")] + ROWS[2:])
    trace = load_trace(path, columns=COLUMNS, on_bad_row="skip")
    assert ids_of(trace) == IDS
    assert "skipped 1 bad row(s)" in trace.notices[0]


def test_cli_fit_and_bad_session_column(tmp_path):
    rows = chat_rows(n_sessions=60, seed=3)
    src = write_csv(tmp_path / "chat.csv", rows)
    out = tmp_path / "w.yaml"
    runner = CliRunner()
    result = runner.invoke(app, ["workload", "fit", src, "--columns", COLUMNS, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "prefix reuse: " in result.output and "16-token blocks over the prompt and output" \
        in " ".join(result.output.split())
    model = load_workload(out).prefix_reuse
    assert model is not None and model.covers_output and model.block_tokens == 16
    assert model.sessions is not None and model.system_prompts is None
    bad = tmp_path / "bad.csv"
    bad.write_text("ts,in,out,conv\n0,40,10,A\n1,20,5,\n")
    result = runner.invoke(app, ["workload", "fit", str(bad), "--columns", COLUMNS, "-o",
                                 str(tmp_path / "x.yaml")])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert "row 2 (line 3): conv: expected a session id" in " ".join(result.output.split())
    assert not (tmp_path / "x.yaml").exists()


def test_cli_scale_by(tmp_path):
    src = write_csv(tmp_path / "chat.csv", chat_rows(n_sessions=60, seed=3))
    runner = CliRunner()
    out = tmp_path / "w.yaml"
    result = runner.invoke(app, ["workload", "fit", src, "--columns", COLUMNS, "-o", str(out),
                                 "--scale-by", "sessions", "--quiet"])
    assert result.exit_code == 0, result.output
    assert load_workload(out).prefix_reuse.sessions.scale_by == "sessions"
    assert "scale_by: sessions" in out.read_text()
    result = runner.invoke(app, ["workload", "fit", src, "--columns", COLUMNS, "-o",
                                 str(tmp_path / "x.yaml"), "--scale-by", "users"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--scale-by must be one of time, sessions (got 'users')" in result.output
    assert not (tmp_path / "x.yaml").exists()
    common = ["--profile", "h200-llama-3.1-8b", "--policy",
              "configs/policies/vllm-serve-defaults.yaml", "--slo",
              "configs/slos/mlperf-llama-3.1-8b-server.yaml", "--quiet"]
    result = runner.invoke(app, ["goodput", "--trace", src, "--columns", COLUMNS,
                                 "--scale-by", "sessions", *common])
    assert result.exit_code == 2
    assert "--scale-by applies to --workload" in result.output
    plain = tmp_path / "plain.yaml"
    plain.write_text("apiVersion: servetune/v1\nkind: Workload\nclasses:\n  default:\n"
                     "    arrival: {rate_per_s: 1.0}\n"
                     "    prompt_tokens: {quantiles: [0, 1], values: [10, 100]}\n"
                     "    output_tokens: {quantiles: [0, 1], values: [1, 10]}\n")
    result = runner.invoke(app, ["goodput", "--workload", str(plain), "--scale-by", "time",
                                 *common])
    assert result.exit_code == 2
    assert "--scale-by applies to a workload with sessions" in " ".join(result.output.split())


def test_goodput_by_sessions_resamples_at_each_scale(tmp_path):
    # the one evaluator's sample at a scale: compressed time (time), or sampled again at
    # that scale (sessions): the same requests' count, think times as fitted
    from servetune.sim.evaluator import judged_sample
    from servetune.workloads.fitting import workload_scaled_by

    trace = load_trace(write_csv(tmp_path / "chat.csv", chat_rows(300, seed=2)),
                       columns=COLUMNS)
    workload = fit_workload(trace)
    base = sample_trace(workload, seed=0, n_requests=800)
    same, scale = judged_sample(workload, base, 4.0, 0.0)
    assert same is base and scale == 4.0
    by_sessions = workload_scaled_by(workload, "sessions")
    again, scale = judged_sample(by_sessions, base, 4.0, 0.0)
    assert scale == 1.0 and len(again) == 800
    want = sample_trace(by_sessions, seed=0, n_requests=800, rate_scale=4.0)
    assert np.array_equal(again.arrival_s, want.arrival_s)
    # more sessions at once, each as slow: the think times are not divided by 4
    assert np.median(reuse_stats(again).think_time_s()) > 2 * np.median(
        reuse_stats(base.rate_scaled(4.0)).think_time_s())


# ------------------------------------------------------------------ a chat workload


def chat_rows(n_sessions: int, seed: int, span_s: float = 3600.0) -> list[tuple]:
    """Synthetic conversations: sessions start uniformly over the span, take 1 + a
    geometric number of further turns (mean 3 in all), think 5 s + an exponential 40 s
    between turns; each prompt is the whole context so far plus a new user message."""
    rng = np.random.default_rng(seed)
    rows = []
    for s, t in enumerate(np.sort(rng.uniform(0.0, span_s, n_sessions))):
        context = 200  # the first prompt's instructions
        for _ in range(int(rng.geometric(1 / 3))):
            prompt = context + int(rng.lognormal(4.5, 1.0)) + 1
            output = int(rng.lognormal(5.0, 0.8)) + 1
            rows.append((round(float(t), 3), prompt, output, f"s{s}"))
            context = prompt + output
            t += 5.0 + rng.exponential(40.0)
    return sorted(rows)


def test_chat_workload_sample_keeps_the_reuse(tmp_path):
    trace = load_trace(write_csv(tmp_path / "chat.csv", chat_rows(1500, seed=1)),
                       columns=COLUMNS)
    want = reuse_stats(trace).reuse_ratio
    assert 0.6 < want < 0.7  # about two thirds of the ids are re-sent context
    for arrival in ("auto", "parametric"):
        workload = fit_workload(trace, arrival_process=arrival)
        ratios = []
        for seed in range(3):
            got = reuse_stats(sample_trace(workload, seed=seed, n_requests=len(trace)))
            assert got.reuse_ratio == pytest.approx(want, rel=0.1), (arrival, seed)
            assert got.covers_output
            ratios.append(got.reuse_ratio)
        # the samples replay 95-96% of the trace's later turns (prefixes' HELD_TOLERANCE)
        assert abs(np.mean(ratios) - want) < 0.025, arrival


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 80), st.integers(1, 40),
                          st.integers(0, 3)), min_size=1, max_size=25),
       st.sampled_from([1, 4, 16]))
def test_session_ids_follow_the_rule(rows, b):
    """Any rows: each has ceil((prompt + output) / B) ids; a turn's first
    floor(min(P_k, P_{k-1} + O_{k-1}) / B) ids are its previous turn's and the rest are
    ids no earlier row of any session had; sessions share no id."""
    t, p, o, s = (np.array(c) for c in zip(*rows, strict=True))
    offsets, ids = session_prefix_ids(s, t.astype(float), p, o, block_tokens=b)
    got = [ids[offsets[i]:offsets[i + 1]].tolist() for i in range(len(rows))]
    seen: set[int] = set()
    previous: dict[int, int] = {}
    for i in sorted(range(len(rows)), key=lambda i: (t[i], i)):
        assert len(got[i]) == -(-(p[i] + o[i]) // b)
        k = 0
        if s[i] in previous:
            j = previous[s[i]]
            k = min(p[i], p[j] + o[j]) // b
            assert got[i][:k] == got[j][:k]
        assert not seen & set(got[i][k:])
        seen |= set(got[i])
        previous[s[i]] = i
    for a in set(s.tolist()):
        for c in set(s.tolist()) - {a}:
            assert not ({h for i in np.flatnonzero(s == a) for h in got[i]}
                        & {h for i in np.flatnonzero(s == c) for h in got[i]})


@settings(max_examples=12, deadline=None)
@given(sessions=st.integers(30, 300), seed=st.integers(0, 2**16),
       span=st.sampled_from([600.0, 3600.0]), length=st.sampled_from([0.25, 0.5, 1.0, 3.0]),
       rate_scale=st.sampled_from([0.1, 1.0, 8.0]), by=st.sampled_from(["time", "sessions"]),
       arrival=st.sampled_from(["auto", "parametric"]))
def test_no_sample_is_above_the_traces_bound(tmp_path_factory, sessions, seed, span, length,
                                            rate_scale, by, arrival):
    """Any chat trace, any fit, sample length, rate scale and scaling: the sample never
    re-sends a larger share of its block references than the fitted trace (the trace's
    infinite-cache bound), so its hit-rate curve is never above that bound."""
    path = tmp_path_factory.mktemp("chat") / "chat.csv"
    trace = load_trace(write_csv(path, chat_rows(sessions, seed=seed, span_s=span)),
                       columns=COLUMNS)
    bound = reuse_stats(trace).reuse_ratio
    workload = fit_workload(trace, arrival_process=arrival, scale_by=by)
    sample = sample_trace(workload, seed=seed, n_requests=max(1, int(length * len(trace))),
                          rate_scale=rate_scale)
    assert reuse_stats(sample).reuse_ratio <= bound + 1e-6


def test_a_silent_level_seen_only_last_is_left_again(tmp_path):
    # a sparse chat trace (658 requests over an hour) whose modulated fit saw no window
    # after a silent one turn busy: the silent level's only transition led back to itself,
    # an absorbing silence the schema refuses (hypothesis found it through the test above)
    trace = load_trace(write_csv(tmp_path / "c.csv", chat_rows(211, seed=395)),
                       columns=COLUMNS)
    workload = fit_workload(trace, arrival_process="parametric")
    modulation = workload.classes["default"].arrival.modulation
    assert modulation is not None
    for level, row in zip(modulation.levels, modulation.transitions, strict=True):
        if level == 0:
            assert sum(p for p, rate in zip(row, modulation.levels, strict=True) if rate > 0) > 0
    assert len(sample_trace(workload, seed=0, duration_s=trace.duration_s)) > 100
