"""The engine simulator's hot loop: four named tuples of flat arrays in, one step at a time.

This module is loaded twice (see :mod:`servetune.sim.engine`): once as itself, where the
functions are compiled with numba (fast mode; the two entry points, :func:`run_kernel` and
:func:`reject_at_arrival`, are cached), and once under the name
``servetune.sim._kernel_pure``, where ``jit`` is the identity, so the very same source runs
as plain Python (reference mode). Fast mode additionally jumps decode-only stretches
(``Params.jump``); reference mode walks every step. Tests prove the two give identical
per-request records and, after expanding ``repeat``, identical step logs.

Layout (module-level ``NamedTuple`` classes, which numba compiles and caches):

- :class:`Params`: run constants: engine, policy knobs (in tokens and blocks), KV pool,
  step-time coefficients, SGLang's token-ratio constants, mode (jump, log).
- :class:`Requests`: the trace's columns, one entry per request, including the reason it
  is rejected at arrival (:func:`reject_at_arrival` fills it before the run).
- :class:`State`: per-request progress and timestamps; the waiting queue as one binary
  heap per lane, all in one flat pair of arrays (``heap_key``, ``heap_id``; lane ``l``'s
  heap starts at ``lanes[l, LANE_HEAP_START]`` and holds ``lanes[l, LANE_WAITING]``
  requests; its room is the number of requests in the lane, since a preempted request
  re-enters its own lane); what each lane's running requests hold (``lanes``' other
  columns); the running list in admission order (in the spirit of
  vLLM's ``scheduler.py``); the step's batch; and the scalars that survive between calls
  (clock, counters, KV in use; :data:`SCALARS`) in ``scalars[0]``, so the Python driver
  can pause the loop (to grow the step log or report progress) and resume it.
- :class:`StepLog`: step records, their events, jumped stretches' per-step values, counts.

A step (:func:`run_kernel`): arrivals enter the queue or are turned away (``_arrivals``);
in fast mode a stretch of identical decode steps is jumped instead (``_jump``); else the
batch is formed (``_schedule``). vLLM, TensorRT-LLM and TGI grant tokens to the running
requests in admission order (``_grant_running``), preempting when blocks run out
(``_preempt``), then admit waiting requests unless they preempted. SGLang continues its
chunked prefill and admits, else decodes every running request, retracting when blocks
run out (``_sglang_decode_batch``). Admission is one routine for every engine
(``_admit_waiting``); its checks (``_lane_has_room``, ``_kv_refused``) also decide which
requests are rejected at arrival. Last, the step is executed (``_execute_step``): its
duration from the batch's aggregates, then its tokens, first tokens and finishes.

Lanes (``Params.lane_limits``, one row per lane; ``Requests.lane``): lane 0 is the common
lane, which has no limits; the others (one per policy class with a lane of its own, then
the long-request lane) each have reserved seats and blocks, a seat cap, a cap on their
running requests' footprint (blocks of prompt + expected output) and a queue cap. A request
is admitted only within its lane's caps and while it leaves every other lane's unused
reserve free (seats within ``max_num_seqs``, blocks beside the watermark); each lane's
queue is head-of-line blocking only within itself, and the lanes are merged by queue
order. With one lane (no lanes in the policy) every lane check passes.

Token accounting (one rule for every engine, as vLLM V1): a request's target is
``prompt + generated``; a step grants it ``new`` tokens towards that target; a step that
reaches the target samples one output token. Hence the first output token is sampled in
the step that completes the prefill, and each later step decodes one token. KV blocks
held = ceil(computed / block_size), for every engine (SGLang, too, allocates a chunked
prefill one chunk at a time).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from servetune.engines import kernel_id
from servetune.profiles.steptime import step_seconds as _step_seconds_py
from servetune.routers import kernel_code as route_code

if __name__.endswith("_pure"):

    def jit(fn):  # noqa: D103 - reference mode: plain Python
        return fn

    entry = inline = jit
    _step_seconds = _step_seconds_py
else:
    import numba

    # No reference counting (_nrt=False, as numba's own sort kernels): the kernel
    # allocates nothing, and counting references to every array of a named tuple at each
    # access and call made the loop 15x slower. Helpers are called only from compiled
    # code, so they get no Python wrapper (unboxing the tuples there doubled the compile
    # time); the entry points are cached with their helpers linked in. The few tiny
    # helpers called with many different constants are inlined where they are called
    # (numba would compile them once per constant). The entry points' compiled code is
    # cached per user, keyed by the sources' hash (servetune.sim.kernel_cache).
    from servetune.sim.kernel_cache import cached_jit

    jit = numba.njit(_nrt=False, no_cpython_wrapper=True)
    inline = numba.njit(_nrt=False, no_cpython_wrapper=True, inline="always")
    # nogil: replicas that a static router keeps independent run in threads side by side
    entry = cached_jit(_nrt=False, nogil=True)
    _step_seconds = jit(_step_seconds_py)

# --- engines (their ids in the engine registry; compile-time constants here) ----------
E_VLLM = kernel_id("vllm")
E_SGLANG = kernel_id("sglang")
E_TRTLLM = kernel_id("trtllm")
E_TGI = kernel_id("tgi")

# --- request status (State.status) -----------------------------------------------------
PENDING = -1
COMPLETED = 0
SHED = 1
REJECTED = 2

# --- why a request did not complete (State.reason; REASONS[code] is the text) -----------
REASON_NONE = 0
REASON_SHED_REQUESTS = 1
REASON_SHED_TOKENS = 2
REASON_KV_POOL = 3
REASON_LANE = 4
REASON_BUDGET = 5
REASON_RESERVATION = 6
REASON_READMIT = 7
REASON_SHED_CLASS = 8
REASONS = (
    "",
    "shed: max_queued_requests reached (HTTP 503)",
    "shed: max_queued_prompt_tokens reached (HTTP 503)",
    "rejected: needs more KV blocks than the pool (less lane reserve and watermark at admission)",
    "rejected: the request's footprint exceeds its lane's KV cap (max_kv_fraction of "
    "long_requests or of its class)",
    "rejected: prompt longer than max_num_batched_tokens with chunked prefill off",
    "rejected: prompt + max output reservation exceeds the KV pool",
    "rejected: preempted, its re-prefill no longer fits the pool less watermark/lane reserve",
    "shed: its class's max_queued_requests reached (HTTP 503)",
)

# --- step-log events (StepLog.event_kind) ------------------------------------------------
EV_SCHED = 0
EV_PREEMPT = 1
EV_FINISH = 2
EV_ADMIT = 3
EV_SHED = 4

# --- the lanes' limits (Params.lane_limits columns) and state (State.lanes columns) --------
LIM_RESERVED_SEQS = 0
LIM_RESERVED_BLOCKS = 1
LIM_MAX_SEQS = 2
LIM_MAX_BLOCKS = 3  # cap on the lane footprint of its running requests
LIM_MAX_QUEUED = 4  # cap on its waiting + running requests (<= 0: none)
LANE_LIMITS = 5
LANE_WAITING = 0  # requests in its queue (heap)
LANE_HEAP_START = 1  # where its heap starts in State.heap_key and heap_id
LANE_RUNNING = 2  # its running requests (not counted for lane 0, which has no limits)
LANE_HELD = 3  # KV blocks they hold (idem)
LANE_FOOTPRINT = 4  # their lane footprint, in blocks (idem)
LANE_BLOCKED = 5  # 1: its head waits in this admission pass (scratch)
LANE_STATE = 6

WINDOW_MAX = 4096  # longest jumped stretch (size of the allocation histogram)

# --- prefix cache keys ------------------------------------------------------------------------
EMPTY_KEY = -(1 << 62)  # a free hash-table entry (no block has this key)
UNIQUE_STRIDE = 1 << 24  # blocks per request in the keys of blocks no other request can share
UNIT_BLOCKS_MAX = 32  # blocks per cache unit at most (a unit's cached blocks are a bit mask)
U_KEY = 0  # State.units columns
U_MASK = 1
UNIT_COLUMNS = 2
N_UNIT = 0  # State.nodes columns: the unit (-1: a finished request's anonymous blocks),
N_LO = 1  # its blocks [lo, hi) in the LRU (hi - 1 nearest the head),
N_HI = 2
N_PREV = 3  # and the neighbours in the list
N_NEXT = 4
NODE_COLUMNS = 5

# --- run_kernel's return codes -----------------------------------------------------------
RC_DONE = 0
RC_LOG_FULL = 1
RC_STEP_LIMIT = 2
RC_STUCK = 3
RC_UNTIL = 4


class Params(NamedTuple):
    """Run constants. Token and block counts are absolute (fractions already applied)."""

    engine: int  # E_*
    # policy knobs
    priority_scheduling: bool  # else FCFS
    max_seqs: int  # max_num_seqs
    budget: int  # max_num_batched_tokens (the prefill budget for SGLang and TGI)
    long_prefill_threshold: int  # the policy's chunk cap (the kernel reads Requests.chunk_cap)
    chunked_prefill: bool
    reserve_full_prompt: bool  # vLLM's scheduler_reserve_full_isl
    watermark_blocks: int
    max_queued_requests: int  # <= 0: no cap
    max_queued_prompt_tokens: int  # <= 0: no cap
    # the long-request lane as the knob table encodes it (servetune.knobs); the kernel
    # reads lane_limits, whose last row it is when ``lanes``
    lanes: bool  # long-request lanes on
    lane_reserved_seqs: int
    lane_reserved_blocks: int
    lane_max_seqs: int
    lane_max_blocks: int
    lane_limits: np.ndarray  # int64 (lanes, LANE_LIMITS): row 0 the common lane (no limits)
    prefix_caching: bool  # freed blocks stay cached (LRU) and a prompt's cached prefix is free
    # KV pool and step time
    total_blocks: int
    block_size: int
    prefix_block_tokens: int  # tokens per trace prefix id (Requests.prefix_ids)
    unit_blocks: int  # prefix cache: blocks per unit (unit_blocks_for)
    step_coef: np.ndarray  # float64[N_COEF], StepTimeModel.as_arrays(engine), host terms in
    step_pieces: np.ndarray  # float64 (k, 2)
    # SGLang environment constants (engines.md 2.2)
    sglang_clip: int  # SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
    sglang_retract_steps: int  # SGLANG_RETRACT_DECODE_STEPS
    sglang_preempt_threshold: int  # --priority-scheduling-preemption-threshold (< 0: off)
    ratio_init: float
    ratio_floor: float
    ratio_decay: float  # per decode step
    # mode
    jump: bool  # fast mode: jump decode stretches
    log: bool  # keep a step log


class Requests(NamedTuple):
    """The trace's columns (request id = row)."""

    arrival: np.ndarray  # float64, seconds, sorted
    prompt: np.ndarray  # int64
    output: np.ndarray  # int64, tokens it generates
    max_tokens: np.ndarray  # int64, its declared maximum output
    priority: np.ndarray  # int64, lower first
    lane: np.ndarray  # int32, its lane (0: the common lane)
    lane_blocks: np.ndarray  # int64, lane footprint: blocks of prompt + expected output (lane 0: 0)
    chunk_cap: np.ndarray  # int64, tokens per step (vLLM's long_prefill_token_threshold; 0: off)
    reserved_blocks: np.ndarray  # int64, TensorRT-LLM/TGI reservation (else 0)
    reject: np.ndarray  # int8, REASON_* it is rejected with at arrival (0: none)
    prefix_start: np.ndarray  # int64[n + 1], CSR: r's ids are prefix_ids[start[r]:start[r + 1]]
    prefix_ids: np.ndarray  # int64 >= 0, chain ids of prefix_block_tokens-token blocks
    precomputed: np.ndarray  # int64, prompt tokens whose KV arrives with it (P/D decode side)
    ready_delay: np.ndarray  # float64, s after first admission before it can run (KV transfer)


