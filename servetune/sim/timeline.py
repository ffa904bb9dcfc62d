"""A simulated run as a timeline in the Chrome trace-event format (Perfetto, chrome://tracing).

Built from the engine's step log (:mod:`servetune.sim.engine`: one record per step, or per jumped
stretch of identical decode steps with ``repeat: N``) and the trace:

- process ``engine``, thread ``steps``: one complete (``ph: X``) slice per step record,
  named ``prefill``, ``decode``, ``prefill+decode`` or ``decode xN``, with the step's
  prefill tokens, decode sequences, and admitted/preempted/finished ids in its args;
- process ``engine``, counters ``kv_blocks`` (blocks in use, total) and ``queue`` (waiting,
  running), sampled at every step start;
- process ``requests``, one thread per request: slices for its phases ``queued`` (arrival to
  admission), ``prefill`` (admission to its first sampled token; a re-prefill after a
  preemption has ``recompute: true``), ``decode`` (to its finish) and ``preempted`` (waiting
  again after a preemption until re-admitted); shed and rejected requests are instants.
  Zero-length phases (a request admitted the moment it arrives) are left out.

Phase boundaries come from replaying the step log with each request's token accounting
(the vLLM rule: a step that brings a request's computed tokens up to prompt + generated
samples one token). Timestamps are microseconds. ``window=(start_s, end_s)`` keeps only
steps, counter samples and phases that overlap the window, which keeps files of long runs
small; the replay itself still reads the whole log.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from servetune.errors import ServetuneError
from servetune.io import write_text_atomic

ENGINE_PID = 1
REQUESTS_PID = 2
STEPS_TID = 0

Window = tuple[float, float]


def parse_window(window: str) -> Window:
    """``"START:END"`` in seconds (either side may be empty: open) -> (start_s, end_s)."""
    parts = window.split(":")
    if len(parts) != 2:
        raise ServetuneError(
            f"argument `window` {window!r}: expected START:END in seconds, e.g. 60:120"
        )
    try:
        start = float(parts[0]) if parts[0].strip() else 0.0
        end = float(parts[1]) if parts[1].strip() else float("inf")
    except ValueError:
        raise ServetuneError(
            f"argument `window` {window!r}: START and END must be numbers of seconds, "
            "e.g. 60:120"
        ) from None
    if not (np.isfinite(start) and start >= 0 and end > start):
        raise ServetuneError(
            f"argument `window` {window!r}: need 0 <= START < END "
            "(seconds from the first arrival)"
        )
    return start, end


def _us(t_s: float) -> float:
    return round(t_s * 1e6, 3)


def record_end_s(rec: dict[str, Any]) -> float:
    """End time of a step record (a ``repeat`` record's ``duration_s`` spans all its steps)."""
    if "end_s" in rec:
        return float(rec["end_s"])
    return float(rec["start_s"]) + float(rec["duration_s"])


class _Phases:
    """Per-request phase state, replayed from the step log; emits finished phase slices."""

    def __init__(self, prompt_tokens: np.ndarray, window: Window, events: list[dict]) -> None:
        self.prompt = prompt_tokens
        self.window = window
        self.events = events
        self.phase: dict[int, tuple[str, float, dict]] = {}
        self.computed: dict[int, int] = {}
        self.generated: dict[int, int] = {}
        self.seen: set[int] = set()

    def open(self, rid: int, name: str, t_s: float, **args: Any) -> None:
        self.phase[rid] = (name, t_s, args)

    def close(self, rid: int, t_s: float) -> None:
        entry = self.phase.pop(rid, None)
        if entry is None:
            return
        name, start, args = entry
        lo, hi = self.window
        # Zero-length phases (admitted on arrival, finished on the first token) are noise.
        if t_s > start and start <= hi and t_s >= lo:
            self.seen.add(rid)
            self.events.append(
                {
                    "name": name,
                    "ph": "X",
                    "pid": REQUESTS_PID,
                    "tid": rid,
                    "ts": _us(start),
                    "dur": _us(max(t_s - start, 0.0)),
                    "args": {"request": rid, **args},
                }
            )

    def instant(self, rid: int, name: str, t_s: float, **args: Any) -> None:
        lo, hi = self.window
        if lo <= t_s <= hi:
            self.seen.add(rid)
            self.events.append(
                {
                    "name": name, "ph": "i", "s": "t", "pid": REQUESTS_PID, "tid": rid,
                    "ts": _us(t_s), "args": {"request": rid, **args},
                }
            )


def build_timeline(
    step_log: Iterable[dict[str, Any]],
    arrival_s: np.ndarray,
    prompt_tokens: np.ndarray,
    *,
    status: np.ndarray | None = None,
    reasons: tuple[str, ...] = (),
    reason: np.ndarray | None = None,
    window: Window | None = None,
    title: str = "servetune simulation",
) -> dict[str, Any]:
    """The trace-event document (``{"traceEvents": [...], ...}``) of one run."""
    win: Window = window if window is not None else (0.0, float("inf"))
    lo, hi = win
    events: list[dict[str, Any]] = []
    phases = _Phases(np.asarray(prompt_tokens), win, events)
    end_s = 0.0
    for rec in step_log:
        t0 = float(rec["start_s"])
        t1 = record_end_s(rec)
        end_s = max(end_s, t1)
        repeat = int(rec.get("repeat", 1) or 1)
        for rid in rec.get("shed", ()):
            phases.instant(int(rid), "shed", float(arrival_s[int(rid)]))
        for rid in rec.get("preempted", ()):
            rid = int(rid)
            phases.close(rid, t0)
            phases.computed[rid] = 0
            phases.open(rid, "preempted", t0)
        for rid in rec.get("admitted", ()):
            rid = int(rid)
            again = rid in phases.phase and phases.phase[rid][0] == "preempted"
            if again:
                phases.close(rid, t0)
            else:
                phases.open(rid, "queued", float(arrival_s[rid]))
                phases.close(rid, t0)
            phases.open(rid, "prefill", t0, **({"recompute": True} if again else {}))
        prefill_tokens = 0
        decode_seqs = 0
        for rid, new_tokens in rec.get("scheduled", ()):
            rid, new_tokens = int(rid), int(new_tokens)
            computed = phases.computed.get(rid, 0)
            generated = phases.generated.get(rid, 0)
            target = int(phases.prompt[rid]) + generated
            if new_tokens == 1 and generated >= 1 and computed == target - 1:
                decode_seqs += 1
                phases.computed[rid] = computed + repeat
                phases.generated[rid] = generated + repeat
                continue
            prefill_tokens += new_tokens * repeat
            computed += new_tokens * repeat
            phases.computed[rid] = computed
            if computed >= target:
                phases.generated[rid] = generated + 1
                if rid in phases.phase and phases.phase[rid][0] == "prefill":
                    phases.close(rid, t1)
                    phases.open(rid, "decode", t1)
        for rid in rec.get("finished", ()):
            phases.close(int(rid), t1)
        if t0 <= hi and t1 >= lo:
            if repeat > 1:
                name = f"decode x{repeat}"
            elif prefill_tokens and decode_seqs:
                name = "prefill+decode"
            elif prefill_tokens:
                name = "prefill"
            else:
                name = "decode"
            args = {
                "step": rec.get("step"),
                "prefill_tokens": prefill_tokens,
                "decode_seqs": decode_seqs,
                "scheduled_requests": len(rec.get("scheduled", ())),
            }
            if repeat > 1:
                args["repeat"] = repeat
            for key in ("admitted", "preempted", "finished", "shed"):
                if rec.get(key):
                    args[key] = [int(r) for r in rec[key]]
            events.append(
                {
                    "name": name, "ph": "X", "pid": ENGINE_PID, "tid": STEPS_TID,
                    "ts": _us(t0), "dur": _us(t1 - t0), "args": args,
                }
            )
            counters = (
                ("kv_blocks", {"used": rec.get("kv_blocks_used"),
                               "total": rec.get("kv_blocks_total")}),
                ("queue", {"waiting": rec.get("waiting"), "running": rec.get("running")}),
            )
            for cname, cargs in counters:
                if any(v is not None for v in cargs.values()):
                    events.append(
                        {
                            "name": cname, "ph": "C", "pid": ENGINE_PID, "ts": _us(t0),
                            "args": {k: v for k, v in cargs.items() if v is not None},
                        }
                    )
    for rid in sorted(phases.phase):
        phases.close(rid, end_s)
    if status is not None:
        reason_code = np.asarray(reason) if reason is not None else None
        for rid in np.flatnonzero(np.asarray(status) == 2).tolist():
            code = int(reason_code[rid]) if reason_code is not None else 0
            text = reasons[code] if 0 < code < len(reasons) else ""
            phases.instant(rid, "rejected", float(arrival_s[rid]), reason=text)
    meta: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": ENGINE_PID, "args": {"name": "engine"}},
        {"name": "process_sort_index", "ph": "M", "pid": ENGINE_PID, "args": {"sort_index": 0}},
        {"name": "thread_name", "ph": "M", "pid": ENGINE_PID, "tid": STEPS_TID,
         "args": {"name": "steps"}},
        {"name": "process_name", "ph": "M", "pid": REQUESTS_PID, "args": {"name": "requests"}},
        {"name": "process_sort_index", "ph": "M", "pid": REQUESTS_PID,
         "args": {"sort_index": 1}},
    ]
    for rid in sorted(phases.seen):
        meta.append(
            {"name": "thread_name", "ph": "M", "pid": REQUESTS_PID, "tid": rid,
             "args": {"name": f"request {rid}"}}
        )
        meta.append(
            {"name": "thread_sort_index", "ph": "M", "pid": REQUESTS_PID, "tid": rid,
             "args": {"sort_index": rid}}
        )
    other = {"title": title}
    if window is not None:
        other["window_s"] = [lo, hi if np.isfinite(hi) else None]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": other}


def timeline_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False) + "\n"


def write_timeline(path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    """Write the trace-event document atomically."""
    write_text_atomic(path, timeline_json(doc))
