"""An independent model of vLLM V1's scheduler, to check servetune's ``vllm`` engine against.

This is deliberately plain Python, written from vLLM's rules (``Scheduler.schedule`` in
``vllm/v1/core/sched/scheduler.py`` and ``KVCacheManager.allocate_slots`` in
``vllm/v1/core/kv_cache_manager.py``; summarised in ``../shared/reference/engines.md``
section 1.1), not from servetune's kernel: it shares nothing with ``servetune`` but the
shape of its output (one record per step, as ``run_engine(..., step_log=True)`` writes).

What it models, for one engine replaying a small trace:

- paged KV: a pool of ``num_blocks`` usable blocks of ``block_size`` tokens; a request
  holds ``ceil(slots / block_size)`` blocks for the tokens it has computed or is computing;
- one ``schedule()`` per step: the RUNNING list in list order (each gets what it lacks of
  prompt + generated tokens, capped by ``long_prefill_token_threshold`` and the remaining
  budget; blocks for those tokens only; out of blocks: preempt the last running request
  (``priority``: the max ``(priority, arrival)``, the first such in the list), recompute
  style, to the front of the waiting queue (``priority``: back into the heap), until the
  allocation succeeds or the request preempted itself, which ends the pass); then, only
  if nothing was preempted, the WAITING queue (FCFS deque, arrivals appended in request
  id order; or a heap on ``(priority, arrival, id)``) while budget remains and fewer than
  ``max_num_seqs`` run, with strict head-of-line blocking: chunked prefill off and the
  chunk over the remaining budget, or the KV check failing, stops admission;
- the KV check at admission (``allocate_slots`` for a WAITING/PREEMPTED request): with
  ``reserve_full_isl`` the blocks of the whole sequence (prompt + generated) plus the
  watermark must not exceed the free blocks; then this chunk's blocks plus the watermark
  must not exceed them; the watermark counts only while the running list is non-empty
  (``has_scheduled_reqs=bool(self.running)``), and nothing is kept back for other
  requests' unfinished prefills (that is only for KV-connector loads);
- the step's outcome (``update_from_output``): a request whose computed tokens reach its
  prompt + generated tokens samples one token; it finishes (and frees its blocks) when it
  has generated its output length;
- time: a constant step time (a step that scheduled nothing, as when the first running
  request preempted itself, runs no forward pass and takes none); arrivals at or before
  a step's start join the queue before it is scheduled; an idle engine waits for the
  next arrival.

Not modelled: prefix caching, speculative decoding, KV connectors, encoder inputs,
``max_model_len``, async scheduling, requests that could never fit (the caller keeps the
pool big enough for every request's last token).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class OracleConfig:
    num_blocks: int  # usable KV blocks (free on an idle engine)
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int = 0  # 0: off
    enable_chunked_prefill: bool = True
    reserve_full_isl: bool = True  # vLLM's scheduler_reserve_full_isl
    watermark_blocks: int = 0  # int(watermark * blocks), already in blocks
    policy: str = "fcfs"  # or "priority" (lower value first)
    step_s: float = 1.0


@dataclass(frozen=True)
class OracleRequest:
    arrival_s: float
    prompt: int
    output: int
    priority: int = 0


@dataclass
class _Request:
    rid: int
    arrival_s: float
    prompt: int
    output: int
    priority: int
    computed: int = 0  # num_computed_tokens
    generated: int = 0  # num_output_tokens
    blocks: int = 0  # blocks held
    preemptions: int = 0
    finished: bool = False

    @property
    def num_tokens(self) -> int:
        """Prompt plus tokens generated so far (vLLM's ``request.num_tokens``)."""
        return self.prompt + self.generated


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass
class _Scheduler:
    cfg: OracleConfig
    running: list[_Request] = field(default_factory=list)
    fcfs_queue: deque[_Request] = field(default_factory=deque)
    heap: list[tuple[int, float, int, _Request]] = field(default_factory=list)
    used_blocks: int = 0

    # --- the waiting queue -----------------------------------------------------------

    def add_waiting(self, req: _Request) -> None:
        if self.cfg.policy == "priority":
            heapq.heappush(self.heap, (req.priority, req.arrival_s, req.rid, req))
        else:
            self.fcfs_queue.append(req)

    def prepend_waiting(self, req: _Request) -> None:
        if self.cfg.policy == "priority":
            heapq.heappush(self.heap, (req.priority, req.arrival_s, req.rid, req))
        else:
            self.fcfs_queue.appendleft(req)

    def peek_waiting(self) -> _Request | None:
        if self.cfg.policy == "priority":
            return self.heap[0][3] if self.heap else None
        return self.fcfs_queue[0] if self.fcfs_queue else None

    def pop_waiting(self) -> _Request:
        if self.cfg.policy == "priority":
            return heapq.heappop(self.heap)[3]
        return self.fcfs_queue.popleft()

    def num_waiting(self) -> int:
        return len(self.heap) if self.cfg.policy == "priority" else len(self.fcfs_queue)

    # --- the KV cache manager --------------------------------------------------------

    def free_blocks(self) -> int:
        return self.cfg.num_blocks - self.used_blocks

    def allocate_slots(self, req: _Request, num_new_tokens: int, admitting: bool) -> bool:
        """Blocks for ``req``'s computed tokens plus ``num_new_tokens``; False if refused."""
        bs = self.cfg.block_size
        watermark = self.cfg.watermark_blocks if admitting and self.running else 0
        if admitting and self.cfg.reserve_full_isl:
            full = _blocks_for(req.num_tokens, bs) - req.blocks
            if full + watermark > self.free_blocks():
                return False
        need = _blocks_for(req.computed + num_new_tokens, bs) - req.blocks
        if need + watermark > self.free_blocks():
            return False
        req.blocks += max(need, 0)
        self.used_blocks += max(need, 0)
        return True

    def free(self, req: _Request) -> None:
        self.used_blocks -= req.blocks
        req.blocks = 0

    # --- one step --------------------------------------------------------------------

    def preempt(self, req: _Request) -> None:
        self.free(req)
        req.computed = 0
        req.preemptions += 1
        self.prepend_waiting(req)

    def schedule(self) -> tuple[dict[int, int], list[int], list[int]]:
        """One ``Scheduler.schedule()``: ({request id: new tokens} in grant order,
        preempted ids, admitted ids)."""
        cfg = self.cfg
        budget = cfg.max_num_batched_tokens
        threshold = cfg.long_prefill_token_threshold
        scheduled: dict[int, int] = {}
        preempted: list[int] = []
        admitted: list[int] = []

        # Pass 1: the running list, in order.
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            num_new = req.num_tokens - req.computed
            if 0 < threshold < num_new:
                num_new = threshold
            num_new = min(num_new, budget)
            if num_new == 0:
                index += 1
                continue
            granted = True
            while not self.allocate_slots(req, num_new, admitting=False):
                if cfg.policy == "priority":
                    victim = max(self.running, key=lambda r: (r.priority, r.arrival_s))
                    self.running.remove(victim)
                    if victim.rid in scheduled:
                        budget += scheduled.pop(victim.rid)
                        index -= 1
                else:
                    victim = self.running.pop()
                self.preempt(victim)
                preempted.append(victim.rid)
                if victim is req:
                    granted = False
                    break
            if not granted:
                break
            scheduled[req.rid] = num_new
            budget -= num_new
            index += 1

        # Pass 2: the waiting queue, only in a step that preempted nothing.
        if not preempted:
            while budget > 0:
                req = self.peek_waiting()
                if req is None or len(self.running) == cfg.max_num_seqs:
                    break
                num_new = req.num_tokens - req.computed
                if 0 < threshold < num_new:
                    num_new = threshold
                if not cfg.enable_chunked_prefill and num_new > budget:
                    break
                num_new = min(num_new, budget)
                if not self.allocate_slots(req, num_new, admitting=True):
                    break
                self.pop_waiting()
                self.running.append(req)
                scheduled[req.rid] = num_new
                budget -= num_new
                admitted.append(req.rid)
        return scheduled, preempted, admitted

    def update_from_output(self, requests: list[_Request],
                           scheduled: dict[int, int]) -> list[int]:
        """Advance the scheduled requests; those that sampled their last token finish."""
        finished: list[int] = []
        for rid, num_new in scheduled.items():
            req = requests[rid]
            req.computed += num_new
            if req.computed >= req.num_tokens:  # the prefill (or the decode) is complete
                req.generated += 1
                if req.generated >= req.output:
                    req.finished = True
                    self.running.remove(req)
                    self.free(req)
                    finished.append(rid)
        return finished


def replay(requests: list[OracleRequest], cfg: OracleConfig,
           max_steps: int = 100_000) -> list[dict[str, Any]]:
    """Replay ``requests`` (request id = list index; arrivals in non-decreasing order)
    and return one record per step: ``step``, ``start_s``, ``scheduled`` (``[id,
    tokens]`` in grant order), ``preempted``, ``admitted``, ``finished``,
    ``kv_blocks_used`` (after the step's allocations, before its finishes), ``waiting``
    and ``running`` (after scheduling)."""
    arrivals = [r.arrival_s for r in requests]
    if arrivals != sorted(arrivals):
        raise ValueError("requests must be in arrival order")
    reqs = [_Request(i, r.arrival_s, r.prompt, r.output, r.priority)
            for i, r in enumerate(requests)]
    sched = _Scheduler(cfg)
    log: list[dict[str, Any]] = []
    now = 0.0
    next_arrival = 0
    while not all(r.finished for r in reqs):
        if len(log) >= max_steps:
            raise RuntimeError(f"no end after {max_steps} steps")
        if not sched.running and sched.num_waiting() == 0:
            now = max(now, reqs[next_arrival].arrival_s)  # idle: wait for the next arrival
        while next_arrival < len(reqs) and reqs[next_arrival].arrival_s <= now:
            sched.add_waiting(reqs[next_arrival])
            next_arrival += 1
        scheduled, preempted, admitted = sched.schedule()
        kv_used = sched.used_blocks
        waiting, running = sched.num_waiting(), len(sched.running)
        finished = sched.update_from_output(reqs, scheduled)
        log.append({
            "step": len(log),
            "start_s": now,
            "scheduled": [[rid, n] for rid, n in scheduled.items()],
            "preempted": preempted,
            "admitted": admitted,
            "finished": finished,
            "kv_blocks_used": kv_used,
            "waiting": waiting,
            "running": running,
        })
        # a step that scheduled nothing runs no forward pass: it takes no time
        now += cfg.step_s if scheduled else 0.0
    return log


def preemptions(requests: list[OracleRequest], log: list[dict[str, Any]]) -> list[int]:
    """Times each request was preempted, from a step log."""
    counts = [0] * len(requests)
    for rec in log:
        for rid in rec["preempted"]:
            counts[rid] += 1
    return counts
