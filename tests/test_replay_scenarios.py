"""Replay scenarios worked by hand, checked step by step against the step log.

In the spirit of vLLM's own scheduler tests: every scenario uses a constant step time of
1 s (so step k starts at k s unless the engine idles), an exact KV pool, and requests
small enough that each step was computed on paper. Each record below is
``(start_s, scheduled [(id, new_tokens)], preempted, admitted, finished, kv_blocks_used,
waiting, running)``; fast mode must give the same log after expanding ``repeat``.
Token rule: a step that brings a request's computed tokens up to prompt + generated
samples one token; KV blocks held = ceil(computed / block_size).
"""

from __future__ import annotations

import numpy as np
from test_engine_helpers import both_modes, compact, policy, trace_of


def test_token_budget_split_across_requests():
    # budget 10: A's 6-token prompt, then B gets the 4 tokens left (chunked prefill).
    tr = trace_of([(0, 6, 2), (0, 6, 2)])
    pol = policy(batching={"max_num_seqs": 4, "max_num_batched_tokens": 10})
    out, log = both_modes(tr, pol, kv_blocks=100, block_size=4)
    assert compact(log) == [
        (0.0, [(0, 6), (1, 4)], [], [0, 1], [], 3, 0, 2),
        (1.0, [(0, 1), (1, 2)], [], [], [0], 4, 0, 2),  # A decodes; B finishes prefill
        (2.0, [(1, 1)], [], [], [1], 2, 0, 1),
    ]
    assert out.first_token_s.tolist() == [1.0, 2.0]
    assert out.finish_s.tolist() == [2.0, 3.0]


def test_long_prefill_token_threshold_caps_each_request_per_step():
    tr = trace_of([(0, 10, 1), (0, 3, 2)])
    pol = policy(batching={"max_num_seqs": 4, "max_num_batched_tokens": 16,
                           "long_prefill_token_threshold": 4})
    _, log = both_modes(tr, pol, kv_blocks=100, block_size=4)
    assert compact(log) == [
        (0.0, [(0, 4), (1, 3)], [], [0, 1], [], 2, 0, 2),
        (1.0, [(0, 4), (1, 1)], [], [], [1], 3, 0, 2),
        (2.0, [(0, 2)], [], [], [0], 3, 0, 1),
    ]


def test_running_requests_are_served_before_new_prefills():
    # B arrives while A decodes: A's decode token comes first, B gets the rest (7).
    tr = trace_of([(0, 4, 3), (0.5, 10, 1)])
    pol = policy(batching={"max_num_seqs": 4, "max_num_batched_tokens": 8})
    _, log = both_modes(tr, pol, kv_blocks=100, block_size=4)
    assert compact(log) == [
        (0.0, [(0, 4)], [], [0], [], 1, 0, 1),
        (1.0, [(0, 1), (1, 7)], [], [1], [], 4, 0, 2),
        (2.0, [(0, 1), (1, 3)], [], [], [0, 1], 5, 0, 2),
    ]


def test_max_num_seqs_caps_the_running_batch():
    tr = trace_of([(0, 4, 3), (0, 4, 3), (0, 4, 3)])
    pol = policy(batching={"max_num_seqs": 2, "max_num_batched_tokens": 64})
    out, log = both_modes(tr, pol, kv_blocks=100, block_size=4)
    assert compact(log) == [
        (0.0, [(0, 4), (1, 4)], [], [0, 1], [], 2, 1, 2),
        (1.0, [(0, 1), (1, 1)], [], [], [], 4, 1, 2),
        (2.0, [(0, 1), (1, 1)], [], [], [0, 1], 4, 1, 2),
        (3.0, [(2, 4)], [], [2], [], 1, 0, 1),
        (4.0, [(2, 1)], [], [], [], 2, 0, 1),
        (5.0, [(2, 1)], [], [], [2], 2, 0, 1),
    ]
    assert out.admitted_s.tolist() == [0.0, 0.0, 3.0]


