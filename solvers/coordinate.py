"""Coordinate descent by simulation: the moves the model does not rank.

The fluid model proposes; the simulator decides. Where the model is far off (long
prompts that bind on KV, bursty traces, prefix caching), the policy MILP's answer can sit
in a corner the model liked, and every candidate the model ranks near it is as wrong. So
part of the budget always goes to moves the model has no say in:

- **starts**: besides the loop's incumbent, the engine's defaults and a space-filling
  design (a Latin hypercube over the axes' value indices, seeded) are simulated; the
  best of them that is not the incumbent's own start also gets a descent;
- **lines**: from a start ``x``, every other value of every axis (one knob changed, the
  rest as in ``x``) is simulated as one batch at ``x``'s goodput raised by the bar
  tolerance; a failure there rejects the move in one simulation (branch and bound on
  simulated bounds), a pass is searched up. The best move that passes becomes ``x``,
  and the lines around it are simulated next; a point whose lines all fail the bar is
  a local optimum *by simulation*;
- **axes**: the space's knobs (seats, token budget, chunk cap, watermark, queue caps) and
  the long-request lane (:func:`lane_axes`): off, or one of the pairs of a threshold at
  the sample's prompt-plus-output quantiles and 1 to 4 seats, so that a line through the
  lane judges every pair.

Budget: simulations (work), checked before each batch; a started batch finishes. The
batches run on an executor (:func:`servetune.solvers.loop.find_goodputs`), so the answer
is the same on any executor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from servetune import knobs as knob_table
from servetune.executor import Executor
from servetune.models.fluid import Knobs
from servetune.search import GoodputResult, SimPoint
from servetune.solvers.loop import (
    Evaluated,
    GoodputTask,
    Simulator,
    find_goodputs,
    refine_goodput,
)

# The lane axis: None (off) or (threshold tokens, seats): requests whose prompt plus
# expected output reaches the threshold are long; ``seats`` seats are reserved for them
# and at most that many of them run.
LANE = "long_requests.lane"
# Quantiles of prompt + expected output the lane thresholds sit at, and the seats.
LANE_QUANTILES = (0.80, 0.90, 0.95, 0.99, 0.999)
LANE_SEAT_COUNTS = (1, 2, 3, 4)
# Points of the space-filling design.
DESIGN_POINTS = 8
# Descents started (the incumbent's first).
MAX_STARTS = 3


def lane_axes(request_tokens: np.ndarray) -> dict[str, list[Any]]:
    """The lane axis from a sample's prompt + expected output per request: off (None),
    or a threshold at each of ``LANE_QUANTILES`` (rounded up to 16 tokens, distinct) with
    each of ``LANE_SEAT_COUNTS`` seats."""
    tokens = np.asarray(request_tokens, dtype=float)
    if not len(tokens):
        return {}
    cuts = sorted({int(np.ceil(np.quantile(tokens, q) / 16.0) * 16)
                   for q in LANE_QUANTILES})
    return {LANE: [None, *((cut, seats) for cut in cuts for seats in LANE_SEAT_COUNTS)]}


def dotted_of(point: dict[str, Any]) -> dict[str, Any]:
    """A point's policy fields (path -> value): a lane (threshold, seats) sets its
    threshold and that many reserved and maximum long seats; an off lane clears them."""
    out = {p: v for p, v in point.items() if p != LANE}
    if LANE in point:
        threshold, seats = point[LANE] or (None, 0)
        out["long_requests.threshold_tokens"] = threshold
        out["long_requests.reserved_seqs"] = seats
        out["long_requests.max_seqs"] = seats or None
    return out


def point_key(point: dict[str, Any]) -> str:
    """Points the simulator cannot tell apart share a key: the knob table's rule
    (:func:`servetune.knobs.equivalence_key`: a chunk cap at or above the token budget
    caps nothing), over the point's policy fields; fields the table does not know as
    they are."""
    dotted = dotted_of(point)
    others = {p: v for p, v in dotted.items() if p not in knob_table.BY_PATH}
    return json.dumps([knob_table.equivalence_key(dotted), others], sort_keys=True,
                      default=str)


def point_of(policy: Any, axes: dict[str, list[Any]]) -> dict[str, Any]:
    """A policy's values on ``axes`` (its lane: (threshold, maximum long seats))."""
    data = policy.model_dump()
    out: dict[str, Any] = {}
    for path in axes:
        if path == LANE:
            lr = data["long_requests"]
            threshold = lr["threshold_tokens"]
            out[path] = None if threshold is None else (threshold, int(lr["max_seqs"] or 1))
            continue
        node: Any = data
        for part in path.split("."):
            node = node[part]
        out[path] = node
    return out


def snapped(point: dict[str, Any], axes: dict[str, list[Any]]) -> dict[str, Any]:
    """``point`` on ``axes``: each axis's value the nearest offered (numbers by ratio;
    None, no cap, only to None), so a start never leaves the space."""
    out = {}
    for path, values in axes.items():
        value = point.get(path)
        if value in values:
            out[path] = value
            continue
        numbers = [v for v in values if isinstance(v, int | float) and v > 0]
        if value is None or not isinstance(value, int | float) or value <= 0 or not numbers:
            out[path] = values[0]
            continue
        out[path] = min(numbers, key=lambda v: (abs(np.log(v / value)), v))
    return out


