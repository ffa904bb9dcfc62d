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
small. The replay reads the whole log, but a chunk at a time (:class:`TimelineBuilder`,
fed by the engine while it runs): a window's timeline needs memory for the window, plus a
few numbers per request, however long the run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from servetune.errors import ServetuneError
from servetune.io import write_text_atomic

ENGINE_PID = 1
REQUESTS_PID = 2
STEPS_TID = 0
# A timeline holds its events in memory (about 0.8 KB each) until it is written, and a
# file of more is more than Perfetto opens comfortably (~110 bytes an event): past this,
# building one fails and asks for a shorter window.
MAX_TIMELINE_EVENTS = 2_000_000

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


@dataclass(frozen=True)
class StepChunk:
    """Consecutive records of a step log as columns, the replay's input: record ``i`` runs
    from ``start_s[i]`` to ``end_s[i]`` (:func:`record_end_s`) over ``repeat[i]`` steps,
    and its events (kinds: the kernel's ``EV_*``) end at ``events_end[i]`` in the event
    columns. ``records(i, j)`` gives records ``i..j-1`` as step-log dicts (the engine
    builds them from its buffer only when asked: the timeline asks only for the records
    its window shows). A chunk from the engine is valid only while it is being added."""

    start_s: np.ndarray  # float64
    end_s: np.ndarray  # float64
    repeat: np.ndarray  # int64
    events_end: np.ndarray  # int64
    event_kind: np.ndarray  # int64
    event_req: np.ndarray  # int64
    event_value: np.ndarray  # int64, tokens granted (scheduled events)
    records: Callable[[int, int], Sequence[dict[str, Any]]]


def chunk_of_records(step_log: Iterable[dict[str, Any]]) -> StepChunk:
    """A step log given as dicts (``run_engine(..., step_log=True)``), as one chunk."""
    # lazy: the kernel imports numba, which writing a timeline from arrays does not need
    from servetune.sim._kernel import EV_ADMIT, EV_FINISH, EV_PREEMPT, EV_SCHED, EV_SHED

    recs = list(step_log)
    kinds: list[int] = []
    reqs: list[int] = []
    values: list[int] = []
    ends: list[int] = []
    for rec in recs:
        cached = {int(rid): int(tokens) for rid, tokens in rec.get("cached_tokens", ())}
        for kind, key in ((EV_SHED, "shed"), (EV_PREEMPT, "preempted"), (EV_ADMIT, "admitted"),
                          (EV_FINISH, "finished")):
            for rid in rec.get(key, ()):
                kinds.append(kind)
                reqs.append(int(rid))
                values.append(cached.get(int(rid), 0) if kind == EV_ADMIT else 0)
        for rid, new_tokens in rec.get("scheduled", ()):
            kinds.append(EV_SCHED)
            reqs.append(int(rid))
            values.append(int(new_tokens))
        ends.append(len(kinds))

    def ints(values: list[int]) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    return StepChunk(
        start_s=np.array([float(rec["start_s"]) for rec in recs], dtype=np.float64),
        end_s=np.array([record_end_s(rec) for rec in recs], dtype=np.float64),
        repeat=ints([int(rec.get("repeat", 1) or 1) for rec in recs]),
        events_end=ints(ends), event_kind=ints(kinds), event_req=ints(reqs),
        event_value=ints(values), records=lambda i, j: recs[i:j],
    )