def test_fcfs_preempts_the_last_admitted_and_recomputes_it():
    # 3 blocks of 4 tokens. Step 1: A takes the last free block; B (last admitted)
    # needs one too and is preempted. B resumes after A finishes: it re-prefills its
    # prompt plus its one generated token (5 tokens) and samples its 2nd token.
    tr = trace_of([(0, 4, 6), (0, 4, 6)])
    pol = policy(batching={"max_num_seqs": 4, "max_num_batched_tokens": 64})
    out, log = both_modes(tr, pol, kv_blocks=3, block_size=4)
    assert compact(log) == [
        (0.0, [(0, 4), (1, 4)], [], [0, 1], [], 2, 0, 2),
        (1.0, [(0, 1)], [1], [], [], 2, 1, 1),
        (2.0, [(0, 1)], [], [], [], 2, 1, 1),  # B needs 2 blocks, 1 free: waits
        (3.0, [(0, 1)], [], [], [], 2, 1, 1),
        (4.0, [(0, 1)], [], [], [], 2, 1, 1),
        (5.0, [(0, 1)], [], [], [0], 3, 1, 1),
        (6.0, [(1, 5)], [], [1], [], 2, 0, 1),
        (7.0, [(1, 1)], [], [], [], 2, 0, 1),
        (8.0, [(1, 1)], [], [], [], 2, 0, 1),
        (9.0, [(1, 1)], [], [], [], 2, 0, 1),
        (10.0, [(1, 1)], [], [], [1], 3, 0, 1),
    ]
    assert out.preemptions.tolist() == [0, 1]
    assert out.first_token_s.tolist() == [1.0, 1.0]  # the first token is kept
    assert out.finish_s.tolist() == [6.0, 11.0]
    assert out.generated.tolist() == [6, 6]


def test_priority_preempts_the_lowest_priority_even_if_already_scheduled():
    # A (priority 1) runs first; B (priority 0) arrives. In step 2 B needs a block:
    # under priority the victim is A (already granted this step: its grant is undone).
    rows = [(0, 4, 4), (0.5, 4, 3)]
    tr = trace_of(rows, priority=np.array([1, 0], dtype=np.int32))
    pol = policy(scheduling="priority",
                 batching={"max_num_seqs": 4, "max_num_batched_tokens": 64})
    out, log = both_modes(tr, pol, kv_blocks=3, block_size=4)
    assert compact(log) == [
        (0.0, [(0, 4)], [], [0], [], 1, 0, 1),
        (1.0, [(0, 1), (1, 4)], [], [1], [], 3, 0, 2),
        (2.0, [(1, 1)], [0], [], [], 2, 1, 1),
        (3.0, [(1, 1)], [], [], [1], 2, 1, 1),
        (4.0, [(0, 6)], [], [0], [], 2, 0, 1),  # re-prefill of 4 prompt + 2 generated
        (5.0, [(0, 1)], [], [], [0], 2, 0, 1),
    ]
    assert out.preemptions.tolist() == [1, 0]


def test_fcfs_preempts_the_request_itself_when_it_is_the_last_admitted():
    # Same input as above under FCFS: B is the last admitted, so B is the victim.
    tr = trace_of([(0, 4, 4), (0.5, 4, 3)], priority=np.array([1, 0], dtype=np.int32))
    pol = policy(batching={"max_num_seqs": 4, "max_num_batched_tokens": 64})
    out, log = both_modes(tr, pol, kv_blocks=3, block_size=4)
    assert compact(log) == [
        (0.0, [(0, 4)], [], [0], [], 1, 0, 1),
        (1.0, [(0, 1), (1, 4)], [], [1], [], 3, 0, 2),
        (2.0, [(0, 1)], [1], [], [], 2, 1, 1),
        (3.0, [(0, 1)], [], [], [0], 2, 1, 1),
        (4.0, [(1, 5)], [], [1], [], 2, 0, 1),
        (5.0, [(1, 1)], [], [], [1], 2, 0, 1),
    ]
    assert out.preemptions.tolist() == [0, 1]


def test_a_preempted_request_resumes_from_its_cached_blocks():
    # The case above with prefix caching on (vLLM's default): B's first block (its 4
    # prompt tokens) stays cached when B is preempted, so its re-prefill of 4 prompt + 1
    # generated tokens computes only the last one.
    tr = trace_of([(0, 4, 4), (0.5, 4, 3)], priority=np.array([1, 0], dtype=np.int32))
    pol = policy(batching={"max_num_seqs": 4, "max_num_batched_tokens": 64},
                 caching={"enable_prefix_caching": True})
    out, log = both_modes(tr, pol, kv_blocks=3, block_size=4)
    assert compact(log)[4:] == [
        (4.0, [(1, 1)], [], [1], [], 2, 0, 1),
        (5.0, [(1, 1)], [], [], [1], 2, 0, 1),
    ]
    assert log[4]["cached_tokens"] == [[1, 4]]
    assert out.preemptions.tolist() == [0, 1]


