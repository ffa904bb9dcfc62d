"""The engine simulator's hot loop: flat arrays in, flat arrays out, one step function.

This module is loaded twice (see :mod:`servetune.sim.engine`): once as itself, where
``jit`` is ``numba.njit(cache=True)`` and the loop runs compiled (fast mode), and once
under the name ``servetune.sim._kernel_pure``, where ``jit`` is the identity, so the very
same source runs as plain Python (reference mode). Fast mode additionally jumps
decode-only stretches (``P_JUMP``); reference mode walks every step. Tests prove the two
give identical per-request records and, after expanding ``repeat``, identical step logs.

State lives in a few flat numpy arrays (per request: computed/generated tokens, blocks
held, timestamps, status), the waiting queue is one binary heap per lane, and the running
list is an array in admission order, in the spirit of vLLM's ``scheduler.py``.
Scalars that survive between calls (clock, counters, queue sizes) live in ``si``
(int64) and ``sf`` (float64) so the Python driver can pause the loop (to grow the
step-log buffers or report progress) and resume it.

Token accounting (one rule for every engine, as vLLM V1): a request's target is
``prompt + generated``; a step grants it ``new`` tokens towards that target; a step that
reaches the target samples one output token. Hence the first output token is sampled in
the step that completes the prefill, and each later step decodes one token. KV blocks
held = ceil(computed / block_size) (SGLang: the whole re-prefill is allocated at
admission).
"""

from __future__ import annotations

from servetune.profiles.steptime import step_seconds as _step_seconds_py

if __name__.endswith("_pure"):

    def jit(fn):  # noqa: D103 - reference mode: plain Python
        return fn

    _step_seconds = _step_seconds_py
else:
    import numba

    jit = numba.njit(cache=True)
    _step_seconds = jit(_step_seconds_py)

# --- engines ---------------------------------------------------------------------------
E_VLLM = 0
E_SGLANG = 1
E_TRTLLM = 2
E_TGI = 3

# --- int parameters (pi) ---------------------------------------------------------------
P_ENGINE = 0
P_PRIO_MODE = 1  # 1: priority scheduling, 0: FCFS
P_MAX_SEQS = 2
P_BUDGET = 3  # max_num_batched_tokens (prefill budget for sglang/tgi)
P_THRESH = 4  # long_prefill_token_threshold (vLLM only; 0 = off)
P_CHUNKED = 5
P_RESERVE_FULL = 6
P_WM = 7  # watermark blocks
P_TOTAL = 8  # usable KV blocks
P_BS = 9  # block size in tokens
P_QREQ = 10  # max_queued_requests (-1 = none)
P_QTOK = 11  # max_queued_prompt_tokens (-1 = none)
P_LANES = 12
P_RSEQ = 13
P_RKV = 14
P_MSEQ = 15
P_MKV = 16
P_JUMP = 17
P_LOG = 18
P_CLIP = 19  # SGLang's output-estimate clip (4096)
P_RETRACT_STEPS = 20  # SGLang's SGLANG_RETRACT_DECODE_STEPS (20)
N_PI = 21

# --- float parameters (pf) -------------------------------------------------------------
F_RATIO_INIT = 0
F_RATIO_FLOOR = 1
F_RATIO_DECAY = 2
N_PF = 3

# --- int state (si) --------------------------------------------------------------------
S_NEXT_ARR = 0  # next trace row to arrive
S_NRUN = 1  # running list length
S_STEPS = 2
S_USED = 3  # KV blocks in use
S_FRONT = 4  # push-front counter (FCFS keys of requeued requests)
S_QPROMPT = 5  # prompt tokens of accepted requests that have not produced a first token
S_LONG_N = 6  # running long requests
S_LONG_HELD = 7  # KV blocks held by long requests
S_LONG_LANE = 8  # lane footprint (blocks of prompt + expected output) of running long ones
S_RESV_SUM = 9  # reserved blocks (trtllm / tgi)
S_DONE = 10  # requests completed, shed or rejected
S_PURE = 11  # previous step was a pure decode step that changed nothing else
S_REC = 12  # step-log records written
S_EV = 13  # step-log events written
S_REP = 14  # per-step values of jumped records written
S_CHUNKED_REQ = 15  # SGLang's request in chunked prefill (-1 none)
S_PEAK = 16  # peak KV blocks in use
S_H0 = 17  # short-lane (or only) waiting heap size
S_H1 = 18  # long-lane waiting heap size
S_JUMPS = 19  # jumped stretches
N_SI = 20

