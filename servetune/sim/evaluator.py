"""The one evaluator: how servetune judges a policy's goodput on a trace or a workload.

Every goodput a command prints for a policy on a source (``optimize`` with every method,
``nightly``, ``report``, ``goodput``) comes from these rules, so a number one command
prints, another reproduces:

- **sample** (:func:`base_sample`): a Trace is replayed whole, or its first ``n_requests``
  rows when given (at most :data:`MAX_TRACE_REQUESTS` by default); a Workload is sampled
  with ``seed``, ``n_requests`` requests at its own rates (default: one whole cycle of a
  block bootstrap, which holds every request of the trace it was fitted to, up to
  ``MAX_TRACE_REQUESTS``; else :data:`DEFAULT_REQUESTS`). A rate scale then compresses
  the sample's time; for a workload whose sessions scale by ``sessions``
  (:mod:`servetune.workloads.prefixes`) it samples the same number of requests again at
  that scale instead (more sessions at once, think times kept);
- **window** (:func:`judged_sample`): a run whose sample would span less than
  ``window_s`` seconds at the rate judged replays a longer sample of the same source
  instead (whole multiples of the base sample's size, at most
  :data:`~servetune.steady_state.MAX_WINDOW_REQUESTS`), compressed to the same arrival
  rate. ``window_s`` is :func:`judging_window_s`: the steady-state window of the SLO's
  TTFT target at the :data:`WINDOW_REL_TOL` rate tolerance, capped at
  :data:`MAX_MIN_WINDOW_S`. A whole trace cannot be lengthened: it is what it is;
- **verdict**: every class present meets its SLO (:func:`servetune.sim.metrics.slo_verdicts`);
- **search** (:meth:`Evaluator.goodput`): from scale 1, double while the SLO holds or
  halve while it fails, then bisect geometrically to :data:`EVAL_REL_TOL`
  (:func:`servetune.search.goodput_search`). The answer is the highest passing scale.

The optimizer's searches use the same runs (:meth:`Evaluator.run`) from other starts and
with pruning; the goodput it prints for its answer is :meth:`Evaluator.goodput`'s, the
number ``servetune goodput`` gives with the same ``--requests`` and ``--seed``.
"""

from __future__ import annotations

import copy
import math
import time
from typing import TYPE_CHECKING

from servetune.conditions import Condition, Family
from servetune.optimize_options import DEFAULT_REQUESTS
from servetune.schemas.policy import Policy
from servetune.schemas.slo import SLOSet
from servetune.schemas.workload import Workload
from servetune.search import GoodputResult, SimPoint, SimTally, goodput_search
from servetune.sim import metrics as M
from servetune.sim.api import base_rate_per_s, prepare_trace, simulate
from servetune.steady_state import MAX_WINDOW_REQUESTS, arrivals_in, steady_window_s
from servetune.workloads.trace import Trace

if TYPE_CHECKING:
    from servetune.profiles.schema import Profile

# The goodput every command prints is bisected to this relative tolerance.
EVAL_REL_TOL = 0.01
# The rate tolerance the judging window is sized for (steady_state: 67 s for a 2 s TTFT).
WINDOW_REL_TOL = 0.03
# Cap on the judging window (seconds).
MAX_MIN_WINDOW_S = 600.0
# Rows of a trace replayed when no one says: the whole trace up to this many.
MAX_TRACE_REQUESTS = MAX_WINDOW_REQUESTS


def judging_window_s(slo: SLOSet, rel_tol: float = WINDOW_REL_TOL) -> float:
    """The shortest stretch of arrivals a run must cover to judge a rate at tolerance
    ``rel_tol``: the steady-state window of the TTFT target over ``rel_tol``
    (:func:`servetune.steady_state.steady_window_s`), capped at ``MAX_MIN_WINDOW_S``; no
    TTFT target: no minimum."""
    return steady_window_s(slo, rate_tolerance=rel_tol, cap_s=MAX_MIN_WINDOW_S)


def default_requests(source: Trace | Workload, n_requests: int | None = None) -> int:
    """The requests a run replays of ``source`` when ``n_requests`` is None: a trace's
    rows, a block bootstrap's cycle (the fitted trace's requests), both at most
    ``MAX_TRACE_REQUESTS``; another workload's ``DEFAULT_REQUESTS``."""
    if n_requests is not None:
        return int(n_requests)
    if isinstance(source, Trace):
        return min(len(source), MAX_TRACE_REQUESTS)
    if source.block_bootstrap is not None:
        return min(source.block_bootstrap.n_requests, MAX_TRACE_REQUESTS)
    return DEFAULT_REQUESTS