# The scalars a run carries from step to step (State.scalars[0]): compiled, a numpy record
# (read and written in place through the 1-element array); in reference mode, any object
# with these attributes. One record keeps the tuples small: numba passes each array of a
# tuple as seven machine words to every call.
SCALARS = np.dtype([
    ("next_arrival", np.int64),  # next trace row to arrive
    ("known", np.int64),  # rows of the trace known so far (a router appends them)
    ("n_running", np.int64),  # running list length
    ("batch_size", np.int64),  # requests in this step's batch
    ("steps", np.int64),
    ("used", np.int64),  # KV blocks in use
    ("peak", np.int64),  # peak KV blocks in use
    ("front_count", np.int64),  # FCFS keys of requeued requests go below 0
    ("queued_prompt", np.int64),  # prompt tokens of accepted requests before their first token
    ("reserved_sum", np.int64),  # reserved blocks of running requests (TensorRT-LLM, TGI)
    ("resolved", np.int64),  # requests completed, shed or rejected
    ("pure_decode", np.int64),  # 1: the last step only decoded (a stretch may be jumped)
    ("chunked_req", np.int64),  # SGLang's request in chunked prefill (-1: none)
    ("jumps", np.int64),  # jumped stretches
    ("cached_free", np.int64),  # prefix cache: blocks no request holds, kept for reuse
    ("lru_head", np.int64),  # their eviction order: a doubly linked list of LRU nodes
    ("lru_tail", np.int64),
    ("free_units", np.int64),  # unused cache units (a stack in State.unit_free)
    ("free_nodes", np.int64),  # unused LRU nodes (a stack in State.node_free)
    ("evictions", np.int64),
    ("n_done", np.int64),  # completed requests, in State.done_order
    ("now", np.float64),  # clock (s)
    ("until", np.float64),  # stop at the first step boundary at or after this (router)
    ("kv_integral", np.float64),  # integral of blocks in use over time
    ("token_ratio", np.float64),  # SGLang's new_token_ratio
    ("bin_width", np.float64),  # series bin width (s)
], align=True)

# Step-log entries written so far (StepLog.counts[0]), kept like SCALARS, and the event
# rows the next step may write (set when the kernel stops for room: the driver drains the
# log and grows the event columns if even an empty log would be too small).
LOG_COUNTS = np.dtype([("records", np.int64), ("events", np.int64), ("repeats", np.int64),
                       ("events_need", np.int64)], align=True)


class State(NamedTuple):
    """Everything a run changes."""

    # per request
    computed: np.ndarray  # int64, tokens in KV
    generated: np.ndarray  # int64, output tokens sampled
    held: np.ndarray  # int64, KV blocks held
    admitted_s: np.ndarray  # float64, first admission (nan: never)
    first_token_s: np.ndarray  # float64
    finish_s: np.ndarray  # float64
    preemptions: np.ndarray  # int32
    status: np.ndarray  # int8, PENDING/COMPLETED/SHED/REJECTED
    reason: np.ndarray  # int8, REASON_*
    # waiting queue: a min-heap on (key, request id) per lane, lane l's at
    # heap_key/heap_id[lanes[l, LANE_HEAP_START]:], room for the lane's requests
    heap_key: np.ndarray  # int64
    heap_id: np.ndarray  # int64
    lanes: np.ndarray  # int64 (lanes, LANE_STATE): per lane its queue and use (one array:
    # every array of a tuple costs seven machine words in each call)
    # running list (admission order) and this step's batch (grant order)
    running: np.ndarray  # int64, request ids
    batch_req: np.ndarray  # int64, request ids
    batch_tokens: np.ndarray  # int64, tokens granted
    jump_hist: np.ndarray  # int64 scratch: blocks opened per step of a jumped stretch
    series: np.ndarray  # float64 (3, bins): time-weighted KV blocks, waiting, running
    victims: np.ndarray  # int64 scratch: SGLang's priority victims, queued after the pass
    ready_s: np.ndarray  # float64, when an admitted request's KV is in place (P/D)
    done_order: np.ndarray  # int64, completed requests in completion order (n_done of them)
    # prefix cache (one row each when off; "the prefix cache" below): prefix_blocks[r]
    # leading blocks of request r are held through cache units (shared, counted once), its
    # other blocks privately; a hash table (open addressing) maps a unit's key -> unit
    prefix_blocks: np.ndarray  # int64 per request
    hit_tokens: np.ndarray  # int64 per request: tokens served from the cache at first admission
    table_key: np.ndarray  # int64[2^k], EMPTY_KEY where free
    table_slot: np.ndarray  # int64[2^k]: the key's unit
    units: np.ndarray  # int64 (total_blocks, UNIT_COLUMNS): key, bit mask of cached blocks
    unit_ref: np.ndarray  # int32 (total_blocks, unit_blocks): requests holding each block
    unit_node: np.ndarray  # int32 (total_blocks, unit_blocks): an evictable block's LRU node
    unit_free: np.ndarray  # int64 stack of unused units
    nodes: np.ndarray  # int64 (total_blocks, NODE_COLUMNS): LRU nodes (N_*)
    node_free: np.ndarray  # int64 stack of unused nodes
    scalars: Any  # SCALARS record array of 1 (reference mode: [namespace])


class StepLog(NamedTuple):
    """The step log: one record per step (or jumped stretch), its events, and the per-step
    values of jumped stretches; record k's events and values end at ``events_end[k]`` and
    ``repeats_end[k]``. Without a log, every column has one row."""

    step: np.ndarray  # int64
    start_s: np.ndarray  # float64
    duration_s: np.ndarray  # float64
    kv_used: np.ndarray  # int64
    waiting: np.ndarray  # int64
    running: np.ndarray  # int64
    repeat: np.ndarray  # int64, steps in the record
    events_end: np.ndarray  # int64
    repeats_end: np.ndarray  # int64
    event_kind: np.ndarray  # int64, EV_*
    event_req: np.ndarray  # int64
    event_value: np.ndarray  # int64 (EV_SCHED: tokens granted)
    repeat_duration_s: np.ndarray  # float64
    repeat_kv_used: np.ndarray  # int64
    counts: Any  # LOG_COUNTS record array of 1 (reference mode: [namespace])


# --- small helpers -------------------------------------------------------------------------


@jit
def _blocks(tokens, bs):
    return (tokens + bs - 1) // bs


@jit
def _heap_push(hk, hid, base, size, key, r):
    """Min-heap on (key, request id) at ``hk[base:]``, ``hid[base:]``; returns the new size."""
    i = size
    while i > 0:
        p = (i - 1) // 2
        if hk[base + p] < key or (hk[base + p] == key and hid[base + p] < r):
            break
        hk[base + i] = hk[base + p]
        hid[base + i] = hid[base + p]
        i = p
    hk[base + i] = key
    hid[base + i] = r
    return size + 1


@jit
def _heap_pop(hk, hid, base, size):
    """Drop the head of the heap at ``base``; returns the new size."""
    size -= 1
    if size <= 0:
        return 0
    key = hk[base + size]
    r = hid[base + size]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        a = base + c
        if c + 1 < size and (hk[a + 1] < hk[a] or (hk[a + 1] == hk[a] and hid[a + 1] < hid[a])):
            c += 1
            a += 1
        if hk[a] < key or (hk[a] == key and hid[a] < r):
            hk[base + i] = hk[a]
            hid[base + i] = hid[a]
            i = c
        else:
            break
    hk[base + i] = key
    hid[base + i] = r
    return size


@jit
def _waiting(st):
    ls = st.lanes
    w = ls[0, LANE_WAITING]
    for lane in range(1, ls.shape[0]):
        w += ls[lane, LANE_WAITING]
    return w


@inline
def _lane_of(p, rq, r):
    """Request ``r``'s lane (its column is not read when the policy has no lanes)."""
    return rq.lane[r] if p.lane_limits.shape[0] > 1 else 0


@inline
def _head(st, lane):
    """The request at the head of waiting ``lane``."""
    return st.heap_id[st.lanes[lane, LANE_HEAP_START]]


@jit
def _enqueue(p, rq, st, r, front):
    """Put a request into its lane's waiting queue: FCFS at the back (arrival) or the front
    (requeued after preemption), or by (priority, arrival) under priority scheduling."""
    sc = st.scalars[0]
    if p.priority_scheduling:
        key = rq.priority[r]
    elif front:
        sc.front_count += 1
        key = -sc.front_count
    else:
        key = r
    ls = st.lanes
    lane = _lane_of(p, rq, r)
    ls[lane, LANE_WAITING] = _heap_push(st.heap_key, st.heap_id, ls[lane, LANE_HEAP_START],
                                        ls[lane, LANE_WAITING], key, r)


