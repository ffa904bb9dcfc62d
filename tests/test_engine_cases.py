"""Hand-worked cases of the engine models and the known failure shapes, reproduced and
then fixed by policy."""

from __future__ import annotations

import numpy as np
import pytest
from test_engine_helpers import both_modes, compact, policy, same_records, trace_of

from servetune.engines import ENGINE_NAMES
from servetune.errors import ServetuneError
from servetune.profiles.steptime import StepTimeModel
from servetune.schemas.policy import Policy
from servetune.sim.engine import REASONS, expand_repeats, run_engine
from servetune.workloads.trace import from_arrays

BATCH64 = {"max_num_seqs": 8, "max_num_batched_tokens": 64}


# ---- other engines' admission models -------------------------------------------------

def test_sglang_retracts_the_fewest_generated_and_recomputes_it():
    """bs=1, a pool of 66 tokens, A and B (5-token prompt, 30 output) at t=0.

    Admission follows ``PrefillAdder.add_one_req`` (``schedule_policy.py``): a request is
    refused when prompt + min(max_new - generated, 4096) + a page >= the free tokens less
    the running requests' ratio-scaled estimates and what this pass admitted.
    Step 0: A needs 5 + 30 + 1 = 36 < 66: admitted; the pass then has 66 - 36 = 30 left
    and B's 36 >= 30: refused. Step 1: A runs (1 generated), estimate 29 * 0.7 = 20.3;
    B's 36 < 66 - 5 - 20.3 = 40.7: B prefills alone (prefill and decode batches are
    separate). Steps 2-29 decode both, 2 tokens of KV each: 10 + 56 = 66 after step 29.
    Step 30 does not fit: B (a tie on generated tokens and prompt; the later one) is
    retracted (``retract_decode``, ``schedule_batch.py``) and A decodes its 30th token
    alone. Step 31: B re-prefills 5 + 29 = 34 tokens and samples its last token.
    """
    tr = trace_of([(0, 5, 30), (0, 5, 30)])
    out, log = both_modes(tr, policy(batching=BATCH64), kv_blocks=66, block_size=1,
                          engine="sglang")
    steps = compact(log)
    assert steps[0] == (0.0, [(0, 5)], [], [0], [], 5, 1, 1)
    assert steps[1] == (1.0, [(1, 5)], [], [1], [], 10, 0, 2)
    assert steps[2] == (2.0, [(0, 1), (1, 1)], [], [], [], 12, 0, 2)
    assert steps[29] == (29.0, [(0, 1), (1, 1)], [], [], [], 66, 0, 2)
    assert steps[30] == (30.0, [(0, 1)], [1], [], [0], 34, 1, 1)
    assert steps[31] == (31.0, [(1, 34)], [], [1], [1], 34, 0, 1)
    assert len(steps) == 32
    assert out.finish_s.tolist() == [31.0, 32.0]
    assert out.preemptions.tolist() == [0, 1]
    assert (out.status == 0).all()


def test_sglang_counts_the_new_requests_output_in_full_and_refuses_on_equality():
    """bs=1, one request with a 5-token prompt and 30 output tokens.

    ``PrefillAdder.add_one_req`` (``schedule_policy.py``): total = extend_input_len +
    min(max_new_tokens - generated, CLIP) + page_size, refused when total >=
    rem_total_tokens (the new request's own output is not scaled by new_token_ratio,
    which servetune used to do: 5 + 0.7 * 30 = 26 would have fitted both pools).
    Pool 36: 5 + 30 + 1 = 36 >= 36, it can never run: rejected at arrival (at its last
    token: 34 + min(30 - 29, 4096) + 1 = 36). Pool 37: 36 < 37, admitted at step 0.
    """
    tr = trace_of([(0, 5, 30)])
    out, log = both_modes(tr, policy(batching=BATCH64), kv_blocks=36, block_size=1,
                          engine="sglang")
    assert out.status.tolist() == [2]
    assert REASONS[out.reason[0]].startswith("rejected: prompt + max output")
    assert log[0]["shed"] == [0]
    out, log = both_modes(tr, policy(batching=BATCH64), kv_blocks=37, block_size=1,
                          engine="sglang")
    assert compact(log)[0] == (0.0, [(0, 5)], [], [0], [], 5, 0, 1)
    assert out.finish_s.tolist() == [30.0]