def base_sample(source: Trace | Workload, *, seed: int = 0,
                n_requests: int | None = None) -> Trace:
    """The sample every run of ``source`` starts from (module docstring)."""
    return prepare_trace(source, seed=seed, n_requests=default_requests(source, n_requests))


def judged_sample(
    source: Trace | Workload | None, sample: Trace, rate_scale: float, window_s: float, *,
    seed: int = 0, max_requests: int = MAX_WINDOW_REQUESTS,
    longer: dict[int, tuple[Trace, float]] | None = None,
) -> tuple[Trace, float]:
    """The trace a run at ``rate_scale`` (times ``sample``'s rate) replays, and the rate
    scale that gives it the same arrival rate: ``sample`` itself, or a longer sample of
    ``source`` when ``sample`` would span less than ``window_s``; for a workload that
    scales by sessions, as many requests sampled at that scale, replayed at scale 1
    (module docstring). ``longer`` caches the longer samples by size."""
    trace, own_scale = _windowed(source, sample, rate_scale, window_s, seed=seed,
                                 max_requests=max_requests, longer=longer)
    if scales_sessions(source) and own_scale != 1.0:
        return prepare_trace(source, seed=seed, n_requests=len(trace),
                             rate_scale=own_scale), 1.0
    return trace, own_scale


def _windowed(
    source: Trace | Workload | None, sample: Trace, rate_scale: float, window_s: float, *,
    seed: int, max_requests: int, longer: dict[int, tuple[Trace, float]] | None,
) -> tuple[Trace, float]:
    """:func:`judged_sample` by time: ``sample`` or a longer one, and its own scale."""
    base = float(base_rate_per_s(sample))
    rate = rate_scale * base
    need = arrivals_in(rate, window_s) + 1  # n arrivals span n - 1 gaps
    size = len(sample)
    if source is None or need <= size or rate <= 0:
        return sample, rate_scale
    n = min(size * math.ceil(need / size), max(max_requests, size))
    if n <= size:
        return sample, rate_scale
    cache = {} if longer is None else longer
    if n not in cache:
        grown = prepare_trace(source, seed=seed, n_requests=n)
        cache[n] = (grown, float(base_rate_per_s(grown)))
    grown, grown_base = cache[n]
    if len(grown) <= size or grown_base <= 0:
        return sample, rate_scale
    return grown, rate / grown_base


def scales_sessions(source: Trace | Workload | None) -> bool:
    """Whether a rate scale of ``source`` makes more sessions rather than compressing
    time (a workload whose ``prefix_reuse.sessions.scale_by`` is ``sessions``)."""
    return (isinstance(source, Workload) and source.prefix_reuse is not None
            and source.prefix_reuse.sessions is not None
            and source.prefix_reuse.sessions.scale_by == "sessions")