@jit
def _pop_head(st, lane):
    ls = st.lanes
    ls[lane, LANE_WAITING] = _heap_pop(st.heap_key, st.heap_id, ls[lane, LANE_HEAP_START],
                                       ls[lane, LANE_WAITING])


@jit
def _pick_lane(st):
    """The waiting lane whose head comes first in queue order (-1: none that is not
    blocked)."""
    ls = st.lanes
    best = -1
    best_key = 0
    best_id = 0
    for lane in range(ls.shape[0]):
        if ls[lane, LANE_WAITING] == 0 or ls[lane, LANE_BLOCKED] != 0:
            continue
        h = ls[lane, LANE_HEAP_START]
        key = st.heap_key[h]
        r = st.heap_id[h]
        if best == -1 or key < best_key or (key == best_key and r < best_id):
            best = lane
            best_key = key
            best_id = r
    return best


@inline
def _log_event(p, lg, kind, r, value):
    if not p.log:
        return
    lc = lg.counts[0]
    k = lc.events
    lg.event_kind[k] = kind
    lg.event_req[k] = r
    lg.event_value[k] = value
    lc.events = k + 1


@inline
def _log_record(p, lg, step, start, dur, kv, waiting, running, repeat):
    if not p.log:
        return
    lc = lg.counts[0]
    k = lc.records
    lg.step[k] = step
    lg.start_s[k] = start
    lg.duration_s[k] = dur
    lg.kv_used[k] = kv
    lg.waiting[k] = waiting
    lg.running[k] = running
    lg.repeat[k] = repeat
    lg.events_end[k] = lc.events
    lg.repeats_end[k] = lc.repeats
    lc.records = k + 1


@jit
def _log_needs_room(p, rq, st, lg, t):
    """The step log might overflow in the next step (the driver drains or grows it). A
    jumped stretch always finds room for its longest length, so where the log's buffer
    happens to fill never cuts a stretch: the records are the same however the driver
    drains them."""
    sc = st.scalars[0]
    lc = lg.counts[0]
    n = sc.known
    a = sc.next_arrival
    while a < n and rq.arrival[a] <= t:
        a += 1
    need = 4 * p.max_seqs + (a - sc.next_arrival) + _waiting(st) + 8
    lc.events_need = need
    return (lc.records + 2 > lg.step.shape[0]
            or lc.events + need > lg.event_kind.shape[0]
            or lc.repeats + WINDOW_MAX + 1 > lg.repeat_duration_s.shape[0])


@jit
def _series_add(st, t0, t1, kv, waiting, running, cached):
    """Add a step's time-weighted values to the coarse series (bins double when full):
    blocks in use, waiting, running, and blocks kept only by the prefix cache."""
    if t1 <= t0:
        return
    sc = st.scalars[0]
    ser = st.series
    nb = ser.shape[1]
    while t1 > nb * sc.bin_width:
        half = nb // 2
        for i in range(half):
            for c in range(4):
                ser[c, i] = ser[c, 2 * i] + ser[c, 2 * i + 1]
        for i in range(half, nb):
            for c in range(4):
                ser[c, i] = 0.0
        sc.bin_width = sc.bin_width * 2.0
    bw = sc.bin_width
    b = int(t0 / bw)
    if b >= nb:
        b = nb - 1
    while t0 < t1:
        end = (b + 1) * bw
        if end > t1 or b >= nb - 1:
            end = t1
        dt = end - t0
        ser[0, b] += kv * dt
        ser[1, b] += waiting * dt
        ser[2, b] += running * dt
        ser[3, b] += cached * dt
        t0 = end
        b += 1


# --- the prefix cache ------------------------------------------------------------------------
#
# As vLLM's KV cache manager: a block is cached under a key naming the whole prefix up to
# its end; a full block's key is registered as soon as it is computed (prompt blocks) or
# when its request frees it (the rest); a freed block keeps its key, evictable, at the
# tail of an LRU list (a request's blocks last to first, so its tail goes first), and is
# taken from the head when a block is needed. An admission's longest run of cached
# leading blocks is computed for free (at least the last token is recomputed); blocks
# shared by running requests are counted once in ``used``.
#
# Keys: block ``j`` of request ``r`` whose tokens lie within its known prefix ids is named
# by the id of the block's last token and where the block ends in it; any other block has
# a name of its own, which only the request itself can hit again (after a preemption).
# A finished request's own-name blocks, which no one can hit, become one anonymous LRU node.
#
# Layout: blocks are kept in *units* of ``unit_blocks`` (G) consecutive blocks of one
# prefix id (or of one request's own blocks), so that a 512-token id costs one hash-table
# entry, not 32: ``units[u]`` holds the unit's key (that of its first block) and a bit
# mask of its cached blocks, ``unit_ref[u, o]`` how many running requests hold block
# ``o``. The LRU list is a list of *nodes*, each a run of one unit's blocks ``[lo, hi)``
# in the order they were freed (top first): a request frees a unit's blocks last to first,
# so one release makes one node per unit. A block leaves the LRU from its node's top
# (eviction) or, taken back into use, from its bottom (a request holding a unit's block
# holds every block below it, none of which is in the LRU), so nodes never split. The
# order of blocks in the list, and so every eviction, is the per-block LRU's.


@inline
def _keyed_tokens(p, rq, r):
    """Request ``r``'s leading tokens its prefix ids name (blocks within them share keys)."""
    keyed = (rq.prefix_start[r + 1] - rq.prefix_start[r]) * p.prefix_block_tokens
    total = rq.prompt[r] + rq.output[r]
    return total if total < keyed else keyed


@inline
def _id_key(ids, first, width, end):
    """The key of the block ending at token ``end`` of a prompt whose prefix ids (of
    ``width`` tokens each) start at ``ids[first]``: the id of the block holding its last
    token, and where in it the block ends."""
    m = (end - 1) // width
    return ids[first + m] * width + (end - m * width)


@inline
def _unit_key(p, rq, r, j, keyed_blocks):
    """The key of the unit holding block ``j`` of request ``r`` (its first ``keyed_blocks``
    blocks lie within its prefix ids): the key of the unit's first block, or one of
    ``r``'s own."""
    first = j - j % p.unit_blocks
    if j < keyed_blocks:
        return _id_key(rq.prefix_ids, rq.prefix_start[r], p.prefix_block_tokens,
                       (first + 1) * p.block_size)
    return -(r * UNIQUE_STRIDE + first) - 1


@inline
def _unit_end(p, j, stop):
    """Where the unit of block ``j`` ends for a walk that stops at block ``stop``. (A unit
    is all keyed or all ``r``'s own: the keyed blocks end at an id's end, a multiple of
    ``unit_blocks``, or at the request's last full block, past any block a walk visits.)"""
    end = j - j % p.unit_blocks + p.unit_blocks
    return end if end < stop else stop


@inline
def _hash(key):
    h = (key ^ (key >> 23) ^ (key >> 41)) & 0x3FFFFFF
    return (h * 2654435761) >> 16


@jit
def _probe(table_key, table_slot, key):
    """The unit holding ``key`` (-1: none)."""
    mask = table_key.shape[0] - 1
    i = _hash(key) & mask
    while True:
        k = table_key[i]
        if k == key:
            return table_slot[i]
        if k == EMPTY_KEY:
            return -1
        i = (i + 1) & mask


@inline
def _unit_of(st, key):
    return _probe(st.table_key, st.table_slot, key)


@jit
def _table_put(st, key, slot):
    mask = st.table_key.shape[0] - 1
    i = _hash(key) & mask
    while st.table_key[i] != EMPTY_KEY:
        i = (i + 1) & mask
    st.table_key[i] = key
    st.table_slot[i] = slot


@jit
def _table_delete(st, key):
    """Remove ``key`` (present) by backward-shift deletion (linear probing keeps no
    tombstones)."""
    mask = st.table_key.shape[0] - 1
    i = _hash(key) & mask
    while st.table_key[i] != key:
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        kj = st.table_key[j]
        if kj == EMPTY_KEY:
            break
        h = _hash(kj) & mask
        # the entry at j may move to i unless its home h lies cyclically in (i, j]
        if (i <= j and i < h <= j) or (i > j and (h > i or h <= j)):
            continue
        st.table_key[i] = kj
        st.table_slot[i] = st.table_slot[j]
        i = j
    st.table_key[i] = EMPTY_KEY


@jit
def _unit_new(st, key):
    """A new unit for ``key``, no block of it cached yet."""
    sc = st.scalars[0]
    sc.free_units -= 1
    u = st.unit_free[sc.free_units]
    st.units[u, U_KEY] = key
    st.units[u, U_MASK] = 0
    _table_put(st, key, u)
    return u


@jit
def _node_append(st, u, lo, hi):
    """A new LRU node at the tail: blocks ``[lo, hi)`` of unit ``u`` (-1: anonymous)."""
    sc = st.scalars[0]
    sc.free_nodes -= 1
    node = st.node_free[sc.free_nodes]
    st.nodes[node, N_UNIT] = u
    st.nodes[node, N_LO] = lo
    st.nodes[node, N_HI] = hi
    st.nodes[node, N_PREV] = sc.lru_tail
    st.nodes[node, N_NEXT] = -1
    if sc.lru_tail >= 0:
        st.nodes[sc.lru_tail, N_NEXT] = node
    else:
        sc.lru_head = node
    sc.lru_tail = node
    return node


@jit
def _node_drop(st, node):
    """Unlink an emptied LRU node and free it."""
    sc = st.scalars[0]
    prev = st.nodes[node, N_PREV]
    nxt = st.nodes[node, N_NEXT]
    if prev >= 0:
        st.nodes[prev, N_NEXT] = nxt
    else:
        sc.lru_head = nxt
    if nxt >= 0:
        st.nodes[nxt, N_PREV] = prev
    else:
        sc.lru_tail = prev
    st.node_free[sc.free_nodes] = node
    sc.free_nodes += 1


@jit
def _lru_push(st, u, o):
    """Block ``o`` of unit ``u`` becomes evictable: to the LRU tail (the tail node grows
    when the block continues its run downwards)."""
    sc = st.scalars[0]
    tail = sc.lru_tail
    if tail >= 0 and st.nodes[tail, N_UNIT] == u and st.nodes[tail, N_LO] == o + 1:
        st.nodes[tail, N_LO] = o
    else:
        tail = _node_append(st, u, o, o + 1)
    st.unit_node[u, o] = tail
    sc.cached_free += 1


