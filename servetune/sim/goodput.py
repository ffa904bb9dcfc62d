"""Goodput: the highest rate scale at which a policy still meets its SLO.

Goodput is the highest arrival rate at which SLO attainment stays at or above the target
(DistServe; ``vllm bench serve --goodput``) or at which the percentile limits hold (MLPerf
server scenario), DESIGN.md "Metric definitions". Search is on the multiplicative rate
scale ``x`` (arrivals compressed by ``x`` for a trace, rates multiplied by ``x`` for a
workload):

1. *bracket*: from ``x = 1`` double while the SLO holds, or halve while it fails, until a
   passing ``lo`` and a failing ``hi = 2 lo`` are found (or the scale limits are reached);
2. *bisect* geometrically, ``mid = sqrt(lo * hi)``, keeping ``lo`` passing and ``hi``
   failing, until ``hi / lo <= 1 + rel_tol``.

The answer is ``lo``. A point passes only when it passes for every seed (sampled workloads
are judged on several independent samples; a trace is replayed once). Every simulation is
deterministic, so the whole search is: same inputs, same points, same answer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from servetune.errors import ServetuneError


@dataclass
class GoodputResult:
    """``rate_scale``: highest passing scale found (0.0 when even ``min_scale`` fails);
    ``rate_per_s``: the arrival rate it means; ``points``: every scale tried, in order, with
    its verdict and metrics."""

    rate_scale: float
    rate_per_s: float
    points: list[dict[str, Any]] = field(default_factory=list)
    base_rate_per_s: float = 0.0
    bracketed: bool = True  # False when the search hit max_scale or min_scale
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rate_scale": self.rate_scale,
            "rate_per_s": self.rate_per_s,
            "base_rate_per_s": self.base_rate_per_s,
            "bracketed": self.bracketed,
            "warnings": self.warnings,
            "points": self.points,
        }


def search_rate_scale(
    passes: Callable[[float], bool],
    *,
    start: float = 1.0,
    rel_tol: float = 0.02,
    min_scale: float = 1.0 / 1024,
    max_scale: float = 1024.0,
) -> tuple[float, bool]:
    """Bracket then bisect for the largest passing scale of a (nearly) monotone ``passes``.

    Returns ``(scale, bracketed)``: ``scale`` passes (0.0 if nothing down to ``min_scale``
    does); ``bracketed`` is False when a scale limit ended the search."""
    if not (0 < min_scale <= start <= max_scale):
        raise ServetuneError(
            f"goodput: need 0 < min_scale <= start <= max_scale (got {min_scale}, {start}, "
            f"{max_scale})"
        )
    if not rel_tol > 0:
        raise ServetuneError(f"goodput: rel_tol must be > 0 (got {rel_tol})")
    x = start
    if passes(x):
        lo = x
        while True:
            if lo >= max_scale:
                return lo, False
            hi = min(lo * 2.0, max_scale)
            if not passes(hi):
                break
            lo = hi
    else:
        hi = x
        while True:
            if hi <= min_scale:
                return 0.0, False
            lo = max(hi / 2.0, min_scale)
            if passes(lo):
                break
            hi = lo
    while hi / lo > 1.0 + rel_tol:
        mid = math.sqrt(lo * hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return lo, True


def goodput_search(
    evaluate: Callable[[float], tuple[bool, dict[str, Any]]],
    base_rate_per_s: float,
    *,
    start: float = 1.0,
    rel_tol: float = 0.02,
    min_scale: float = 1.0 / 1024,
    max_scale: float = 1024.0,
) -> GoodputResult:
    """Run :func:`search_rate_scale` on ``evaluate(scale) -> (passes, metrics)``, recording
    every point tried (each scale is evaluated once, even if the search returns to it)."""
    points: list[dict[str, Any]] = []
    seen: dict[float, bool] = {}

    def passes(scale: float) -> bool:
        if scale not in seen:
            ok, metrics = evaluate(scale)
            seen[scale] = ok
            points.append(
                {
                    "rate_scale": scale,
                    "rate_per_s": scale * base_rate_per_s,
                    "meets_slo": ok,
                    **metrics,
                }
            )
        return seen[scale]

    scale, bracketed = search_rate_scale(
        passes, start=start, rel_tol=rel_tol, min_scale=min_scale, max_scale=max_scale
    )
    return GoodputResult(
        rate_scale=scale,
        rate_per_s=scale * base_rate_per_s,
        points=points,
        base_rate_per_s=base_rate_per_s,
        bracketed=bracketed,
    )


def seeds_for(n: int, first: int = 0) -> Sequence[int]:
    """``n`` consecutive seeds from ``first``."""
    if n < 1:
        raise ServetuneError(f"--seeds must be >= 1 (got {n})")
    return tuple(range(first, first + n))
