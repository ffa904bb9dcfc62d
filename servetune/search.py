"""The goodput search: the largest rate scale at which a (nearly) monotone test passes.

Every goodput in servetune comes from here: ``servetune goodput`` and capacity
measurement (:mod:`servetune.sim.goodput`), the optimizer's loop and baselines
(:mod:`servetune.solvers.loop`), the spare capacity of background-job placement
(:mod:`servetune.apps.place`). It is pure: it calls ``passes(scale) -> bool`` (or
``evaluate(scale) -> point``) and knows nothing of simulators.

1. *bracket*: from ``start`` (clamped to ``[min_scale, max_scale]``) step up by ``factor``
   while the test passes, or down while it fails, until a passing ``lo`` and a failing
   ``hi`` are found or a scale limit is reached. With ``accelerate`` the step is squared
   after each step (x1.25, x1.56, x2.44, ...: a good start is bracketed in few runs and a
   bad one still quickly); without, it stays ``factor``;
2. *bisect* geometrically, ``mid = sqrt(lo * hi)``, keeping ``lo`` passing and ``hi``
   failing, until ``hi / lo <= 1 + rel_tol``.

Two bounds cut it short: ``max_evaluations`` (distinct scales tested) and ``prune_at``
(branch and bound: once a scale at or below ``prune_at`` fails, the answer cannot beat
``prune_at``, so the search stops; the answer is then only a lower bound). Each scale is
tested at most once, and the answer is the highest passing scale found (0.0 when none).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

PointT = TypeVar("PointT")


def _field(point: Any, name: str) -> Any:
    """A point's ``rate_scale`` or ``meets_slo``: points are mappings (JSON records) or
    objects with those attributes."""
    return point[name] if isinstance(point, Mapping) else getattr(point, name)


@dataclass
class GoodputResult(Generic[PointT]):
    """A goodput search's answer.

    ``rate_scale``: the highest passing scale found (0.0 when none passed); ``rate_per_s``:
    the arrival rate it means; ``points``: every scale tested, in order, each a record
    with at least ``rate_scale`` and ``meets_slo``; ``bracketed``: False when a scale
    limit, the evaluation budget or pruning ended the search before a passing and a
    failing scale enclosed the answer."""

    rate_scale: float
    rate_per_s: float
    points: list[PointT] = field(default_factory=list)
    base_rate_per_s: float = 0.0
    bracketed: bool = True
    warnings: list[str] = field(default_factory=list)

    @property
    def best_point(self) -> PointT | None:
        """The highest passing point (None when nothing passed)."""
        passing = [p for p in self.points if _field(p, "meets_slo")]
        return max(passing, key=lambda p: _field(p, "rate_scale")) if passing else None

    @property
    def passed(self) -> bool:
        return self.best_point is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "rate_scale": self.rate_scale,
            "rate_per_s": self.rate_per_s,
            "base_rate_per_s": self.base_rate_per_s,
            "bracketed": self.bracketed,
            "warnings": self.warnings,
            "points": self.points,
        }


@dataclass(frozen=True)
class Bracket:
    """Where a search ended: ``lo`` the highest passing scale, ``hi`` the lowest failing
    one above it (None where none was found)."""

    lo: float | None
    hi: float | None

    @property
    def scale(self) -> float:
        """The answer: ``lo``, or 0.0 when nothing passed."""
        return self.lo or 0.0

    @property
    def closed(self) -> bool:
        return self.lo is not None and self.hi is not None


class _Counted:
    """``passes`` tested once per scale, counting the distinct scales tested."""

    def __init__(self, passes: Callable[[float], bool]) -> None:
        self._passes = passes
        self._seen: dict[float, bool] = {}

    def __call__(self, scale: float) -> bool:
        if scale not in self._seen:
            self._seen[scale] = bool(self._passes(scale))
        return self._seen[scale]

    @property
    def count(self) -> int:
        return len(self._seen)


def _within(count: int, max_evaluations: int | None) -> bool:
    return max_evaluations is None or count < max_evaluations


def _pruned(hi: float | None, prune_at: float | None) -> bool:
    return prune_at is not None and hi is not None and hi <= prune_at


def _bisect(
    passes: _Counted, lo: float, hi: float, *, rel_tol: float, max_evaluations: int | None,
    prune_at: float | None,
) -> Bracket:
    while hi / lo > 1.0 + rel_tol and _within(passes.count, max_evaluations):
        if _pruned(hi, prune_at):
            break
        mid = math.sqrt(lo * hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    return Bracket(lo, hi)


def search_scale(
    passes: Callable[[float], bool],
    *,
    start: float = 1.0,
    rel_tol: float = 0.02,
    min_scale: float = 1.0 / 1024,
    max_scale: float = 1024.0,
    factor: float = 2.0,
    accelerate: bool = False,
    max_evaluations: int | None = None,
    prune_at: float | None = None,
) -> Bracket:
    """Bracket then bisect (module docstring) for the largest scale where ``passes``
    holds; ``passes`` is called at most once per scale."""
    if not (0 < min_scale <= max_scale) or not rel_tol > 0 or not factor > 1:
        raise ValueError(
            f"search_scale: need 0 < min_scale <= max_scale, rel_tol > 0 and factor > 1 "
            f"(got {min_scale}, {max_scale}, {rel_tol}, {factor})"
        )
    test = _Counted(passes)
    scale = min(max(start, min_scale), max_scale)
    step = factor
    lo: float | None = None
    hi: float | None = None
    if test(scale):
        lo = scale
        while _within(test.count, max_evaluations):
            up = min(lo * step, max_scale)
            if up <= lo:
                break  # at max_scale
            if not test(up):
                hi = up
                break
            lo = up
            if accelerate:
                step *= step
    else:
        hi = scale
        while _within(test.count, max_evaluations) and not _pruned(hi, prune_at):
            down = max(hi / step, min_scale)
            if down >= hi:
                break  # at min_scale
            if test(down):
                lo = down
                break
            hi = down
            if accelerate:
                step *= step
    if lo is None or hi is None:
        return Bracket(lo, hi)
    return _bisect(test, lo, hi, rel_tol=rel_tol, max_evaluations=max_evaluations,
                   prune_at=prune_at)


def refine_bracket(
    passes: Callable[[float], bool], lo: float, hi: float, *, rel_tol: float,
    max_evaluations: int | None = None,
) -> Bracket:
    """Bisect a known bracket (``lo`` passing, ``hi`` failing) further, to ``rel_tol``."""
    return _bisect(_Counted(passes), lo, hi, rel_tol=rel_tol,
                   max_evaluations=max_evaluations, prune_at=None)


def goodput_search(
    evaluate: Callable[[float], PointT],
    *,
    base_rate_per_s: float,
    start: float = 1.0,
    rel_tol: float = 0.02,
    min_scale: float = 1.0 / 1024,
    max_scale: float = 1024.0,
    factor: float = 2.0,
    accelerate: bool = False,
    max_evaluations: int | None = None,
    prune_at: float | None = None,
) -> GoodputResult[PointT]:
    """:func:`search_scale` over ``evaluate(scale) -> point`` (a point passes when its
    ``meets_slo`` is true), recording every point in the order tested."""
    points: list[PointT] = []

    def passes(scale: float) -> bool:
        point = evaluate(scale)
        points.append(point)
        return bool(_field(point, "meets_slo"))

    bracket = search_scale(
        passes, start=start, rel_tol=rel_tol, min_scale=min_scale, max_scale=max_scale,
        factor=factor, accelerate=accelerate, max_evaluations=max_evaluations,
        prune_at=prune_at,
    )
    return GoodputResult(
        rate_scale=bracket.scale,
        rate_per_s=bracket.scale * base_rate_per_s,
        points=points,
        base_rate_per_s=base_rate_per_s,
        bracketed=bracket.closed,
    )


def refine_goodput(
    evaluate: Callable[[float], PointT], result: GoodputResult[PointT], *, rel_tol: float,
    max_evaluations: int | None = None, base_rate_per_s: float | None = None,
) -> GoodputResult[PointT]:
    """Narrow a finished search's bracket (its best passing scale and the lowest failing
    scale above it) to ``rel_tol`` by more bisection, at most ``max_evaluations`` more
    points; the answer stays a lower bound, a tighter one. ``result`` itself when nothing
    passed or nothing failed above. ``base_rate_per_s``: the rate at scale 1 (default:
    the result's)."""
    best = result.best_point
    if best is None:
        return result
    best_scale = _field(best, "rate_scale")
    above = [_field(p, "rate_scale") for p in result.points
             if not _field(p, "meets_slo") and _field(p, "rate_scale") > best_scale]
    if not above:
        return result
    points = list(result.points)

    def passes(scale: float) -> bool:
        point = evaluate(scale)
        points.append(point)
        return bool(_field(point, "meets_slo"))

    bracket = refine_bracket(passes, best_scale, min(above), rel_tol=rel_tol,
                             max_evaluations=max_evaluations)
    base = result.base_rate_per_s if base_rate_per_s is None else base_rate_per_s
    lo = bracket.scale
    return GoodputResult(
        rate_scale=lo, rate_per_s=lo * base, points=points, base_rate_per_s=base,
        bracketed=True,
    )


@dataclass
class SimPoint:
    """One simulation of a policy at one rate scale."""

    rate_scale: float
    rate_per_s: float
    meets_slo: bool
    attainment: float
    # by Condition key (ttft[c], tpot[c]), and kv_peak_tokens, sample_window_s
    measured: dict[str, float] = field(default_factory=dict)
    judged: dict[str, Any] = field(default_factory=dict)  # the simulator's per-class verdicts
    # the requests turned away (SimResult.turned_away: count, share, which by reason)
    turned_away: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "rate_scale": self.rate_scale,
            "rate_per_s": self.rate_per_s,
            "meets_slo": self.meets_slo,
            "attainment": self.attainment,
            "measured": dict(self.measured),
        }


@dataclass
class SimTally:
    """What a forked simulator did: its simulations and their time, and the cache entries
    it added (``Evaluator``'s ``_seen`` points and ``_longer`` samples; empty for a
    simulator without caches)."""

    simulations: int = 0
    simulation_s: float = 0.0
    caches: dict[str, dict[Any, Any]] = field(default_factory=dict)