# --- float state (sf) ------------------------------------------------------------------
T_NOW = 0
T_KV_INT = 1  # integral of KV blocks in use over time
T_RATIO = 2  # SGLang new_token_ratio
T_BIN_W = 3  # series bin width
N_SF = 4

# --- step-log events -------------------------------------------------------------------
EV_SCHED = 0
EV_PREEMPT = 1
EV_FINISH = 2
EV_ADMIT = 3
EV_SHED = 4

# step-log record columns (rec_i)
R_STEP = 0
R_KV = 1
R_WAITING = 2
R_RUNNING = 3
R_REPEAT = 4
R_EV_END = 5
R_REP_END = 6
N_RI = 7

WINDOW_MAX = 4096  # longest jumped stretch (size of the allocation histogram)

# a rejection reason the kernel itself records (engine.REASONS[RJ_READMIT])
RJ_READMIT = 7

RC_DONE = 0
RC_LOG_FULL = 1
RC_STEP_LIMIT = 2
RC_STUCK = 3


@jit
def _blocks(tokens, bs):
    return (tokens + bs - 1) // bs


@jit
def _heap_push(hk, hid, size, key, r):
    """Min-heap on (key, request id); returns the new size."""
    i = size
    while i > 0:
        p = (i - 1) // 2
        if hk[p] < key or (hk[p] == key and hid[p] < r):
            break
        hk[i] = hk[p]
        hid[i] = hid[p]
        i = p
    hk[i] = key
    hid[i] = r
    return size + 1


@jit
def _heap_pop(hk, hid, size):
    """Drop the heap's head; returns the new size."""
    size -= 1
    if size <= 0:
        return 0
    key = hk[size]
    r = hid[size]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= size:
            break
        if c + 1 < size and (hk[c + 1] < hk[c] or (hk[c + 1] == hk[c] and hid[c + 1] < hid[c])):
            c += 1
        if hk[c] < key or (hk[c] == key and hid[c] < r):
            hk[i] = hk[c]
            hid[i] = hid[c]
            i = c
        else:
            break
    hk[i] = key
    hid[i] = r
    return size


@jit
def _enqueue(r, front, pi, si, prio, is_long, hk0, hid0, hk1, hid1):
    """Put a request into the waiting queue: FCFS at the back (arrival) or the front
    (requeued after preemption), or by (priority, arrival) under priority scheduling."""
    if pi[P_PRIO_MODE] == 1:
        key = prio[r]
    elif front:
        si[S_FRONT] += 1
        key = -si[S_FRONT]
    else:
        key = r
    if pi[P_LANES] == 1 and is_long[r] == 1:
        si[S_H1] = _heap_push(hk1, hid1, si[S_H1], key, r)
    else:
        si[S_H0] = _heap_push(hk0, hid0, si[S_H0], key, r)


@jit
def _pick_lane(si, hk0, hid0, hk1, hid1, blocked0, blocked1):
    """The waiting lane whose head comes first in queue order (-1: none unblocked)."""
    lane = -1
    if si[S_H0] > 0 and not blocked0:
        lane = 0
    if si[S_H1] > 0 and not blocked1:
        if lane == -1 or hk1[0] < hk0[0] or (hk1[0] == hk0[0] and hid1[0] < hid0[0]):
            lane = 1
    return lane


@jit
def _event(ev, si, kind, r, val):
    k = si[S_EV]
    ev[k, 0] = kind
    ev[k, 1] = r
    ev[k, 2] = val
    si[S_EV] = k + 1


@jit
def _record(rec_i, rec_f, si, step, start, dur, kv, waiting, running, repeat):
    k = si[S_REC]
    rec_i[k, R_STEP] = step
    rec_i[k, R_KV] = kv
    rec_i[k, R_WAITING] = waiting
    rec_i[k, R_RUNNING] = running
    rec_i[k, R_REPEAT] = repeat
    rec_i[k, R_EV_END] = si[S_EV]
    rec_i[k, R_REP_END] = si[S_REP]
    rec_f[k, 0] = start
    rec_f[k, 1] = dur
    si[S_REC] = k + 1


