"""Properties of the engine models on random small inputs (hypothesis).

- every request completes, is shed, or is rejected with a reason;
- a completed request sampled exactly its output tokens, in time order
  (arrival <= admission <= first token <= finish);
- KV blocks in use never exceed the pool, and all are free at the end;
- time never goes backwards (each step starts where the previous one ended or later);
- no admission in a step that preempted; the running batch never exceeds max_num_seqs;
- the fast (compiled, jumping) mode gives exactly the reference mode's per-request
  records, and its step log expands to exactly the reference step log;
- the same input gives the same records.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_engine_helpers import same_records

from servetune.engines import ENGINE_NAMES
from servetune.profiles.steptime import StepTimeModel
from servetune.schemas.policy import Policy
from servetune.sim.engine import REASON_READMIT, REASONS, expand_repeats, run_engine
from servetune.workloads.trace import from_arrays


@st.composite
def cases(draw):
    n = draw(st.integers(1, 12))
    gaps = draw(st.lists(st.sampled_from([0.0, 0.0, 0.0, 0.0, 0.25, 0.5, 1.0, 7.5]),
                         min_size=n, max_size=n))
    arrival = np.cumsum(gaps)
    prompt = np.array(draw(st.lists(st.integers(1, 80), min_size=n, max_size=n)))
    output = np.array(draw(st.lists(st.integers(1, 40), min_size=n, max_size=n)))
    columns: dict = {}
    if draw(st.booleans()):
        columns["priority"] = np.array(draw(st.lists(st.integers(0, 2), min_size=n,
                                                     max_size=n)), dtype=np.int32)
    if draw(st.booleans()):
        columns["max_tokens"] = output + np.array(
            draw(st.lists(st.integers(-3, 20), min_size=n, max_size=n)))
        columns["max_tokens"] = np.maximum(columns["max_tokens"], 1)
    if draw(st.booleans()):
        columns["class_id"] = np.array(draw(st.lists(st.integers(0, 1), min_size=n,
                                                     max_size=n)), dtype=np.int32)
        columns["class_names"] = ("a", "b")
    trace = from_arrays(arrival, prompt, output, **columns)

    # "pressure" cases: everything fits the pool alone but not together, no caps or
    # lanes, so preemption and retraction are common.
    pressure = draw(st.booleans())
    max_seqs = draw(st.integers(1, 6))
    batching = {
        "max_num_seqs": max_seqs,
        "max_num_batched_tokens": draw(st.integers(max_seqs, 64)),
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 1, 5, 16])),
        "enable_chunked_prefill": pressure or draw(st.booleans()),
    }
    watermark = 0.0 if pressure else draw(st.sampled_from([0.0, 0.0, 0.1, 0.3]))
    admission = {
        "kv_watermark": watermark,
        "reserve_full_prompt": draw(st.booleans()),
    }
    if not pressure:
        admission["max_queued_requests"] = draw(st.sampled_from([None, None, 1, 3]))
        admission["max_queued_prompt_tokens"] = draw(st.sampled_from([None, None, 50, 200]))
    long_requests: dict = {}
    if not pressure and draw(st.booleans()):
        max_kv = draw(st.sampled_from([0.3, 0.6, 1.0]))
        long_max_seqs = draw(st.sampled_from([None, 1, 2]))
        reserved_seqs = draw(st.integers(0, min(max_seqs - 1, long_max_seqs or 9)))
        long_requests = {
            "threshold_tokens": draw(st.integers(10, 100)),
            "reserved_seqs": reserved_seqs,
            "reserved_kv_fraction": draw(st.sampled_from(
                [x for x in (0.0, 0.1, 0.3) if x <= max_kv and x + watermark < 1])),
            "max_seqs": long_max_seqs,
            "max_kv_fraction": max_kv,
        }
    classes = {"b": {"priority": -1}} if draw(st.booleans()) else {}
    policy = Policy(scheduling=draw(st.sampled_from(["fcfs", "priority"])),
                    batching=batching, admission=admission, long_requests=long_requests,
                    classes=classes)
    if draw(st.booleans()):
        step_time = StepTimeModel(constant_s=draw(st.sampled_from([0.01, 0.3, 1.0])))
    else:
        step_time = StepTimeModel(
            fixed_s=draw(st.sampled_from([0.0, 0.003, 0.1])),
            gemm_pieces=[(0.004, 1e-4), (0.001, 3.3e-4)],
            decode_attn_s_per_context_token=draw(st.sampled_from([0.0, 1.7e-5, 0.01])),
            decode_attn_s_per_seq=1e-4,
            prefill_attn_s_per_token_pair=draw(st.sampled_from([0.0, 3e-7])),
            lm_head_s_per_row=2e-4,
        )
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    # A pool around the largest request's final KV, so that preemption, retraction
    # and admission refusals are common (and a few requests are too large: rejected).
    largest = int(((prompt + output - 1 + block_size - 1) // block_size).max())
    low = largest if pressure else max(2, largest * 3 // 4)
    kv_blocks = draw(st.integers(low, largest * 2 + 2))
    engine = draw(st.sampled_from(ENGINE_NAMES))
    return trace, policy, kv_blocks, block_size, step_time, engine


def check_invariants(trace, policy, kv_blocks, out, log):
    n = len(trace)
    status = out.status
    assert set(np.unique(status)) <= {0, 1, 2}
    done = status == 0
    assert (out.reason[done] == 0).all()
    assert ((out.reason[~done] > 0) & (out.reason[~done] < len(REASONS))).all()
    assert (np.isnan(out.finish_s[~done])).all()
    expected = trace.output_tokens.copy()
    if trace.max_tokens is not None:
        expected = np.minimum(expected, trace.max_tokens)
    assert (out.generated[done] == expected[done]).all()
    # Only a request rejected after a preemption (its re-prefill outgrew the headroom)
    # was served in part; every other request that did not complete never ran.
    readmit = out.reason == REASON_READMIT
    never_ran = ~done & ~readmit
    assert (out.generated[never_ran] == 0).all()
    assert (out.preemptions[readmit] >= 1).all()
    a = trace.arrival_s[done]
    assert (a <= out.admitted_s[done]).all()
    assert (out.admitted_s[done] < out.first_token_s[done]).all() or not done.any() or (
        out.admitted_s[done] <= out.first_token_s[done]).all()
    assert (out.first_token_s[done] <= out.finish_s[done]).all()
    assert out.kv_blocks_in_use_end == 0
    assert 0 <= out.kv_util_mean <= out.kv_util_peak <= 1.0
    clock = 0.0
    admitted_running_max = policy.batching.max_num_seqs
    seen = np.zeros(n, dtype=int)
    for rec in log:
        assert rec["start_s"] >= clock
        assert rec["duration_s"] >= 0
        clock = rec["start_s"] + rec["duration_s"]
        assert 0 <= rec["kv_blocks_used"] <= kv_blocks == rec["kv_blocks_total"]
        assert rec["running"] <= admitted_running_max
        if rec["preempted"]:
            assert rec["admitted"] == []
        for rid in rec["finished"] + rec["shed"]:
            seen[rid] += 1
    assert clock == out.sim_end_s or not log
    assert (seen == 1).all()  # every request leaves exactly once
    # Token conservation: a completed request computes its prompt and all but its last
    # output token, plus whatever preemption threw away.
    granted = np.zeros(n, dtype=np.int64)
    for rec in log:
        for rid, new in rec["scheduled"]:
            granted[rid] += new
    needed = trace.prompt_tokens + out.generated - 1
    clean = done & (out.preemptions == 0)
    assert (granted[clean] == needed[clean]).all()
    assert (granted[done] >= needed[done]).all()
    assert (granted[never_ran] == 0).all()


def fast_matches_reference(case):
    """Run ``case`` in both modes with step logs; records, expanded logs and invariants
    must agree. Returns the fast run."""
    trace, policy, kv_blocks, block_size, step_time, engine = case
    ref = run_engine(trace, policy, kv_blocks, block_size, step_time, engine=engine,
                     reference=True, step_log=True)
    fast = run_engine(trace, policy, kv_blocks, block_size, step_time, engine=engine,
                      step_log=True)
    same_records(fast, ref)
    assert expand_repeats(fast.step_log) == ref.step_log
    check_invariants(trace, policy, kv_blocks, ref, ref.step_log)
    return fast


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_fast_equals_reference_and_invariants_hold(case):
    trace, policy, kv_blocks, block_size, step_time, engine = case
    fast = fast_matches_reference(case)
    plain = run_engine(trace, policy, kv_blocks, block_size, step_time, engine=engine)
    same_records(plain, fast)  # the step log does not change the run
    assert plain.step_log is None
    again = run_engine(trace, policy, kv_blocks, block_size, step_time, engine=engine)
    same_records(again, plain)


def test_long_decode_stretches_are_jumped_and_match_the_reference():
    # A few long outputs with a context-dependent step time: many decode-only steps.
    rng = np.random.default_rng(7)
    n = 30
    trace = from_arrays(np.sort(rng.uniform(0, 20, n)), rng.integers(1, 400, n),
                        rng.integers(1, 600, n))
    step_time = StepTimeModel(fixed_s=0.004, gemm_pieces=[(0.005, 1e-5)],
                              decode_attn_s_per_context_token=3e-8, lm_head_s_per_row=1e-6)
    for engine in ENGINE_NAMES:
        policy = Policy(batching={"max_num_seqs": 8, "max_num_batched_tokens": 512})
        ref = run_engine(trace, policy, 300, 16, step_time, engine=engine, reference=True,
                         step_log=True)
        fast = run_engine(trace, policy, 300, 16, step_time, engine=engine, step_log=True)
        same_records(fast, ref)
        assert expand_repeats(fast.step_log) == ref.step_log
        assert fast.jumps > 10
        assert len(fast.step_log) < len(ref.step_log) / 3
        jumped = [rec for rec in fast.step_log if "repeat" in rec]
        assert all(rec["repeat"] == len(rec["step_durations_s"]) >= 2 for rec in jumped)
        check_invariants(trace, policy, 300, ref, ref.step_log)


def test_series_is_bounded_and_consistent():
    rng = np.random.default_rng(3)
    n = 400
    trace = from_arrays(np.sort(rng.uniform(0, 50, n)), rng.integers(1, 300, n),
                        rng.integers(1, 100, n))
    out = run_engine(trace, Policy(), 2000, 16, StepTimeModel(constant_s=0.02))
    s = out.series
    lengths = {len(v) for v in s.values()}
    assert len(lengths) == 1 and 1 <= lengths.pop() <= 2048
    assert np.all(np.diff(s["t_s"]) > 0)
    assert (s["kv_util"] >= 0).all() and (s["kv_util"] <= out.kv_util_peak + 1e-12).all()
    width = s["t_s"][1] - s["t_s"][0]
    # the bins' time-weighted mean equals the run's mean utilisation
    widths = np.minimum(s["t_s"] + width, out.sim_end_s) - s["t_s"]
    mean = float((s["kv_util"] * widths).sum() / out.sim_end_s)
    assert abs(mean - out.kv_util_mean) < 1e-9


@st.composite
def crowded_cases(draw):
    """Bursts of requests with long outputs on a small pool: retraction (SGLang) and
    preemption (vLLM) happen in most cases."""
    n = draw(st.integers(3, 10))
    arrival = np.sort(np.array(draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                                             min_size=n, max_size=n))))
    prompt = np.array(draw(st.lists(st.integers(1, 12), min_size=n, max_size=n)))
    output = np.array(draw(st.lists(st.integers(10, 60), min_size=n, max_size=n)))
    trace = from_arrays(arrival, prompt, output)
    block_size = draw(st.sampled_from([1, 2, 4]))
    largest = int(((prompt + output - 1 + block_size - 1) // block_size).max())
    kv_blocks = draw(st.integers(largest, largest * 3))
    policy = Policy(scheduling=draw(st.sampled_from(["fcfs", "priority"])),
                    batching={"max_num_seqs": draw(st.integers(2, 8)),
                              "max_num_batched_tokens": draw(st.sampled_from([8, 16, 64]))})
    step_time = StepTimeModel(fixed_s=0.01, decode_attn_s_per_context_token=1e-4,
                              gemm_pieces=[(0.0, 1e-4)])
    return trace, policy, kv_blocks, block_size, step_time, draw(st.sampled_from(
        ["vllm", "sglang"]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(crowded_cases())
def test_preemption_and_retraction_fast_equals_reference(case):
    fast_matches_reference(case)


def test_stretches_are_jumped_while_the_waiting_queue_is_blocked():
    # max_num_seqs 2: two long decodes run while three requests wait (seat-blocked);
    # the stretch is still jumped, and expands to the reference log.
    trace = from_arrays(np.zeros(5), np.full(5, 20), np.array([300, 300, 5, 5, 5]))
    policy = Policy(batching={"max_num_seqs": 2, "max_num_batched_tokens": 64})
    step_time = StepTimeModel(fixed_s=0.01, decode_attn_s_per_context_token=1e-5)
    ref = run_engine(trace, policy, 200, 16, step_time, reference=True, step_log=True)
    fast = run_engine(trace, policy, 200, 16, step_time, step_log=True)
    same_records(fast, ref)
    assert expand_repeats(fast.step_log) == ref.step_log
    blocked = [rec for rec in fast.step_log if rec.get("repeat", 1) > 1 and rec["waiting"] == 3]
    assert sum(rec["repeat"] for rec in blocked) > 250