def test_sglang_allocates_a_chunked_prefill_one_chunk_at_a_time():
    """Blocks of 4 tokens, a 4-token prefill budget (chunked-prefill-size), one request
    with a 10-token prompt and 2 output tokens.

    ``PrefillAdder.add_one_req`` admits it with a truncated extend of 4 tokens and
    ``add_chunked_req`` continues it (``schedule_policy.py``); the scheduler allocates KV
    for each chunk's tokens only (``ScheduleBatch.prepare_for_extend``,
    ``schedule_batch.py``). Step 0: tokens 0-3, 1 block (servetune used to allocate all
    3 blocks here). Step 1: tokens 4-7, 2 blocks. Step 2: tokens 8-9, 3 blocks, first
    token sampled. Step 3: decodes the second token (11 tokens, still 3 blocks).
    """
    tr = trace_of([(0, 10, 2)])
    pol = policy(batching={"max_num_seqs": 2, "max_num_batched_tokens": 4})
    out, log = both_modes(tr, pol, kv_blocks=100, block_size=4, engine="sglang")
    assert compact(log) == [
        (0.0, [(0, 4)], [], [0], [], 1, 0, 1),
        (1.0, [(0, 4)], [], [], [], 2, 0, 1),
        (2.0, [(0, 2)], [], [], [], 3, 0, 1),
        (3.0, [(0, 1)], [], [], [0], 3, 0, 1),
    ]
    assert out.first_token_s.tolist() == [3.0]


@pytest.mark.parametrize("b_priority, preempts", [(0, True), (10, False)])
def test_sglang_priority_preempts_past_the_threshold(b_priority, preempts):
    """One seat, a pool of 100 tokens (bs=1), priority scheduling with lower values
    first (the exporter writes ``schedule-low-priority-values-first``). A (prompt 4,
    output 5, priority 20) at t=0; B (prompt 4, output 2) at t=1.5, queued at t=2.

    ``Scheduler.get_new_batch_prefill`` (``scheduler.py``): the batch is full, so
    ``PrefillAdder.preempt_to_schedule`` (``schedule_policy.py``) may preempt running
    requests whose priority is worse by more than
    ``--priority-scheduling-preemption-threshold`` (10); B's need (4 + 2 less a budget
    of ~93 tokens) is already covered, so one victim suffices.
    B priority 0 (20 - 0 > 10): step 2 preempts A and prefills B; B decodes its second
    token in step 3 (A cannot preempt B back: 0 - 20 <= 10); A re-prefills 4 + 2 = 6
    tokens in step 4 and finishes at the end of step 6.
    B priority 10 (20 - 10 = 10, not > 10): B waits for A (steps 0-4), then runs in
    steps 5-6.
    """
    tr = trace_of([(0, 4, 5), (1.5, 4, 2)], priority=np.array([20, b_priority]))
    pol = policy(batching={"max_num_seqs": 1, "max_num_batched_tokens": 64},
                 scheduling="priority")
    out, log = both_modes(tr, pol, kv_blocks=100, block_size=1, engine="sglang")
    steps = compact(log)
    if preempts:
        assert steps == [
            (0.0, [(0, 4)], [], [0], [], 4, 0, 1),
            (1.0, [(0, 1)], [], [], [], 5, 0, 1),
            (2.0, [(1, 4)], [0], [1], [], 4, 1, 1),
            (3.0, [(1, 1)], [], [], [1], 5, 1, 1),
            (4.0, [(0, 6)], [], [0], [], 6, 0, 1),
            (5.0, [(0, 1)], [], [], [], 7, 0, 1),
            (6.0, [(0, 1)], [], [], [0], 8, 0, 1),
        ]
        assert out.finish_s.tolist() == [7.0, 4.0]
        assert out.preemptions.tolist() == [1, 0]
    else:
        assert [s[1] for s in steps] == [[(0, 4)], [(0, 1)], [(0, 1)], [(0, 1)], [(0, 1)],
                                         [(1, 4)], [(1, 1)]]
        assert out.finish_s.tolist() == [5.0, 7.0]
        assert out.preemptions.sum() == 0