@jit
def _alloc(r, nblocks, pi, si, held, is_long):
    held[r] += nblocks
    si[S_USED] += nblocks
    if pi[P_LANES] == 1 and is_long[r] == 1:
        si[S_LONG_HELD] += nblocks
    if si[S_USED] > si[S_PEAK]:
        si[S_PEAK] = si[S_USED]


@jit
def _release(r, pi, si, held, is_long, lane_blocks, resv):
    """Give back a request's blocks and its seat accounting (finish or preemption)."""
    si[S_USED] -= held[r]
    if pi[P_LANES] == 1 and is_long[r] == 1:
        si[S_LONG_HELD] -= held[r]
        si[S_LONG_N] -= 1
        si[S_LONG_LANE] -= lane_blocks[r]
    held[r] = 0
    si[S_RESV_SUM] -= resv[r]


@jit
def _preempt(v, vp, pi, si, comp, held, in_prefill, npre, prio, is_long, lane_blocks, resv,
             run, hk0, hid0, hk1, hid1, ev):
    """Recompute-preempt (SGLang: retract) running request ``v`` at running position
    ``vp``: free its blocks, drop its computed tokens, requeue it at the front."""
    _release(v, pi, si, held, is_long, lane_blocks, resv)
    comp[v] = 0
    in_prefill[v] = 0
    npre[v] += 1
    _enqueue(v, True, pi, si, prio, is_long, hk0, hid0, hk1, hid1)
    nrun = si[S_NRUN]
    for q in range(vp, nrun - 1):
        run[q] = run[q + 1]
    si[S_NRUN] = nrun - 1
    if pi[P_LOG] == 1:
        _event(ev, si, EV_PREEMPT, v, 0)


@jit
def _admission_headroom(r, pi, si, is_long, lane_blocks):
    """Blocks a waiting request must leave free when admitted: the watermark, plus (for a
    short request) what the long lane's reserve still lacks; -1 when its lane has no seat
    or KV share left for it."""
    headroom = pi[P_WM]
    if pi[P_LANES] == 1:
        if is_long[r] == 1:
            if si[S_LONG_N] + 1 > pi[P_MSEQ] or si[S_LONG_LANE] + lane_blocks[r] > pi[P_MKV]:
                return -1
        else:
            spare = pi[P_RSEQ] - si[S_LONG_N]
            if spare < 0:
                spare = 0
            if si[S_NRUN] + 1 + spare > pi[P_MAX_SEQS]:
                return -1
            spare = pi[P_RKV] - si[S_LONG_HELD]
            if spare > 0:
                headroom += spare
    return headroom


@jit
def _admit(r, lane, nblocks, t, pi, si, hk0, hid0, hk1, hid1, run, held, is_long,
           lane_blocks, resv, in_prefill, admitted_s, ev):
    """Move the head of waiting ``lane`` (request ``r``) to the end of the running list
    with ``nblocks`` blocks allocated."""
    if lane == 0:
        si[S_H0] = _heap_pop(hk0, hid0, si[S_H0])
    else:
        si[S_H1] = _heap_pop(hk1, hid1, si[S_H1])
    run[si[S_NRUN]] = r
    si[S_NRUN] += 1
    _alloc(r, nblocks, pi, si, held, is_long)
    if pi[P_LANES] == 1 and is_long[r] == 1:
        si[S_LONG_N] += 1
        si[S_LONG_LANE] += lane_blocks[r]
    si[S_RESV_SUM] += resv[r]
    in_prefill[r] = 1
    if admitted_s[r] != admitted_s[r]:  # nan: first admission
        admitted_s[r] = t
    if pi[P_LOG] == 1:
        _event(ev, si, EV_ADMIT, r, 0)