def test_no_admission_in_a_step_that_preempted():
    # C (1 block, high priority) arrives at 0.5. In step 1 B is preempted, which frees
    # a block C would fit in, but a step that preempted admits nothing: C waits a step.
    rows = [(0, 4, 6), (0, 4, 6), (0.5, 1, 1)]
    tr = trace_of(rows, priority=np.array([0, 1, 0], dtype=np.int32))
    pol = policy(scheduling="priority",
                 batching={"max_num_seqs": 8, "max_num_batched_tokens": 64})
    out, log = both_modes(tr, pol, kv_blocks=3, block_size=4)
    assert compact(log) == [
        (0.0, [(0, 4), (1, 4)], [], [0, 1], [], 2, 0, 2),
        (1.0, [(0, 1)], [1], [], [], 2, 2, 1),
        (2.0, [(0, 1), (2, 1)], [], [2], [2], 3, 1, 2),
        (3.0, [(0, 1)], [], [], [], 2, 1, 1),
        (4.0, [(0, 1)], [], [], [], 2, 1, 1),
        (5.0, [(0, 1)], [], [], [0], 3, 1, 1),
        (6.0, [(1, 5)], [], [1], [], 2, 0, 1),
        (7.0, [(1, 1)], [], [], [], 2, 0, 1),
        (8.0, [(1, 1)], [], [], [], 2, 0, 1),
        (9.0, [(1, 1)], [], [], [], 2, 0, 1),
        (10.0, [(1, 1)], [], [], [1], 3, 0, 1),
    ]
    assert out.first_token_s[2] == 3.0


def test_head_of_line_blocking_with_chunked_prefill_off():
    # Budget 8, chunking off: B (6 tokens) does not fit the 2 left after A and blocks
    # C (1 token) behind it, which would have fitted.
    tr = trace_of([(0, 6, 3), (0, 6, 1), (0, 1, 1)])
    pol = policy(batching={"max_num_seqs": 8, "max_num_batched_tokens": 8,
                           "enable_chunked_prefill": False})
    _, log = both_modes(tr, pol, kv_blocks=100, block_size=4)
    assert compact(log) == [
        (0.0, [(0, 6)], [], [0], [], 2, 2, 1),
        (1.0, [(0, 1), (1, 6), (2, 1)], [], [1, 2], [1, 2], 5, 0, 3),
        (2.0, [(0, 1)], [], [], [0], 2, 0, 1),
    ]


def test_chunked_prefill_on_splits_the_same_prompt():
    tr = trace_of([(0, 6, 3), (0, 6, 1), (0, 1, 1)])
    pol = policy(batching={"max_num_seqs": 8, "max_num_batched_tokens": 8})
    _, log = both_modes(tr, pol, kv_blocks=100, block_size=4)
    assert compact(log) == [
        (0.0, [(0, 6), (1, 2)], [], [0, 1], [], 3, 1, 2),
        (1.0, [(0, 1), (1, 4), (2, 1)], [], [2], [1, 2], 5, 0, 3),
        (2.0, [(0, 1)], [], [], [0], 2, 0, 1),
    ]


def test_priority_order_with_ties_broken_by_arrival():
    tr = trace_of([(0, 4, 1)] * 4, priority=np.array([2, 1, 1, 0], dtype=np.int32))
    pol = policy(scheduling="priority",
                 batching={"max_num_seqs": 1, "max_num_batched_tokens": 64})
    _, log = both_modes(tr, pol, kv_blocks=100, block_size=4)
    assert compact(log) == [
        (0.0, [(3, 4)], [], [3], [3], 1, 3, 1),
        (1.0, [(1, 4)], [], [1], [1], 1, 2, 1),
        (2.0, [(2, 4)], [], [2], [2], 1, 1, 1),
        (3.0, [(0, 4)], [], [0], [0], 1, 0, 1),
    ]


def test_class_priorities_from_the_policy():
    tr = trace_of([(0, 4, 1)] * 3, class_id=np.array([0, 1, 0], dtype=np.int32),
                  class_names=("batch", "chat"))
    pol = policy(scheduling="priority", classes={"chat": {"priority": -1}},
                 batching={"max_num_seqs": 1, "max_num_batched_tokens": 64})
    _, log = both_modes(tr, pol, kv_blocks=100, block_size=4)
    assert [rec["admitted"] for rec in log] == [[1], [0], [2]]


