"""Digests of engine runs on the shipped example trace, for the per-class lanes' "nothing
changed" check (not a test module).

``tests/sim_golden/lanes_baseline.json`` holds the digests that the engine gave before the
lanes were generalized (commit 27d17ce, two lanes at most); ``test_sim_class_lanes.py``
asserts today's code gives the same. Only APIs older than the change are used here, so
that the file can be regenerated from that commit's code:

    cd /tmp && PYTHONPATH=/path/to/old/checkout python /path/to/tests/lanes_baseline.py OUT
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from servetune.profiles.schema import Profile
from servetune.schemas.base import load_document
from servetune.schemas.policy import Policy
from servetune.sim.engine import run_engine
from servetune.workloads.formats import load_trace

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "configs/examples/azure-conv-synthetic.csv"
PROFILE = REPO / "gpu_profiles/h200-llama-3.1-8b.yaml"
KV_BLOCKS = 4000  # 64k tokens: a queue forms, requests are preempted and lanes bind
SPEEDUP = 5.0  # arrivals five times as fast as the trace's: overloaded, a queue forms

PLAIN: dict[str, Any] = {"batching": {"max_num_seqs": 64, "max_num_batched_tokens": 4096}}
LONG_LANE: dict[str, Any] = {
    "batching": {"max_num_seqs": 64, "max_num_batched_tokens": 4096,
                 "long_prefill_token_threshold": 1024},
    "admission": {"kv_watermark": 0.01, "max_queued_requests": 400},
    "long_requests": {"threshold_tokens": 2500, "reserved_seqs": 2,
                      "reserved_kv_fraction": 0.15, "max_seqs": 8, "max_kv_fraction": 0.5},
}
PRIORITY_LANE: dict[str, Any] = {
    "scheduling": "priority",
    "batching": {"max_num_seqs": 32, "max_num_batched_tokens": 2048},
    "long_requests": {"threshold_tokens": 2000, "reserved_kv_fraction": 0.2,
                      "max_kv_fraction": 0.3},
    "classes": {"default": {"priority": 1}},
}
POLICIES = {"plain": PLAIN, "long_lane": LONG_LANE, "priority_lane": PRIORITY_LANE}
ENGINES = ("vllm", "sglang", "trtllm", "tgi")
# (policy, engine, step log): every pair without a log, a few with one
CASES = [(name, engine, False) for name in POLICIES for engine in ENGINES] + [
    ("long_lane", "vllm", True), ("long_lane", "trtllm", True), ("priority_lane", "sglang", True),
]


def example_trace() -> Any:
    trace = load_trace(TRACE)
    return replace(trace, arrival_s=trace.arrival_s / SPEEDUP)


def digest(out: Any) -> str:
    """sha256 over a run's per-request arrays, totals, series and step log."""
    h = hashlib.sha256()
    for name in ("admitted_s", "first_token_s", "finish_s", "preemptions", "status",
                 "reason", "generated", "hit_tokens"):
        value = getattr(out, name)
        h.update(name.encode())
        if value is not None:
            h.update(np.ascontiguousarray(value).tobytes())
    totals = [out.steps, out.kv_blocks_total, out.kv_util_mean, out.kv_util_peak,
              out.sim_end_s, out.jumps, out.kv_blocks_in_use_end, out.cache_evictions]
    h.update(repr(totals).encode())
    for key in sorted(out.series):
        h.update(key.encode())
        h.update(np.ascontiguousarray(out.series[key]).tobytes())
    if out.step_log is not None:
        h.update(json.dumps(out.step_log, sort_keys=True).encode())
    return h.hexdigest()


def run_case(trace: Any, profile: Profile, policy_name: str, engine: str,
             step_log: bool) -> Any:
    # GPU time only, as every engine's host cost was when the baseline was recorded (the
    # vLLM host term came later): the check is about the lanes, not step times
    step_time = profile.step_time.model_copy(update={"host_s_per_step": 0.0,
                                                     "host_s_per_seq": 0.0})
    return run_engine(trace, Policy(**POLICIES[policy_name]), KV_BLOCKS, profile.block_size,
                      step_time, engine=engine, step_log=step_log)


def case_key(policy_name: str, engine: str, step_log: bool) -> str:
    return f"{policy_name}/{engine}" + ("/log" if step_log else "")


def digests() -> dict[str, str]:
    trace = example_trace()
    profile = load_document(PROFILE, Profile)
    return {case_key(*case): digest(run_case(trace, profile, *case)) for case in CASES}


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(digests(), indent=1, sort_keys=True) + "\n")