class TimelineBuilder:
    """The timeline of one run, built from its step log a chunk at a time (while the
    engine runs, or from a whole log): what it holds is a few numbers per request and the
    events the window shows, so a window's timeline of a long run needs no more memory
    than the window's. The replay itself is compiled (:mod:`servetune.sim._replay`)."""

    def __init__(self, arrival_s: np.ndarray, prompt_tokens: np.ndarray,
                 window: Window | None = None) -> None:
        from servetune.sim import _replay  # lazy: numba

        self._replay = _replay
        self.arrival = np.ascontiguousarray(arrival_s, dtype=np.float64)
        self.prompt = np.ascontiguousarray(prompt_tokens, dtype=np.int64)
        n = len(self.arrival)
        self.phase = np.zeros(n, dtype=np.int8)
        self.phase_s = np.zeros(n, dtype=np.float64)
        self.computed = np.zeros(n, dtype=np.int64)
        self.generated = np.zeros(n, dtype=np.int64)
        self.clock = np.zeros(1, dtype=np.float64)  # the latest record end
        self.window = window
        self.lo, self.hi = window if window is not None else (0.0, float("inf"))
        self.events: list[dict[str, Any]] = []
        self.seen: set[int] = set()
        self.doc: dict[str, Any] | None = None

    def add(self, chunk: StepChunk) -> None:
        """Replay the chunk's records (the next ones of the log)."""
        rows = len(chunk.event_kind) + len(chunk.start_s)
        ints = np.empty((rows, 5), dtype=np.int64)
        times = np.empty((rows, 2), dtype=np.float64)
        k = self._replay.replay(
            chunk.start_s, chunk.end_s, chunk.repeat, chunk.events_end, chunk.event_kind,
            chunk.event_req, chunk.event_value, self.arrival, self.prompt, self.phase,
            self.phase_s, self.computed, self.generated, self.clock, self.lo, self.hi,
            ints, times,
        )
        self._append(ints[:k], times[:k], chunk)

    def _append(self, ints: np.ndarray, times: np.ndarray, chunk: StepChunk | None) -> None:
        """Format the replay's rows as trace events."""
        rows = ints.tolist()
        steps = [row[2] for row in rows if row[0] == self._replay.OUT_STEP]
        first = steps[0] if steps else 0
        records = chunk.records(first, steps[-1] + 1) if steps and chunk is not None else ()
        for (kind, rid, a, b, c), (t0, t1) in zip(rows, times.tolist(), strict=True):
            if kind == self._replay.OUT_CLOSE:
                self.seen.add(rid)
                extra = {"recompute": True} if a == self._replay.PHASE_REPREFILL else {}
                self.events.append(
                    {
                        "name": self._replay.PHASE_NAMES[a],
                        "ph": "X",
                        "pid": REQUESTS_PID,
                        "tid": rid,
                        "ts": _us(t0),
                        "dur": _us(max(t1 - t0, 0.0)),
                        "args": {"request": rid, **extra},
                    }
                )
            elif kind == self._replay.OUT_SHED:
                self._instant(rid, "shed", t0)
            else:
                self._step(records[a - first], t0, t1, b, c)
        if len(self.events) > MAX_TIMELINE_EVENTS:
            raise ServetuneError(
                f"the timeline would hold more than {MAX_TIMELINE_EVENTS:,} events (a file "
                "too large to open); keep a shorter part of the run with --timeline-window "
                "START:END (seconds)"
            )

    def _instant(self, rid: int, name: str, t_s: float, **args: Any) -> None:
        self.seen.add(rid)
        self.events.append(
            {
                "name": name, "ph": "i", "s": "t", "pid": REQUESTS_PID, "tid": rid,
                "ts": _us(t_s), "args": {"request": rid, **args},
            }
        )

    def _step(self, rec: dict[str, Any], t0: float, t1: float, prefill_tokens: int,
              decode_seqs: int) -> None:
        """One step record's slice and its counter samples."""
        repeat = int(rec.get("repeat", 1) or 1)
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
        self.events.append(
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
                self.events.append(
                    {
                        "name": cname, "ph": "C", "pid": ENGINE_PID, "ts": _us(t0),
                        "args": {k: v for k, v in cargs.items() if v is not None},
                    }
                )

    def finish(
        self,
        *,
        status: np.ndarray | None = None,
        reasons: tuple[str, ...] = (),
        reason: np.ndarray | None = None,
        title: str = "servetune simulation",
    ) -> dict[str, Any]:
        """The trace-event document (``{"traceEvents": [...], ...}``), once every record
        was added: phases still open end at the last record's end; rejected requests
        (``status`` 2) are instants at their arrival."""
        if self.doc is not None:
            return self.doc
        lo, hi = self.lo, self.hi
        rows = int(np.count_nonzero(self.phase))
        ints = np.empty((rows, 5), dtype=np.int64)
        times = np.empty((rows, 2), dtype=np.float64)
        k = self._replay.close_all(self.phase, self.phase_s, float(self.clock[0]), lo, hi,
                                   ints, times)
        self._append(ints[:k], times[:k], None)
        if status is not None:
            reason_code = np.asarray(reason) if reason is not None else None
            shown = (np.asarray(status) == 2) & (self.arrival >= lo) & (self.arrival <= hi)
            for rid in np.flatnonzero(shown).tolist():
                code = int(reason_code[rid]) if reason_code is not None else 0
                text = reasons[code] if 0 < code < len(reasons) else ""
                self._instant(rid, "rejected", float(self.arrival[rid]), reason=text)
        meta: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": ENGINE_PID, "args": {"name": "engine"}},
            {"name": "process_sort_index", "ph": "M", "pid": ENGINE_PID,
             "args": {"sort_index": 0}},
            {"name": "thread_name", "ph": "M", "pid": ENGINE_PID, "tid": STEPS_TID,
             "args": {"name": "steps"}},
            {"name": "process_name", "ph": "M", "pid": REQUESTS_PID,
             "args": {"name": "requests"}},
            {"name": "process_sort_index", "ph": "M", "pid": REQUESTS_PID,
             "args": {"sort_index": 1}},
        ]
        for rid in sorted(self.seen):
            meta.append(
                {"name": "thread_name", "ph": "M", "pid": REQUESTS_PID, "tid": rid,
                 "args": {"name": f"request {rid}"}}
            )
            meta.append(
                {"name": "thread_sort_index", "ph": "M", "pid": REQUESTS_PID, "tid": rid,
                 "args": {"sort_index": rid}}
            )
        other: dict[str, Any] = {"title": title}
        if self.window is not None:
            other["window_s"] = [lo, hi if np.isfinite(hi) else None]
        self.doc = {"traceEvents": meta + self.events, "displayTimeUnit": "ms",
                    "otherData": other}
        return self.doc


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
    """The trace-event document (``{"traceEvents": [...], ...}``) of one run, from its whole
    step log (:class:`TimelineBuilder` builds the same while the engine runs)."""
    builder = TimelineBuilder(arrival_s, prompt_tokens, window)
    builder.add(chunk_of_records(step_log))
    return builder.finish(status=status, reasons=reasons, reason=reason, title=title)


def timeline_json(doc: dict[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False) + "\n"


def write_timeline(path: str | os.PathLike[str], doc: dict[str, Any]) -> None:
    """Write the trace-event document atomically."""
    write_text_atomic(path, timeline_json(doc))