@jit
def _lru_take(st, u, o):
    """Block ``o`` of unit ``u`` (evictable) goes back into use: it leaves its node's
    bottom (the blocks below it are in use)."""
    sc = st.scalars[0]
    node = st.unit_node[u, o]
    assert st.nodes[node, N_LO] == o
    st.nodes[node, N_LO] = o + 1
    if o + 1 == st.nodes[node, N_HI]:
        _node_drop(st, node)
    sc.cached_free -= 1


@jit
def _evict_to_fit(p, st):
    """Evict cached blocks from the LRU head until the blocks in use and the cached ones
    fit the pool."""
    sc = st.scalars[0]
    while sc.used + sc.cached_free > p.total_blocks and sc.cached_free > 0:
        node = sc.lru_head
        lo = st.nodes[node, N_LO]
        hi = st.nodes[node, N_HI]
        k = sc.used + sc.cached_free - p.total_blocks  # the node's top k blocks go
        if k > hi - lo:
            k = hi - lo
        u = st.nodes[node, N_UNIT]
        if u >= 0:
            mask = st.units[u, U_MASK] & ~(((1 << k) - 1) << (hi - k))
            st.units[u, U_MASK] = mask
            if mask == 0:
                _table_delete(st, st.units[u, U_KEY])
                st.unit_free[sc.free_units] = u
                sc.free_units += 1
        if k == hi - lo:
            _node_drop(st, node)
        else:
            st.nodes[node, N_HI] = hi - k
        sc.cached_free -= k
        sc.evictions += k


@jit
def _cache_hits(p, rq, st, r, target):
    """Request ``r``'s cached leading blocks for a (re-)prefill of ``target`` tokens (at
    most ``(target - 1) // block_size``: the last token is always computed), and how many
    of them are evictable (held by no request: taking them uses free blocks)."""
    most = (target - 1) // p.block_size
    keyed_blocks = _keyed_tokens(p, rq, r) // p.block_size
    k = 0
    evictable = 0
    while k < most:
        u = _unit_of(st, _unit_key(p, rq, r, k, keyed_blocks))
        if u < 0:
            break
        first = k - k % p.unit_blocks
        end = _unit_end(p, k, most)
        mask = st.units[u, U_MASK]
        while k < end and (mask >> (k - first)) & 1:
            if st.unit_ref[u, k - first] == 0:
                evictable += 1
            k += 1
        if k < end:
            break
    return k, evictable


@jit
def _cache_take(p, rq, st, r, k):
    """Request ``r`` (holding nothing) takes its ``k`` cached leading blocks
    (:func:`_cache_hits`): they are computed and held through their units."""
    sc = st.scalars[0]
    keyed_blocks = _keyed_tokens(p, rq, r) // p.block_size
    j = 0
    while j < k:
        u = _unit_of(st, _unit_key(p, rq, r, j, keyed_blocks))
        first = j - j % p.unit_blocks
        end = _unit_end(p, j, k)
        while j < end:
            o = j - first
            if st.unit_ref[u, o] == 0:
                _lru_take(st, u, o)
                sc.used += 1
            st.unit_ref[u, o] += 1
            j += 1
    st.prefix_blocks[r] = k
    st.held[r] += k
    st.computed[r] = k * p.block_size
    lane = _lane_of(p, rq, r)
    if lane > 0:
        st.lanes[lane, LANE_HELD] += k
    if sc.used > sc.peak:
        sc.peak = sc.used


@jit
def _cache_register(p, rq, st, r):
    """Register request ``r``'s newly computed full prompt blocks under their keys; a key
    another request registered first is shared, and ``r``'s own copy freed."""
    sc = st.scalars[0]
    full = rq.prompt[r]
    if st.computed[r] < full:
        full = st.computed[r]
    full = full // p.block_size
    keyed_blocks = _keyed_tokens(p, rq, r) // p.block_size
    if full > keyed_blocks:
        full = keyed_blocks  # the rest have keys of r's own: no one can share them yet
    j = st.prefix_blocks[r]
    while j < full:
        key = _unit_key(p, rq, r, j, keyed_blocks)
        u = _unit_of(st, key)
        if u < 0:
            u = _unit_new(st, key)
        first = j - j % p.unit_blocks
        end = _unit_end(p, j, full)
        while j < end:
            o = j - first
            if (st.units[u, U_MASK] >> o) & 1 == 0:
                st.units[u, U_MASK] |= 1 << o  # r's block is now the cached one
            elif st.unit_ref[u, o] == 0:
                _lru_take(st, u, o)  # cached, now in use: its block replaces r's copy
            else:
                sc.used -= 1  # held by another request: r's copy is freed
            st.unit_ref[u, o] += 1
            j += 1
    st.prefix_blocks[r] = j


@jit
def _cache_release(p, rq, st, r):
    """Request ``r`` gives its blocks back (finish or preemption): its full blocks stay
    cached (last to first into the LRU; a finished request's own-key blocks as one
    anonymous node), the rest is freed. Returns the blocks that leave ``used``."""
    sc = st.scalars[0]
    full = st.computed[r] // p.block_size
    if full > st.held[r]:
        full = st.held[r]
    freed = st.held[r] - full
    shared = st.prefix_blocks[r]
    keyed_blocks = _keyed_tokens(p, rq, r) // p.block_size
    j = full - 1
    if st.status[r] == COMPLETED:
        own = keyed_blocks if keyed_blocks > shared else shared  # own keys from here on
        if full > own:
            _node_append(st, -1, 0, full - own)
            sc.cached_free += full - own
            freed += full - own
            j = own - 1
    while j >= 0:
        first = j - j % p.unit_blocks  # the unit's blocks of r, last to first
        key = _unit_key(p, rq, r, j, keyed_blocks)
        u = _unit_of(st, key)
        while j >= first:
            o = j - first
            if j < shared:
                st.unit_ref[u, o] -= 1
                if st.unit_ref[u, o] == 0:
                    _lru_push(st, u, o)
                    freed += 1
            else:
                freed += 1
                if u < 0:
                    u = _unit_new(st, key)
                if (st.units[u, U_MASK] >> o) & 1 == 0:
                    st.units[u, U_MASK] |= 1 << o  # cached on its way out
                    _lru_push(st, u, o)
            j -= 1
    st.prefix_blocks[r] = 0
    return freed


@entry
def cached_prefix_blocks(table_key, table_slot, units, unit_blocks, bs, ids, width, tokens):
    """Leading blocks of ``bs`` tokens of a prompt of ``tokens`` tokens with prefix ids
    ``ids`` (of ``width`` tokens each, ``unit_blocks`` blocks a unit) that an engine's
    cache (``State.table_key``, ``table_slot`` and ``units``) holds: a router's probe."""
    most = (tokens - 1) // bs
    keyed_blocks = ids.shape[0] * width // bs
    if most > keyed_blocks:
        most = keyed_blocks
    k = 0
    while k < most:
        first = k - k % unit_blocks
        u = _probe(table_key, table_slot, _id_key(ids, 0, width, (first + 1) * bs))
        if u < 0:
            break
        end = first + unit_blocks
        if end > most:
            end = most
        mask = units[u, U_MASK]
        while k < end and (mask >> (k - first)) & 1:
            k += 1
        if k < end:
            break
    return k


# --- blocks and the batch --------------------------------------------------------------------


@jit
def _alloc(p, rq, st, r, nblocks):
    sc = st.scalars[0]
    st.held[r] += nblocks
    sc.used += nblocks
    lane = _lane_of(p, rq, r)
    if lane > 0:
        st.lanes[lane, LANE_HELD] += nblocks
    if sc.used > sc.peak:
        sc.peak = sc.used
    if p.prefix_caching:
        _evict_to_fit(p, st)


@jit
def _release(p, rq, st, r):
    """Give back a request's blocks and its seat accounting (finish or preemption)."""
    sc = st.scalars[0]
    if p.prefix_caching:
        sc.used -= _cache_release(p, rq, st, r)
    else:
        sc.used -= st.held[r]
    lane = _lane_of(p, rq, r)
    if lane > 0:
        ls = st.lanes
        ls[lane, LANE_HELD] -= st.held[r]
        ls[lane, LANE_RUNNING] -= 1
        ls[lane, LANE_FOOTPRINT] -= rq.lane_blocks[r]
    st.held[r] = 0
    sc.reserved_sum -= rq.reserved_blocks[r]


@inline
def _grant(st, r, tokens):
    sc = st.scalars[0]
    k = sc.batch_size
    st.batch_req[k] = r
    st.batch_tokens[k] = tokens
    sc.batch_size = k + 1


@jit
def _ungrant(st, r):
    """Take ``r`` out of this step's batch; returns the tokens it had been granted."""
    sc = st.scalars[0]
    nb = sc.batch_size
    for q in range(nb):
        if st.batch_req[q] == r:
            tokens = st.batch_tokens[q]
            for q2 in range(q, nb - 1):
                st.batch_req[q2] = st.batch_req[q2 + 1]
                st.batch_tokens[q2] = st.batch_tokens[q2 + 1]
            sc.batch_size = nb - 1
            return tokens
    return 0


@jit
def _long_prefill_cap(p, rq, r, tokens):
    """vLLM's long_prefill_token_threshold (the policy's, or request ``r``'s class's) caps
    its tokens per step (only vLLM)."""
    if p.engine != E_VLLM:
        return tokens
    cap = rq.chunk_cap[r]
    return cap if 0 < cap < tokens else tokens


# --- preempt ---------------------------------------------------------------------------------


@jit
def _preempt(p, rq, st, lg, v, vp):
    """Recompute-preempt (SGLang: retract) running request ``v`` at running position
    ``vp``: free its blocks, drop its computed tokens, requeue it at the front."""
    sc = st.scalars[0]
    _release(p, rq, st, v)
    st.computed[v] = 0
    st.preemptions[v] += 1
    _enqueue(p, rq, st, v, True)
    nrun = sc.n_running
    for q in range(vp, nrun - 1):
        st.running[q] = st.running[q + 1]
    sc.n_running = nrun - 1
    _log_event(p, lg, EV_PREEMPT, v, 0)