def test_sglang_prefill_and_decode_batches_are_separate():
    tr = trace_of([(0, 4, 5), (1.5, 8, 2)])
    _, log = both_modes(tr, policy(batching=BATCH64), kv_blocks=100, block_size=4,
                        engine="sglang")
    assert [rec["scheduled"] for rec in log[:5]] == [
        [[0, 4]], [[0, 1]], [[1, 8]], [[0, 1], [1, 1]], [[0, 1]],
    ]


def test_trtllm_reserves_prompt_plus_max_output_and_never_evicts():
    # 10 blocks of 4: each request reserves ceil((4 + 20 - 1) / 4) = 6 blocks, so B
    # waits until A finishes (end of step 19); vLLM admits both and must preempt.
    tr = trace_of([(0, 4, 20), (0, 4, 20)])
    out, _ = both_modes(tr, policy(batching=BATCH64), kv_blocks=10, block_size=4,
                        engine="trtllm")
    assert out.admitted_s.tolist() == [0.0, 20.0]
    assert out.preemptions.sum() == 0
    vllm, _ = both_modes(tr, policy(batching=BATCH64), kv_blocks=10, block_size=4)
    assert vllm.admitted_s.tolist() == [0.0, 0.0]
    assert vllm.preemptions.sum() > 0


def test_trtllm_reservation_uses_max_tokens_not_the_actual_output():
    tr = trace_of([(0, 4, 2), (0, 4, 2)], max_tokens=np.array([20, 20]))
    out, _ = both_modes(tr, policy(batching=BATCH64), kv_blocks=10, block_size=4,
                        engine="trtllm")
    assert out.admitted_s.tolist() == [0.0, 2.0]


def test_tgi_budgets_prefill_tokens_only_without_chunking():
    # budget 4. With prefill chunking TGI takes the running batch's decode tokens out of
    # the prefill budget (backends/v3/src/backend.rs, batching_task), so A's decode token
    # takes one of the 4, as under TensorRT-LLM. (This test used to expect A's token to
    # ride along with B's 4-token chunk: the old rule ignored that subtraction.)
    # (Chunking asked for explicitly: trtllm-serve does not chunk by default.)
    tr = trace_of([(0, 4, 5), (0.5, 8, 1)])
    pol = policy(batching={"max_num_seqs": 2, "max_num_batched_tokens": 4,
                           "enable_chunked_prefill": True})
    for engine in ("tgi", "trtllm"):
        _, log = both_modes(tr, pol, kv_blocks=100, block_size=4, engine=engine)
        assert [rec["scheduled"] for rec in log[:4]] == [
            [[0, 4]], [[0, 1], [1, 3]], [[0, 1], [1, 3]], [[0, 1], [1, 2]]]
    # Without chunking the decode token rides along with B's whole 4-token prompt; under
    # TensorRT-LLM it takes one of the 4, so B waits until A finishes (step 4).
    tr = trace_of([(0, 4, 5), (0.5, 4, 1)])
    pol = policy(batching={"max_num_seqs": 2, "max_num_batched_tokens": 4,
                           "enable_chunked_prefill": False})
    _, log = both_modes(tr, pol, kv_blocks=100, block_size=4, engine="tgi")
    assert [rec["scheduled"] for rec in log[:2]] == [[[0, 4]], [[0, 1], [1, 4]]]
    _, log = both_modes(tr, pol, kv_blocks=100, block_size=4, engine="trtllm")
    assert [rec["scheduled"] for rec in log] == [[[0, 4]]] + [[[0, 1]]] * 4 + [[[1, 4]]]


