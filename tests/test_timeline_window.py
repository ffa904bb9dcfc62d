"""A timeline window built while the engine runs (issue 14: bounded memory).

The engine hands its step log to the timeline a chunk at a time and keeps none of it; the
result must be byte-identical to filtering the whole step log afterwards, for windows cut
mid-step, empty windows and windows past the end, however often the log's buffer is
drained (tests shrink it to a few records), and identical to the Python replay servetune
used before (``timeline_oracle.py``). Only the records the window shows are ever turned
into Python objects.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import timeline_oracle as oracle
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine_invariants import cases

from servetune.errors import ServetuneError
from servetune.profiles.shipped import load_profile
from servetune.profiles.steptime import StepTimeModel
from servetune.schemas.policy import Policy
from servetune.sim import _kernel as K
from servetune.sim import engine as E
from servetune.sim import simulate
from servetune.sim.timeline import TimelineBuilder, build_timeline, record_end_s, timeline_json
from servetune.workloads.trace import from_arrays

INF = float("inf")
STEP_TIME = StepTimeModel(fixed_s=0.003, gemm_pieces=[(0.004, 1e-4)],
                          decode_attn_s_per_context_token=1.7e-5, lm_head_s_per_row=2e-4)


@pytest.fixture
def tiny_buffers(monkeypatch):
    """A step-log buffer of 3 records and a few events: drained (and its event columns
    grown) many times in a run."""
    monkeypatch.setattr(E, "LOG_RECORDS", 3)
    monkeypatch.setattr(E, "LOG_EVENTS", 5)


def busy_trace(seed: int = 0, n: int = 80):
    """Bursts of arrivals, then an idle gap of 100 s, then a second burst."""
    rng = np.random.default_rng(seed)
    gaps = rng.choice([0.0, 0.0, 0.01, 0.05, 0.4], size=n)
    gaps[n // 2] = 100.0
    arrival = np.cumsum(gaps)
    prompt = rng.integers(1, 120, size=n)
    output = rng.integers(1, 60, size=n)
    prompt[5] = 10_000  # never fits the pool: rejected at arrival
    return from_arrays(arrival, prompt, output,
                       priority=rng.integers(0, 3, size=n).astype(np.int32))


# engine, pool (blocks of 16 tokens), policy: small pools preempt / retract; queue caps shed
RUNS = [
    ("vllm", 14, Policy(batching={"max_num_seqs": 8, "max_num_batched_tokens": 64})),
    ("vllm", 40, Policy(scheduling="priority", batching={"max_num_seqs": 4},
                        admission={"max_queued_requests": 6})),
    ("sglang", 14, Policy(batching={"max_num_seqs": 8, "max_num_batched_tokens": 64})),
    ("trtllm", 30, Policy(batching={"max_num_seqs": 6},
                          admission={"max_queued_prompt_tokens": 400})),
    ("tgi", 30, Policy(batching={"max_num_seqs": 6, "enable_chunked_prefill": True},
                       admission={"max_queued_requests": 8})),
]


def whole_log_timeline(trace, policy, kv_blocks, engine, window, block_size=16,
                       step_time=STEP_TIME, reference=False):
    """The timeline filtered from the whole step log after the run (default buffers)."""
    out = E.run_engine(trace, policy, kv_blocks, block_size, step_time, engine=engine,
                       reference=reference, step_log=True)
    doc = build_timeline(out.step_log, trace.arrival_s, trace.prompt_tokens,
                         status=out.status, reason=out.reason, reasons=E.REASONS,
                         window=window)
    return out, timeline_json(doc)


def streamed_timeline(trace, policy, kv_blocks, engine, window, block_size=16,
                      step_time=STEP_TIME, reference=False):
    """The timeline built while the engine runs; the run keeps no step log."""
    builder = TimelineBuilder(trace.arrival_s, trace.prompt_tokens, window)
    out = E.run_engine(trace, policy, kv_blocks, block_size, step_time, engine=engine,
                       reference=reference, on_step_log=builder.add)
    assert out.step_log is None
    doc = builder.finish(status=out.status, reason=out.reason, reasons=E.REASONS)
    return out, timeline_json(doc)


def windows_of(log, end_s):
    """Windows cut mid-step, at step boundaries, empty (in the idle gap), past the end."""
    spans = [(float(r["start_s"]), float(r["start_s"]) + float(r["duration_s"])) for r in log]
    busy = [(a, b) for a, b in spans if b > a]
    (a3, b3), (a9, b9) = busy[3], busy[min(9, len(busy) - 1)]
    gap = max(zip(spans, spans[1:], strict=False), key=lambda p: p[1][0] - p[0][1])
    return [
        None,
        (0.0, INF),
        ((a3 + b3) / 2, (a9 + b9) / 2),  # both ends mid-step
        (a3, b9),  # exactly at step boundaries
        (b3, b3),  # a single instant: the steps ending and starting there
        (gap[0][1] + 1.0, gap[1][0] - 1.0),  # inside the idle gap: no steps
        (end_s + 1.0, end_s + 50.0),  # past the end
        (end_s, INF),
        (end_s / 2, INF),
    ]


@pytest.mark.parametrize("engine,kv_blocks,policy", RUNS)
def test_streamed_window_equals_the_filtered_whole_log(engine, kv_blocks, policy,
                                                       monkeypatch):
    trace = busy_trace()
    out, _ = whole_log_timeline(trace, policy, kv_blocks, engine, None)
    # the runs exercise what the replay tracks: preemption or shedding, rejection, jumps
    assert out.preemptions.sum() > 0 or (out.status == 1).any()
    assert (out.status == 2).any() and any("repeat" in r for r in out.step_log)
    windows = windows_of(out.step_log, float(out.sim_end_s))
    expected = {w: whole_log_timeline(trace, policy, kv_blocks, engine, w)[1] for w in windows}
    for records, events in ((E.LOG_RECORDS, E.LOG_EVENTS), (3, 5)):
        monkeypatch.setattr(E, "LOG_RECORDS", records)
        monkeypatch.setattr(E, "LOG_EVENTS", events)
        for w in windows:
            assert streamed_timeline(trace, policy, kv_blocks, engine, w)[1] == expected[w], w


def test_windows_past_the_end_or_in_a_gap_show_no_steps():
    trace = busy_trace()
    engine, kv_blocks, policy = RUNS[0]
    out, _ = whole_log_timeline(trace, policy, kv_blocks, engine, None)
    end = float(out.sim_end_s)
    for w in windows_of(out.step_log, end)[5:7]:
        doc = json.loads(streamed_timeline(trace, policy, kv_blocks, engine, w)[1])
        assert not [e for e in doc["traceEvents"] if e["pid"] == 1 and e["ph"] != "M"]
        assert doc["otherData"]["window_s"] == list(w)


def test_reference_mode_streams_the_same(tiny_buffers):
    trace = busy_trace(1, 40)
    engine, kv_blocks, policy = RUNS[2]
    out, _ = whole_log_timeline(trace, policy, kv_blocks, engine, None, reference=True)
    for w in windows_of(out.step_log, float(out.sim_end_s))[:5]:
        assert (streamed_timeline(trace, policy, kv_blocks, engine, w, reference=True)[1]
                == whole_log_timeline(trace, policy, kv_blocks, engine, w,
                                      reference=True)[1])


def test_drained_step_log_is_the_same_log(monkeypatch):
    """However often the buffer is drained (or its events grown), the records are the
    same: a jumped stretch is never cut where the buffer happens to fill."""
    trace = busy_trace(2)
    for engine, kv_blocks, policy in RUNS:
        whole = E.run_engine(trace, policy, kv_blocks, 16, STEP_TIME, engine=engine,
                             step_log=True)
        monkeypatch.setattr(E, "LOG_RECORDS", 2)
        monkeypatch.setattr(E, "LOG_EVENTS", 1)
        drained = E.run_engine(trace, policy, kv_blocks, 16, STEP_TIME, engine=engine,
                               step_log=True)
        monkeypatch.undo()
        assert drained.step_log == whole.step_log
        assert drained.jumps == whole.jumps


def test_only_the_window_records_become_python_objects(tiny_buffers, monkeypatch):
    """Memory for the timeline grows with the window: records outside it stay numbers in
    the (drained) buffer; only those the window shows are built as dicts."""
    built: list[int] = []
    real = E._step_records

    def counting(log, total, first, stop):
        built.append(stop - first)
        return real(log, total, first, stop)

    monkeypatch.setattr(E, "_step_records", counting)
    trace = busy_trace(3, 200)
    engine, kv_blocks, policy = RUNS[0]
    builder = TimelineBuilder(trace.arrival_s, trace.prompt_tokens, (1.0, 1.5))
    out = E.run_engine(trace, policy, kv_blocks, 16, STEP_TIME, engine=engine,
                       on_step_log=builder.add)
    doc = builder.finish(status=out.status)
    shown = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    assert 0 < len(shown) < out.steps / 10
    assert sum(built) == len(shown)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases(), data=st.data())
def test_streamed_and_filtered_equal_the_oracle_on_random_runs(case, data):
    """Byte-identical to the Python replay servetune used before (tests/timeline_oracle.py),
    for windows whose ends fall on step boundaries, inside steps, or past the end (that
    replay predates prefix caching: a re-prefill computes everything there)."""
    trace, policy, kv_blocks, block_size, step_time, engine = case
    policy = policy.model_copy(update={"caching": policy.caching.model_copy(
        update={"enable_prefix_caching": False})})
    out = E.run_engine(trace, policy, kv_blocks, block_size, step_time, engine=engine,
                       step_log=True)
    end = float(out.sim_end_s)
    bounds = sorted({0.0} | {float(r["start_s"]) for r in out.step_log}
                    | {record_end_s(r) for r in out.step_log})
    point = st.one_of(st.sampled_from(bounds), st.floats(0.0, 1.2 * end + 1.0))
    lo, hi = sorted((data.draw(point), data.draw(point)))
    window = data.draw(st.sampled_from([None, (lo, hi), (lo, INF)]))
    args = (trace, policy, kv_blocks, engine, window, block_size, step_time)
    expected = timeline_json(oracle.build_timeline(
        out.step_log, trace.arrival_s, trace.prompt_tokens, status=out.status,
        reason=out.reason, reasons=E.REASONS, window=window))
    assert whole_log_timeline(*args)[1] == expected
    with pytest.MonkeyPatch.context() as mp:  # a buffer drained every two records
        mp.setattr(E, "LOG_RECORDS", 2)
        mp.setattr(E, "LOG_EVENTS", 1)
        assert streamed_timeline(*args)[1] == expected


def test_drain_keeps_the_events_of_the_record_not_yet_written():
    """Events logged before their record (arrivals turned away while the engine idles)
    stay in the buffer, at its front, when the records before them are drained."""
    log = E._new_step_log(True, 4, reference=False)
    counts = log.counts[0]
    log.event_kind[:3] = (K.EV_ADMIT, K.EV_SCHED, K.EV_SHED)
    log.event_req[:3] = (0, 0, 7)
    log.event_value[:3] = (0, 5, 0)
    log.step[0], log.start_s[0], log.duration_s[0], log.repeat[0] = 0, 0.0, 0.5, 1
    log.events_end[0], log.repeats_end[0] = 2, 0
    counts.records, counts.events = 1, 3
    got = []
    assert E._drain(log, 10, [lambda chunk: got.append(chunk.records(0, 1))]) == 1
    assert got == [[{
        "step": 0, "start_s": 0.0, "duration_s": 0.5, "scheduled": [[0, 5]],
        "preempted": [], "finished": [], "admitted": [0], "shed": [],
        "kv_blocks_used": 0, "kv_blocks_total": 10, "waiting": 0, "running": 0,
    }]]
    assert (counts.records, counts.events, counts.repeats) == (0, 1, 0)
    assert (log.event_kind[0], log.event_req[0]) == (K.EV_SHED, 7)


def test_window_boundaries_worked_by_hand():
    """A phase or step is shown when it overlaps the closed window [lo, hi]: one that ends
    exactly at lo or starts exactly at hi is shown; zero-length phases never are."""
    # r0: prompt 4, 3 tokens; r1: prompt 2, 2 tokens, arrives at 0.05 (as tests/test_timeline)
    def step(k, start, scheduled, **kw):
        rec = {"step": k, "start_s": start, "duration_s": 0.1, "scheduled": scheduled,
               "preempted": [], "finished": [], "admitted": [], "shed": [],
               "kv_blocks_used": 1, "kv_blocks_total": 8, "waiting": 0, "running": 1}
        return rec | kw

    log = [step(0, 0.0, [[0, 4]], admitted=[0]),
           step(1, 0.1, [[0, 1], [1, 2]], admitted=[1]),
           step(2, 0.2, [[0, 1], [1, 1]], finished=[0, 1])]
    arrival, prompt = np.array([0.0, 0.05]), np.array([4, 2])
    t_end = 0.2 + 0.1  # the last step's end, as the replay adds it

    def shown(window):
        doc = build_timeline(log, arrival, prompt, window=window)
        assert timeline_json(doc) == timeline_json(
            oracle.build_timeline(log, arrival, prompt, window=window))
        return sorted((e["pid"], e.get("tid"), e["name"]) for e in doc["traceEvents"]
                      if e["ph"] == "X")

    steps = [(1, 0, "prefill"), (1, 0, "prefill+decode"), (1, 0, "decode")]
    assert shown((t_end, t_end)) == [(1, 0, "decode"), (2, 0, "decode"), (2, 1, "decode")]
    assert shown((0.0, 0.05)) == [steps[0], (2, 0, "prefill"), (2, 1, "queued")]
    assert shown((0.1, 0.1)) == sorted(steps[:2] + [
        (2, 0, "decode"), (2, 0, "prefill"), (2, 1, "prefill"), (2, 1, "queued")])
    assert shown((t_end + 1e-9, 1.0)) == []


def test_simulate_builds_the_window_while_running():
    profile = load_profile("h200-llama-3.1-8b")
    trace = busy_trace(4, 300)
    policy = Policy(batching={"max_num_seqs": 16})
    kept = simulate(trace, policy, profile, step_log=True)
    streamed = simulate(trace, policy, profile, timeline=True, timeline_window=(0.5, 2.0))
    assert streamed.output.step_log is None
    assert (timeline_json(streamed.timeline((0.5, 2.0)))
            == timeline_json(kept.timeline((0.5, 2.0))))
    with pytest.raises(ServetuneError, match="step_log=True"):
        streamed.timeline((0.0, 1.0))  # another window needs the whole log
    with pytest.raises(ServetuneError, match="step_log=True"):
        streamed.step_log()


def test_steps_file_is_spooled_while_running(tmp_path):
    """--steps writes the step log as the run goes (the run keeps none of it); the file is
    byte-identical to the one written from a kept log."""
    profile = load_profile("h200-llama-3.1-8b")
    trace = busy_trace(5, 300)
    policy = Policy(batching={"max_num_seqs": 16})
    kept = simulate(trace, policy, profile, step_log=True)
    kept.write_steps(tmp_path / "kept.jsonl")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(E, "LOG_RECORDS", 4)
        spooled = simulate(trace, policy, profile, steps_file=tmp_path / "s.jsonl",
                           timeline=True, timeline_window=(0.5, 2.0))
    assert spooled.output.step_log is None
    assert not (tmp_path / "s.jsonl").exists()  # written only when asked to
    spooled.write_steps(tmp_path / "s.jsonl")
    assert (tmp_path / "s.jsonl").read_bytes() == (tmp_path / "kept.jsonl").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.jsonl", "s.jsonl"]
    assert (timeline_json(spooled.timeline((0.5, 2.0)))
            == timeline_json(kept.timeline((0.5, 2.0))))


def test_a_timeline_too_large_fails_with_one_line_and_writes_nothing(tmp_path, monkeypatch):
    from test_simulate_cli import POLICY, PROFILE, azure_rows, one_error_line
    from typer.testing import CliRunner

    from servetune.cli import app
    from servetune.sim import timeline

    for name, text in (("trace.csv", azure_rows(40)), ("policy.yaml", POLICY),
                       ("profile.yaml", PROFILE)):
        (tmp_path / name).write_text(text)
    args = ["simulate", "--trace", str(tmp_path / "trace.csv"), "--profile",
            str(tmp_path / "profile.yaml"), "--policy", str(tmp_path / "policy.yaml"),
            "--json-out", str(tmp_path / "s.json"), "--timeline", str(tmp_path / "t.json")]
    monkeypatch.setattr(timeline, "MAX_TIMELINE_EVENTS", 50)
    line = one_error_line(CliRunner().invoke(app, args))
    assert "more than 50 events" in line and "--timeline-window" in line
    assert not (tmp_path / "t.json").exists() and not (tmp_path / "s.json").exists()
    result = CliRunner().invoke(app, [*args, "--timeline-window", "1:1.05"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "t.json").exists()