@jit
def _preemption_victim(p, rq, st):
    """vLLM: the running position of the last admitted request (FCFS) or of the max
    (priority, arrival time) one (``Scheduler.schedule``: ``max(self.running,
    key=lambda r: (r.priority, r.arrival_time))``). Among exact ties vLLM's ``max`` keeps
    the first in running-list order; servetune takes the latest request instead, because
    the first-in-list rule can thrash forever on exact ties (the oldest, most advanced
    request is preempted again each time it is re-admitted; hypothesis found a case with
    a 1-token per-request prefill cap), and a simulation must end."""
    sc = st.scalars[0]
    nrun = sc.n_running
    vp = nrun - 1
    if p.priority_scheduling:
        vp = 0
        for q in range(1, nrun):
            a = st.running[q]
            b = st.running[vp]
            if rq.priority[a] > rq.priority[b] or (rq.priority[a] == rq.priority[b] and (
                    rq.arrival[a] > rq.arrival[b] or (rq.arrival[a] == rq.arrival[b]
                                                      and a > b))):
                vp = q
    return vp


@jit
def _retraction_victim(p, rq, st):
    """SGLang: the running position of the request with the fewest generated tokens
    (longest prompt, then latest arrival among ties); under priority scheduling
    (``--retraction-policy priority``, which the exporter writes) the least important
    priority first, then the same order (``schedule_batch.py``, ``retract_decode``)."""
    sc = st.scalars[0]
    gen = st.generated
    prompt = rq.prompt
    prio = rq.priority
    by_prio = p.priority_scheduling
    vp = 0
    for q in range(1, sc.n_running):
        a = st.running[q]
        b = st.running[vp]
        if by_prio and prio[a] != prio[b]:
            if prio[a] > prio[b]:
                vp = q
            continue
        if gen[a] < gen[b] or (gen[a] == gen[b] and (
                prompt[a] > prompt[b] or (prompt[a] == prompt[b] and a > b))):
            vp = q
    return vp


# --- admission: shared by every engine and by the arrival-time rejection ---------------------


@jit
def _lane_has_room(p, rq, st, r):
    """Request ``r``'s lane has room for it: its lane's seat and footprint caps hold, and
    (where lanes other than the common one and its own exist) a seat is left beside every
    other lane's unused seat reserve. That check fails on a full batch too, as it always
    did for short requests beside the long lane, so SGLang's priority preemption does not
    act for such a request."""
    lim = p.lane_limits
    n_lanes = lim.shape[0]
    if n_lanes == 1:
        return True
    ls = st.lanes
    lane = rq.lane[r]
    if lane > 0 and (ls[lane, LANE_RUNNING] + 1 > lim[lane, LIM_MAX_SEQS]
                     or ls[lane, LANE_FOOTPRINT] + rq.lane_blocks[r] > lim[lane, LIM_MAX_BLOCKS]):
        return False
    others = False
    spare = 0
    for k in range(1, n_lanes):
        if k == lane:
            continue
        others = True
        unused = lim[k, LIM_RESERVED_SEQS] - ls[k, LANE_RUNNING]
        if unused > 0:
            spare += unused
    return not others or st.scalars[0].n_running + 1 + spare <= p.max_seqs


@jit
def _headroom(p, rq, st, r):
    """Blocks request ``r`` must leave free when admitted: the watermark, plus what every
    other lane's block reserve still lacks (what it reserves less what it holds). vLLM
    keeps the watermark only while the running list is non-empty (it includes requests
    admitted earlier in this step): ``Scheduler.schedule`` passes
    ``has_scheduled_reqs=bool(self.running)`` to ``KVCacheManager.allocate_slots``, so an
    idle engine admits a request into the watermark. The other engines have no watermark;
    servetune's keeps it at every admission."""
    sc = st.scalars[0]
    headroom = p.watermark_blocks
    if p.engine == E_VLLM and sc.n_running == 0:
        headroom = 0
    lim = p.lane_limits
    lane = _lane_of(p, rq, r)
    for k in range(1, lim.shape[0]):
        if k != lane:
            unused = lim[k, LIM_RESERVED_BLOCKS] - st.lanes[k, LANE_HELD]
            if unused > 0:
                headroom += unused
    return headroom


@jit
def _kv_refused(p, rq, st, r, target, chunk, base, hit, hit_evictable):
    """The engine's KV check refuses request ``r`` (a (re-)prefill of ``target`` tokens whose first
    ``base`` tokens are in KV already (``hit`` cached blocks, ``hit_evictable`` of them held
    by no request, or KV that arrived with it) and whose first chunk is ``chunk``): what the
    admission needs does not fit beside what is committed, less the headroom. Cached blocks
    that no request holds count as needed (taking them uses free blocks), those held by
    running requests do not (vLLM's ``allocate_slots``). vLLM: the whole (re-)prefill
    (``reserve_full_prompt``), else this chunk, beside the blocks in use
    (``KVCacheManager.allocate_slots`` with ``full_sequence_must_fit``; the blocks other in-
    flight prefills still need are kept back only for a request whose KV a connector loads
    asynchronously, which servetune does not model); SGLang: the whole (re-)prefill beside
    the blocks in use (servetune's watermark and lane check; SGLang's own token check is in
    ``_admit_waiting``); TensorRT-LLM and TGI: the prompt + max output reservation beside
    the running requests' reservations."""
    sc = st.scalars[0]
    if p.engine == E_VLLM:
        committed = sc.used
        if p.reserve_full_prompt:
            need = _blocks(target, p.block_size) - hit + hit_evictable
        else:
            need = _blocks(base + chunk, p.block_size) - hit + hit_evictable
    elif p.engine == E_SGLANG:
        committed = sc.used
        need = _blocks(target, p.block_size) - hit + hit_evictable
    else:
        committed = sc.reserved_sum
        need = rq.reserved_blocks[r]
    return committed + need + _headroom(p, rq, st, r) > p.total_blocks


@jit
def _sglang_estimate(p, rq, r, generated, ratio):
    """SGLang's estimate of the KV tokens running request ``r`` still grows by: its
    remaining maximum output, clipped, times the new-token ratio
    (``PrefillAdder._get_running_request_total_token_offset``)."""
    f = rq.max_tokens[r] - generated
    if f > p.sglang_clip:
        f = p.sglang_clip
    return f * ratio


@jit
def _sglang_clipped(p, tokens):
    return p.sglang_clip if tokens > p.sglang_clip else tokens


@jit
def _sglang_offset(p, rq, st, r, ratio):
    """What running request ``r`` takes off SGLang's prefill budget: its output estimate,
    or, for the chunked request in its last chunk (``add_chunked_req``, not part of the
    running batch), its whole clipped ``max_new_tokens``, unscaled."""
    if r == st.scalars[0].chunked_req:
        return float(_sglang_clipped(p, rq.max_tokens[r]))
    return _sglang_estimate(p, rq, r, st.generated[r], ratio)


@jit
def _sglang_comes_first(rq, a, b):
    """``a`` comes before ``b`` in SGLang's priority-preemption order
    (``PrefillAdder.preempt_to_schedule``: least important priority first, then the
    latest to enter the queue; servetune: latest arrival, then higher id)."""
    pa = rq.priority[a]
    pb = rq.priority[b]
    return pa > pb or (pa == pb and (rq.arrival[a] > rq.arrival[b]
                                     or (rq.arrival[a] == rq.arrival[b] and a > b)))


@jit
def _sglang_next_victim(rq, st, n_elig, prev):
    """Running position (< ``n_elig``, not the chunked request) of the request after
    ``prev`` (-1: the first) in SGLang's priority-preemption order; -1 if none."""
    cr = st.scalars[0].chunked_req
    best = -1
    for q in range(n_elig):
        a = st.running[q]
        if a == cr or (prev >= 0 and not _sglang_comes_first(rq, prev, a)):
            continue
        if best == -1 or _sglang_comes_first(rq, a, st.running[best]):
            best = q
    return best


@jit
def _sglang_preempt_for(p, rq, st, lg, r, rem, ratio, n_elig, nvict):
    """SGLang's priority preemption (``PrefillAdder.preempt_to_schedule``) for waiting
    request ``r``: walk the running requests admitted before this pass in preemption
    order while each is less important than ``r`` by more than the threshold, counting
    their output estimates off ``r``'s need (its re-prefill plus clipped
    ``max_new_tokens`` less the budget ``rem``); if that covers the need, free those
    requests (their KV and estimates return to the budget) and hold them for the queue
    until the pass ends. Returns (preempted, budget, eligible running, victims held)."""
    need = float(rq.prompt[r] + st.generated[r] + _sglang_clipped(p, rq.max_tokens[r])) - rem
    k = 0
    prev = -1
    while True:
        q = _sglang_next_victim(rq, st, n_elig, prev)
        if q == -1:
            break
        a = st.running[q]
        if rq.priority[a] - rq.priority[r] <= p.sglang_preempt_threshold:
            break
        k += 1
        need -= _sglang_offset(p, rq, st, a, ratio)
        prev = a
        if need <= 0:
            break
    if k == 0 or need > 0:
        return False, rem, n_elig, nvict
    sc = st.scalars[0]
    bs = p.block_size
    for _ in range(k):
        vp = _sglang_next_victim(rq, st, n_elig, -1)
        v = st.running[vp]
        rem += _sglang_offset(p, rq, st, v, ratio) + st.held[v] * bs
        _release(p, rq, st, v)
        st.computed[v] = 0
        st.preemptions[v] += 1
        for q in range(vp, sc.n_running - 1):
            st.running[q] = st.running[q + 1]
        sc.n_running -= 1
        n_elig -= 1
        st.victims[nvict] = v
        nvict += 1
        _log_event(p, lg, EV_PREEMPT, v, 0)
    return True, rem, n_elig, nvict


@jit
def _reject_head(p, rq, st, lg, lane):
    """Turn away the head of waiting ``lane``: an empty engine cannot admit it, so it never
    will (a resumed request whose re-prefill outgrew the headroom)."""
    sc = st.scalars[0]
    r = _head(st, lane)
    _pop_head(st, lane)
    st.status[r] = REJECTED
    st.reason[r] = REASON_READMIT
    sc.resolved += 1
    if st.generated[r] == 0:
        sc.queued_prompt -= rq.prompt[r]
    _log_event(p, lg, EV_SHED, r, 0)