def test_trtllm_without_chunking_holds_a_long_prompt_whole():
    # trtllm-serve has chunked prefill off by default (engines.md 4), and so has the
    # trtllm model when the policy leaves enable_chunked_prefill unset. Budget 8 tokens
    # per step (decode rows included), 1 s steps, 100 blocks of 4.
    # A (t=0, prompt 4, output 5) prefills its 4 tokens in step 0 and samples its first
    # token; it decodes one token in each of steps 1-4 and finishes at t=5.
    # B (t=0.5, prompt 8) is first seen at step 1, where A's decode token leaves 7 of the
    # 8: its 8-token prompt does not fit, and unchunked it waits (it fits a whole step,
    # so it is not rejected) until A is done; step 5 prefills all 8 tokens at once, and
    # B's single output token comes at the end of that step (t=6).
    tr = trace_of([(0, 4, 5), (0.5, 8, 1)])
    batching = {"max_num_seqs": 2, "max_num_batched_tokens": 8}
    unset, log = both_modes(tr, policy(batching=batching), kv_blocks=100, block_size=4,
                            engine="trtllm")
    assert [rec["scheduled"] for rec in log] == [[[0, 4]]] + [[[0, 1]]] * 4 + [[[1, 8]]]
    assert unset.first_token_s.tolist() == [1.0, 6.0]
    assert unset.finish_s.tolist() == [5.0, 6.0]
    off, _ = both_modes(tr, policy(batching={**batching, "enable_chunked_prefill": False}),
                        kv_blocks=100, block_size=4, engine="trtllm")
    same_records(off, unset)  # unset is the engine's default: off
    # Asked for explicitly, chunking splits B: 7 tokens beside A's decode in step 1, the
    # last one in step 2, so B's token comes at t=3 instead of t=6.
    on, log = both_modes(tr, policy(batching={**batching, "enable_chunked_prefill": True}),
                         kv_blocks=100, block_size=4, engine="trtllm")
    assert [rec["scheduled"] for rec in log[:3]] == [
        [[0, 4]], [[0, 1], [1, 7]], [[0, 1], [1, 1]]]
    assert on.first_token_s.tolist() == [1.0, 3.0]
    # vLLM's default is on: the unset policy chunks B there.
    vllm, log = both_modes(tr, policy(batching=batching), kv_blocks=100, block_size=4)
    assert [rec["scheduled"] for rec in log[:3]] == [
        [[0, 4]], [[0, 1], [1, 7]], [[0, 1], [1, 1]]]


# ---- rejection instead of deadlock, shedding, inputs ---------------------------------

@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_a_prompt_too_large_for_the_pool_is_rejected_not_a_deadlock(engine):
    # 10 blocks of 16 tokens = 160 tokens; the 500-token prompt can never fit.
    tr = trace_of([(0, 20, 5), (0.5, 500, 3), (1.0, 20, 5)])
    out, log = both_modes(tr, policy(batching=BATCH64), kv_blocks=10, block_size=16,
                          engine=engine)
    assert out.status.tolist() == [0, 2, 0]
    assert REASONS[out.reason[1]].startswith("rejected")
    assert np.isnan(out.admitted_s[1]) and np.isnan(out.finish_s[1])
    assert any(1 in rec["shed"] for rec in log)


def test_prompt_over_the_budget_with_chunking_off_is_rejected():
    tr = trace_of([(0, 100, 2), (0, 10, 2)])
    pol = policy(batching={"max_num_seqs": 4, "max_num_batched_tokens": 64,
                           "enable_chunked_prefill": False})
    out, _ = both_modes(tr, pol, kv_blocks=100, block_size=16)
    assert out.status.tolist() == [2, 0]
    assert "chunked prefill off" in REASONS[out.reason[0]]


