"""Helpers shared by the engine and replay tests (not a test module)."""

from __future__ import annotations

import numpy as np

from servetune.profiles.steptime import StepTimeModel
from servetune.schemas.policy import Policy
from servetune.sim.engine import EngineOutput, expand_repeats, run_engine
from servetune.workloads.trace import Trace, from_arrays

ONE_SECOND = StepTimeModel(constant_s=1.0)
PER_REQUEST = ("admitted_s", "first_token_s", "finish_s", "preemptions", "status", "reason",
               "generated")


def trace_of(rows: list[tuple], **columns: object) -> Trace:
    """rows: (arrival_s, prompt_tokens, output_tokens) in file order."""
    arr = np.array([r[0] for r in rows], dtype=float)
    return from_arrays(arr, np.array([r[1] for r in rows]), np.array([r[2] for r in rows]),
                       **columns)


def policy(**sections: dict) -> Policy:
    """A policy for the hand-worked cases, which work the rules without prefix caching
    (a re-prefill recomputes everything) unless a case asks for it; the cache's own cases
    are in test_prefix_cache.py."""
    sections.setdefault("caching", {"enable_prefix_caching": False})
    return Policy(**sections)


def same_records(a: EngineOutput, b: EngineOutput) -> None:
    for name in PER_REQUEST:
        x, y = getattr(a, name), getattr(b, name)
        assert np.array_equal(x, y, equal_nan=True), (name, x, y)
    assert (a.steps, a.sim_end_s, a.kv_util_peak) == (b.steps, b.sim_end_s, b.kv_util_peak)
    assert a.kv_util_mean == b.kv_util_mean


def both_modes(trace: Trace, pol: Policy, kv_blocks: int, block_size: int,
               step_time: StepTimeModel = ONE_SECOND, engine: str = "vllm",
               ) -> tuple[EngineOutput, list[dict]]:
    """Run fast and reference mode with step logs, check they agree, return the
    reference output and its step log."""
    ref = run_engine(trace, pol, kv_blocks, block_size, step_time, engine=engine,
                     reference=True, step_log=True)
    fast = run_engine(trace, pol, kv_blocks, block_size, step_time, engine=engine,
                      step_log=True)
    same_records(fast, ref)
    assert expand_repeats(fast.step_log) == ref.step_log
    assert all("repeat" not in rec for rec in ref.step_log)
    return ref, ref.step_log


def compact(log: list[dict]) -> list[tuple]:
    """(start_s, scheduled, preempted, admitted, finished, kv_used, waiting, running)."""
    return [
        (rec["start_s"], [tuple(x) for x in rec["scheduled"]], rec["preempted"],
         rec["admitted"], rec["finished"], rec["kv_blocks_used"], rec["waiting"],
         rec["running"])
        for rec in log
    ]