class Evaluator:
    """The simulator on one sample of a source, judging runs by the module's rules and
    counting simulations and their time.

    ``trace`` is the base sample (:func:`base_sample` of ``source``); ``window_s`` the
    judging window (:func:`judging_window_s`). A policy simulated again at the same rate
    gives the same point: kept, not re-simulated."""

    def __init__(
        self, trace: Trace, profile: Profile, slo: SLOSet, *, engine: str = "vllm",
        source: Trace | Workload | None = None, seed: int = 0, min_window_s: float = 0.0,
        max_requests: int = MAX_WINDOW_REQUESTS,
    ) -> None:
        self.trace = trace
        self.profile = profile
        self.slo = slo
        self.engine = engine
        self.source = source
        self.seed = seed
        self.min_window_s = float(min_window_s)
        self.max_requests = int(max_requests)
        self.base_rate_per_s = float(base_rate_per_s(trace))
        self.simulations = 0
        self.simulation_s = 0.0
        self.kv_tokens = int(profile.kv_blocks()) * int(profile.block_size)
        self._longer: dict[int, tuple[Trace, float]] = {}
        self._seen: dict[tuple[str, float], SimPoint] = {}
        # A fork's caches as it started (:meth:`fork`), so that its tally holds only what
        # it added.
        self._forked_from: tuple[set, set] = (set(), set())

    @staticmethod
    def of(source: Trace | Workload, profile: Profile, slo: SLOSet, *, engine: str = "vllm",
           seed: int = 0, n_requests: int | None = None) -> Evaluator:
        """The evaluator of ``source`` by the module's rules (sample, window)."""
        return Evaluator(base_sample(source, seed=seed, n_requests=n_requests), profile, slo,
                         engine=engine, source=source, seed=seed,
                         min_window_s=judging_window_s(slo))

    def sample_for(self, rate_scale: float) -> tuple[Trace, float]:
        """:func:`judged_sample` of this evaluator's sample at ``rate_scale``."""
        return judged_sample(self.source, self.trace, rate_scale, self.min_window_s,
                             seed=self.seed, max_requests=self.max_requests,
                             longer=self._longer)

    def goodput(self, policy: Policy, *, rel_tol: float = EVAL_REL_TOL,
                min_scale: float = 1.0 / 1024, max_scale: float = 1024.0
                ) -> GoodputResult[SimPoint]:
        """The goodput every command prints for ``policy`` (module docstring: from scale
        1, doubling or halving, then bisection to ``rel_tol``)."""
        return goodput_search(lambda scale: self.run(policy, scale),
                              base_rate_per_s=self.base_rate_per_s, start=1.0,
                              rel_tol=rel_tol, min_scale=min_scale, max_scale=max_scale,
                              factor=2.0)

    def fork(self) -> Evaluator:
        """A copy for one search of a batch (:func:`servetune.solvers.loop.find_goodputs`):
        the same inputs and caches (copied, so the fork adds to its own), counters at
        zero; :meth:`tally` then says what it added."""
        child = copy.copy(self)
        child.simulations = 0
        child.simulation_s = 0.0
        child._seen = dict(self._seen)
        child._longer = dict(self._longer)
        child._forked_from = (set(self._seen), set(self._longer))
        return child

    def tally(self) -> SimTally:
        """What this fork did since :meth:`fork`: its counters, and only the cache entries
        it added (they travel back from a worker; the rest the parent has)."""
        seen, longer = self._forked_from
        return SimTally(self.simulations, self.simulation_s, {
            "seen": {k: v for k, v in self._seen.items() if k not in seen},
            "longer": {k: v for k, v in self._longer.items() if k not in longer},
        })

    def merge(self, tally: SimTally) -> None:
        """Add a fork's tally: its counters, and its cache entries this one lacks (the
        first fork's wins: they are the same simulations of the same inputs)."""
        self.simulations += tally.simulations
        self.simulation_s += tally.simulation_s
        for key, point in tally.caches.get("seen", {}).items():
            self._seen.setdefault(key, point)
        for n, sample in tally.caches.get("longer", {}).items():
            self._longer.setdefault(n, sample)

    def run(self, policy: Policy, rate_scale: float) -> SimPoint:
        key = (policy.model_dump_json(exclude={"name", "metadata"}), float(rate_scale))
        if key not in self._seen:
            self._seen[key] = self._simulate(policy, rate_scale)
        return self._seen[key]

    def _simulate(self, policy: Policy, rate_scale: float) -> SimPoint:
        trace, own_scale = self.sample_for(rate_scale)
        started = time.perf_counter()
        res = simulate(trace, policy, self.profile, engine=self.engine,
                       rate_scale=own_scale)
        self.simulation_s += time.perf_counter() - started
        self.simulations += 1
        verdicts = res.slo_verdicts(self.slo)
        ok = all(v[0] for v in verdicts.values())
        m = res.metrics
        measured: dict[str, float] = {}
        for cid, name in enumerate(res.trace.class_names):
            sel = m.class_id == cid
            if not sel.any():
                continue
            target = self.slo.for_class(name)
            q = target.percentile if target.percentile is not None else 100 * target.attainment
            sub = M.RequestMetrics(
                m.ttft_s[sel], m.tpot_s[sel], m.e2e_s[sel], m.completed[sel],
                m.output_tokens[sel], m.status[sel], m.class_id[sel],
            )
            measured[Condition(Family.TTFT, name).key] = M.percentile_value(sub, "ttft_s", q)
            measured[Condition(Family.TPOT, name).key] = M.percentile_value(sub, "tpot_s", q)
        peak = getattr(res.output, "kv_util_peak", float("nan"))
        measured["kv_peak_tokens"] = float(peak) * self.kv_tokens
        measured["sample_window_s"] = float(res.trace.duration_s)
        return SimPoint(
            rate_scale=float(rate_scale),
            rate_per_s=float(rate_scale) * self.base_rate_per_s,
            meets_slo=bool(ok),
            attainment=float(res.attainment(self.slo)),
            measured=measured,
            judged={k: v[1] for k, v in verdicts.items()},
            turned_away=res.turned_away(),
        )
