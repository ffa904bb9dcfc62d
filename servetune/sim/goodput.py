"""Goodput: the highest rate scale at which a policy still meets its SLO.

Goodput is the highest arrival rate at which SLO attainment stays at or above the target
(DistServe; ``vllm bench serve --goodput``) or at which the percentile limits hold (MLPerf
server scenario), with the metrics of :mod:`servetune.sim.metrics`. Search is on the
multiplicative rate scale ``x`` (arrivals compressed by ``x`` for a trace, rates multiplied
by ``x`` for a workload):

1. *bracket*: from ``x = 1`` double while the SLO holds, or halve while it fails, until a
   passing ``lo`` and a failing ``hi = 2 lo`` are found (or the scale limits are reached);
2. *bisect* geometrically, ``mid = sqrt(lo * hi)``, keeping ``lo`` passing and ``hi``
   failing, until ``hi / lo <= 1 + rel_tol``.

The answer is ``lo``. A point passes only when it passes for every seed (sampled workloads
are judged on several independent samples; a trace is replayed once). Every simulation is
deterministic, so the whole search is: same inputs, same points, same answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from servetune.errors import ServetuneError
from servetune.search import GoodputResult, search_scale
from servetune.search import goodput_search as _search

__all__ = ["GoodputResult", "goodput_search", "search_rate_scale", "seeds_for"]


def _check(start: float, rel_tol: float, min_scale: float, max_scale: float) -> None:
    if not (0 < min_scale <= start <= max_scale):
        raise ServetuneError(
            f"goodput: need 0 < min_scale <= start <= max_scale (got {min_scale}, {start}, "
            f"{max_scale})"
        )
    if not rel_tol > 0:
        raise ServetuneError(f"goodput: rel_tol must be > 0 (got {rel_tol})")


def search_rate_scale(
    passes: Callable[[float], bool],
    *,
    start: float = 1.0,
    rel_tol: float = 0.02,
    min_scale: float = 1.0 / 1024,
    max_scale: float = 1024.0,
) -> tuple[float, bool]:
    """Bracket (doubling or halving) then bisect for the largest passing scale of a
    (nearly) monotone ``passes`` (:func:`servetune.search.search_scale`).

    Returns ``(scale, bracketed)``: ``scale`` passes (0.0 if nothing down to ``min_scale``
    does); ``bracketed`` is False when a scale limit ended the search."""
    _check(start, rel_tol, min_scale, max_scale)
    bracket = search_scale(passes, start=start, rel_tol=rel_tol, min_scale=min_scale,
                           max_scale=max_scale)
    return bracket.scale, bracket.closed


def goodput_search(
    evaluate: Callable[[float], tuple[bool, dict[str, Any]]],
    base_rate_per_s: float,
    *,
    start: float = 1.0,
    rel_tol: float = 0.02,
    min_scale: float = 1.0 / 1024,
    max_scale: float = 1024.0,
    prune_at: float | None = None,
) -> GoodputResult[dict[str, Any]]:
    """The search of :func:`search_rate_scale` on ``evaluate(scale) -> (passes, metrics)``,
    recording every point tried (each scale is evaluated once, even if the search returns
    to it) as ``{rate_scale, rate_per_s, meets_slo, **metrics}``; ``prune_at`` as in
    :func:`servetune.search.search_scale`."""
    _check(start, rel_tol, min_scale, max_scale)

    def point(scale: float) -> dict[str, Any]:
        ok, metrics = evaluate(scale)
        return {"rate_scale": scale, "rate_per_s": scale * base_rate_per_s, "meets_slo": ok,
                **metrics}

    return _search(point, base_rate_per_s=base_rate_per_s, start=start, rel_tol=rel_tol,
                   min_scale=min_scale, max_scale=max_scale, prune_at=prune_at)


# Each seed is a whole simulation at every rate the search tries; more than this many is
# a mistake, not a measurement (and a billion of them would not fit in memory).
MAX_SEEDS = 1000


def seeds_for(n_seeds: int, first: int = 0) -> Sequence[int]:
    """``n_seeds`` consecutive seeds from ``first`` (1 to ``MAX_SEEDS`` of them)."""
    if not 1 <= n_seeds <= MAX_SEEDS:
        raise ServetuneError(
            f"argument `n_seeds` must be between 1 and {MAX_SEEDS} (got {n_seeds}); every "
            "seed is a whole simulation at each rate the goodput search tries"
        )
    return tuple(range(first, first + n_seeds))