def test_watermark_refuses_an_admission_that_would_eat_the_headroom():
    # 10 blocks, watermark 0.2 -> 2 blocks kept free: C (1 block) would leave 1.
    tr = trace_of([(0, 16, 1), (0, 16, 1), (0, 4, 1)])
    batching = {"max_num_seqs": 8, "max_num_batched_tokens": 64}
    _, log = both_modes(tr, policy(batching=batching, admission={"kv_watermark": 0.2}),
                        kv_blocks=10, block_size=4)
    assert compact(log) == [
        (0.0, [(0, 16), (1, 16)], [], [0, 1], [0, 1], 8, 1, 2),
        (1.0, [(2, 4)], [], [2], [2], 1, 0, 1),
    ]
    _, log = both_modes(tr, policy(batching=batching), kv_blocks=10, block_size=4)
    assert compact(log) == [(0.0, [(0, 16), (1, 16), (2, 4)], [], [0, 1, 2], [0, 1, 2], 9, 0, 3)]


def test_queue_cap_sheds_at_arrival():
    tr = trace_of([(0, 4, 2), (0, 4, 2), (0, 4, 2), (3.5, 4, 1)])
    pol = policy(batching={"max_num_seqs": 1, "max_num_batched_tokens": 64},
                 admission={"max_queued_requests": 2})
    out, log = both_modes(tr, pol, kv_blocks=100, block_size=4)
    assert [rec["shed"] for rec in log] == [[2], [], [], [], []]
    assert out.status.tolist() == [0, 0, 1, 0]
    assert out.reason[2] == 1
    assert compact(log)[3] == (3.0, [(1, 1)], [], [], [1], 2, 0, 1)
    assert compact(log)[4] == (4.0, [(3, 4)], [], [3], [3], 1, 0, 1)


def test_long_request_lane_does_not_block_short_requests():
    # Long = prompt + expected output >= 20. Lane max_seqs=1: B (long) waits for A, but
    # C (short) behind it is admitted at once.
    tr = trace_of([(0, 30, 2), (0, 30, 2), (0, 4, 1)])
    pol = policy(batching={"max_num_seqs": 8, "max_num_batched_tokens": 60},
                 long_requests={"threshold_tokens": 20, "max_seqs": 1})
    _, log = both_modes(tr, pol, kv_blocks=100, block_size=4)
    assert compact(log) == [
        (0.0, [(0, 30), (2, 4)], [], [0, 2], [2], 9, 1, 2),
        (1.0, [(0, 1)], [], [], [0], 8, 1, 1),
        (2.0, [(1, 30)], [], [1], [], 8, 0, 1),
        (3.0, [(1, 1)], [], [], [1], 8, 0, 1),
    ]
    # Without the lane, B takes the rest of the budget and C waits a step.
    _, log = both_modes(tr, policy(batching={"max_num_seqs": 8,
                                             "max_num_batched_tokens": 60}),
                        kv_blocks=100, block_size=4)
    assert [rec["admitted"] for rec in log[:2]] == [[0, 1], [2]]
    assert log[0]["scheduled"] == [[0, 30], [1, 30]]


def test_idle_engine_jumps_to_the_next_arrival():
    tr = trace_of([(0, 4, 1), (10.25, 4, 2)])
    pol = policy(batching={"max_num_seqs": 4, "max_num_batched_tokens": 64})
    out, log = both_modes(tr, pol, kv_blocks=100, block_size=4)
    assert [rec["start_s"] for rec in log] == [0.0, 10.25, 11.25]
    assert out.finish_s.tolist() == [1.0, 12.25]


def test_reserved_seat_for_long_requests_is_left_free_by_short_ones():
    # max_num_seqs 2 with 1 seat reserved for long requests: the second short request
    # waits although a seat is free, and the long one (arriving later) takes that seat.
    tr = trace_of([(0, 4, 3), (0, 4, 1), (0.5, 30, 2)])
    pol = policy(batching={"max_num_seqs": 2, "max_num_batched_tokens": 64},
                 long_requests={"threshold_tokens": 20, "reserved_seqs": 1})
    _, log = both_modes(tr, pol, kv_blocks=100, block_size=4)
    assert compact(log) == [
        (0.0, [(0, 4)], [], [0], [], 1, 1, 1),
        (1.0, [(0, 1), (2, 30)], [], [2], [], 10, 1, 2),
        (2.0, [(0, 1), (2, 1)], [], [], [0, 2], 10, 1, 2),
        (3.0, [(1, 4)], [], [1], [1], 1, 0, 1),
    ]