@jit
def _admit(p, rq, st, lg, lane, hit, base, chunk, t):
    """Move the head of waiting ``lane`` to the end of the running list, its first ``base``
    tokens in KV (``hit`` cached blocks, or KV that arrived with it) and blocks allocated
    for its first ``chunk`` tokens beyond; returns the blocks allocated."""
    sc = st.scalars[0]
    r = _head(st, lane)
    _pop_head(st, lane)
    st.running[sc.n_running] = r
    sc.n_running += 1
    if hit > 0:
        _cache_take(p, rq, st, r, hit)
    else:
        st.computed[r] = base
    nblocks = _blocks(base + chunk, p.block_size) - st.held[r]
    _alloc(p, rq, st, r, nblocks)
    lane = _lane_of(p, rq, r)
    if lane > 0:
        st.lanes[lane, LANE_RUNNING] += 1
        st.lanes[lane, LANE_FOOTPRINT] += rq.lane_blocks[r]
    sc.reserved_sum += rq.reserved_blocks[r]
    if st.admitted_s[r] != st.admitted_s[r]:  # nan: first admission
        st.admitted_s[r] = t
        st.hit_tokens[r] = hit * p.block_size
        st.ready_s[r] = t + rq.ready_delay[r]
    _log_event(p, lg, EV_ADMIT, r, base)
    return nblocks


@jit
def _admit_waiting(p, rq, st, lg, t, budget, ratio):
    """Admit waiting requests in queue order into this step, up to ``max_seqs`` and while
    ``budget`` tokens are left; returns (budget left, requests admitted).

    Every engine: a (re-)prefill's first chunk is capped by the budget (with chunked prefill
    off, one that would fit a whole step waits); the lane must have room; the engine's KV
    check (``_kv_refused``) must pass. SGLang (``PrefillAdder.add_one_req``) also refuses
    a request when its re-prefill plus its clipped remaining output, unscaled, plus a
    page reaches (``>=``) the free KV tokens less every running request's ratio-scaled
    output estimate and what this pass admitted (prompt, clipped ``max_new_tokens`` and a
    page each); under priority scheduling a request refused for a seat or for KV may
    preempt less important running requests (``_sglang_preempt_for``). A head that does
    not fit blocks its lane (strict head-of-line within its lane; the other lanes' heads
    are still tried), or is rejected when the engine is empty. Admitting allocates the
    chunk's blocks only; SGLang stops after a chunked admission.
    """
    sc = st.scalars[0]
    engine = p.engine
    bs = p.block_size
    sglang = engine == E_SGLANG
    preempts = sglang and p.priority_scheduling and p.sglang_preempt_threshold >= 0
    rem = 0.0  # SGLang: free KV tokens less the running requests' output estimate
    if sglang:
        future = 0.0
        for q in range(sc.n_running):
            future += _sglang_offset(p, rq, st, st.running[q], ratio)
        rem = float((p.total_blocks - sc.used) * bs) - future
    n_elig = sc.n_running  # SGLang: running before this pass (preemption candidates)
    nvict = 0
    tried = -1  # SGLang: the request a preemption was last tried for
    nadm = 0
    for lane in range(st.lanes.shape[0]):
        st.lanes[lane, LANE_BLOCKED] = 0
    while budget > 0:
        lane = _pick_lane(st)
        if lane == -1:
            break
        r = _head(st, lane)
        seat = sc.n_running < p.max_seqs
        if not seat and not (preempts and tried != r):
            break
        target = rq.prompt[r] + st.generated[r]
        hit = 0
        hit_evictable = 0
        base = 0  # tokens in KV before its first chunk
        if p.prefix_caching:
            hit, hit_evictable = _cache_hits(p, rq, st, r, target)
            base = hit * bs
        if st.preemptions[r] == 0 and rq.precomputed[r] > base:
            hit = 0
            hit_evictable = 0
            base = rq.precomputed[r]
        chunk = _long_prefill_cap(p, rq, r, target - base)
        waits = False
        if chunk > budget:
            if not p.chunked_prefill and chunk <= p.budget:
                waits = True  # chunked prefill off: the prompt waits for a step with room
            else:
                chunk = budget  # (off: a re-prefill over the whole budget is chunked)
        total = 0.0
        if sglang:
            total = float(target - base
                          + _sglang_clipped(p, rq.max_tokens[r] - st.generated[r]) + bs)
        others = (not waits and _lane_has_room(p, rq, st, r)
                  and not _kv_refused(p, rq, st, r, target, chunk, base, hit, hit_evictable))
        fits = seat and others and (not sglang or total < rem)
        if not fits and preempts and tried != r and others:
            tried = r
            done, rem, n_elig, nvict = _sglang_preempt_for(p, rq, st, lg, r, rem, ratio,
                                                           n_elig, nvict)
            if done:
                continue  # the same head, checked again
        if not fits:
            if sc.n_running == 0:
                _reject_head(p, rq, st, lg, lane)
                continue
            if not seat:
                break
            st.lanes[lane, LANE_BLOCKED] = 1  # head-of-line blocking within its lane only
            continue
        nblocks = _admit(p, rq, st, lg, lane, hit, base, chunk, t)
        nadm += 1
        if st.ready_s[r] > t:
            continue  # its KV is on the way (P/D): it holds its blocks and runs when ready
        if sglang:
            rem -= nblocks * bs + bs
            if base + chunk == target:
                rem -= _sglang_clipped(p, rq.max_tokens[r])
        _grant(st, r, chunk)
        budget -= chunk
        if sglang and base + chunk < target:
            sc.chunked_req = r
            break
    for i in range(nvict):
        _enqueue(p, rq, st, st.victims[i], True)
    return budget, nadm


@entry
def reject_at_arrival(p, rq, st):
    """Fill ``rq.reject`` before the run: why each request could never run (0: it can), so
    that none waits forever at the head of the queue. ``st`` is the run's initial (empty)
    state: the checks are the kernel's own admission checks on an empty engine with a whole
    step's budget, plus the request's KV at its last token. The first that applies wins:

    - REASON_KV_POOL: its last token's KV exceeds the pool (TensorRT-LLM, TGI: less the
      headroom), or (vLLM, SGLang) the KV check refuses it on an empty engine;
    - REASON_LANE: its lane has no room for it on an empty engine (its footprint exceeds
      the lane's KV cap);
    - REASON_BUDGET: chunked prefill off and its first chunk exceeds the budget (a
      resumed request's longer re-prefill is chunked instead: vLLM's own config check
      rules that case out);
    - REASON_RESERVATION: TensorRT-LLM/TGI's KV check (its reservation) refuses it on an
      empty engine; SGLang: its re-prefill at its last token plus its clipped remaining
      output plus a page reaches the pool (``add_one_req`` refuses on ``>=``).
    """
    bs = p.block_size
    total = p.total_blocks
    for r in range(rq.arrival.shape[0]):
        prompt = rq.prompt[r]
        last = prompt + rq.output[r] - 1  # tokens in KV when its last token is sampled
        base = rq.precomputed[r]
        chunk = _long_prefill_cap(p, rq, r, prompt - base)
        over_budget = not p.chunked_prefill and chunk > p.budget
        if chunk > p.budget:
            chunk = p.budget
        refused = _kv_refused(p, rq, st, r, prompt, chunk, base, 0, 0)
        if p.engine == E_TRTLLM or p.engine == E_TGI:
            never_fits = _blocks(last, bs) + _headroom(p, rq, st, r) > total
            reservation = refused
        else:
            never_fits = refused or _blocks(last, bs) > total
            # SGLang's own check at its last token on an empty engine (add_one_req):
            # re-prefill + clipped remaining output + a page must stay below the pool.
            reservation = (p.engine == E_SGLANG and last + _sglang_clipped(
                p, rq.max_tokens[r] - rq.output[r] + 1) + bs >= total * bs)
        if never_fits:
            rq.reject[r] = REASON_KV_POOL
        elif not _lane_has_room(p, rq, st, r):
            rq.reject[r] = REASON_LANE
        elif over_budget:
            rq.reject[r] = REASON_BUDGET
        elif reservation:
            rq.reject[r] = REASON_RESERVATION
        else:
            rq.reject[r] = REASON_NONE


# --- the step's parts ------------------------------------------------------------------------


@inline
def _lane_full(p, rq, st, r):
    """Request ``r``'s lane has its queue cap of waiting + running requests."""
    lane = _lane_of(p, rq, r)
    cap = p.lane_limits[lane, LIM_MAX_QUEUED]
    return cap > 0 and st.lanes[lane, LANE_WAITING] + st.lanes[lane, LANE_RUNNING] >= cap


@jit
def _arrivals(p, rq, st, lg, t):
    """Arrivals up to ``t`` enter the waiting queue, or are rejected (``rq.reject``) or
    shed (queue caps); returns whether any arrived."""
    sc = st.scalars[0]
    n = sc.known
    arrived = False
    while sc.next_arrival < n and rq.arrival[sc.next_arrival] <= t:
        r = sc.next_arrival
        sc.next_arrival = r + 1
        arrived = True
        waiting = _waiting(st)
        if rq.reject[r] != REASON_NONE:
            st.status[r] = REJECTED
            st.reason[r] = rq.reject[r]
        elif p.max_queued_requests > 0 and waiting + sc.n_running >= p.max_queued_requests:
            st.status[r] = SHED
            st.reason[r] = REASON_SHED_REQUESTS
        elif _lane_full(p, rq, st, r):
            st.status[r] = SHED
            st.reason[r] = REASON_SHED_CLASS
        elif (p.max_queued_prompt_tokens > 0
              and sc.queued_prompt + rq.prompt[r] > p.max_queued_prompt_tokens):
            st.status[r] = SHED
            st.reason[r] = REASON_SHED_TOKENS
        else:
            _enqueue(p, rq, st, r, False)
            sc.queued_prompt += rq.prompt[r]
            continue
        sc.resolved += 1
        _log_event(p, lg, EV_SHED, r, 0)
    return arrived