@jit
def _reject_head(r, lane, si, hk0, hid0, hk1, hid1, prompt, gen, status, reason, pi, ev):
    """Turn away the head of waiting ``lane`` (request ``r``): an empty engine cannot
    admit it, so it never will (a resumed request whose re-prefill outgrew the headroom)."""
    if lane == 0:
        si[S_H0] = _heap_pop(hk0, hid0, si[S_H0])
    else:
        si[S_H1] = _heap_pop(hk1, hid1, si[S_H1])
    status[r] = 2
    reason[r] = RJ_READMIT
    si[S_DONE] += 1
    if gen[r] == 0:
        si[S_QPROMPT] -= prompt[r]
    if pi[P_LOG] == 1:
        _event(ev, si, EV_SHED, r, 0)


@jit
def _series_add(ser, sf, t0, t1, kv, waiting, running):
    """Add a step's time-weighted values to the coarse series (bins double when full)."""
    if t1 <= t0:
        return
    nb = ser.shape[1]
    while t1 > nb * sf[T_BIN_W]:
        half = nb // 2
        for i in range(half):
            for c in range(3):
                ser[c, i] = ser[c, 2 * i] + ser[c, 2 * i + 1]
        for i in range(half, nb):
            for c in range(3):
                ser[c, i] = 0.0
        sf[T_BIN_W] = sf[T_BIN_W] * 2.0
    bw = sf[T_BIN_W]
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
        t0 = end
        b += 1


@jit
def _need_blocks(run, nrun, comp, k, bs):
    """Blocks the running (decoding) requests allocate over the next ``k`` decode steps."""
    s = 0
    for q in range(nrun):
        c = comp[run[q]]
        s += (c + k + bs - 1) // bs - (c + bs - 1) // bs
    return s


@jit
def _jump(pi, pf, coef, pieces, arrival, out, gen, comp, held, is_long, run, hist,
          si, sf, ser, rec_i, rec_f, ev, rep_f, rep_i):
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
    n = arrival.shape[0]
    nrun = si[S_NRUN]
    bs = pi[P_BS]
    engine = pi[P_ENGINE]
    if ((engine == E_TRTLLM or engine == E_TGI) and pi[P_LANES] == 1 and pi[P_RKV] > 0
            and si[S_H0] > 0):
        # These engines admit against reservations, which decoding does not change, while
        # a waiting short request's headroom (the long lane's reserve less what long
        # requests hold) shrinks as long requests grow: it may fit after any step.
        return 0
    log = pi[P_LOG] == 1
    kfin = WINDOW_MAX
    csum = 0
    for q in range(nrun):
        r = run[q]
        rem = out[r] - gen[r] - 1
        if rem < kfin:
            kfin = rem
        csum += comp[r] + 1
    k = kfin
    if log and rep_f.shape[0] - si[S_REP] < k:
        k = rep_f.shape[0] - si[S_REP]
    if k < 2:
        return 0
    free = pi[P_TOTAL] - si[S_USED]
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
    for j in range(k + 1):
        hist[j] = 0
    for q in range(nrun):
        c = comp[run[q]]
        j = (bs - c % bs) % bs + 1  # first step whose new token opens a block
        while j <= k:
            hist[j] += 1
            j += bs
    waiting = si[S_H0] + si[S_H1]
    t0 = sf[T_NOW]
    t = t0
    used = si[S_USED]
    step0 = si[S_STEPS]
    fD = float(nrun)
    done = 0
    while done < k:
        if done > 0 and si[S_NEXT_ARR] < n and arrival[si[S_NEXT_ARR]] <= t:
            break
        j = done + 1
        used += hist[j]
        C = csum + (j - 1) * nrun
        dur = _step_seconds(coef, pieces, fD, fD, fD, float(C), 0.0)
        if log:
            rep_f[si[S_REP]] = dur
            rep_i[si[S_REP]] = used
            si[S_REP] += 1
        sf[T_KV_INT] += used * dur
        _series_add(ser, sf, t, t + dur, float(used), float(waiting), fD)
        t = t + dur
        if engine == E_SGLANG:
            ratio = sf[T_RATIO] - pf[F_RATIO_DECAY]
            sf[T_RATIO] = ratio if ratio > pf[F_RATIO_FLOOR] else pf[F_RATIO_FLOOR]
        done += 1
    if used > si[S_PEAK]:
        si[S_PEAK] = used
    lanes = pi[P_LANES] == 1
    for q in range(nrun):
        r = run[q]
        comp[r] += done
        gen[r] += done
        nb = _blocks(comp[r], bs)
        if lanes and is_long[r] == 1:
            si[S_LONG_HELD] += nb - held[r]
        held[r] = nb
    si[S_USED] = used
    si[S_STEPS] = step0 + done
    sf[T_NOW] = t
    si[S_JUMPS] += 1
    if log:
        for q in range(nrun):
            _event(ev, si, EV_SCHED, run[q], 1)
        _record(rec_i, rec_f, si, step0, t0, t - t0, used, waiting, nrun, done)
    return done


