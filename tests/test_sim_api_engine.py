"""simulate / goodput / timeline on the real engine, small inputs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetune.profiles.schema import Profile
from servetune.schemas.policy import Policy
from servetune.schemas.slo import SLOSet
from servetune.sim import goodput, simulate
from servetune.sim.records import record_columns, records_csv
from servetune.workloads.fitting import fit_workload
from servetune.workloads.trace import from_arrays


def small_profile(blocks: int = 400, step_s: float = 0.02) -> Profile:
    return Profile(name="small", memory={"kv_blocks_override": blocks},
                   step_time={"constant_s": step_s})


def random_trace(seed: int, n: int = 120, rate: float = 8.0):
    rng = np.random.default_rng(seed)
    return from_arrays(
        np.cumsum(rng.exponential(1 / rate, n)), rng.integers(16, 400, n),
        rng.integers(1, 120, n),
    )


POLICY = Policy(name="tight", batching={"max_num_seqs": 16, "max_num_batched_tokens": 512})


def test_every_request_accounted_and_same_inputs_same_bytes():
    trace = random_trace(1)
    a = simulate(trace, POLICY, small_profile())
    b = simulate(trace, POLICY, small_profile())
    s = a.summary()
    assert s["requests"] == len(trace)
    assert s["completed"] + s["shed"] + s["rejected"] == len(trace)
    cols = record_columns(a.trace, a.output, a.reasons())
    assert records_csv(cols) == records_csv(record_columns(b.trace, b.output, b.reasons()))
    sa, sb = a.summary(), b.summary()
    sa.pop("sim_wall_s")
    sb.pop("sim_wall_s")
    assert sa == sb


def test_workload_source_is_sampled_with_the_seed():
    workload = fit_workload(random_trace(2, n=400), name="fitted")
    a = simulate(workload, POLICY, small_profile(), seed=3, n_requests=150)
    b = simulate(workload, POLICY, small_profile(), seed=3, n_requests=150)
    c = simulate(workload, POLICY, small_profile(), seed=4, n_requests=150)
    assert len(a.trace) == 150
    assert np.array_equal(a.trace.arrival_s, b.trace.arrival_s)
    assert np.array_equal(a.output.finish_s, b.output.finish_s, equal_nan=True)
    assert not np.array_equal(a.trace.arrival_s, c.trace.arrival_s)
    faster = simulate(workload, POLICY, small_profile(), seed=3, n_requests=150, rate_scale=2)
    assert faster.trace.arrival_s[-1] < a.trace.arrival_s[-1]


def phases_by_request(doc):
    out: dict[int, list[tuple[str, float, float]]] = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["pid"] == 2:
            out.setdefault(e["tid"], []).append((e["name"], e["ts"], e["ts"] + e["dur"]))
    return {k: sorted(v, key=lambda p: p[1]) for k, v in out.items()}


@pytest.mark.parametrize("seed", [5, 6])
def test_timeline_phases_agree_with_engine_timestamps(seed):
    # A small pool forces preemptions and recomputes.
    trace = random_trace(seed, n=60, rate=20.0)
    result = simulate(trace, POLICY, small_profile(blocks=60), step_log=True)
    assert int(np.sum(result.output.preemptions)) > 0
    check_phases(result)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000), n=st.integers(1, 40), rate=st.floats(1.0, 50.0),
    blocks=st.integers(30, 300), engine=st.sampled_from(["vllm", "sglang", "trtllm", "tgi"]),
    scheduling=st.sampled_from(["fcfs", "priority"]), chunk=st.sampled_from([0, 64]),
)
def test_timeline_phases_agree_on_random_runs(seed, n, rate, blocks, engine, scheduling, chunk):
    trace = random_trace(seed, n=n, rate=rate)
    policy = Policy(
        scheduling=scheduling,
        batching={"max_num_seqs": 8, "max_num_batched_tokens": 512,
                  "long_prefill_token_threshold": chunk},
    )
    result = simulate(trace, policy, small_profile(blocks=blocks), engine=engine,
                      step_log=True)
    check_phases(result)


def check_phases(result):
    trace, out = result.trace, result.output
    phases = phases_by_request(result.timeline())
    for rid in np.flatnonzero(np.asarray(out.status) == 0).tolist():
        seq = phases[rid]
        assert [name for name, *_ in seq].count("preempted") == int(out.preemptions[rid])
        assert seq[-1][2] == pytest.approx(out.finish_s[rid] * 1e6, abs=1e-2)
        # Phases tile the request's life from arrival to finish (zero-length ones omitted).
        assert seq[0][1] == pytest.approx(
            (trace.arrival_s[rid] if seq[0][0] == "queued" else out.admitted_s[rid]) * 1e6,
            abs=1e-2)
        for (_, _, end), (_, start, _) in zip(seq, seq[1:], strict=False):
            assert start == pytest.approx(end, abs=1e-2)
        if out.preemptions[rid] == 0:
            prefill = [p for p in seq if p[0] == "prefill"]
            assert len(prefill) == 1
            assert prefill[0][2] == pytest.approx(out.first_token_s[rid] * 1e6, abs=1e-2)


def test_timeline_request_phases_same_in_fast_and_reference_mode():
    trace = random_trace(7, n=50, rate=10.0)
    fast = simulate(trace, POLICY, small_profile(blocks=80), step_log=True)
    ref = simulate(trace, POLICY, small_profile(blocks=80), step_log=True, reference=True)
    assert any("repeat" in rec for rec in fast.output.step_log)
    assert phases_by_request(fast.timeline()) == phases_by_request(ref.timeline())


def test_goodput_points_agree_with_direct_runs():
    trace = random_trace(8, n=150, rate=4.0)
    slo = SLOSet(classes={"default": {"ttft_s": 0.5, "attainment": 0.9}})
    profile = small_profile()
    result = goodput(trace, POLICY, profile, slo, rel_tol=0.05)
    assert result.bracketed and result.rate_scale > 0
    for point in result.points[:3]:
        direct = simulate(trace, POLICY, profile, rate_scale=point["rate_scale"])
        assert direct.meets_slo(slo) == point["meets_slo"]
        assert direct.attainment(slo) == pytest.approx(point["attainment"])
    assert simulate(trace, POLICY, profile, rate_scale=result.rate_scale).meets_slo(slo)
    assert result.base_rate_per_s == pytest.approx((len(trace) - 1) / trace.duration_s)


def test_goodput_on_a_workload_uses_every_seed():
    workload = fit_workload(random_trace(9, n=300, rate=4.0), name="w")
    slo = SLOSet(classes={"default": {"ttft_s": 0.5, "percentile": 90}})
    result = goodput(workload, POLICY, small_profile(), slo, seeds=(0, 1), n_requests=100,
                     rel_tol=0.1)
    assert all(len(p["seeds"]) == 2 for p in result.points)
    assert all("sim_wall_s" not in s for p in result.points for s in p["seeds"])
    again = goodput(workload, POLICY, small_profile(), slo, seeds=(0, 1), n_requests=100,
                    rel_tol=0.1)
    assert again.to_dict() == result.to_dict()


def test_summary_of_a_run_worked_by_hand():
    # One seat, 0.1 s steps. r0 (arrives 0, 3 tokens): admitted 0, first token 0.1,
    # finish 0.3. r1 (arrives 0.05, 2 tokens): waits for the seat, admitted 0.3, first
    # token 0.4, finish 0.5.
    trace = from_arrays(np.array([0.0, 0.05]), np.array([16, 16]), np.array([3, 2]))
    policy = Policy(batching={"max_num_seqs": 1, "max_num_batched_tokens": 64})
    result = simulate(trace, policy, small_profile(blocks=10, step_s=0.1))
    out = result.output
    np.testing.assert_allclose(out.admitted_s, [0.0, 0.3])
    np.testing.assert_allclose(out.first_token_s, [0.1, 0.4])
    np.testing.assert_allclose(out.finish_s, [0.3, 0.5])
    s = result.summary(SLOSet(classes={"default": {"ttft_s": 0.2, "attainment": 0.5}}))
    assert s["steps"] == 5
    o = s["overall"]
    assert o["ttft_s"]["mean"] == pytest.approx((0.1 + 0.35) / 2)
    assert o["e2e_s"]["p50"] == pytest.approx((0.3 + 0.45) / 2)
    assert o["tpot_s"]["mean"] == pytest.approx(0.1)  # (0.3-0.1)/2 and (0.45-0.35)/1
    assert o["throughput_tok_s"] == pytest.approx(5 / 0.5)
    assert o["throughput_req_s"] == pytest.approx(2 / 0.5)
    assert o["attainment"] == pytest.approx(0.5)  # r1's TTFT 0.35 > 0.2
    assert 0 < s["kv"]["mean_util"] <= s["kv"]["peak_util"] <= 1
    assert s["preemptions"] == 0


def test_workload_lanes_judge_long_by_the_workload_class_mean(monkeypatch):
    from servetune.sim import engine
    from servetune.workloads.fitting import class_stats

    workload = fit_workload(random_trace(11, n=400), split="bands", bands=2, name="two")
    seen = {}
    real = engine.run_engine

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "run_engine", spy)
    policy = Policy(batching={"max_num_seqs": 8, "max_num_batched_tokens": 512},
                    long_requests={"threshold_tokens": 300, "reserved_seqs": 1})
    result = simulate(workload, policy, small_profile(), n_requests=100)
    assert result.summary()["requests"] == 100
    np.testing.assert_allclose(seen["expected_output"],
                               [c.output_mean for c in class_stats(workload)])
    seen.clear()
    simulate(random_trace(11), policy, small_profile())  # a trace: its own class means
    assert "expected_output" not in seen


def test_goodput_warns_when_the_replay_is_too_short_for_steady_state():
    # 150 requests at ~4 req/s span ~37 s of arrivals at scale 1 and less when compressed:
    # below the one-minute floor, so the answer is flagged as possibly optimistic.
    trace = random_trace(8, n=150, rate=4.0)
    slo = SLOSet(classes={"default": {"ttft_s": 0.5, "attainment": 0.9}})
    short = goodput(trace, POLICY, small_profile(), slo, rel_tol=0.05)
    best = max((p for p in short.points if p["meets_slo"]), key=lambda p: p["rate_scale"])
    assert best["window_s"] == pytest.approx(trace.duration_s / best["rate_scale"])
    assert len(short.warnings) == 1 and "steady state" in short.warnings[0]
    # A replay long enough at its goodput carries no warning.
    long = random_trace(8, n=4000, rate=4.0)
    assert not goodput(long, POLICY, small_profile(), slo, rel_tol=0.05).warnings