@jit
def _grant_running(p, rq, st, lg):
    """vLLM, TensorRT-LLM, TGI: grant each running request, in admission order, its
    remaining tokens capped by the threshold and the budget (TGI: decode tokens are never
    capped; with prefill chunking they take budget first, without it they ride free),
    allocating their blocks; when blocks run out, preempt the last admitted (FCFS) or the
    max (priority, arrival) request until this one fits (if it is itself the victim,
    nothing after it runs). Returns (budget left, preempted)."""
    sc = st.scalars[0]
    budget = p.budget
    tgi = p.engine == E_TGI
    if tgi and p.chunked_prefill:
        # TGI's batching_task (backends/v3/src/backend.rs): with chunking, the prefill
        # budget for the next batch is max_batch_prefill_tokens.saturating_sub(the
        # running batch's current tokens): each decode row takes one token of it.
        for q in range(sc.n_running):
            r = st.running[q]
            if st.generated[r] >= 1 and rq.prompt[r] + st.generated[r] - st.computed[r] == 1:
                budget -= 1
        if budget < 0:
            budget = 0
    bs = p.block_size
    preempted = False
    i = 0
    while i < sc.n_running:
        if budget <= 0 and not tgi:
            break
        r = st.running[i]
        if st.ready_s[r] > sc.now:  # its KV is still on the way
            i += 1
            continue
        target = rq.prompt[r] + st.generated[r]
        new = target - st.computed[r]
        decoding = st.generated[r] >= 1 and new == 1
        new = _long_prefill_cap(p, rq, r, new)
        if not (tgi and decoding) and new > budget:
            new = budget
        if new <= 0:
            i += 1
            continue
        need = _blocks(st.computed[r] + new, bs) - st.held[r]
        fits = True
        while need > p.total_blocks - sc.used:
            vp = _preemption_victim(p, rq, st)
            v = st.running[vp]
            budget += _ungrant(st, v)  # already granted this step: give it back
            _preempt(p, rq, st, lg, v, vp)
            preempted = True
            if v == r:
                fits = False
                break
            if vp < i:
                i -= 1
        if not fits:
            break
        _alloc(p, rq, st, r, need)
        _grant(st, r, new)
        if not (tgi and decoding):
            budget -= new
        i += 1
    return budget, preempted


@jit
def _sglang_decode_batch(p, rq, st, lg, ratio):
    """SGLang's decode batch: every running request decodes one token (not budgeted);
    when the batch's blocks do not fit, retract requests until it does, then update the
    new-token ratio (jump up after a retraction, else decay). Returns whether it retracted."""
    sc = st.scalars[0]
    bs = p.block_size
    need = 0
    for q in range(sc.n_running):
        r = st.running[q]
        need += _blocks(st.computed[r] + 1, bs) - st.held[r]
    retracted = False
    while need > p.total_blocks - sc.used and sc.n_running > 0:
        vp = _retraction_victim(p, rq, st)
        v = st.running[vp]
        need -= _blocks(st.computed[v] + 1, bs) - st.held[v]
        _preempt(p, rq, st, lg, v, vp)
        retracted = True
    if retracted:
        if sc.n_running > 0:
            decoded = 0
            max_new = 0
            for q in range(sc.n_running):
                r = st.running[q]
                decoded += st.generated[r]
                max_new += rq.max_tokens[r]
            ratio = (decoded + p.sglang_retract_steps * sc.n_running) / max_new
            if ratio > 1.0:
                ratio = 1.0
    else:
        ratio = ratio - p.ratio_decay
        if ratio < p.ratio_floor:
            ratio = p.ratio_floor
    sc.token_ratio = ratio
    for q in range(sc.n_running):
        r = st.running[q]
        _alloc(p, rq, st, r, _blocks(st.computed[r] + 1, bs) - st.held[r])
        _grant(st, r, 1)
    return retracted


@jit
def _schedule(p, rq, st, lg, t):
    """Form this step's batch; returns (admitted, preempted, SGLang prefill step)."""
    sc = st.scalars[0]
    if p.engine != E_SGLANG:
        budget, preempted = _grant_running(p, rq, st, lg)
        nadm = 0
        if not preempted:  # never admit in a step that preempted
            budget, nadm = _admit_waiting(p, rq, st, lg, t, budget, 0.0)
        return nadm, preempted, False
    # SGLang: a prefill batch when one can be formed (the chunked request first, then
    # admissions under the new_token_ratio estimate), else a decode batch.
    ratio = sc.token_ratio
    budget = p.budget
    prefill_step = False
    still_chunking = False
    cr = sc.chunked_req
    if cr >= 0:
        new = rq.prompt[cr] + st.generated[cr] - st.computed[cr]
        if new > budget:
            new = budget
            still_chunking = True
        # Only this chunk's KV is allocated (it fits: the admission counted the whole
        # re-prefill, and nothing else allocates while the request is chunked).
        _alloc(p, rq, st, cr, _blocks(st.computed[cr] + new, p.block_size) - st.held[cr])
        _grant(st, cr, new)
        budget -= new
        prefill_step = True
    nadm = 0
    if _waiting(st) > 0 and budget > 0 and not still_chunking:
        budget, nadm = _admit_waiting(p, rq, st, lg, t, budget, ratio)
        if nadm > 0:
            prefill_step = True
    preempted = False
    if not prefill_step:
        preempted = _sglang_decode_batch(p, rq, st, lg, ratio)
    return nadm, preempted, prefill_step


@jit
def _execute_step(p, rq, st, lg, t, nadm, preempted, prefill_step):
    """Run the batch: the step's time from its five aggregates, then its tokens, first
    tokens and finishes; record it and note whether it only decoded."""
    sc = st.scalars[0]
    nsched = sc.batch_size
    T = 0
    S = 0
    D = 0
    C = 0
    W = 0.0
    for q in range(nsched):
        r = st.batch_req[q]
        new = st.batch_tokens[q]
        before = st.computed[r]
        target = rq.prompt[r] + st.generated[r]
        T += new
        if st.generated[r] >= 1 and new == 1 and before == target - 1:
            D += 1
            C += before + 1
        else:
            W += new * (before + new / 2.0)
        if before + new == target:
            S += 1
    dur = 0.0
    if nsched > 0:
        dur = _step_seconds(p.step_coef, p.step_pieces, float(T), float(S), float(D), float(C),
                            W)
    used = sc.used
    waiting = _waiting(st)
    nrun_step = sc.n_running
    sc.kv_integral += used * dur
    _series_add(st, t, t + dur, float(used), float(waiting), float(nrun_step),
                float(sc.cached_free))
    t_end = t + dur
    nfin = 0
    for q in range(nsched):
        r = st.batch_req[q]
        st.computed[r] += st.batch_tokens[q]
        if p.prefix_caching:
            _cache_register(p, rq, st, r)
        _log_event(p, lg, EV_SCHED, r, st.batch_tokens[q])
        if st.computed[r] == rq.prompt[r] + st.generated[r]:
            st.generated[r] += 1
            if r == sc.chunked_req:
                sc.chunked_req = -1
            if st.generated[r] == 1:
                st.first_token_s[r] = t_end
                sc.queued_prompt -= rq.prompt[r]
            if st.generated[r] == rq.output[r]:
                st.status[r] = COMPLETED
                st.finish_s[r] = t_end
                st.done_order[sc.n_done] = r
                sc.n_done += 1
                _release(p, rq, st, r)
                sc.resolved += 1
                nfin += 1
                _log_event(p, lg, EV_FINISH, r, 0)
    if nfin > 0:
        k = 0
        for q in range(sc.n_running):
            r = st.running[q]
            if st.status[r] != COMPLETED:
                st.running[k] = r
                k += 1
        sc.n_running = k
    _log_record(p, lg, sc.steps, t, dur, used, waiting, nrun_step, 1)
    sc.now = t_end
    sc.steps += 1
    pure = (D == nsched and nsched == nrun_step and nadm == 0 and not preempted
            and nfin == 0)
    if p.engine == E_SGLANG:
        pure = pure and not prefill_step and _waiting(st) == 0
    sc.pure_decode = 1 if pure else 0


@jit
def _need_blocks(run, nrun, comp, k, bs):
    """Blocks the running (decoding) requests allocate over the next ``k`` decode steps."""
    s = 0
    for q in range(nrun):
        c = comp[run[q]]
        s += (c + k + bs - 1) // bs - (c + bs - 1) // bs
    return s


@jit
def _reserve_gives_way(p, st):
    """A lane reserves blocks while requests of another lane wait (their headroom shrinks
    as the reserving lane's requests grow)."""
    lim = p.lane_limits
    n_lanes = lim.shape[0]
    for k in range(1, n_lanes):
        if lim[k, LIM_RESERVED_BLOCKS] > 0:
            for lane in range(n_lanes):
                if lane != k and st.lanes[lane, LANE_WAITING] > 0:
                    return True
    return False