# ---- vLLM admission as its source does it (issue 13) ---------------------------------


def test_full_prompt_check_ignores_the_blocks_other_prefills_still_need():
    # 3 blocks of 16, budget 2, threshold 1, max_num_seqs 2. A (33-token prompt = 3
    # blocks) and B (1 token) arrive together. A is admitted with its first token (its
    # whole prompt fits the 3 free blocks); B's prompt needs 1 block and 2 are free, so
    # B is admitted too and finishes in step 0. vLLM keeps back the blocks in-flight
    # prefills still need only for a request whose KV a connector loads asynchronously
    # (vllm/v1/core/sched/scheduler.py, Scheduler.schedule: reserved_blocks =
    # _inflight_prefill_reserved_blocks() only `if load_kv_async`; allocate_slots with
    # full_sequence_must_fit checks the full prompt's blocks against the free blocks).
    # servetune used to add A's 2 missing blocks to B's need and keep B waiting 33 steps.
    tr = trace_of([(0, 33, 1), (0, 1, 1)])
    pol = policy(batching={"max_num_seqs": 2, "max_num_batched_tokens": 2,
                           "long_prefill_token_threshold": 1})
    out, log = both_modes(tr, pol, kv_blocks=3, block_size=16)
    # A then prefills one token a step; it holds ceil(computed / 16) blocks and samples
    # its only token when its 33rd is computed, in step 32.
    assert compact(log) == [
        (0.0, [(0, 1), (1, 1)], [], [0, 1], [1], 2, 0, 2),
    ] + [
        (float(k), [(0, 1)], [], [], [0] if k == 32 else [], -(-(k + 1) // 16), 0, 1)
        for k in range(1, 33)
    ]
    assert out.finish_s.tolist() == [33.0, 1.0]


def test_watermark_is_waived_on_an_idle_engine():
    # 10 blocks of 4, watermark 0.5 -> 5 blocks kept free while something runs. A's
    # 28-token prompt (7 blocks) would leave 3 free, yet the idle engine admits it: vLLM
    # applies the watermark only when the running list is non-empty
    # (vllm/v1/core/sched/scheduler.py, Scheduler.schedule: allocate_slots(...,
    # has_scheduled_reqs=bool(self.running)); vllm/v1/core/kv_cache_manager.py,
    # KVCacheManager.allocate_slots: watermark_blocks only if has_scheduled_reqs).
    # The running list includes A once admitted, so B (1 block) is refused in step 0
    # (7 + 1 + 5 > 10) and in step 1 (8 + 1 + 5), and admitted in step 2 once A is gone.
    # servetune used to reject A at arrival (7 + 5 > 10).
    tr = trace_of([(0, 28, 2), (0, 4, 1)])
    pol = policy(batching={"max_num_seqs": 8, "max_num_batched_tokens": 64},
                 admission={"kv_watermark": 0.5})
    out, log = both_modes(tr, pol, kv_blocks=10, block_size=4)
    assert compact(log) == [
        (0.0, [(0, 28)], [], [0], [], 7, 1, 1),
        (1.0, [(0, 1)], [], [], [0], 8, 1, 1),
        (2.0, [(1, 4)], [], [1], [1], 1, 0, 1),
    ]
    assert out.status.tolist() == [0, 0]
    # The arrival-time rejection is the same check on the empty engine: only a prompt
    # beyond the whole pool (44 tokens = 11 blocks) is turned away.
    out, log = both_modes(trace_of([(0, 40, 1), (0, 44, 1)]), pol, kv_blocks=10,
                          block_size=4)
    assert out.status.tolist() == [0, 2]
    assert out.reason[1] == 3  # REASON_KV_POOL
    assert [rec["shed"] for rec in log] == [[1]]


def test_priority_victim_among_exact_ties_is_the_latest_request():
    # A and B: same priority, same arrival time; the queue admits A first (ties broken
    # by request id, vllm/v1/request.py Request.__lt__: priority, arrival_time,
    # request_id), so the running list is [A, B]. 3 blocks of 4: in step 1 A takes the
    # last free block, then B needs one. The victim is the max (priority, arrival time)
    # request (vllm/v1/core/sched/scheduler.py, Scheduler.schedule); among exact ties
    # servetune takes the latest request, B, so B gives itself up. (vLLM's max keeps the
    # first in the list, A; servetune does not, because that rule can thrash forever on
    # exact ties: see _preemption_victim.)
    tr = trace_of([(0, 4, 6), (0, 4, 6)], priority=np.array([0, 0], dtype=np.int32))
    pol = policy(scheduling="priority",
                 batching={"max_num_seqs": 4, "max_num_batched_tokens": 64})
    out, log = both_modes(tr, pol, kv_blocks=3, block_size=4)
    assert compact(log) == [
        (0.0, [(0, 4), (1, 4)], [], [0, 1], [], 2, 0, 2),
        (1.0, [(0, 1)], [1], [], [], 2, 1, 1),
        (2.0, [(0, 1)], [], [], [], 2, 1, 1),  # B's re-prefill needs 2 blocks, 1 free
        (3.0, [(0, 1)], [], [], [], 2, 1, 1),
        (4.0, [(0, 1)], [], [], [], 2, 1, 1),
        (5.0, [(0, 1)], [], [], [0], 3, 1, 1),
        (6.0, [(1, 5)], [], [1], [], 2, 0, 1),  # 4 prompt + 1 generated
        (7.0, [(1, 1)], [], [], [], 2, 0, 1),
        (8.0, [(1, 1)], [], [], [], 2, 0, 1),
        (9.0, [(1, 1)], [], [], [], 2, 0, 1),
        (10.0, [(1, 1)], [], [], [1], 3, 0, 1),
    ]
    assert out.preemptions.tolist() == [0, 1]
    assert out.finish_s.tolist() == [6.0, 11.0]


def test_queue_ties_are_broken_by_request_id_in_both_policies():
    # Equal arrival times (and equal priorities): the queue order is the request id,
    # as vLLM's FCFS deque (arrival order) and its priority heap (Request.__lt__ falls
    # back to request_id) give. One seat: the requests run one after another in id order.
    rows = [(0, 4, 1)] * 3
    for scheduling in ("fcfs", "priority"):
        tr = trace_of(rows, priority=np.array([1, 1, 1], dtype=np.int32))
        pol = policy(scheduling=scheduling,
                     batching={"max_num_seqs": 1, "max_num_batched_tokens": 64})
        _, log = both_modes(tr, pol, kv_blocks=100, block_size=4)
        assert [rec["admitted"] for rec in log] == [[0], [1], [2]]


def test_tgi_decode_rows_take_prefill_budget_with_chunking():
    # TGI, budget (max_batch_prefill_tokens) 8. A (4-token prompt, 4 tokens out) decodes
    # when B (8-token prompt) arrives. With prefill chunking TGI's batching_task
    # (backends/v3/src/backend.rs) gives the next prefill
    # max_batch_prefill_tokens.saturating_sub(batch.current_tokens): A's decode row takes
    # 1, so B gets a 7-token chunk in step 1 and its last token in step 2.
    tr = trace_of([(0, 4, 4), (0.5, 8, 1)])
    batching = {"max_num_seqs": 8, "max_num_batched_tokens": 8}
    _, log = both_modes(tr, policy(batching=batching), kv_blocks=100, block_size=4,
                        engine="tgi")
    assert compact(log) == [
        (0.0, [(0, 4)], [], [0], [], 1, 0, 1),
        (1.0, [(0, 1), (1, 7)], [], [1], [], 4, 0, 2),
        (2.0, [(0, 1), (1, 1)], [], [], [1], 4, 0, 2),
        (3.0, [(0, 1)], [], [], [0], 2, 0, 1),
    ]
    # Without chunking TGI runs a prefill batch of its own within the whole budget while
    # the decode rows wait for it: servetune lets them ride in the same step, free.
    _, log = both_modes(tr, policy(batching={**batching, "enable_chunked_prefill": False}),
                        kv_blocks=100, block_size=4, engine="tgi")
    assert compact(log) == [
        (0.0, [(0, 4)], [], [0], [], 1, 0, 1),
        (1.0, [(0, 1), (1, 8)], [], [1], [1], 4, 0, 2),
        (2.0, [(0, 1)], [], [], [], 2, 0, 1),
        (3.0, [(0, 1)], [], [], [0], 2, 0, 1),
    ]
