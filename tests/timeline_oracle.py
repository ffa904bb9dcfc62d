"""The timeline replay as servetune wrote it before issue 14, kept as a test oracle.

It replays a whole step log (dicts) in Python; :mod:`servetune.sim.timeline` now replays it
compiled, a chunk at a time, while the engine runs. Its output must stay byte-identical to
this (``tests/test_timeline_window.py``). Verbatim apart from this docstring and imports.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from servetune.sim.timeline import ENGINE_PID, REQUESTS_PID, STEPS_TID, Window, record_end_s


def _us(t_s: float) -> float:
    return round(t_s * 1e6, 3)


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