@jit
def run_kernel(pi, pf, coef, pieces,
               arrival, prompt, out, maxtok, prio, is_long, lane_blocks, reject, resv,
               comp, gen, held, in_prefill, admitted_s, first_s, finish_s, npre, status,
               reason, hk0, hid0, hk1, hid1, run, sched_r, sched_n, hist,
               si, sf, ser, rec_i, rec_f, ev, rep_f, rep_i, max_steps):
    """Run the engine until every request is resolved (RC_DONE), the step-log buffers
    need to grow (RC_LOG_FULL), ``max_steps`` steps ran (RC_STEP_LIMIT), or no progress
    is possible (RC_STUCK, a bug guard)."""
    n = arrival.shape[0]
    engine = pi[P_ENGINE]
    bs = pi[P_BS]
    total = pi[P_TOTAL]
    max_seqs = pi[P_MAX_SEQS]
    lanes = pi[P_LANES] == 1
    log = pi[P_LOG] == 1
    steps_here = 0
    while True:
        if steps_here >= max_steps:
            return RC_STEP_LIMIT
        t = sf[T_NOW]
        if log:
            a = si[S_NEXT_ARR]
            while a < n and arrival[a] <= t:
                a += 1
            if (si[S_REC] + 2 > rec_i.shape[0]
                    or si[S_EV] + 4 * max_seqs + (a - si[S_NEXT_ARR]) + si[S_H0] + si[S_H1]
                    + 8 > ev.shape[0]
                    or si[S_REP] + 2 > rep_f.shape[0]):
                return RC_LOG_FULL

        # ---- arrivals enter at the step boundary (rejected / shed ones are turned away)
        arrived = False
        while si[S_NEXT_ARR] < n and arrival[si[S_NEXT_ARR]] <= t:
            r = si[S_NEXT_ARR]
            si[S_NEXT_ARR] = r + 1
            arrived = True
            waiting = si[S_H0] + si[S_H1]
            if reject[r] != 0:
                status[r] = 2
                reason[r] = reject[r]
            elif pi[P_QREQ] > 0 and waiting + si[S_NRUN] >= pi[P_QREQ]:
                status[r] = 1
                reason[r] = 1
            elif pi[P_QTOK] > 0 and si[S_QPROMPT] + prompt[r] > pi[P_QTOK]:
                status[r] = 1
                reason[r] = 2
            else:
                _enqueue(r, False, pi, si, prio, is_long, hk0, hid0, hk1, hid1)
                si[S_QPROMPT] += prompt[r]
                continue
            si[S_DONE] += 1
            if log:
                _event(ev, si, EV_SHED, r, 0)
        waiting = si[S_H0] + si[S_H1]
        if waiting == 0 and si[S_NRUN] == 0:
            si[S_PURE] = 0
            if si[S_NEXT_ARR] >= n:
                break
            nxt = arrival[si[S_NEXT_ARR]]
            sf[T_NOW] = nxt if nxt > t else t  # idle: jump to the next arrival
            sf[T_RATIO] = pf[F_RATIO_INIT]
            continue

        # ---- fast mode: a stretch of identical decode steps in one go
        if pi[P_JUMP] == 1 and not arrived and si[S_PURE] == 1:
            k = _jump(pi, pf, coef, pieces, arrival, out, gen, comp, held, is_long, run, hist,
                      si, sf, ser, rec_i, rec_f, ev, rep_f, rep_i)
            if k > 0:
                steps_here += k
                continue

        # ---- schedule one step
        nsched = 0
        nadm = 0
        preempted = False
        prefill_step = False
        retracted = False
        if engine != E_SGLANG:
            budget = pi[P_BUDGET]
            thresh = pi[P_THRESH] if engine == E_VLLM else 0
            tgi = engine == E_TGI
            # Pass 1: running requests in admission order.
            i = 0
            while i < si[S_NRUN]:
                if budget <= 0 and not tgi:
                    break
                r = run[i]
                target = prompt[r] + gen[r]
                new = target - comp[r]
                decoding = gen[r] >= 1 and new == 1
                if thresh > 0 and new > thresh:
                    new = thresh
                if not (tgi and decoding) and new > budget:
                    new = budget  # tgi: decode tokens are not budgeted
                if new <= 0:
                    i += 1
                    continue
                need = _blocks(comp[r] + new, bs) - held[r]
                ok = True
                while need > total - si[S_USED]:
                    # Out of blocks: recompute-preempt the last admitted (FCFS) or the
                    # max (priority, arrival) running request until this one fits.
                    nrun = si[S_NRUN]
                    vp = nrun - 1
                    if pi[P_PRIO_MODE] == 1:
                        vp = 0
                        for q in range(1, nrun):
                            a = run[q]
                            b = run[vp]
                            if prio[a] > prio[b] or (prio[a] == prio[b] and a > b):
                                vp = q
                    v = run[vp]
                    for q in range(nsched):
                        if sched_r[q] == v:  # already granted this step: give it back
                            budget += sched_n[q]
                            for q2 in range(q, nsched - 1):
                                sched_r[q2] = sched_r[q2 + 1]
                                sched_n[q2] = sched_n[q2 + 1]
                            nsched -= 1
                            break
                    _preempt(v, vp, pi, si, comp, held, in_prefill, npre, prio, is_long,
                             lane_blocks, resv, run, hk0, hid0, hk1, hid1, ev)
                    preempted = True
                    if v == r:
                        ok = False
                        break
                    if vp < i:
                        i -= 1
                if not ok:
                    break
                _alloc(r, need, pi, si, held, is_long)
                sched_r[nsched] = r
                sched_n[nsched] = new
                nsched += 1
                if not (tgi and decoding):
                    budget -= new
                i += 1
            # Pass 2: admit from the waiting queue, never in a step that preempted.
            if not preempted:
                owed = 0  # blocks in-flight prefills still need (vLLM reserve_full_isl)
                if engine == E_VLLM and pi[P_RESERVE_FULL] == 1 and si[S_H0] + si[S_H1] > 0:
                    for q in range(si[S_NRUN]):
                        r = run[q]
                        if in_prefill[r] == 1:
                            d = _blocks(prompt[r] + gen[r], bs) - held[r]
                            if d > 0:
                                owed += d
                blocked0 = False
                blocked1 = False
                while budget > 0 and si[S_NRUN] < max_seqs:
                    lane = _pick_lane(si, hk0, hid0, hk1, hid1, blocked0, blocked1)
                    if lane == -1:
                        break
                    r = hid0[0] if lane == 0 else hid1[0]
                    target = prompt[r] + gen[r]
                    new = target
                    if thresh > 0 and new > thresh:
                        new = thresh
                    fits = True
                    if new > budget:
                        if pi[P_CHUNKED] == 0 and new <= pi[P_BUDGET]:
                            fits = False  # chunked prefill off: the prompt waits
                        else:
                            new = budget  # (off: a re-prefill over the whole budget)
                    headroom = _admission_headroom(r, pi, si, is_long, lane_blocks)
                    chunk_blocks = _blocks(new, bs)
                    if headroom < 0:
                        fits = False
                    elif engine == E_VLLM:
                        if pi[P_RESERVE_FULL] == 1:
                            need_check = _blocks(target, bs) + owed
                        else:
                            need_check = chunk_blocks
                        if total - si[S_USED] - need_check < headroom:
                            fits = False
                    elif si[S_RESV_SUM] + resv[r] + headroom > total:
                        fits = False
                    if not fits and si[S_NRUN] == 0:
                        _reject_head(r, lane, si, hk0, hid0, hk1, hid1, prompt, gen, status,
                                     reason, pi, ev)
                        continue
                    if not fits:
                        if lanes:  # each lane is head-of-line only within itself
                            if lane == 0:
                                blocked0 = True
                            else:
                                blocked1 = True
                            continue
                        break  # strict head-of-line blocking
                    _admit(r, lane, chunk_blocks, t, pi, si, hk0, hid0, hk1, hid1, run, held,
                           is_long, lane_blocks, resv, in_prefill, admitted_s, ev)
                    if pi[P_RESERVE_FULL] == 1 and engine == E_VLLM:
                        owed += _blocks(target, bs) - chunk_blocks
                    sched_r[nsched] = r
                    sched_n[nsched] = new
                    nsched += 1
                    budget -= new
                    nadm += 1
        else:
            # SGLang: a prefill batch when one can be formed (chunked continuation first,
            # then admissions under the new_token_ratio reservation), else a decode batch.
            ratio = sf[T_RATIO]
            budget = pi[P_BUDGET]
            clip = pi[P_CLIP]
            cr = si[S_CHUNKED_REQ]
            still_chunking = False
            if cr >= 0:
                new = prompt[cr] + gen[cr] - comp[cr]
                if new > budget:
                    new = budget
                    still_chunking = True
                sched_r[nsched] = cr
                sched_n[nsched] = new
                nsched += 1
                budget -= new
                prefill_step = True
            if si[S_H0] + si[S_H1] > 0 and budget > 0 and not still_chunking:
                future = 0.0
                for q in range(si[S_NRUN]):
                    r = run[q]
                    f = maxtok[r] - gen[r]
                    if f > clip:
                        f = clip
                    future += f * ratio
                rem = float((total - si[S_USED]) * bs) - future
                blocked0 = False
                blocked1 = False
                while budget > 0 and si[S_NRUN] < max_seqs:
                    lane = _pick_lane(si, hk0, hid0, hk1, hid1, blocked0, blocked1)
                    if lane == -1:
                        break
                    r = hid0[0] if lane == 0 else hid1[0]
                    extend = prompt[r] + gen[r]
                    f = maxtok[r] - gen[r]
                    if f > clip:
                        f = clip
                    fr = f * ratio
                    fits = extend + fr <= rem
                    new = extend
                    if new > budget:
                        if pi[P_CHUNKED] == 0 and new <= pi[P_BUDGET]:
                            fits = False
                        else:
                            new = budget
                    headroom = _admission_headroom(r, pi, si, is_long, lane_blocks)
                    eb = _blocks(extend, bs)
                    if headroom < 0 or total - si[S_USED] - eb < headroom:
                        fits = False
                    if not fits and si[S_NRUN] == 0:
                        _reject_head(r, lane, si, hk0, hid0, hk1, hid1, prompt, gen, status,
                                     reason, pi, ev)
                        continue
                    if not fits:
                        if lanes:
                            if lane == 0:
                                blocked0 = True
                            else:
                                blocked1 = True
                            continue
                        break
                    # the whole re-prefill is allocated at admission
                    _admit(r, lane, eb, t, pi, si, hk0, hid0, hk1, hid1, run, held, is_long,
                           lane_blocks, resv, in_prefill, admitted_s, ev)
                    rem -= eb * bs + fr
                    sched_r[nsched] = r
                    sched_n[nsched] = new
                    nsched += 1
                    budget -= new
                    nadm += 1
                    prefill_step = True
                    if new < extend:
                        si[S_CHUNKED_REQ] = r
                        break
            if not prefill_step:
                # Decode batch: every running request decodes one token (not budgeted).
                need = 0
                for q in range(si[S_NRUN]):
                    r = run[q]
                    need += _blocks(comp[r] + 1, bs) - held[r]
                while need > total - si[S_USED] and si[S_NRUN] > 0:
                    # Retract the request with the fewest generated tokens (longest
                    # prompt, then latest arrival among ties) until the batch fits.
                    nrun = si[S_NRUN]
                    vp = 0
                    for q in range(1, nrun):
                        a = run[q]
                        b = run[vp]
                        if gen[a] < gen[b] or (gen[a] == gen[b] and (
                                prompt[a] > prompt[b] or (prompt[a] == prompt[b] and a > b))):
                            vp = q
                    v = run[vp]
                    need -= _blocks(comp[v] + 1, bs) - held[v]
                    _preempt(v, vp, pi, si, comp, held, in_prefill, npre, prio, is_long,
                             lane_blocks, resv, run, hk0, hid0, hk1, hid1, ev)
                    retracted = True
                    preempted = True
                if retracted:
                    if si[S_NRUN] > 0:
                        decoded = 0
                        max_new = 0
                        for q in range(si[S_NRUN]):
                            r = run[q]
                            decoded += gen[r]
                            max_new += maxtok[r]
                        ratio = (decoded + pi[P_RETRACT_STEPS] * si[S_NRUN]) / max_new
                        if ratio > 1.0:
                            ratio = 1.0
                else:
                    ratio = ratio - pf[F_RATIO_DECAY]
                    if ratio < pf[F_RATIO_FLOOR]:
                        ratio = pf[F_RATIO_FLOOR]
                sf[T_RATIO] = ratio
                for q in range(si[S_NRUN]):
                    r = run[q]
                    _alloc(r, _blocks(comp[r] + 1, bs) - held[r], pi, si, held, is_long)
                    sched_r[nsched] = r
                    sched_n[nsched] = 1
                    nsched += 1

        # ---- execute the step: its time from the five aggregates, then its outcomes
        if nsched == 0 and not preempted:
            si[S_PURE] = 0
            if si[S_NRUN] == 0 and si[S_H0] + si[S_H1] == 0:
                continue  # every waiting request was turned away: end or idle at the top
            if si[S_NRUN] == 0 and si[S_NEXT_ARR] < n and arrival[si[S_NEXT_ARR]] > t:
                sf[T_NOW] = arrival[si[S_NEXT_ARR]]  # only blocked requests wait: idle
                continue
            return RC_STUCK
        T = 0
        S = 0
        D = 0
        C = 0
        W = 0.0
        for q in range(nsched):
            r = sched_r[q]
            new = sched_n[q]
            before = comp[r]
            target = prompt[r] + gen[r]
            T += new
            if gen[r] >= 1 and new == 1 and before == target - 1:
                D += 1
                C += before + 1
            else:
                W += new * (before + new / 2.0)
            if before + new == target:
                S += 1
        dur = 0.0
        if nsched > 0:
            dur = _step_seconds(coef, pieces, float(T), float(S), float(D), float(C), W)
        used = si[S_USED]
        waiting = si[S_H0] + si[S_H1]
        nrun_step = si[S_NRUN]
        sf[T_KV_INT] += used * dur
        _series_add(ser, sf, t, t + dur, float(used), float(waiting), float(nrun_step))
        t_end = t + dur
        nfin = 0
        for q in range(nsched):
            r = sched_r[q]
            comp[r] += sched_n[q]
            if log:
                _event(ev, si, EV_SCHED, r, sched_n[q])
            if comp[r] == prompt[r] + gen[r]:
                gen[r] += 1
                in_prefill[r] = 0
                if r == si[S_CHUNKED_REQ]:
                    si[S_CHUNKED_REQ] = -1
                if gen[r] == 1:
                    first_s[r] = t_end
                    si[S_QPROMPT] -= prompt[r]
                if gen[r] == out[r]:
                    status[r] = 0
                    finish_s[r] = t_end
                    _release(r, pi, si, held, is_long, lane_blocks, resv)
                    si[S_DONE] += 1
                    nfin += 1
                    if log:
                        _event(ev, si, EV_FINISH, r, 0)
        if nfin > 0:
            k = 0
            for q in range(si[S_NRUN]):
                r = run[q]
                if status[r] != 0:
                    run[k] = r
                    k += 1
            si[S_NRUN] = k
        if log:
            _record(rec_i, rec_f, si, si[S_STEPS], t, dur, used, waiting, nrun_step, 1)
        sf[T_NOW] = t_end
        si[S_STEPS] += 1
        steps_here += 1
        pure = (D == nsched and nsched == nrun_step and nadm == 0 and not preempted
                and nfin == 0)
        if engine == E_SGLANG:
            pure = pure and not prefill_step and si[S_H0] + si[S_H1] == 0
        si[S_PURE] = 1 if pure else 0

    # Requests turned away after the last step still get a (zero-length) record.
    if log:
        last = rec_i[si[S_REC] - 1, R_EV_END] if si[S_REC] > 0 else 0
        if si[S_EV] > last:
            _record(rec_i, rec_f, si, si[S_STEPS], sf[T_NOW], 0.0, 0, 0, 0, 1)
    return RC_DONE
