"""Request-level metrics of a simulated run, and SLO judgement.

Definitions are the ones serving benchmarks report (``vllm bench serve``, MLPerf Inference):

- TTFT = first token time - arrival;
- end-to-end (e2e) = finish time - arrival;
- TPOT of a request = (e2e - TTFT) / (output tokens - 1), undefined for a 1-token output
  (such requests are left out of TPOT statistics and have no TPOT limit to meet);
- SLO attainment = share of requests meeting every limit of their class; shed and rejected
  requests count as misses;
- throughput = completed output tokens (or requests) per second of the run, the run lasting
  from the first arrival to the later of the last finish and the last arrival;
- value served = the sum of the ``value`` of each request's class (SLO tiers) over the
  requests meeting every limit of their class, per second of the run.

Latency distributions (mean, p50, p90, p99; numpy's linear interpolation) are over
completed requests. A percentile-mode SLO (MLPerf's server scenario) instead judges the
percentile over *all* requests of the class, counting a shed or rejected request as an
infinitely late one, so dropping requests can never make a percentile look better.

Everything here is a pure function of numpy arrays: ``arrival_s``, ``first_token_s``,
``finish_s`` (nan when not reached), ``output_tokens``, ``status`` (0 completed, 1 shed,
2 rejected) and ``class_id``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from servetune.errors import ServetuneError
from servetune.schemas.slo import ClassSLO, SLOSet

if TYPE_CHECKING:
    from servetune.sim.engine import EngineOutput
    from servetune.workloads.trace import Trace

STATUS_COMPLETED = 0
STATUS_SHED = 1
STATUS_REJECTED = 2
STATUS_NAMES = ("completed", "shed", "rejected")

QUANTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0))
METRICS = ("ttft_s", "tpot_s", "e2e_s")

# Stands in for "never" (a shed or rejected request) in percentile-mode judgement: finite, so
# numpy's linear interpolation stays well defined, and larger than any limit a user can set.
_NEVER_S = 1e30


def served_output_tokens(trace: Trace) -> np.ndarray:
    """Output tokens each request generates when served: its ``output_tokens``, capped by
    its ``max_tokens`` where the trace has that column (the engine stops there)."""
    out = np.asarray(trace.output_tokens, dtype=np.int64)
    if trace.max_tokens is None:
        return out
    return np.minimum(out, np.maximum(np.asarray(trace.max_tokens, dtype=np.int64), 1))


@dataclass(frozen=True, eq=False)
class RequestMetrics:
    """Per-request latencies (nan where undefined) and the masks that select them."""

    ttft_s: np.ndarray
    tpot_s: np.ndarray
    e2e_s: np.ndarray
    completed: np.ndarray  # bool
    output_tokens: np.ndarray
    status: np.ndarray
    class_id: np.ndarray

    def __len__(self) -> int:
        return len(self.status)


def request_metrics(
    arrival_s: np.ndarray,
    first_token_s: np.ndarray,
    finish_s: np.ndarray,
    output_tokens: np.ndarray,
    status: np.ndarray,
    class_id: np.ndarray | None = None,
) -> RequestMetrics:
    """TTFT, TPOT and e2e per request from the engine's timestamps."""
    arrival = np.asarray(arrival_s, dtype=np.float64)
    status = np.asarray(status)
    completed = status == STATUS_COMPLETED
    output = np.asarray(output_tokens, dtype=np.int64)
    ttft = np.where(completed, np.asarray(first_token_s, dtype=np.float64) - arrival, np.nan)
    e2e = np.where(completed, np.asarray(finish_s, dtype=np.float64) - arrival, np.nan)
    has_tpot = completed & (output > 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(has_tpot, (e2e - ttft) / np.maximum(output - 1, 1), np.nan)
    cls = np.zeros(len(arrival), dtype=np.int32) if class_id is None else np.asarray(class_id)
    return RequestMetrics(ttft, tpot, e2e, completed, output, status, cls)


def distribution(values: np.ndarray) -> dict[str, float | None]:
    """``{"mean", "p50", "p90", "p99"}`` of the finite values; all None when there are none."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return {"mean": None, **{name: None for name, _ in QUANTILES}}
    qs = np.percentile(finite, [q for _, q in QUANTILES])
    out: dict[str, float | None] = {"mean": float(finite.mean())}
    for (name, _), value in zip(QUANTILES, qs, strict=True):
        out[name] = float(value)
    return out


def run_span_s(arrival_s: np.ndarray, finish_s: np.ndarray) -> float:
    """Seconds from the first arrival to the later of the last finish and the last arrival."""
    if len(arrival_s) == 0:
        return 0.0
    finished = finish_s[np.isfinite(finish_s)]
    end = max(float(arrival_s[-1]), float(finished.max()) if finished.size else 0.0)
    return end - float(arrival_s[0])


def throughput(m: RequestMetrics, span_s: float, mask: np.ndarray | None = None) -> dict:
    """Completed output tokens and requests per second over ``span_s``."""
    done = m.completed if mask is None else m.completed & mask
    if span_s <= 0:
        return {"throughput_tok_s": None, "throughput_req_s": None}
    return {
        "throughput_tok_s": float(m.output_tokens[done].sum()) / span_s,
        "throughput_req_s": float(done.sum()) / span_s,
    }


def class_slos(slo: SLOSet, class_names: tuple[str, ...]) -> list[ClassSLO]:
    """The SLO of each class index, or a ServetuneError naming the class without one."""
    out = []
    for name in class_names:
        try:
            out.append(slo.for_class(name))
        except KeyError:
            raise ServetuneError(
                f"SLO set {slo.name!r} has no entry for request class {name!r}; "
                "add it or a 'default' class"
            ) from None
    return out


def request_values(slo: SLOSet, class_names: tuple[str, ...], class_id: np.ndarray
                   ) -> np.ndarray:
    """Per request: the ``value`` of its class's SLO (float64)."""
    per_class = np.array([t.value for t in class_slos(slo, class_names)], dtype=np.float64)
    return per_class[np.asarray(class_id, dtype=np.int64)]


def value_served_per_s(met: np.ndarray, value: np.ndarray, span_s: float,
                       mask: np.ndarray | None = None) -> float | None:
    """Value of the (selected) requests that met every limit of their class, per second of
    the run; None for a run of no length."""
    if span_s <= 0:
        return None
    served = met if mask is None else met & mask
    return float(value[served].sum()) / span_s


def meets_limits(m: RequestMetrics, target: ClassSLO) -> np.ndarray:
    """Per request: completed and within every limit of ``target`` (TPOT limit vacuous for a
    1-token output)."""
    ok = m.completed.copy()
    limits = target.limits()
    with np.errstate(invalid="ignore"):
        if "ttft_s" in limits:
            ok &= m.ttft_s <= limits["ttft_s"]
        if "e2e_s" in limits:
            ok &= m.e2e_s <= limits["e2e_s"]
        if "tpot_s" in limits:
            ok &= ~(m.tpot_s > limits["tpot_s"])  # nan (1-token output) passes
    return ok


def slo_met_mask(m: RequestMetrics, slo: SLOSet, class_names: tuple[str, ...]) -> np.ndarray:
    """Per request: does it meet every limit of its class's SLO."""
    targets = class_slos(slo, class_names)
    met = np.zeros(len(m), dtype=bool)
    for cid, target in enumerate(targets):
        sel = m.class_id == cid
        if sel.any():
            met[sel] = meets_limits(_subset(m, sel), target)
    return met


def percentile_value(m: RequestMetrics, metric: str, q: float) -> float:
    """The ``q``-th percentile of ``metric`` over all requests in ``m``, a shed or rejected
    request counting as never served; nan when no request has the metric defined."""
    values = getattr(m, metric).copy()
    values[~m.completed] = _NEVER_S
    if metric == "tpot_s":
        values = values[~(m.completed & (m.output_tokens <= 1))]
    if values.size == 0:
        return float("nan")
    return float(np.percentile(values, q))


def class_verdict(m: RequestMetrics, target: ClassSLO) -> tuple[bool, dict]:
    """Does one class (all its requests in ``m``) meet ``target``; with the judged values.
    Beyond its latency target, a class fails when it turned away more than
    ``target.max_rejected_share`` of its requests."""
    met = meets_limits(m, target)
    attainment = float(met.mean()) if len(m) else 1.0
    turned_away = int((m.status != STATUS_COMPLETED).sum())
    share = turned_away / len(m) if len(m) else 0.0
    # Counted in requests, so that a cap of 0 allows none and 0.01 of 300 allows 3.
    within_cap = turned_away <= math.floor(target.max_rejected_share * len(m) + 1e-9)
    if target.attainment is not None:
        return (attainment >= target.attainment and within_cap,
                {"attainment": attainment, "rejected_share": share})
    assert target.percentile is not None
    judged: dict[str, float] = {"rejected_share": share}
    ok = within_cap
    for metric, limit in target.limits().items():
        value = percentile_value(m, metric, target.percentile)
        judged[f"p{target.percentile:g}_{metric}"] = value
        if np.isfinite(value) and value > limit:
            ok = False
    return ok, {"attainment": attainment, **judged}


def meets_slo(m: RequestMetrics, slo: SLOSet, class_names: tuple[str, ...]) -> bool:
    """Every class present in the run meets its SLO (percentile or attainment mode)."""
    return all(ok for ok, _ in slo_verdicts(m, slo, class_names).values())


def slo_verdicts(
    m: RequestMetrics, slo: SLOSet, class_names: tuple[str, ...]
) -> dict[str, tuple[bool, dict]]:
    """Per class present in the run: (meets its SLO, judged values)."""
    targets = class_slos(slo, class_names)
    out = {}
    for cid, target in enumerate(targets):
        sel = m.class_id == cid
        if sel.any():
            out[class_names[cid]] = class_verdict(_subset(m, sel), target)
    return out


def _subset(m: RequestMetrics, sel: np.ndarray) -> RequestMetrics:
    return RequestMetrics(
        m.ttft_s[sel], m.tpot_s[sel], m.e2e_s[sel], m.completed[sel], m.output_tokens[sel],
        m.status[sel], m.class_id[sel],
    )


def group_summary(
    m: RequestMetrics, span_s: float, mask: np.ndarray | None, met: np.ndarray | None,
    value: np.ndarray | None = None,
) -> dict:
    """Counts, latency distributions, throughput, attainment and value served per second
    (``value`` per request, 1 each when not given) of the selected requests."""
    sel = np.ones(len(m), dtype=bool) if mask is None else mask
    sub = _subset(m, sel)
    n = int(sel.sum())
    out: dict = {
        "requests": n,
        "completed": int(sub.completed.sum()),
        "shed": int((sub.status == STATUS_SHED).sum()),
        "rejected": int((sub.status == STATUS_REJECTED).sum()),
    }
    for metric in METRICS:
        out[metric] = distribution(getattr(sub, metric))
    out.update(throughput(m, span_s, sel))
    out["attainment"] = None if met is None or n == 0 else float(met[sel].mean())
    out["value_served_per_s"] = None if met is None else value_served_per_s(
        met, np.ones(len(m)) if value is None else value, span_s, sel)
    return out


def prefix_cache_summary(prompt_tokens: np.ndarray, output: EngineOutput) -> dict[str, Any]:
    """Prefix-cache hits of a run whose requests have ``prompt_tokens``: the share of
    admitted prompt tokens (and of their full blocks) served from the cache at first
    admission, evictions, and the mean share of the pool the cache kept beside the blocks
    in use."""
    admitted = ~np.isnan(np.asarray(output.admitted_s))
    prompt = np.asarray(prompt_tokens, dtype=np.int64)[admitted]
    hits = np.asarray(output.hit_tokens, dtype=np.int64)[admitted]
    bs = int(output.block_size)
    prompt_blocks = int((prompt // bs).sum())
    cached = output.series.get("kv_cached")
    return {
        "hit_rate_tokens": float(hits.sum() / prompt.sum()) if prompt.sum() else 0.0,
        "hit_rate_blocks": float((hits // bs).sum() / prompt_blocks) if prompt_blocks else 0.0,
        "hit_tokens": int(hits.sum()),
        "prompt_tokens": int(prompt.sum()),
        "evictions": int(output.cache_evictions),
        "cached_util_mean": float(np.mean(cached)) if cached is not None and len(cached) else 0.0,
    }