def test_queued_prompt_token_cap_sheds():
    tr = trace_of([(0, 40, 3), (0, 40, 3), (0, 10, 1)])
    pol = policy(batching=BATCH64, admission={"max_queued_prompt_tokens": 60})
    out, _ = both_modes(tr, pol, kv_blocks=100, block_size=16)
    assert out.status.tolist() == [0, 1, 0]
    assert "max_queued_prompt_tokens" in REASONS[out.reason[1]]


def test_max_tokens_caps_the_output():
    tr = trace_of([(0, 4, 10), (0, 4, 3)], max_tokens=np.array([4, 8]))
    out, _ = both_modes(tr, policy(batching=BATCH64), kv_blocks=100, block_size=4)
    assert out.generated.tolist() == [4, 3]


def test_bad_inputs_are_one_line_errors():
    tr = trace_of([(0, 4, 1)])
    with pytest.raises(ServetuneError, match="engine 'foo'"):
        run_engine(tr, Policy(), 10, 16, StepTimeModel(constant_s=1.0), engine="foo")
    with pytest.raises(ServetuneError, match="at least one block"):
        run_engine(tr, Policy(), 0, 16, StepTimeModel(constant_s=1.0))
    with pytest.raises(ServetuneError, match="expected_output"):
        run_engine(tr, Policy(long_requests={"threshold_tokens": 5}), 10, 16,
                   StepTimeModel(constant_s=1.0), expected_output=np.ones(7))


