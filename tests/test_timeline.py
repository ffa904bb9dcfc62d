"""The Perfetto/Chrome trace-event timeline, from hand-written step logs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from servetune.errors import ServetuneError
from servetune.sim.timeline import build_timeline, parse_window, timeline_json

# r0: prompt 4, 3 output tokens, arrives at 0; r1: prompt 2, 2 output tokens, arrives at 0.05.
ARRIVAL = np.array([0.0, 0.05])
PROMPT = np.array([4, 2])


def step(k, start, scheduled, dur=0.1, **kw):
    rec = {
        "step": k, "start_s": start, "duration_s": dur, "scheduled": scheduled,
        "preempted": [], "finished": [], "admitted": [], "shed": [],
        "kv_blocks_used": 1, "kv_blocks_total": 8, "waiting": 0, "running": 1,
    }
    rec.update(kw)
    return rec


LOG = [
    step(0, 0.0, [[0, 4]], admitted=[0]),
    step(1, 0.1, [[0, 1], [1, 2]], admitted=[1], running=2),
    step(2, 0.2, [[0, 1], [1, 1]], finished=[0, 1], running=2, kv_blocks_used=2),
]


def phases(doc, pid=2):
    out = {}
    for e in doc["traceEvents"]:
        if e["ph"] == "X" and e["pid"] == pid:
            out.setdefault(e["tid"], []).append(
                (e["name"], round(e["ts"] / 1e6, 9), round((e["ts"] + e["dur"]) / 1e6, 9))
            )
    return out


def steps(doc):
    return [e for e in doc["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]


def test_request_phases_and_step_args_worked_by_hand():
    doc = build_timeline(LOG, ARRIVAL, PROMPT)
    assert phases(doc) == {
        0: [("prefill", 0.0, 0.1), ("decode", 0.1, 0.3)],  # zero-length queued left out
        1: [("queued", 0.05, 0.1), ("prefill", 0.1, 0.2), ("decode", 0.2, 0.3)],
    }
    s = steps(doc)
    assert [e["name"] for e in s] == ["prefill", "prefill+decode", "decode"]
    assert [(e["args"]["prefill_tokens"], e["args"]["decode_seqs"]) for e in s] == [
        (4, 0), (2, 1), (0, 2)
    ]
    assert s[0]["ts"] == 0.0 and s[0]["dur"] == pytest.approx(1e5)
    assert s[2]["args"]["finished"] == [0, 1]
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    assert [e["args"] for e in counters if e["name"] == "kv_blocks"] == [
        {"used": 1, "total": 8}, {"used": 1, "total": 8}, {"used": 2, "total": 8}
    ]
    assert [e["args"]["running"] for e in counters if e["name"] == "queue"] == [1, 2, 2]
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 2}
    assert names == {0: "request 0", 1: "request 1"}


def test_preemption_and_recompute_phases():
    # r1 samples its first token at the end of step 1, is preempted at step 2 and
    # re-prefilled at step 3: it recomputes prompt 2 + 1 generated token, then samples its
    # second (last) token and finishes. Its zero-length decode phases are left out.
    log = [
        step(0, 0.0, [[0, 4]], admitted=[0]),
        step(1, 0.1, [[0, 1], [1, 2]], admitted=[1]),
        step(2, 0.2, [[0, 1]], preempted=[1], finished=[0]),
        step(3, 0.3, [[1, 3]], admitted=[1], finished=[1]),
    ]
    doc = build_timeline(log, ARRIVAL, PROMPT)
    assert phases(doc)[1] == [
        ("queued", 0.05, 0.1), ("prefill", 0.1, 0.2), ("preempted", 0.2, 0.3),
        ("prefill", 0.3, 0.4),
    ]
    recompute = [e for e in doc["traceEvents"] if e.get("tid") == 1 and e["ph"] == "X"][-1]
    assert recompute["args"]["recompute"] is True
    assert steps(doc)[2]["args"]["preempted"] == [1]


def test_repeat_record_is_one_slice_spanning_its_steps():
    log = [
        step(0, 0.0, [[0, 4]], admitted=[0]),
        step(1, 0.1, [[0, 1]], dur=0.2, repeat=2, finished=[0]),
    ]
    doc = build_timeline(log, ARRIVAL[:1], PROMPT[:1])
    s = steps(doc)
    assert s[1]["name"] == "decode x2" and s[1]["args"]["repeat"] == 2
    assert s[1]["args"]["decode_seqs"] == 1
    assert phases(doc)[0][-1] == ("decode", 0.1, 0.3)


def test_shed_and_rejected_requests_are_instants():
    log = [step(0, 0.0, [[0, 4]], admitted=[0], shed=[1], finished=[])]
    doc = build_timeline(log, np.array([0.0, 0.05, 0.07]), np.array([4, 2, 9]),
                         status=np.array([0, 1, 2]), reason=np.array([0, 1, 2]),
                         reasons=("", "queue full", "prompt larger than KV pool"))
    instants = {(e["tid"], e["name"]) for e in doc["traceEvents"] if e["ph"] == "i"}
    assert instants == {(1, "shed"), (2, "rejected")}
    rejected = [e for e in doc["traceEvents"] if e["ph"] == "i" and e["tid"] == 2][0]
    assert rejected["args"]["reason"] == "prompt larger than KV pool"


def test_window_keeps_only_overlapping_events():
    doc = build_timeline(LOG, ARRIVAL, PROMPT, window=(0.21, 0.25))
    assert [e["args"]["step"] for e in steps(doc)] == [2]
    assert phases(doc) == {0: [("decode", 0.1, 0.3)], 1: [("decode", 0.2, 0.3)]}
    assert doc["otherData"]["window_s"] == [0.21, 0.25]
    full = timeline_json(build_timeline(LOG, ARRIVAL, PROMPT))
    assert len(timeline_json(doc)) < len(full)


def test_json_is_valid_and_deterministic():
    a = timeline_json(build_timeline(LOG, ARRIVAL, PROMPT))
    b = timeline_json(build_timeline(LOG, ARRIVAL, PROMPT))
    assert a == b
    doc = json.loads(a)
    for e in doc["traceEvents"]:
        assert {"name", "ph", "pid"} <= e.keys()
        if e["ph"] in ("X", "C", "i"):
            assert e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0


@pytest.mark.parametrize(
    "text,expected",
    [("60:120", (60.0, 120.0)), ("0.5:1", (0.5, 1.0)), (":10", (0.0, 10.0)),
     ("5:", (5.0, float("inf")))],
)
def test_parse_window(text, expected):
    assert parse_window(text) == expected


@pytest.mark.parametrize("text", ["10", "a:b", "5:5", "9:3", "-1:4", "1:2:3", "nan:4"])
def test_parse_window_rejects(text):
    with pytest.raises(ServetuneError, match="argument `window`"):
        parse_window(text)