def design(axes: dict[str, list[Any]], n: int, seed: int) -> list[dict[str, Any]]:
    """A Latin hypercube of ``n`` points over the axes' value indices (each axis's values
    cut into ``n`` strata, one point in each, strata paired at random), seeded."""
    rng = np.random.default_rng(seed)
    columns = {}
    for path, values in axes.items():
        strata = (rng.permutation(n) + rng.random(n)) / n
        columns[path] = [values[min(int(u * len(values)), len(values) - 1)] for u in strata]
    return [{p: columns[p][i] for p in axes} for i in range(n)]


@dataclass
class DescentResult:
    """What the descent did: the candidates it simulated (label ``descent`` or
    ``start``), the starts it descended from, the moves, the simulations, and the limit
    that cut it short ("" when every descent reached a local optimum)."""

    evaluated: list[Evaluated] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)
    moves: int = 0
    simulations: int = 0
    stopped_by: str = ""


def descend(
    sim: Simulator,
    axes: dict[str, list[Any]],
    make_policy: Callable[[dict[str, Any]], Any],
    incumbent: Evaluated,
    starts: Sequence[dict[str, Any]],
    *,
    budget: int,
    rel_tol: float,
    bar_tol: float = 0.01,
    known: Sequence[Evaluated] = (),
    executor: Executor | None = None,
    log: Callable[[str], Any] | None = None,
) -> DescentResult:
    """Coordinate descent by simulation (module docstring) from ``incumbent`` and the
    best of ``starts``, over ``axes``, spending at most ``budget`` simulations (checked
    before each batch). ``make_policy(point)`` builds a point's policy (raising
    ``ValueError`` for an invalid one, which is skipped); ``known``: candidates already
    simulated, whose failures are not simulated again."""
    out = DescentResult()
    began = sim.simulations
    seen: dict[str, Evaluated] = {}
    for ev in known:
        if ev.policy is not None:
            seen.setdefault(point_key(point_of(ev.policy, axes)), ev)

    def spent() -> bool:
        return sim.simulations - began >= budget

    def policy_of(point: dict[str, Any]) -> Any | None:
        try:
            return make_policy(point)
        except ValueError:
            return None

    def evaluated(point: dict[str, Any], policy: Any, est: GoodputResult[SimPoint],
                  label: str) -> Evaluated:
        ev = Evaluated(-1, Knobs.from_policy(policy), float("nan"), None, est, policy,
                       label=label)
        seen[point_key(point)] = ev
        out.evaluated.append(ev)
        return ev

    def fails_at(key: str, scale: float) -> bool:
        ev = seen.get(key)
        return ev is not None and any(not p.meets_slo and p.rate_scale <= scale
                                      for p in ev.goodput.points)

    # The starts not simulated yet: each searched in full (they set their own bars).
    start_evs: list[tuple[dict[str, Any], Evaluated]] = []
    fresh = []
    for point in starts:
        key = point_key(point)
        if key in seen:
            start_evs.append((point, seen[key]))
            continue
        policy = policy_of(point)
        if policy is not None and key not in {point_key(p) for p, _ in fresh}:
            fresh.append((point, policy))
    if fresh and not spent():
        tasks = [GoodputTask(policy, 1.0, rel_tol, factor=2.0) for _, policy in fresh]
        for (point, policy), est in zip(fresh, find_goodputs(sim, tasks, executor),
                                        strict=True):
            start_evs.append((point, evaluated(point, policy, est, "start")))
    here = point_of(incumbent.policy, axes)
    seen.setdefault(point_key(here), incumbent)
    others = sorted((pair for pair in start_evs if pair[1].goodput.passed
                     and point_key(pair[0]) != point_key(here)),
                    key=lambda pair: -pair[1].goodput.rate_per_s)
    descents = [(here, incumbent), *others[:MAX_STARTS - 1]]
    for point, ev in descents:  # each has passed: its goodput sets its bar
        out.starts.append({"point": point, "rate_per_s": ev.goodput.rate_per_s})
        while not (stopped := spent()):
            ev.goodput = refine_goodput(sim, ev.policy, ev.goodput, rel_tol=bar_tol)
            bar = ev.goodput.rate_scale * (1.0 + bar_tol)
            moves: dict[str, tuple[dict[str, Any], Any]] = {}
            for path, values in axes.items():
                for value in values:
                    cand = {**point, path: value}
                    key = point_key(cand)
                    if key == point_key(point) or key in moves or fails_at(key, bar):
                        continue
                    policy = policy_of(cand)
                    if policy is not None:
                        moves[key] = (cand, policy)
            if not moves:
                break
            tasks = [GoodputTask(policy, bar, rel_tol, prune_at=bar)
                     for _, policy in moves.values()]
            best_move = None
            for (cand, policy), est in zip(moves.values(), find_goodputs(sim, tasks, executor),
                                           strict=True):
                cev = evaluated(cand, policy, est, "descent")
                if est.passed and est.rate_scale >= bar and (
                        best_move is None or est.rate_per_s > best_move[1].goodput.rate_per_s):
                    best_move = (cand, cev)
            if best_move is None:
                break  # a local optimum by simulation
            point, ev = best_move
            out.moves += 1
            if log:
                log(f"descent: moved to {_described(point)} at "
                    f"{ev.goodput.rate_per_s:.3f} req/s")
        if stopped:
            out.stopped_by = "simulation_budget"
            break
    out.simulations = sim.simulations - began
    return out


def _described(point: dict[str, Any]) -> str:
    return ", ".join(f"{p.split('.')[-1]}={v}" for p, v in point.items())