@jit
def _jump(p, rq, st, lg):
    """Advance a stretch of identical decode steps in one go; returns the steps taken
    (0: no stretch of at least two steps is possible here).

    Preconditions (checked by the caller): every running request decodes one token per
    step, nothing arrived at this boundary, and the previous step changed nothing but
    the decode progress (so a blocked waiting queue stays blocked: free blocks only
    shrink and seats stay taken). The stretch ends before the first step in which a
    request finishes, an arrival is due, or the blocks needed could exceed the free
    ones (where a preemption or retraction could happen). Step times are still summed
    one step at a time: with the same float operations as the reference loop, the
    clock is bit-identical to it (a closed form would differ in the last bits).
    """
    sc = st.scalars[0]
    lc = lg.counts[0]
    n = sc.known
    run = st.running
    comp = st.computed
    nrun = sc.n_running
    bs = p.block_size
    engine = p.engine
    if (engine == E_TRTLLM or engine == E_TGI) and _reserve_gives_way(p, st):
        # These engines admit against reservations, which decoding does not change, while
        # a waiting request's headroom (another lane's block reserve less what that lane
        # holds) shrinks as that lane's requests grow: it may fit after any step.
        return 0
    kfin = WINDOW_MAX
    csum = 0
    for q in range(nrun):
        r = run[q]
        rem = rq.output[r] - st.generated[r] - 1
        if rem < kfin:
            kfin = rem
        csum += comp[r] + 1
    k = kfin  # <= WINDOW_MAX, which the step log has room for (_log_needs_room)
    if k < 2:
        return 0
    free = p.total_blocks - sc.used
    if engine == E_VLLM or engine == E_SGLANG:
        if _need_blocks(run, nrun, comp, k, bs) > free:
            lo = 0  # need(lo) <= free
            hi = k  # need(hi) > free
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if _need_blocks(run, nrun, comp, mid, bs) <= free:
                    lo = mid
                else:
                    hi = mid
            k = lo
        if k < 2:
            return 0
    hist = st.jump_hist
    for j in range(k + 1):
        hist[j] = 0
    for q in range(nrun):
        c = comp[run[q]]
        j = (bs - c % bs) % bs + 1  # first step whose new token opens a block
        while j <= k:
            hist[j] += 1
            j += bs
    waiting = _waiting(st)
    t0 = sc.now
    t = t0
    used = sc.used
    step0 = sc.steps
    fD = float(nrun)
    done = 0
    cached0 = sc.cached_free
    while done < k:
        if done > 0 and ((sc.next_arrival < n and rq.arrival[sc.next_arrival] <= t)
                         or t >= sc.until):
            break
        j = done + 1
        used += hist[j]
        # the prefix cache gives up its LRU blocks as the pool fills (evicted at the end)
        cached = cached0
        if cached > p.total_blocks - used:
            cached = p.total_blocks - used
        C = csum + (j - 1) * nrun
        dur = _step_seconds(p.step_coef, p.step_pieces, fD, fD, fD, float(C), 0.0)
        if p.log:
            lg.repeat_duration_s[lc.repeats] = dur
            lg.repeat_kv_used[lc.repeats] = used
            lc.repeats += 1
        sc.kv_integral += used * dur
        _series_add(st, t, t + dur, float(used), float(waiting), fD, float(cached))
        t = t + dur
        if engine == E_SGLANG:
            ratio = sc.token_ratio - p.ratio_decay
            sc.token_ratio = ratio if ratio > p.ratio_floor else p.ratio_floor
        done += 1
    if used > sc.peak:
        sc.peak = used
    for q in range(nrun):
        r = run[q]
        comp[r] += done
        st.generated[r] += done
        nb = _blocks(comp[r], bs)
        lane = _lane_of(p, rq, r)
        if lane > 0:
            st.lanes[lane, LANE_HELD] += nb - st.held[r]
        st.held[r] = nb
    sc.used = used
    if p.prefix_caching:
        _evict_to_fit(p, st)
    sc.steps = step0 + done
    sc.now = t
    sc.jumps += 1
    if p.log:
        for q in range(nrun):
            _log_event(p, lg, EV_SCHED, run[q], 1)
        _log_record(p, lg, step0, t0, t - t0, used, waiting, nrun, done)
    return done


@entry
def run_kernel(p, rq, st, lg, max_steps):
    """Run the engine until every known request is resolved (RC_DONE), the step log needs
    to grow (RC_LOG_FULL), ``max_steps`` steps ran (RC_STEP_LIMIT), the clock reached
    ``until`` at a step boundary (RC_UNTIL: a router appends the next arrival), or no
    progress is possible (RC_STUCK, a bug guard)."""
    sc = st.scalars[0]
    lc = lg.counts[0]
    n = sc.known
    steps_here = 0
    while True:
        if steps_here >= max_steps:
            return RC_STEP_LIMIT
        t = sc.now
        if t >= sc.until:
            return RC_UNTIL
        if p.log and _log_needs_room(p, rq, st, lg, t):
            return RC_LOG_FULL

        # ---- arrivals enter at the step boundary (rejected / shed ones are turned away)
        arrived = _arrivals(p, rq, st, lg, t)
        if _waiting(st) == 0 and sc.n_running == 0:
            sc.pure_decode = 0
            if sc.next_arrival >= n:
                break
            nxt = rq.arrival[sc.next_arrival]
            sc.now = nxt if nxt > t else t  # idle: jump to the next arrival
            sc.token_ratio = p.ratio_init
            continue

        # ---- fast mode: a stretch of identical decode steps in one go
        if p.jump and not arrived and sc.pure_decode == 1:
            k = _jump(p, rq, st, lg)
            if k > 0:
                steps_here += k
                continue

        # ---- form the batch, then execute it
        sc.batch_size = 0
        nadm, preempted, prefill_step = _schedule(p, rq, st, lg, t)
        if sc.batch_size == 0 and not preempted:
            sc.pure_decode = 0
            if sc.n_running == 0 and _waiting(st) == 0:
                continue  # every waiting request was turned away: end or idle at the top
            # idle until the next arrival, or until a running request's KV arrives
            wake = np.inf
            if sc.next_arrival < n:
                wake = rq.arrival[sc.next_arrival]
            transfer = False
            for q in range(sc.n_running):
                ready = st.ready_s[st.running[q]]
                if ready > t:
                    transfer = True
                    if ready < wake:
                        wake = ready
            if (sc.n_running == 0 or transfer) and t < wake < np.inf:
                sc.now = wake
                continue
            return RC_STUCK
        _execute_step(p, rq, st, lg, t, nadm, preempted, prefill_step)
        steps_here += 1

    # Requests turned away after the last step still get a (zero-length) record.
    if p.log:
        last = lg.events_end[lc.records - 1] if lc.records > 0 else 0
        if lc.events > last:
            _log_record(p, lg, sc.steps, sc.now, 0.0, 0, 0, 0, 1)
    return RC_DONE


# --- a router over replicas (servetune.sim.cluster) -------------------------------------------

ROUTE_LEAST_LOADED = route_code("least_loaded")
ROUTE_LEAST_KV = route_code("least_kv")
ROUTE_PREFIX_AWARE = route_code("prefix_aware")


@jit
def _replica_load(st):
    """Requests a replica has: running, waiting, and sent but not yet at a step boundary."""
    sc = st.scalars[0]
    return sc.n_running + _waiting(st) + sc.known - sc.next_arrival


@jit
def _kv_committed(p, rq, st):
    """Blocks a replica has committed: in use, plus its queued and sent prompts' blocks."""
    sc = st.scalars[0]
    sent = 0
    for m in range(sc.next_arrival, sc.known):
        sent += rq.prompt[m]
    return float(sc.used) + float(sc.queued_prompt + sent) / p.block_size


@entry
def append_row(rq, st, full, row, t):
    """Send trace row ``row`` (its columns in ``full``, this replica's view of the whole
    trace) to a replica, arriving at ``t``; returns its row there."""
    sc = st.scalars[0]
    m = sc.known
    rq.arrival[m] = t
    rq.prompt[m] = full.prompt[row]
    rq.output[m] = full.output[row]
    rq.max_tokens[m] = full.max_tokens[row]
    rq.priority[m] = full.priority[row]
    rq.lane[m] = full.lane[row]
    rq.lane_blocks[m] = full.lane_blocks[row]
    rq.chunk_cap[m] = full.chunk_cap[row]
    rq.reserved_blocks[m] = full.reserved_blocks[row]
    rq.reject[m] = full.reject[row]
    rq.precomputed[m] = full.precomputed[row]
    rq.ready_delay[m] = 0.0
    a = full.prefix_start[row]
    b = full.prefix_start[row + 1]
    start = rq.prefix_start[m]
    for i in range(b - a):
        rq.prefix_ids[start + i] = full.prefix_ids[a + i]
    rq.prefix_start[m + 1] = start + b - a
    sc.known = m + 1
    return m


@entry
def append_rows(rq, st, full, rows, arrival):
    """:func:`append_row` for each of ``rows`` (ascending), arriving at ``arrival[row]``:
    a static router's whole share at once."""
    for i in range(rows.shape[0]):
        append_row(rq, st, full, rows[i], arrival[rows[i]])


@jit
def _pick(ps, rqs, sts, fulls, row, router):
    """The replica (index into the tuples) of least cost for trace row ``row`` under
    ``router`` (ties: the lowest index)."""
    best = 0
    best_a = 0.0
    best_b = 0.0
    for k in range(len(sts)):
        p = ps[k]
        st = sts[k]
        if router == ROUTE_LEAST_LOADED:
            a = float(_replica_load(st))
            b = 0.0
        elif router == ROUTE_LEAST_KV:
            a = _kv_committed(p, rqs[k], st) / p.total_blocks
            b = float(_replica_load(st))
        else:  # prefix-aware: blocks to prefill there + blocks committed there
            full = fulls[k]
            prompt = full.prompt[row]
            cached = 0
            lo = full.prefix_start[row]
            hi = full.prefix_start[row + 1]
            if p.prefix_caching and hi > lo:
                cached = cached_prefix_blocks(st.table_key, st.table_slot, st.units,
                                              p.unit_blocks, p.block_size,
                                              full.prefix_ids[lo:hi], p.prefix_block_tokens,
                                              prompt)
            a = float(_blocks(prompt, p.block_size) - cached) + _kv_committed(p, rqs[k], st)
            b = 0.0
        if k == 0 or a < best_a or (a == best_a and b < best_b):
            best = k
            best_a = a
            best_b = b
    return best


@entry
def pick_replica(ps, rqs, sts, fulls, row, router):
    """:func:`_pick` from Python (the decode pool of a disaggregated cluster)."""
    return _pick(ps, rqs, sts, fulls, row, router)


@entry
def route_arrivals(ps, rqs, sts, lgs, fulls, arrival, router, replica_of, local_of):
    """Serve the trace's rows in arrival order on the replicas (tuples, one entry each)
    behind a router that reads their state (``ROUTE_*``; :mod:`servetune.sim.cluster` has
    the rules): before each arrival every replica runs the steps that start before it;
    the request goes to the replica :func:`_pick` chooses, which is recorded in
    ``replica_of`` and ``local_of`` (its row there). Returns RC_DONE, or RC_STUCK from a
    replica (a bug guard)."""
    n_rep = len(sts)
    for row in range(arrival.shape[0]):
        t = arrival[row]
        for k in range(n_rep):
            st = sts[k]
            sc = st.scalars[0]
            if sc.now >= t:
                continue
            if sc.next_arrival >= sc.known and sc.n_running == 0 and _waiting(st) == 0:
                continue  # idle, nothing to do until a request comes
            sc.until = t
            rc = run_kernel(ps[k], rqs[k], st, lgs[k], 1 << 40)
            if rc == RC_STUCK:
                return RC_STUCK
        best = _pick(ps, rqs, sts, fulls, row, router)
        replica_of[row] = best
        local_of[row] = append_row(rqs[best], sts[best], fulls[best], row, t)
    return RC_DONE
