"""Summary statistics of a trace: request count, span, mean rate, burstiness, lengths.

Definitions: mean arrival rate = (rows - 1) / (last arrival - first arrival); inter-arrival
CV = std / mean of the gaps (population std); percentiles use numpy's default linear
interpolation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from servetune.workloads.trace import Trace

PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0))


def length_summary(tokens: np.ndarray) -> dict[str, float]:
    """Mean, p50, p90, p99 and max of a token-length column."""
    x = np.asarray(tokens, dtype=np.float64)
    if len(x) == 0:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    pct = np.percentile(x, [p for _, p in PERCENTILES])
    out = {"mean": float(x.mean())}
    out.update({name: float(v) for (name, _), v in zip(PERCENTILES, pct, strict=True)})
    out["max"] = float(x.max())
    return out


def gap_cv(gaps: np.ndarray) -> float:
    """Coefficient of variation (population std / mean) of positive-mean gaps, computed on
    the gaps in units of their mean: scale-free, so huge or tiny gaps cannot overflow or
    underflow the squares."""
    return float((gaps / float(gaps.mean())).std())


def rate_and_cv(arrival_s: np.ndarray) -> tuple[float, float]:
    """Mean rate (rows-1)/span and the inter-arrival CV; (0, 0) with under two rows or no span."""
    n = len(arrival_s)
    if n < 2:
        return 0.0, 0.0
    span = float(arrival_s[-1] - arrival_s[0])
    if span <= 0:
        return 0.0, 0.0
    return (n - 1) / span, gap_cv(np.diff(arrival_s))


def trace_stats(trace: Trace) -> dict[str, Any]:
    """The ``trace stats --json`` object."""
    rate, cv = rate_and_cv(trace.arrival_s)
    return {
        "requests": int(len(trace)),
        "duration_s": float(trace.duration_s),
        "rate_per_s": rate,
        "interarrival_cv": cv,
        "prompt_tokens": length_summary(trace.prompt_tokens),
        "output_tokens": length_summary(trace.output_tokens),
    }


def per_class_stats(trace: Trace) -> dict[str, dict[str, Any]]:
    """``trace_stats`` of each class's sub-trace, by class name (classes with rows only)."""
    ids = trace.class_ids()
    out: dict[str, dict[str, Any]] = {}
    for k, name in enumerate(trace.class_names):
        idx = np.flatnonzero(ids == k)
        if len(idx):
            out[name] = trace_stats(trace.take(idx))
    return out
