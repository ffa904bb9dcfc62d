"""The timeline's replay of a step log, compiled: request phases from step records.

:mod:`servetune.sim.timeline` feeds it step-log records as columns, a chunk at a time
(while the engine runs, or from a whole log), and formats what it emits. It walks every
record, whatever the window, because a request's phase in the window may have begun long
before it; but it keeps only numbers per request (phase, phase start, computed and
generated tokens) and emits only what the window shows, so memory does not grow with the
run. Within a record it reads the events by kind in this order: shed, preempted,
admitted, scheduled, finished (the order of a step record's lists).

Emitted rows, in output order: ``ints[k] = (kind, request, a, b, c)`` and
``times[k] = (t0, t1)``:

- ``OUT_CLOSE``: the request's phase ``a`` (a ``PHASE_*``) ran from ``t0`` to ``t1``;
- ``OUT_SHED``: the request was turned away at its arrival ``t0``;
- ``OUT_STEP``: record ``a`` of the chunk (``t0`` to ``t1``) overlaps the window; it
  granted ``b`` prefill tokens (times its ``repeat``) and ``c`` decode rows.
"""

from __future__ import annotations

from servetune.sim._kernel import EV_ADMIT, EV_FINISH, EV_PREEMPT, EV_SCHED, EV_SHED
from servetune.sim.kernel_cache import cached_jit

PHASE_NONE = 0
PHASE_QUEUED = 1
PHASE_PREFILL = 2
PHASE_REPREFILL = 3  # a prefill again after a preemption ("recompute")
PHASE_DECODE = 4
PHASE_PREEMPTED = 5
PHASE_NAMES = ("", "queued", "prefill", "prefill", "decode", "preempted")

OUT_CLOSE = 0
OUT_SHED = 1
OUT_STEP = 2

jit = cached_jit()  # cached per user, keyed by the sources' hash


@jit
def _emit(ints, times, k, kind, r, t0, t1, a, b, c):
    ints[k, 0] = kind
    ints[k, 1] = r
    ints[k, 2] = a
    ints[k, 3] = b
    ints[k, 4] = c
    times[k, 0] = t0
    times[k, 1] = t1
    return k + 1


@jit
def _shown(start, t, lo, hi):
    """A phase from ``start`` to ``t`` is shown: not zero-length, and it overlaps the window."""
    return t > start and start <= hi and t >= lo


@jit
def _close(phase, phase_s, r, t, lo, hi, ints, times, k):
    """End request ``r``'s phase (if any) at ``t``; returns the rows emitted so far."""
    kind = phase[r]
    if kind == PHASE_NONE:
        return k
    phase[r] = PHASE_NONE
    start = phase_s[r]
    if _shown(start, t, lo, hi):
        k = _emit(ints, times, k, OUT_CLOSE, r, start, t, kind, 0, 0)
    return k


@jit
def replay(start_s, end_s, repeat, events_end, ev_kind, ev_req, ev_value, arrival, prompt,
           phase, phase_s, computed, generated, clock, lo, hi, ints, times):
    """Replay records ``0..len(start_s)-1`` (record ``i``'s events end at ``events_end[i]``)
    on the per-request state (``phase``, ``phase_s``, ``computed``, ``generated``) and
    ``clock[0]`` (the latest record end); returns the number of rows emitted (at most one
    per event and one per record)."""
    k = 0
    e0 = 0
    for i in range(start_s.shape[0]):
        t0 = start_s[i]
        t1 = end_s[i]
        rep = repeat[i]
        e1 = events_end[i]
        if t1 > clock[0]:
            clock[0] = t1
        for e in range(e0, e1):
            if ev_kind[e] == EV_SHED:
                r = ev_req[e]
                t = arrival[r]
                if lo <= t <= hi:
                    k = _emit(ints, times, k, OUT_SHED, r, t, t, 0, 0, 0)
        for e in range(e0, e1):
            if ev_kind[e] == EV_PREEMPT:
                r = ev_req[e]
                k = _close(phase, phase_s, r, t0, lo, hi, ints, times, k)
                computed[r] = 0
                phase[r] = PHASE_PREEMPTED
                phase_s[r] = t0
        for e in range(e0, e1):
            if ev_kind[e] == EV_ADMIT:
                r = ev_req[e]
                again = phase[r] == PHASE_PREEMPTED
                if again:
                    k = _close(phase, phase_s, r, t0, lo, hi, ints, times, k)
                else:  # queued from its arrival until now
                    phase[r] = PHASE_QUEUED
                    phase_s[r] = arrival[r]
                    k = _close(phase, phase_s, r, t0, lo, hi, ints, times, k)
                phase[r] = PHASE_REPREFILL if again else PHASE_PREFILL
                phase_s[r] = t0
                computed[r] = ev_value[e]  # tokens in KV at admission (prefix cache, P/D)
        prefill_tokens = 0
        decode_rows = 0
        for e in range(e0, e1):
            if ev_kind[e] != EV_SCHED:
                continue
            r = ev_req[e]
            new = ev_value[e]
            done = computed[r]
            gen = generated[r]
            target = prompt[r] + gen
            if new == 1 and gen >= 1 and done == target - 1:
                decode_rows += 1
                computed[r] = done + rep
                generated[r] = gen + rep
                continue
            prefill_tokens += new * rep
            done += new * rep
            computed[r] = done
            if done >= target:  # the step that completes the (re-)prefill samples a token
                generated[r] = gen + 1
                if phase[r] == PHASE_PREFILL or phase[r] == PHASE_REPREFILL:
                    k = _close(phase, phase_s, r, t1, lo, hi, ints, times, k)
                    phase[r] = PHASE_DECODE
                    phase_s[r] = t1
        for e in range(e0, e1):
            if ev_kind[e] == EV_FINISH:
                k = _close(phase, phase_s, ev_req[e], t1, lo, hi, ints, times, k)
        if t0 <= hi and t1 >= lo:
            k = _emit(ints, times, k, OUT_STEP, -1, t0, t1, i, prefill_tokens, decode_rows)
        e0 = e1
    return k


@jit
def close_all(phase, phase_s, t, lo, hi, ints, times):
    """End every open phase at ``t``, in request order; returns the rows emitted."""
    k = 0
    for r in range(phase.shape[0]):
        k = _close(phase, phase_s, r, t, lo, hi, ints, times, k)
    return k