def test_progress_is_reported_up_to_all_requests():
    tr = trace_of([(0, 4, 3), (1, 4, 3), (2, 4, 300)])
    calls = []
    run_engine(tr, Policy(), 100, 16, StepTimeModel(constant_s=0.1),
               progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (3, 3)
    assert all(total == 3 for _, total in calls)


# ---- failure shapes, reproduced and fixed by policy ----------------------------------

def _thrash_case():
    # Six decoders hold the pool's start; a 1500-token prompt arrives at step 2.
    rows = [(0.0, 64, 200)] * 6 + [(0.015, 1500, 20)]
    return trace_of(rows)


def test_resumed_long_request_thrash_and_its_fix():
    tr = _thrash_case()
    step_time = StepTimeModel(constant_s=0.01)
    batching = {"max_num_seqs": 16, "max_num_batched_tokens": 256}

    def run(admission):
        pol = policy(batching=batching, admission=admission)
        out = run_engine(tr, pol, 120, 16, step_time, step_log=True)
        granted = sum(new for rec in expand_repeats(out.step_log)
                      for rid, new in rec["scheduled"] if rid == 6)
        return out, granted - (1500 + 19)  # tokens recomputed for nothing

    # Without the full-prompt reservation the long request is admitted on its first
    # chunk, then preempted as soon as the decoders need blocks, again and again.
    bad, wasted_bad = run({"reserve_full_prompt": False})
    assert bad.preemptions[6] >= 20
    assert wasted_bad > 20 * 256
    # Reserving the whole prompt at admission (vLLM's scheduler_reserve_full_isl) fixes it,
    # with or without a watermark.
    for admission in ({"reserve_full_prompt": True},
                      {"reserve_full_prompt": True, "kv_watermark": 0.1}):
        good, wasted_good = run(admission)
        assert good.preemptions.sum() <= 1
        assert wasted_good <= 1519
        assert (good.status == 0).all()


def test_long_prompts_starve_short_ttft_and_a_lane_restores_it():
    rng = np.random.default_rng(1)
    dur = 120
    n_short, n_long = dur * 8, int(dur * 0.6)
    arrival = np.concatenate([rng.uniform(0, dur, n_short), rng.uniform(0, dur, n_long)])
    prompt = np.concatenate([rng.integers(100, 300, n_short), rng.integers(7000, 9000, n_long)])
    output = np.concatenate([rng.integers(20, 80, n_short), rng.integers(100, 300, n_long)])
    tr = from_arrays(arrival, prompt, output)
    short = tr.prompt_tokens < 4000
    step_time = StepTimeModel(fixed_s=0.004, gemm_pieces=[(0.005, 1e-5)],
                              decode_attn_s_per_context_token=3e-8)
    batching = {"max_num_seqs": 256, "max_num_batched_tokens": 2048}

    def short_ttft_p99(long_requests):
        out = run_engine(tr, Policy(batching=batching, long_requests=long_requests),
                         1200, 16, step_time)
        assert (out.status == 0).all()
        return float(np.percentile((out.first_token_s - tr.arrival_s)[short], 99))

    # Strict FCFS: a waiting long prompt that does not fit the KV pool blocks every
    # short request behind it.
    starved = short_ttft_p99({})
    assert starved > 1.0
    # A lane capping long requests at half the pool: waiting long requests no longer
    # block short ones.
    fixed = short_ttft_p99({"threshold_tokens": 4000, "max_kv_fraction": 0.5})
    assert fixed < 0.25
    assert fixed < starved / 10


# ---- regressions found in QA ---------------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_chunking_off_rejects_only_prompts_over_the_budget(engine):
    # A 40-token prompt fits the 64-token budget: it runs, even though prompt + output
    # (79 tokens in KV at the end) exceeds the budget.
    tr = trace_of([(0, 40, 40)])
    pol = policy(batching={"max_num_seqs": 4, "max_num_batched_tokens": 64,
                           "enable_chunked_prefill": False})
    out, _ = both_modes(tr, pol, kv_blocks=100, block_size=4, engine=engine)
    assert out.status.tolist() == [0]
    assert out.generated.tolist() == [40]


def test_chunking_off_resumed_request_over_the_budget_is_chunked_not_stuck():
    # B is preempted at step 11 holding 10 generated tokens; its re-prefill (20 tokens)
    # exceeds the whole 16-token budget, so it is chunked (16 + 3) once A is done.
    tr = trace_of([(0, 10, 30), (0, 10, 30)])
    pol = policy(batching={"max_num_seqs": 4, "max_num_batched_tokens": 16,
                           "enable_chunked_prefill": False})
    out, log = both_modes(tr, pol, kv_blocks=10, block_size=4)
    assert out.status.tolist() == [0, 0]
    assert out.preemptions.tolist() == [0, 1]
    resumed = [rec for rec in log if 1 in rec["admitted"]]
    assert [rec["scheduled"] for rec in resumed] == [[[0, 1], [1, 10]], [[1, 16]]]


def test_watermark_binds_at_admission_not_on_the_whole_output():
    # Pool 100 blocks of 4, watermark 50 blocks. vLLM admits the 40-token prompt
    # (10 blocks + 50 free) and lets it decode to 60 blocks (docs/engines.md 1.1: the
    # watermark applies to admission only). TensorRT-LLM and TGI must reserve
    # prompt + max output (60 blocks) beside the watermark, so for them it never fits.
    tr = trace_of([(0, 40, 200)])
    pol = policy(batching=BATCH64, admission={"kv_watermark": 0.5})
    for engine in ("vllm", "sglang"):
        out, _ = both_modes(tr, pol, kv_blocks=100, block_size=4, engine=engine)
        assert out.status.tolist() == [0] and out.generated.tolist() == [200]
    for engine in ("trtllm", "tgi"):
        out, _ = both_modes(tr, pol, kv_blocks=100, block_size=4, engine=engine)
        assert out.status.tolist() == [2]


def test_preempted_request_resumes_into_the_watermark_of_an_idle_engine():
    # 20 blocks of 4, watermark 12 blocks. A and B (4-token prompts) decode until the
    # pool is full; B (last admitted) is preempted at step 37 holding 37 generated
    # tokens. Its re-prefill (41 tokens = 11 blocks) + 12 does not fit 20 blocks while A
    # runs, but vLLM keeps the watermark only while the running list is non-empty
    # (vllm/v1/core/sched/scheduler.py, Scheduler.schedule: allocate_slots(...,
    # has_scheduled_reqs=bool(self.running)); vllm/v1/core/kv_cache_manager.py,
    # KVCacheManager.allocate_slots: watermark_blocks only when has_scheduled_reqs). So
    # when A finishes (end of step 59) B re-prefills in step 60 on the idle engine,
    # samples its 38th token, decodes its last 22 in steps 61-82 and C (arriving at
    # 100 s) is served after it. (This test used to expect B rejected: the old rule kept
    # the watermark on an idle engine too.)
    tr = trace_of([(0, 4, 60), (0, 4, 60), (100, 4, 2)])
    pol = policy(batching=BATCH64, admission={"kv_watermark": 0.6})
    out, log = both_modes(tr, pol, kv_blocks=20, block_size=4)
    assert out.status.tolist() == [0, 0, 0]
    assert out.preemptions.tolist() == [0, 1, 0] and out.generated.tolist() == [60, 60, 2]
    events = [(r["step"], r["preempted"], r["shed"], r["admitted"]) for r in log
              if r["preempted"] or r["shed"] or r["admitted"]]
    assert events == [(0, [], [], [0, 1]), (37, [1], [], []), (60, [], [], [1]),
                      (83, [], [], [2])]
    # step 60: B's 41 tokens in 11 blocks, 9 free < the 12-block watermark
    assert compact(log)[60] == (60.0, [(1, 41)], [], [1], [], 11, 0, 1)
    assert out.finish_s.tolist() == [60.0, 83.0, 102.0]


def test_preempted_request_that_outgrew_the_lane_reserve_is_rejected_not_stuck():
    # The same run with the 12 blocks held back as the long lane's reserve instead (both
    # requests are short): that reserve binds on an idle engine too, so B's re-prefill
    # (11 blocks + 12) never fits 20 blocks; when A is done and the engine is empty B is
    # turned away, and C is served.
    tr = trace_of([(0, 4, 60), (0, 4, 60), (100, 4, 2)])
    pol = policy(batching=BATCH64,
                 long_requests={"threshold_tokens": 1000, "reserved_kv_fraction": 0.6})
    out, log = both_modes(tr, pol, kv_blocks=20, block_size=4)
    assert out.status.tolist() == [0, 2, 0]
    assert "re-prefill" in REASONS[out.reason[1]]
    assert out.preemptions.tolist() == [0, 1, 0] and out.generated.tolist() == [60, 37, 2]
    events = [(r["step"], r["preempted"], r["shed"], r["admitted"]) for r in log
              if r["preempted"] or r["shed"] or r["admitted"]]
    assert events == [(0, [], [], [0, 1]), (37, [1], [], []), (60, [], [1], [2])]


@pytest.mark.parametrize("engine", ["trtllm", "tgi"])
def test_fast_mode_rechecks_a_short_request_as_the_long_lane_grows(engine):
    # Found by a random search: request 0 is long (7 + 55 >= 49) and decodes alone while
    # short request 1 waits because the long lane's unused reserve (10 blocks less what
    # request 0 holds) is headroom it must leave. Reservations do not change while
    # request 0 decodes, but its growing blocks shrink that headroom: request 1 fits
    # after step 11. Fast mode used to jump over that step.
    tr = trace_of([(0, 7, 55), (0.5, 5, 36), (0.5, 23, 53), (1.0, 17, 26)])
    # (Chunking asked for, for both engines, as when this was found: prompts 23 and 17
    # exceed the 14-token budget, so unchunked trtllm-serve would reject them.)
    pol = policy(batching={"max_num_seqs": 3, "max_num_batched_tokens": 14,
                           "enable_chunked_prefill": True},
                 admission={"reserve_full_prompt": False},
                 long_requests={"threshold_tokens": 49, "reserved_kv_fraction": 0.2})
    out, _ = both_modes(tr, pol, kv_blocks=51, block_size=2, engine=engine)
    assert out.status.tolist() == [0, 0, 0, 0]
    assert out.admitted_s[1] == 12.0
