"""Capacity planning: workload buckets, per-replica capacity, plan-then-validate.

1. **Buckets.** A large sample of the workload is sliced by prompt and output length
   (default prompt edges 1,024 and 4,096 tokens, output edge 256), as Melange does, so
   that long and short requests may go to different GPU types. Each bucket keeps its
   requests as a pool of (prompt, output, class) rows, and each class its share per
   bucket, so a forecast of class rates becomes bucket rates ``lam[b,s]``.
2. **Per-replica capacity** ``mu[t,b]``: the goodput (highest arrival rate meeting the
   SLOs, by the simulator's bisection) of one replica of type t serving only bucket b
   under its own optimized policy. ``method="auto"`` (the default) runs the project's
   optimizer (:mod:`servetune.apps.optimize`, MILP loop) on the bucket and also
   measures a few fixed candidate policies (vLLM's defaults and three smaller batch/token
   caps); the policy with the higher simulated goodput wins, so the plan never rests on
   a worse policy than an obvious one. ``"optimizer"`` uses the optimizer alone,
   ``"candidates"`` the candidates alone (fast; tests use it). The requests measured must
   arrive over at least ``MIN_WINDOW_S`` (240 s) at the goodput found, else the run is
   repeated on a longer trace: a short burst never fills the KV cache and overstates
   capacity several times over. Validation runs get the same window. Results are cached on
   disk by a hash of every input (profile, bucket pool, SLO, engine, method), in
   ``~/.cache/servetune/capacity`` unless ``SERVETUNE_CACHE_DIR`` or ``cache_dir`` says
   otherwise, so re-planning and growth sweeps skip the simulations.
3. **Plan, then validate.** The MILP of :mod:`servetune.models.capacity_milp` picks
   replicas and routing. Each GPU type is then simulated as one replica at its planned
   per-replica load, with the requests routed to it (a Poisson mix of its buckets) and
   the policy of its dominant bucket, in every slot whose bucket mix differs (for each
   distinct mix, its busiest slot; busiest first, stopping at the first miss). Where a
   type misses the SLOs, the capacity coefficients of the buckets routed to it there are
   lowered (x ``derate``) and the MILP is solved again, until every type in the plan
   meets the SLOs in simulation.
4. **Comparison.** The same loop restricted to each single GPU type gives the cheapest
   single-type plan; a growth sweep re-plans at each load multiplier.
5. **Topologies** (``topologies``, default ``("agg",)``: steps 1-4 exactly). Each GPU
   type t also offers disaggregated units ``t@P:D`` (:class:`Unit`: P prefill + D decode
   replicas, costing P+D replicas). The MILP plans units instead of types, with the
   type's GPU limits shared by its units (``type_cap``/``type_floor`` of
   :mod:`servetune.models.capacity_milp`). A unit's capacity per bucket
   (:func:`unit_capacity`) is its goodput in the cluster simulator behind ``router`` with
   KV over ``link``, every replica under the policy step 2 chose for that (type, bucket)
   (a simplification: no policy is tuned for the prefill or decode role), cached like a
   replica's with the topology, router and link in the key. Validation simulates each
   planned group of units as one cluster behind the router on all the traffic routed to
   it (n units of P:D = nP prefill + nD decode replicas; n aggregated replicas), so the
   aggregated units of such a plan are checked behind the router as well (with ``agg``
   alone, step 3's one-replica check stands). The comparison adds
   the cheapest aggregated-only and disaggregated-only plans (:func:`topology_plans`);
   the plan written is the cheapest validated one of all, and a single type's plan may
   use any of its units.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from servetune.apps.optimize import optimize
from servetune.engines import DISAGG_DECODE_ENGINES
from servetune.errors import InfeasibleError, ServetuneError
from servetune.executor import Executor, SerialExecutor
from servetune.io import sha256_file, sha256_json, write_text_atomic
from servetune.models.capacity_milp import (
    CapacityInstance,
    CapacitySolution,
)
from servetune.profiles.shipped import load_profile
from servetune.routers import ROUTER_NAMES
from servetune.schemas.base import load_document
from servetune.schemas.fleet import CapacityPlan, Fleet, Forecast, PlanBucket, PlanGPUType
from servetune.schemas.policy import Policy
from servetune.schemas.slo import SLOSet
from servetune.sim import goodput, simulate
from servetune.sim.api import base_rate_per_s, simulate_cluster
from servetune.sim.cluster import LINKS, ReplicaSpec, disaggregated_specs
from servetune.sim.engine import ENGINE_MODEL_VERSION
from servetune.sim.goodput import goodput_search
from servetune.solvers.capacity import solve_capacity
from servetune.steady_state import MAX_WINDOW_REQUESTS, arrivals_in, steady_window_s
from servetune.workloads.fitting import load_workload, sample_trace
from servetune.workloads.trace import Trace

if TYPE_CHECKING:
    from servetune.profiles.schema import Profile
    from servetune.schemas.workload import Workload

# 2: capacities measured over a steady-state window (MIN_WINDOW_S); 3: contenders after
# the first measured against the leader's bar (_best_candidate), and the policy MILP's
# ties broken after the solve
CACHE_VERSION = 3
# The goodput searches of a capacity measurement stop at this relative bracket.
CAPACITY_REL_TOL = 0.03
CACHE_ENV = "SERVETUNE_CACHE_DIR"
DEFAULT_PROMPT_EDGES = (1024, 4096)
DEFAULT_OUTPUT_EDGES = (256,)
# Candidate (max_num_seqs, max_num_batched_tokens) when the optimizer is not available:
# vLLM serve's defaults on a >= 70 GiB GPU, then progressively tighter caps that trade
# throughput for step time (TPOT).
CANDIDATE_BATCHING = ((1024, 8192), (256, 8192), (128, 4096), (64, 2048))
# A capacity or validation run must span this many seconds of arrivals at the rate it
# measures, whatever the TTFT target (the steady-state window of servetune.steady_state,
# whose docstring says why: a burst overstates capacity several times over).
MIN_WINDOW_S = 240.0

Progress = Callable[[str], Any]


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path.home() / ".cache" / "servetune" / "capacity"


# ----------------------------------------------------------------------------- buckets


@dataclass(frozen=True)
class Bucket:
    name: str
    prompt_lo: int
    prompt_hi: int | None  # exclusive; None = unbounded
    output_lo: int
    output_hi: int | None

    def contains(self, prompt: np.ndarray, output: np.ndarray) -> np.ndarray:
        ok = (prompt >= self.prompt_lo) & (output >= self.output_lo)
        if self.prompt_hi is not None:
            ok &= prompt < self.prompt_hi
        if self.output_hi is not None:
            ok &= output < self.output_hi
        return ok


def make_buckets(
    prompt_edges: Sequence[int] = DEFAULT_PROMPT_EDGES,
    output_edges: Sequence[int] = DEFAULT_OUTPUT_EDGES,
) -> list[Bucket]:
    """The grid of buckets cut at the given edges (tokens), named like ``p1024-4096/o0-256``."""
    for name, edges in (("prompt", prompt_edges), ("output", output_edges)):
        if list(edges) != sorted(set(edges)) or any(e < 2 for e in edges):
            raise ServetuneError(
                f"argument `{name}_edges`: give increasing token counts >= 2 "
                f"(got {list(edges)})"
            )
    p_bounds = [0, *prompt_edges, None]
    o_bounds = [0, *output_edges, None]
    out = []
    for i in range(len(p_bounds) - 1):
        for k in range(len(o_bounds) - 1):
            plo, phi = p_bounds[i], p_bounds[i + 1]
            olo, ohi = o_bounds[k], o_bounds[k + 1]
            name = f"p{plo}-{phi if phi else 'inf'}/o{olo}-{ohi if ohi else 'inf'}"
            out.append(Bucket(name, int(plo), phi, int(olo), ohi))
    return out


@dataclass
class WorkloadSlices:
    """A sample of the workload cut into buckets: pools of request shapes per bucket."""

    buckets: list[Bucket]
    class_names: tuple[str, ...]
    prompt: dict[str, np.ndarray]  # bucket -> prompt tokens of its pool
    output: dict[str, np.ndarray]
    class_id: dict[str, np.ndarray]
    class_share: dict[str, dict[str, float]]  # class -> bucket -> share of the class
    share: dict[str, float]  # bucket -> share of all sampled requests
    class_weight: dict[str, float]  # class -> share of the workload's rate

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(b.name for b in self.buckets)

    def pool_hash(self, bucket: str) -> str:
        h = hashlib.sha256()
        for arr in (self.prompt[bucket], self.output[bucket], self.class_id[bucket]):
            h.update(np.ascontiguousarray(arr).astype(np.int64).tobytes())
        h.update(json.dumps(self.class_names).encode())
        return h.hexdigest()

    def bucket_rates(self, forecast: Forecast, growth: float = 1.0) -> dict[tuple[str, int], float]:
        """lam[b,s]: forecast class rates spread over the buckets by each class's shares."""
        rates = class_rates_for(forecast, self.class_names, self.class_weight, growth)
        lam: dict[tuple[str, int], float] = {}
        for b in self.names:
            for s in range(forecast.n_slots):
                lam[b, s] = float(
                    sum(rates[c][s] * self.class_share[c].get(b, 0.0) for c in rates)
                )
        return lam

    def mixed_trace(self, rates: dict[str, float], n_requests: int, seed: int) -> Trace:
        """Poisson arrivals of each bucket at its rate (req/s), shapes drawn from the bucket
        pools with replacement; the first ``n_requests`` arrivals of the merge."""
        rng = np.random.default_rng(seed)
        total = sum(r for r in rates.values() if r > 0)
        if total <= 0:
            raise ValueError("mixed_trace: every rate is 0")
        parts = []
        for b in self.names:  # fixed order: deterministic
            r = rates.get(b, 0.0)
            if r <= 0:
                continue
            k = max(1, int(math.ceil(n_requests * r / total * 1.2)) + 8)
            arrival = np.cumsum(rng.exponential(1.0 / r, size=k))
            pick = rng.integers(0, len(self.prompt[b]), size=k)
            parts.append((arrival, self.prompt[b][pick], self.output[b][pick],
                          self.class_id[b][pick]))
        arrival = np.concatenate([p[0] for p in parts])
        order = np.argsort(arrival, kind="stable")[:n_requests]
        return Trace(
            arrival_s=arrival[order] - arrival[order][0],
            prompt_tokens=np.concatenate([p[1] for p in parts])[order].astype(np.int64),
            output_tokens=np.concatenate([p[2] for p in parts])[order].astype(np.int64),
            class_id=np.concatenate([p[3] for p in parts])[order].astype(np.int32),
            class_names=self.class_names,
            source=f"capacity-mix seed={seed}",
        )


def class_rates_for(
    forecast: Forecast,
    class_names: tuple[str, ...],
    class_weight: dict[str, float],
    growth: float = 1.0,
) -> dict[str, list[float]]:
    """Forecast rates per workload class. Forecast classes name workload classes; a
    forecast with only ``default`` is spread over the workload's classes by their rates."""
    fc = forecast.class_rates(growth)
    if set(fc) <= set(class_names):
        return {c: fc[c] for c in class_names if c in fc}
    if set(fc) == {"default"}:
        return {c: [r * class_weight[c] for r in fc["default"]] for c in class_names}
    unknown = sorted(set(fc) - set(class_names))
    raise ServetuneError(
        f"forecast: classes.{unknown[0]}: the workload has no such class "
        f"(it has {', '.join(class_names)}); use those names or a single 'default'"
    )


def slice_workload(
    workload: Workload,
    buckets: Sequence[Bucket],
    *,
    n_requests: int = 20000,
    seed: int = 0,
) -> WorkloadSlices:
    """Sample ``n_requests`` from the workload and cut the sample into ``buckets``; buckets
    that receive no request are dropped."""
    trace = sample_trace(workload, n_requests=n_requests, seed=seed)
    names = tuple(trace.class_names)
    cid = trace.class_ids()
    rates = {c: workload.classes[c].arrival.rate_per_s for c in names}
    total_rate = sum(rates.values())
    kept: list[Bucket] = []
    prompt, output, class_id, share = {}, {}, {}, {}
    class_share: dict[str, dict[str, float]] = {c: {} for c in names}
    for b in buckets:
        sel = b.contains(trace.prompt_tokens, trace.output_tokens)
        if not sel.any():
            continue
        kept.append(b)
        prompt[b.name] = trace.prompt_tokens[sel]
        output[b.name] = trace.output_tokens[sel]
        class_id[b.name] = cid[sel]
        share[b.name] = float(sel.mean())
        for k, c in enumerate(names):
            in_class = cid == k
            if in_class.any():
                class_share[c][b.name] = float((sel & in_class).sum() / in_class.sum())
    return WorkloadSlices(
        buckets=kept, class_names=names, prompt=prompt, output=output, class_id=class_id,
        class_share=class_share, share=share,
        class_weight={c: rates[c] / total_rate for c in names},
    )


# ------------------------------------------------------------------- per-replica capacity


@dataclass
class ReplicaCapacity:
    rate_per_s: float
    policy: Policy
    method: str
    simulations: int
    cached: bool = False


def _optimizer() -> Callable[..., Any]:
    """The optimizer capacity runs use (tests replace it with a fake)."""
    return optimize


def _candidate_policies() -> list[Policy]:
    return [
        Policy(name=f"candidate-{s}x{t}",
               batching={"max_num_seqs": s, "max_num_batched_tokens": t})
        for s, t in CANDIDATE_BATCHING
    ]


def window_requests(rate_per_s: float, n_requests: int, min_window_s: float | None = None
                    ) -> int:
    """Requests for a run at ``rate_per_s`` to span at least ``min_window_s`` (default
    :data:`MIN_WINDOW_S`) seconds of arrivals (never fewer than ``n_requests``, never more
    than :data:`MAX_WINDOW_REQUESTS`)."""
    if not rate_per_s > 0:
        return n_requests
    need = arrivals_in(rate_per_s, window_s(min_window_s))
    return max(n_requests, min(MAX_WINDOW_REQUESTS, need))


def window_s(min_window_s: float | None = None) -> float:
    """The steady-state window of a capacity or validation run
    (:func:`servetune.steady_state.steady_window_s`): ``min_window_s``, by default
    :data:`MIN_WINDOW_S`."""
    return steady_window_s(floor_s=MIN_WINDOW_S if min_window_s is None else min_window_s)


def _best_candidate(trace: Trace, profile: Profile, slo: SLOSet, engine: str,
                    policies: Sequence[Policy] | None = None, start: float = 1.0,
                    leader: float = 0.0):
    """The best of ``policies`` (default: the fixed candidates) by simulated goodput on
    ``trace`` (at 1 req/s, so a rate is a rate scale): (rate, policy, simulations); rate
    0 and the first policy when none passes or none beats ``leader``.

    The first policy's search starts at ``start`` (without a ``leader``). Once there is a
    leader, each next policy is simulated first at the leader's rate plus the search's
    tolerance and searched on only when it passes there (branch and bound with simulated
    bounds, as in the optimizer's loop): one simulation for a policy that cannot beat
    the leader by more than the tolerance."""
    candidates = list(_candidate_policies() if policies is None else policies)
    best_rate, best_policy = leader, candidates[0]
    base = base_rate_per_s(trace)
    sims = 0
    for policy in candidates:
        if best_rate > 0:
            bar = _scale_start(best_rate * (1 + CAPACITY_REL_TOL) / base)
            res = goodput(trace, policy, profile, slo, engine=engine,
                          rel_tol=CAPACITY_REL_TOL, start=bar, prune_at=bar)
        else:
            res = goodput(trace, policy, profile, slo, engine=engine,
                          rel_tol=CAPACITY_REL_TOL, start=start)
        sims += len(res.points)
        if res.rate_per_s > best_rate * (1 + 1e-9):
            best_rate, best_policy = res.rate_per_s, policy
    return (best_rate, best_policy, sims) if best_rate > leader else (0.0, candidates[0], sims)


def _optimized(trace: Trace, profile: Profile, slo: SLOSet, engine: str, optimize: Callable,
               seed: int):
    """Run the project's optimizer (MILP loop) on one bucket's requests; return
    (goodput req/s, policy, simulations)."""
    res = optimize(trace, profile, slo, engine=engine, seed=seed, n_requests=len(trace),
                   compare_defaults=False)
    summary = res.summary
    return float(summary["goodput_rate_per_s"]), res.policy, int(summary.get("simulations", 0))


def replica_capacity(
    profile: Profile,
    slices: WorkloadSlices,
    bucket: str,
    slo: SLOSet,
    *,
    engine: str = "vllm",
    method: str = "auto",
    n_requests: int = 1000,
    seed: int = 0,
    cache_dir: Path | None = None,
    min_window_s: float | None = None,
) -> ReplicaCapacity:
    """Goodput (req/s) of one replica of ``profile`` serving bucket ``bucket`` alone under
    its own best policy; cached on disk by input hash."""
    optimize = _optimizer() if method in ("auto", "optimizer") else None
    used = ("optimizer" if method == "optimizer" else "optimizer+candidates") if optimize \
        is not None else "candidates"
    path, data = _cached(cache_dir, {
        "v": CACHE_VERSION,
        "engine_model": ENGINE_MODEL_VERSION,
        "profile": profile.model_dump(mode="json"),
        "pool": slices.pool_hash(bucket),
        "slo": slo.model_dump(mode="json"),
        "engine": engine,
        "method": used,
        "candidates": CANDIDATE_BATCHING if "candidates" in used else None,
        "n": n_requests,
        "window": [window_s(min_window_s), MAX_WINDOW_REQUESTS],
        "seed": seed,
    })
    if data is not None:
        try:
            return ReplicaCapacity(
                float(data["rate_per_s"]), Policy.model_validate(data["policy"]),
                data["method"], int(data["simulations"]), cached=True,
            )
        except (ValueError, KeyError, TypeError):
            pass  # a damaged entry is recomputed and overwritten
    # One request per second as the base rate; goodput scales it up or down.
    trace = slices.mixed_trace({bucket: 1.0}, n_requests, seed)
    rate, policy, sims = 0.0, Policy(), 0
    if optimize is not None:
        try:
            rate, policy, sims = _optimized(trace, profile, slo, engine, optimize, seed)
        except InfeasibleError:
            pass  # no policy in the optimizer's space meets the SLOs on this bucket
        except (ServetuneError, TypeError, KeyError) as exc:
            if method == "optimizer":
                raise ServetuneError(f"capacity of {getattr(profile, 'name', '?')} on bucket "
                                     f"{bucket}: the optimizer failed: {exc}") from None
            # auto: the candidates below still give a measured capacity
    if "candidates" in used:
        # The optimizer's answer competes with the fixed candidates: both are measured
        # by simulated goodput, and the plan should rest on the better one.
        c_rate, c_policy, c_sims = _best_candidate(trace, profile, slo, engine, leader=rate)
        sims += c_sims
        if c_rate > rate * (1 + 1e-9):
            rate, policy = c_rate, c_policy
    # Steady state: measure the winner and the candidates again on longer traces (the
    # optimizer runs once).
    contenders = [policy] + (_candidate_policies() if "candidates" in used else [])

    def again(trace: Trace, start: float) -> float:
        nonlocal policy, sims
        found, policy, more = _best_candidate(trace, profile, slo, engine, contenders,
                                              start=start)
        sims += more
        return found

    rate = _steady(rate, slices, bucket, n_requests, seed, min_window_s, again)
    policy = policy.model_copy(update={"metadata": {}})
    _store(path, {
        "rate_per_s": rate, "policy": policy.model_dump(mode="json"), "method": used,
        "simulations": sims, "profile": getattr(profile, "name", ""), "bucket": bucket,
    })
    return ReplicaCapacity(rate, policy, used, sims)


def _scale_start(rate_per_s: float) -> float:
    """A goodput search's first rate scale on a bucket's trace: the trace runs at 1 req/s,
    so a rate is a scale (kept within the search's limits)."""
    return min(max(rate_per_s, 1.0 / 1024), 1024.0)


def _steady(rate: float, slices: WorkloadSlices, bucket: str, n_requests: int, seed: int,
            min_window_s: float | None, measure: Callable[[Trace, float], float]) -> float:
    """While the goodput's arrivals span less than the steady-state window (up to three
    times), ``measure(trace, start)`` again on a longer trace of the bucket, starting at
    the last goodput (an overestimate) instead of doubling up from 1 req/s."""
    n = n_requests
    for _ in range(3):
        n_next = window_requests(rate, n, min_window_s)
        if n_next <= n:
            break
        n = n_next
        rate = measure(slices.mixed_trace({bucket: 1.0}, n, seed), _scale_start(rate))
    return rate


def _cached(cache_dir: Path | None, inputs: dict[str, Any]) -> tuple[Path, Any]:
    """The cache file of a measurement keyed by the hash of ``inputs``, and its data (None
    when absent or unreadable: a damaged entry is measured again and overwritten)."""
    cdir = cache_dir if cache_dir is not None else default_cache_dir()
    path = cdir / f"{sha256_json(inputs)}.json"
    if path.is_file():
        try:
            return path, json.loads(path.read_text())
        except ValueError:
            pass
    return path, None


def _store(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(data, sort_keys=True))
    except ServetuneError:
        pass  # an unwritable cache only costs time


# ------------------------------------------------------------- serving units (topologies)

AGG = "agg"
DEFAULT_TOPOLOGIES = (AGG,)
DEFAULT_ROUTER = "least_kv"
DEFAULT_LINK = "infiniband"
MAX_RATIO_SIDE = 8  # replicas per side of a P:D unit: beyond any useful ratio


@dataclass(frozen=True)
class Unit:
    """A serving unit of one GPU type: one aggregated replica (``prefill == 0``) or a
    disaggregated group of ``prefill`` prefill and ``decode`` decode replicas."""

    gpu_type: str
    prefill: int = 0
    decode: int = 0

    @property
    def disaggregated(self) -> bool:
        return self.prefill > 0

    @property
    def topology(self) -> str:
        return f"{self.prefill}:{self.decode}" if self.disaggregated else AGG

    @property
    def name(self) -> str:
        """``h200`` (aggregated: the type's own name, as plans without units use) or
        ``h200@1:2``; GPU type names cannot hold '@' or ':'."""
        return f"{self.gpu_type}@{self.topology}" if self.disaggregated else self.gpu_type

    @property
    def size(self) -> int:
        return self.prefill + self.decode if self.disaggregated else 1


def parse_topologies(text: str | Sequence[str]) -> tuple[str, ...]:
    """``agg,1:1,1:2`` -> ("agg", "1:1", "1:2") (duplicates dropped, order kept); a P:D
    ratio needs whole P and D from 1 to :data:`MAX_RATIO_SIDE`."""
    items = [x.strip() for x in text.split(",")] if isinstance(text, str) else list(text)
    out: list[str] = []
    for item in items:
        if not item:
            continue
        if item != AGG:
            p, _, d = item.partition(":")
            if not (p.isdigit() and d.isdigit()
                    and 1 <= int(p) <= MAX_RATIO_SIDE and 1 <= int(d) <= MAX_RATIO_SIDE):
                raise ServetuneError(
                    f"argument `topologies`: {item!r} is neither 'agg' nor a prefill:decode "
                    f"ratio like 1:2 (whole numbers 1 to {MAX_RATIO_SIDE}); e.g. agg,1:1,1:2"
                )
            item = f"{int(p)}:{int(d)}"
        if item not in out:
            out.append(item)
    if not out:
        raise ServetuneError("argument `topologies`: name at least one (e.g. agg,1:1)")
    return tuple(out)


def fleet_units(type_names: Sequence[str], topologies: Sequence[str]) -> dict[str, Unit]:
    """Every unit of every GPU type, by name: per type, its topologies in the given order."""
    units: dict[str, Unit] = {}
    for t in type_names:
        for topo in topologies:
            if topo == AGG:
                u = Unit(t)
            else:
                p, d = topo.split(":")
                u = Unit(t, int(p), int(d))
            units[u.name] = u
    return units


def unit_specs(unit: Unit, profile: Profile, policy: Policy, engine: str, n_units: int = 1
               ) -> list[ReplicaSpec]:
    """The replicas of ``n_units`` units: all prefill replicas, then all decode replicas
    (every one running ``policy``); ``n_units`` replicas of an aggregated unit."""
    if not unit.disaggregated:
        return [ReplicaSpec(profile, policy, engine)] * n_units
    return disaggregated_specs(profile, policy, engine, unit.prefill * n_units,
                               unit.decode * n_units)


def _link(name: str) -> Any:
    if name not in LINKS:
        raise ServetuneError(f"argument `link`: {name!r} is unknown; choose one of "
                             f"{', '.join(LINKS)}")
    return LINKS[name]


def unit_capacity(
    unit: Unit,
    profile: Profile,
    slices: WorkloadSlices,
    bucket: str,
    slo: SLOSet,
    agg: ReplicaCapacity,
    *,
    router: str = DEFAULT_ROUTER,
    link: str = DEFAULT_LINK,
    engine: str = "vllm",
    n_requests: int = 1000,
    seed: int = 0,
    cache_dir: Path | None = None,
    min_window_s: float | None = None,
) -> ReplicaCapacity:
    """Goodput (req/s) of one disaggregated unit (its P prefill and D decode replicas behind
    ``router``, KV over ``link``) serving bucket ``bucket`` alone, every replica under the
    policy the aggregated capacity ``agg`` chose for that bucket; cached on disk like
    :func:`replica_capacity`, with the topology, router and link in the key. A bucket one
    aggregated replica cannot serve at all gets 0 without simulating: a prefill or decode
    replica holds the whole prompt's KV as the aggregated replica does."""
    if not unit.disaggregated:
        return agg
    if agg.rate_per_s <= 0:
        return ReplicaCapacity(0.0, agg.policy, f"cluster:{router}", 0)
    policy = agg.policy
    path, data = _cached(cache_dir, {
        "v": CACHE_VERSION,
        "engine_model": ENGINE_MODEL_VERSION,
        "topology": [unit.prefill, unit.decode, router, link],
        "profile": profile.model_dump(mode="json"),
        "pool": slices.pool_hash(bucket),
        "slo": slo.model_dump(mode="json"),
        "engine": engine,
        "policy": policy.model_dump(mode="json"),
        "n": n_requests,
        "window": [window_s(min_window_s), MAX_WINDOW_REQUESTS],
        "seed": seed,
    })
    if data is not None:
        try:
            return ReplicaCapacity(float(data["rate_per_s"]), policy, data["method"],
                                   int(data["simulations"]), cached=True)
        except (ValueError, KeyError, TypeError):
            pass  # a damaged entry is recomputed and overwritten
    specs = unit_specs(unit, profile, policy, engine)
    kv_link = _link(link)
    sims = 0

    def search(trace: Trace, start: float) -> float:
        nonlocal sims

        def evaluate(scale: float) -> tuple[bool, dict[str, Any]]:
            nonlocal sims
            sims += 1
            res, _out = simulate_cluster(trace, specs, router=router, link=kv_link,
                                         rate_scale=scale)
            return res.meets_slo(slo), {}

        return goodput_search(evaluate, base_rate_per_s(trace), start=start,
                              rel_tol=CAPACITY_REL_TOL).rate_per_s

    # The unit has unit.size replicas: start the search near size x one replica's goodput.
    trace = slices.mixed_trace({bucket: 1.0}, n_requests, seed)
    rate = search(trace, _scale_start(agg.rate_per_s * unit.size))
    rate = _steady(rate, slices, bucket, n_requests, seed, min_window_s, search)
    method = f"cluster:{router}"
    _store(path, {
        "rate_per_s": rate, "method": method, "simulations": sims,
        "profile": getattr(profile, "name", ""), "bucket": bucket, "topology": unit.topology,
    })
    return ReplicaCapacity(rate, policy, method, sims)


def measure_unit_capacities(
    units: dict[str, Unit],
    slices: WorkloadSlices,
    profiles: dict[str, Profile],
    slo: SLOSet,
    capacity: dict[tuple[str, str], ReplicaCapacity],
    *,
    progress: Progress | None = None,
    executor: Executor | None = None,
    **kw: Any,
) -> dict[tuple[str, str], ReplicaCapacity]:
    """``capacity`` (the aggregated replicas', by GPU type) extended with every
    disaggregated unit's, by unit name (:func:`unit_capacity`, on ``executor``)."""
    keys = [(name, b) for name, u in units.items() if u.disaggregated for b in slices.names]
    caps = (executor or SerialExecutor()).map(
        _unit_capacity_task, keys, shared=(units, profiles, slices, slo, capacity, kw),
        each=_progress_of(keys, progress))
    return {**capacity, **dict(zip(keys, caps, strict=True))}


def _unit_capacity_task(shared: tuple, key: tuple[str, str]) -> ReplicaCapacity:
    units, profiles, slices, slo, capacity, kw = shared
    u = units[key[0]]
    return unit_capacity(u, profiles[u.gpu_type], slices, key[1], slo,
                         capacity[u.gpu_type, key[1]], **kw)


# --------------------------------------------------------------------- plan and validate


@dataclass
class TypeCheck:
    gpu_type: str
    slot: int
    per_replica_rate_per_s: float
    meets_slo: bool
    attainment: float
    verdicts: dict[str, Any]


@dataclass
class PlanResult:
    instance: CapacityInstance
    solution: CapacitySolution
    capacity: dict[tuple[str, str], ReplicaCapacity]
    type_policy: dict[str, Policy]
    checks: list[TypeCheck]
    rounds: int
    validated: bool
    solver_s: float
    simulation_s: float
    history: list[dict[str, Any]] = field(default_factory=list)
    units: dict[str, Unit] = field(default_factory=dict)  # unit name -> unit (all planned)


def _dominant_bucket(inst: CapacityInstance, sol: CapacitySolution, t: str) -> str | None:
    load = {
        b: sum(sol.routing.get((b, t, s), 0.0) * inst.lam[b, s] / inst.mu[t, b]
               for s in range(inst.n_slots))
        for b in inst.buckets if inst.mu[t, b] > 0
    }
    load = {b: v for b, v in load.items() if v > 0}
    return max(load, key=lambda b: (load[b], b)) if load else None


def _slots_to_check(inst: CapacityInstance, sol: CapacitySolution, t: str) -> list[int]:
    """The slots whose load on type t must be simulated: for each distinct mix of buckets
    routed to t (shares rounded to 0.01), the slot with the highest per-replica rate;
    busiest first. Among slots with the same mix, a lower rate is no harder."""
    best: dict[tuple, tuple[float, int]] = {}
    for s in range(inst.n_slots):
        n = sol.replicas[t, s]
        if n <= 0:
            continue
        rates = [sol.routing.get((b, t, s), 0.0) * inst.lam[b, s] / n for b in inst.buckets]
        total = sum(rates)
        if total <= 1e-12:
            continue
        mix = tuple(round(r / total, 2) for r in rates)
        if mix not in best or total > best[mix][0] + 1e-12:
            best[mix] = (total, s)
    return [s for _r, s in sorted(best.values(), key=lambda x: (-x[0], x[1]))]


def validate_type(
    inst: CapacityInstance,
    sol: CapacitySolution,
    t: str,
    slices: WorkloadSlices,
    profile: Profile,
    policy: Policy,
    slo: SLOSet,
    *,
    engine: str = "vllm",
    n_requests: int = 2000,
    seed: int = 0,
    min_window_s: float | None = None,
) -> list[TypeCheck]:
    """Simulate one replica of type t at each slot of :func:`_slots_to_check` with the
    requests routed to it; stop at the first slot that misses the SLOs."""
    checks = []
    for s in _slots_to_check(inst, sol, t):
        n = sol.replicas[t, s]
        rates = {b: sol.routing.get((b, t, s), 0.0) * inst.lam[b, s] / n for b in inst.buckets}
        rates = {b: r for b, r in rates.items() if r > 1e-12}
        n = window_requests(sum(rates.values()), n_requests, min_window_s)
        trace = slices.mixed_trace(rates, n, seed + 1000 + s)
        result = simulate(trace, policy, profile, engine=engine)
        check = _check_of(t, s, float(sum(rates.values())), result, slo)
        checks.append(check)
        if not check.meets_slo:
            break
    return checks


def validate_units(
    inst: CapacityInstance,
    sol: CapacitySolution,
    name: str,
    unit: Unit,
    slices: WorkloadSlices,
    profile: Profile,
    policy: Policy,
    slo: SLOSet,
    *,
    router: str = DEFAULT_ROUTER,
    link: str = DEFAULT_LINK,
    engine: str = "vllm",
    n_requests: int = 2000,
    seed: int = 0,
    min_window_s: float | None = None,
) -> list[TypeCheck]:
    """Simulate the whole group of units ``name`` as one cluster (n disaggregated units =
    nP prefill + nD decode replicas, or n aggregated replicas, behind ``router``) on all
    the traffic routed to it, at each slot of :func:`_slots_to_check`; stop at the first
    slot that misses the SLOs."""
    checks = []
    kv_link = _link(link)
    for s in _slots_to_check(inst, sol, name):
        n_units = sol.replicas[name, s]
        rates = {b: sol.routing.get((b, name, s), 0.0) * inst.lam[b, s] for b in inst.buckets}
        rates = {b: r for b, r in rates.items() if r > 1e-12}
        total = float(sum(rates.values()))
        trace = slices.mixed_trace(rates, window_requests(total, n_requests, min_window_s),
                                   seed + 1000 + s)
        result, _out = simulate_cluster(trace, unit_specs(unit, profile, policy, engine,
                                                          n_units),
                                        router=router, link=kv_link)
        checks.append(_check_of(name, s, total / n_units, result, slo))
        if not checks[-1].meets_slo:
            break
    return checks


def _validate_task(shared: tuple, t: str) -> list[TypeCheck]:
    """Validate planned type (or group of units) ``t``: as a cluster when it is
    disaggregated or every type is checked as one, else one replica."""
    inst, sol, plan_units, slices, profiles, type_policy, slo, cluster_checks, kw = shared
    u = plan_units[t]
    if u.disaggregated or cluster_checks:
        return validate_units(inst, sol, t, u, slices, profiles[u.gpu_type], type_policy[t],
                              slo, **kw)
    return validate_type(inst, sol, t, slices, profiles[t], type_policy[t], slo,
                         **{k: v for k, v in kw.items() if k not in ("router", "link")})


def _check_of(name: str, s: int, rate: float, result: Any, slo: SLOSet) -> TypeCheck:
    verdicts = result.slo_verdicts(slo)
    return TypeCheck(
        gpu_type=name, slot=s, per_replica_rate_per_s=rate,
        meets_slo=all(ok for ok, _ in verdicts.values()),
        attainment=result.attainment(slo),
        verdicts={c: {"meets_slo": ok, **{k: (None if v != v else v) for k, v in d.items()}}
                  for c, (ok, d) in verdicts.items()},
    )


def build_instance(
    fleet: Fleet,
    type_names: Sequence[str],
    slices: WorkloadSlices,
    lam: dict[tuple[str, int], float],
    mu: dict[tuple[str, str], float],
    n_slots: int,
    hours: float,
    budget: float | None = None,
    units: dict[str, Unit] | None = None,
) -> CapacityInstance:
    """The MILP instance over ``type_names``: GPU types, or unit names of ``units``. With
    any disaggregated unit among them, the instance has serving units (the model's
    docstring); otherwise it is the plain per-type instance."""
    if units and any(units[u].disaggregated for u in type_names):
        return _unit_instance(fleet, [units[u] for u in type_names], slices, lam, mu,
                              n_slots, hours, budget)
    types = [fleet.type_named(n) for n in type_names]
    return CapacityInstance(
        types=tuple(type_names),
        buckets=slices.names,
        n_slots=n_slots,
        lam=lam,
        mu={(t, b): mu[t, b] for t in type_names for b in slices.names},
        price={g.name: g.price_per_replica_hour() for g in types},
        hours=hours,
        headroom=fleet.utilization_headroom,
        n_max={g.name: g.max_replicas() for g in types},
        n_min={g.name: g.min_replicas() for g in types},
        n_plus_one=fleet.redundancy == "n+1",
        budget=budget,
        static=fleet.scaling == "static",
    )


def _unit_instance(
    fleet: Fleet,
    units: Sequence[Unit],
    slices: WorkloadSlices,
    lam: dict[tuple[str, int], float],
    mu: dict[tuple[str, str], float],
    n_slots: int,
    hours: float,
    budget: float | None,
) -> CapacityInstance:
    gpu = {u.gpu_type: fleet.type_named(u.gpu_type) for u in units}
    names = tuple(u.name for u in units)
    return CapacityInstance(
        types=names,
        buckets=slices.names,
        n_slots=n_slots,
        lam=lam,
        mu={(u, b): mu[u, b] for u in names for b in slices.names},
        price={u.name: gpu[u.gpu_type].price_per_replica_hour() * u.size for u in units},
        hours=hours,
        headroom=fleet.utilization_headroom,
        # a unit alone never exceeds its type's limit; the shared limit is type_cap
        n_max={u.name: (None if gpu[u.gpu_type].max_replicas() is None
                        else gpu[u.gpu_type].max_replicas() // u.size) for u in units},
        n_min={},
        n_plus_one=fleet.redundancy == "n+1",
        budget=budget,
        static=fleet.scaling == "static",
        unit_type={u.name: u.gpu_type for u in units},
        unit_size={u.name: u.size for u in units},
        type_max={t: g.max_replicas() for t, g in gpu.items()},
        type_min={t: g.min_replicas() for t, g in gpu.items()},
    )


def plan_capacity(
    fleet: Fleet,
    forecast: Forecast,
    slo: SLOSet,
    slices: WorkloadSlices,
    profiles: dict[str, Profile],
    capacity: dict[tuple[str, str], ReplicaCapacity],
    *,
    type_names: Sequence[str] | None = None,
    growth: float = 1.0,
    engine: str = "vllm",
    budget: float | None = None,
    validate: bool = True,
    max_rounds: int = 8,
    derate: float = 0.85,
    validate_requests: int = 2000,
    min_window_s: float | None = None,
    seed: int = 0,
    time_limit_s: float = 30.0,
    progress: Progress | None = None,
    units: dict[str, Unit] | None = None,
    router: str = DEFAULT_ROUTER,
    link: str = DEFAULT_LINK,
    cluster_checks: bool = False,
    executor: Executor | None = None,
) -> PlanResult:
    """Solve the planning MILP, validate every planned type in simulation, derate the
    capacity of types that miss the SLOs, and re-solve until all meet them. With ``units``
    the MILP plans those serving units (``type_names`` then names units; ``capacity`` holds
    each unit's, by unit name) and disaggregated ones are validated as clusters; with
    ``cluster_checks`` the aggregated ones too (n replicas behind ``router``). The types
    are validated on ``executor``, each independent of the others."""
    units = units or {}
    names = list(type_names) if type_names is not None else (
        list(units) if units else [g.name for g in fleet.gpu_types])
    plan_units = {u: units.get(u, Unit(u)) for u in names}
    lam = slices.bucket_rates(forecast, growth)
    mu = {(t, b): capacity[t, b].rate_per_s for t in names for b in slices.names}
    solver_s = sim_s = 0.0
    history: list[dict[str, Any]] = []
    checks: list[TypeCheck] = []
    validated = not validate
    rounds = 0
    while True:
        rounds += 1
        inst = build_instance(fleet, names, slices, lam, mu, forecast.n_slots,
                              forecast.slot_s / 3600.0, budget, plan_units)
        t0 = time.perf_counter()
        sol = solve_capacity(inst, time_limit_s=time_limit_s)
        solver_s += time.perf_counter() - t0
        type_policy = {}
        for t in names:
            dom = _dominant_bucket(inst, sol, t)
            type_policy[t] = capacity[t, dom].policy if dom else Policy()
        if not validate:
            break
        t0 = time.perf_counter()
        vkw = dict(engine=engine, n_requests=validate_requests, seed=seed,
                   min_window_s=min_window_s)
        checks = [c for per_type in (executor or SerialExecutor()).map(
            _validate_task, names,
            shared=(inst, sol, plan_units, slices, profiles, type_policy, slo,
                    cluster_checks, dict(vkw, router=router, link=link)))
            for c in per_type]
        sim_s += time.perf_counter() - t0
        failing = sorted({c.gpu_type for c in checks if not c.meets_slo}, key=names.index)
        history.append({"round": rounds, "cost": sol.cost, "failing": failing})
        if progress:
            verdict = "derate " + ", ".join(failing) if failing else "all types meet the SLOs"
            progress(f"round {rounds}: cost ${sol.cost:,.2f}, {verdict}")
        if not failing:
            validated = True
            break
        if rounds >= max_rounds:
            break
        # Lower the coefficients of the buckets the failing slot routed to that type.
        for c in checks:
            if not c.meets_slo:
                for b in slices.names:
                    if sol.routing.get((b, c.gpu_type, c.slot), 0.0) > 0:
                        mu[c.gpu_type, b] *= derate
    return PlanResult(inst, sol, dict(capacity), type_policy, checks, rounds, validated,
                      solver_s, sim_s, history, plan_units)


def measure_capacities(
    fleet: Fleet,
    slices: WorkloadSlices,
    profiles: dict[str, Profile],
    slo: SLOSet,
    *,
    engine: str = "vllm",
    method: str = "auto",
    n_requests: int = 1000,
    seed: int = 0,
    cache_dir: Path | None = None,
    min_window_s: float | None = None,
    progress: Progress | None = None,
    executor: Executor | None = None,
) -> dict[tuple[str, str], ReplicaCapacity]:
    """Every (GPU type, bucket)'s :func:`replica_capacity`, measured on ``executor``
    (default: in this process), each independent of the others."""
    keys = [(g.name, b) for g in fleet.gpu_types for b in slices.names]
    kw = dict(engine=engine, method=method, n_requests=n_requests, seed=seed,
              cache_dir=cache_dir, min_window_s=min_window_s)
    caps = (executor or SerialExecutor()).map(
        _replica_capacity_task, keys, shared=(profiles, slices, slo, kw),
        each=_progress_of(keys, progress))
    return dict(zip(keys, caps, strict=True))


def _replica_capacity_task(shared: tuple, key: tuple[str, str]) -> ReplicaCapacity:
    profiles, slices, slo, kw = shared
    return replica_capacity(profiles[key[0]], slices, key[1], slo, **kw)


def _progress_of(keys: list[tuple[str, str]], progress: Progress | None
                 ) -> Callable[[int, ReplicaCapacity], Any] | None:
    """One progress line per measured capacity, in the order of ``keys``."""
    if progress is None:
        return None

    def each(i: int, cap: ReplicaCapacity) -> None:
        src = "cache" if cap.cached else f"{cap.simulations} simulations"
        progress(f"capacity {keys[i][0]} {keys[i][1]}: {cap.rate_per_s:.3g} req/s ({src})")

    return each


def single_type_plans(
    fleet: Fleet,
    forecast: Forecast,
    slo: SLOSet,
    slices: WorkloadSlices,
    profiles: dict[str, Profile],
    capacity: dict[tuple[str, str], ReplicaCapacity],
    *,
    executor: Executor | None = None,
    **kw: Any,
) -> dict[str, dict[str, Any]]:
    """For each GPU type alone (with every unit of it in ``units``, if given): its
    validated plan's cost, or why it cannot serve (the types on ``executor``)."""
    units: dict[str, Unit] = kw.get("units") or {}
    jobs = [([u for u, unit in units.items() if unit.gpu_type == g.name] or [g.name], g.name)
            for g in fleet.gpu_types]
    entries = (executor or SerialExecutor()).map(
        _plan_entry_task, jobs, shared=(fleet, forecast, slo, slices, profiles, capacity, kw))
    return {g: entry for (_names, g), entry in zip(jobs, entries, strict=True)}


def _plan_entry_task(shared: tuple, job: tuple[list[str], str | None]) -> dict[str, Any]:
    fleet, forecast, slo, slices, profiles, capacity, kw = shared
    names, gpu_type = job
    return _plan_entry(fleet, forecast, slo, slices, profiles, capacity, names,
                       gpu_type=gpu_type, **kw)


def _plan_entry(fleet: Fleet, forecast: Forecast, slo: SLOSet, slices: WorkloadSlices,
                profiles: dict[str, Profile], capacity: dict[tuple[str, str], ReplicaCapacity],
                names: list[str], *, gpu_type: str | None = None, **kw: Any
                ) -> dict[str, Any]:
    """The plan restricted to units ``names``: its cost and validation, or why none fits;
    ``peak_replicas`` of ``gpu_type``, else of every GPU type."""
    try:
        res = plan_capacity(fleet, forecast, slo, slices, profiles, capacity,
                            type_names=names, **kw)
    except InfeasibleError as err:
        return {"feasible": False, "reason": err.message}
    inst, sol = res.instance, res.solution
    peak = {g: max(inst.type_replicas(sol, g, s) for s in range(inst.n_slots))
            for g in inst.gpu_types()}
    return {
        "feasible": True,
        "cost": sol.cost,
        "validated": res.validated,
        "peak_replicas": peak[gpu_type] if gpu_type is not None else peak,
        "result": res,
    }


TOPOLOGY_PLANS = ("aggregated", "disaggregated")


def topology_plans(
    fleet: Fleet,
    forecast: Forecast,
    slo: SLOSet,
    slices: WorkloadSlices,
    profiles: dict[str, Profile],
    capacity: dict[tuple[str, str], ReplicaCapacity],
    *,
    executor: Executor | None = None,
    **kw: Any,
) -> dict[str, dict[str, Any]]:
    """The cheapest validated plan with aggregated units only and with disaggregated units
    only (every GPU type), as :func:`single_type_plans` gives each type alone; a kind with
    no unit among ``units`` is left out."""
    units: dict[str, Unit] = kw.get("units") or {}
    kinds = {kind: [u for u, unit in units.items()
                    if unit.disaggregated == (kind == "disaggregated")]
             for kind in TOPOLOGY_PLANS}
    kinds = {kind: names for kind, names in kinds.items() if names}
    entries = (executor or SerialExecutor()).map(
        _plan_entry_task, [(names, None) for names in kinds.values()],
        shared=(fleet, forecast, slo, slices, profiles, capacity, kw))
    return dict(zip(kinds, entries, strict=True))


# ------------------------------------------------------------------------ the plan file


def _r(x: float, nd: int = 6) -> float:
    """Round for the plan file, so that solver noise below 1e-6 never changes its bytes."""
    v = round(float(x), nd)
    return 0.0 if v == 0 else v


def plan_costs(inst: CapacityInstance, sol: CapacitySolution) -> dict[str, Any]:
    hourly = [
        _r(sum(inst.price[t] * sol.replicas[t, s] for t in inst.types), 4)
        for s in range(inst.n_slots)
    ]
    by_type = {  # by GPU type: a type's units summed
        g: _r(sum(inst.price[t] * inst.hours * sol.replicas[t, s] for s in range(inst.n_slots)
                  for t in inst.types if inst.gpu_of(t) == g), 4)
        for g in inst.gpu_types()
    }
    return {
        "hourly_usd": hourly,
        "total_usd": _r(sol.cost, 4),
        "daily_usd": _r(sol.cost * (24.0 / (inst.n_slots * inst.hours)), 4),
        "by_type_usd": by_type,
        "peak_hourly_usd": max(hourly),
    }


def _per_type_checks(checks: list[TypeCheck]) -> dict[str, Any]:
    """Per type: every slot simulated, whether all met the SLOs, and the busiest one."""
    out: dict[str, Any] = {}
    for c in checks:
        row = out.setdefault(c.gpu_type, {"meets_slo": True, "slots_checked": []})
        row["slots_checked"].append(c.slot)
        row["meets_slo"] = row["meets_slo"] and c.meets_slo
        if "busiest_slot" not in row:  # checks come busiest first
            row["busiest_slot"] = c.slot
            row["per_replica_rate_per_s"] = _r(c.per_replica_rate_per_s, 4)
            row["attainment"] = _r(c.attainment, 4)
    return out


def best_single(single: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    feasible = [(v["cost"], k) for k, v in single.items() if v.get("feasible")]
    if not feasible:
        return None
    _cost, name = min(feasible)
    return name, single[name]


def plan_document(
    result: PlanResult,
    fleet: Fleet,
    slices: WorkloadSlices,
    single: dict[str, dict[str, Any]],
    *,
    profile_paths: dict[str, str],
    inputs: dict[str, Any],
    growth: float,
    engine: str,
    sample: dict[str, Any],
    name: str = "plan",
    topology: dict[str, Any] | None = None,
) -> CapacityPlan:
    """The CapacityPlan document (deterministic: no wall-clock values); ``topology`` is
    :func:`topology_section`'s (omitted for aggregated-only plans)."""
    inst, sol = result.instance, result.solution
    S = range(inst.n_slots)
    gpu_types = inst.gpu_types()
    types = []
    for t in gpu_types:
        g = fleet.type_named(t)
        # the aggregated replica's capacity and policy (measured, where no agg unit is planned)
        mu = {b: inst.mu[t, b] if t in inst.types else result.capacity[t, b].rate_per_s
              for b in inst.buckets}
        policy = result.type_policy.get(t) or next(
            result.type_policy[u] for u in inst.types if inst.gpu_of(u) == t)
        types.append(PlanGPUType(
            name=t,
            profile=profile_paths[t],
            price_per_gpu_hour=g.price_per_gpu_hour,
            gpus_per_replica=g.replica_gpus,
            capacity_rate_per_s={b: _r(v, 4) for b, v in mu.items()},
            policy=policy.model_dump(mode="json"),
        ))
    routing: dict[str, dict[str, list[float]]] = {}
    for b in inst.buckets:
        routing[b] = {}
        for t in gpu_types:  # a GPU type's units summed
            row = [_r(sum(sol.routing.get((b, u, s), 0.0) for u in inst.types
                          if inst.gpu_of(u) == t), 6) for s in S]
            if any(row):
                routing[b][t] = row
    bucket_rows = [
        PlanBucket(name=bk.name, prompt_tokens=[bk.prompt_lo, bk.prompt_hi],
                   output_tokens=[bk.output_lo, bk.output_hi], share=_r(slices.share[bk.name]))
        for bk in slices.buckets
    ]
    best = best_single(single)
    cost = plan_costs(inst, sol)
    single_out = {
        k: ({"feasible": True, "daily_usd": _r(v["cost"] * 24.0 / (inst.n_slots * inst.hours), 4),
             "validated": v["validated"], "peak_replicas": v["peak_replicas"]}
            if v.get("feasible") else {"feasible": False, "reason": v["reason"]})
        for k, v in single.items()
    }
    if best is not None:
        best_daily = best[1]["cost"] * 24.0 / (inst.n_slots * inst.hours)
        single_out["best"] = best[0]
        single_out["saving_pct"] = _r(
            100.0 * (best_daily - cost["daily_usd"]) / best_daily if best_daily > 0 else 0.0, 2
        )
    return CapacityPlan(
        name=name,
        inputs=inputs,
        growth=growth,
        slot_s=inst.hours * 3600.0,
        n_slots=inst.n_slots,
        engine=engine,
        sample=sample,
        buckets=bucket_rows,
        gpu_types=types,
        replicas={t: [inst.type_replicas(sol, t, s) for s in S] for t in gpu_types},
        gpus={t: [inst.type_replicas(sol, t, s) * fleet.type_named(t).replica_gpus for s in S]
              for t in gpu_types},
        routing=routing,
        cost=cost,
        single_type=single_out,
        validation={
            "validated": result.validated,
            "rounds": result.rounds,
            "history": [{**h, "cost": _r(h["cost"], 4)} for h in result.history],
            "per_type": _per_type_checks(result.checks),
        },
        solver={"status": sol.status, "headroom": inst.headroom,
                "redundancy": fleet.redundancy, "scaling": fleet.scaling,
                "budget_usd": inst.budget, "served_share": _r(sol.served_share, 4)},
        topology=topology or {},
    )


def _peak_gpus(fleet: Fleet, peak_replicas: dict[str, int]) -> dict[str, int]:
    return {t: n * fleet.type_named(t).replica_gpus for t, n in peak_replicas.items()}


def topology_section(
    result: PlanResult,
    fleet: Fleet,
    compared: dict[str, dict[str, Any]],
    *,
    topologies: Sequence[str],
    router: str,
    link: str,
) -> dict[str, Any]:
    """The plan's ``topology``: the options, which topology each GPU type got (``agg``,
    ``1:2``, ``agg+1:2`` where it runs both, ``none`` where unused), every unit's
    capacity, count and routing, and the aggregated-only, disaggregated-only and mixed
    (this) plans' daily costs side by side."""
    inst, sol = result.instance, result.solution
    S = range(inst.n_slots)
    day = 24.0 / (inst.n_slots * inst.hours)
    chosen: dict[str, str] = {}
    units: dict[str, Any] = {}
    for u in inst.types:
        unit = result.units.get(u, Unit(u))
        counts = [sol.replicas[u, s] for s in S]
        if any(counts):
            chosen[unit.gpu_type] = "+".join(
                x for x in (chosen.get(unit.gpu_type), unit.topology) if x)
        units[u] = {
            "gpu_type": unit.gpu_type, "topology": unit.topology,
            "prefill_replicas": unit.prefill, "decode_replicas": unit.decode,
            "replicas_per_unit": unit.size,
            "capacity_rate_per_s": {b: _r(inst.mu[u, b], 4) for b in inst.buckets},
            "units": counts,
            "routing": {b: row for b in inst.buckets
                        if any(row := [_r(sol.routing.get((b, u, s), 0.0), 6) for s in S])},
        }
    per_type = {t: chosen.get(t, "none") for t in inst.gpu_types()}
    comparison: dict[str, Any] = {}
    for kind, v in compared.items():
        comparison[kind] = (
            {"feasible": True, "daily_usd": _r(v["cost"] * day, 4), "validated": v["validated"],
             "peak_gpus": _peak_gpus(fleet, v["peak_replicas"])}
            if v.get("feasible") else {"feasible": False, "reason": v["reason"]})
    comparison["mixed"] = {"feasible": True, "daily_usd": _r(sol.cost * day, 4),
                           "validated": result.validated}
    # on a tie the mixed plan (this one) is named: it is the plan written
    costs = [(v["daily_usd"], k != "mixed", k) for k, v in comparison.items() if v.get("feasible")]
    comparison["cheapest"] = min(costs)[2]
    return {"options": list(topologies), "router": router, "link": link,
            "per_type": per_type, "units": units, "comparison": comparison}


# ------------------------------------------------------------------- the whole command


@dataclass
class PlanRun:
    plan: CapacityPlan
    result: PlanResult
    single: dict[str, dict[str, Any]]
    sweep: list[dict[str, Any]]
    timings: dict[str, float]
    slices: WorkloadSlices


def load_fleet_profiles(
    fleet: Fleet, fleet_path: Path
) -> tuple[Fleet, dict[str, Profile], dict[str, Path]]:
    """Load each GPU type's profile; errors name the fleet file and field. Returns the
    fleet with every ``gpus_per_replica`` filled in from its profile."""
    profiles, paths = {}, {}
    types = []
    for i, g in enumerate(fleet.gpu_types):
        if g.profiles is not None and fleet.model is not None and fleet.model not in g.profiles:
            continue  # this GPU type has no profile for the model: it cannot serve it
        try:
            path = g.profile_path(fleet.model, fleet_path.parent)
        except ValueError as exc:
            raise ServetuneError(f"{fleet_path}: gpu_types.{i}: {exc}") from None
        if not path.exists() and path.suffix:
            raise ServetuneError(
                f"{fleet_path}: gpu_types.{i} ({g.name}): profile {path} not found; fix the "
                "path (relative to the fleet file) or build it with `servetune profile fit`"
            )
        prof = load_profile(path)
        tp = getattr(prof, "tensor_parallel", 1)
        if g.gpus_per_replica is not None and tp != g.gpus_per_replica:
            raise ServetuneError(
                f"{fleet_path}: gpu_types.{i}.gpus_per_replica is {g.gpus_per_replica} but "
                f"profile {path.name} runs on {tp} GPUs (tensor_parallel); make them agree"
            )
        types.append(g.model_copy(update={"gpus_per_replica": tp}))
        profiles[g.name] = prof
        paths[g.name] = path
    if not types:
        raise ServetuneError(
            f"{fleet_path}: gpu_types: no GPU type has a profile for model {fleet.model!r}"
        )
    return fleet.model_copy(update={"gpu_types": types}), profiles, paths


def _rel(path: Path, base: Path | None) -> str:
    if base is None:
        return str(path)
    try:
        return os.path.relpath(path.resolve(), base.resolve())
    except ValueError:  # another drive
        return str(path.resolve())


def run_plan(
    workload_path: Path,
    forecast_path: Path,
    fleet_path: Path,
    slo_path: Path,
    *,
    out_path: Path | None = None,
    growth: float = 1.0,
    sweep: Sequence[float] | None = None,
    cache_dir: Path | None = None,
    engine: str = "vllm",
    method: str = "auto",
    prompt_edges: Sequence[int] = DEFAULT_PROMPT_EDGES,
    output_edges: Sequence[int] = DEFAULT_OUTPUT_EDGES,
    sample_requests: int = 20000,
    capacity_requests: int = 1000,
    validate_requests: int = 2000,
    min_window_s: float | None = None,
    budget: float | None = None,
    compare_single: bool = True,
    model: str | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    topologies: Sequence[str] | str = DEFAULT_TOPOLOGIES,
    router: str = DEFAULT_ROUTER,
    link: str = DEFAULT_LINK,
    executor: Executor | None = None,
) -> PlanRun:
    """Everything ``servetune plan`` does, as a function: load, bucket, measure capacity
    (cached), plan and validate, compare with single types, optionally sweep growth. The
    independent simulations (capacities, validations per type, single-type plans, growth
    scenarios) run on ``executor`` (default: in this process); the plan is the same,
    byte for byte, on any executor."""
    ex = executor or SerialExecutor()
    t_start = time.perf_counter()
    workload = load_workload(workload_path)
    forecast = load_document(forecast_path, Forecast)
    fleet = load_document(fleet_path, Fleet)
    if model is not None:
        fleet = fleet.model_copy(update={"model": model})
    slo = load_document(slo_path, SLOSet)
    if not (growth > 0 and math.isfinite(growth)):
        raise ServetuneError(f"argument `growth`: factors must be > 0 (got {growth})")
    topologies = parse_topologies(topologies)
    disagg = any(x != AGG for x in topologies)
    if disagg:
        _check_disagg_args(engine, router, link)
    all_types = [g.name for g in fleet.gpu_types]
    fleet, profiles, profile_paths = load_fleet_profiles(fleet, fleet_path)
    # GPU types without a profile for the model cannot serve it: say so, never drop silently
    excluded = {t: f"no profile for model {fleet.model}" for t in all_types if t not in profiles}
    # class names must line up before any simulation runs
    buckets = make_buckets(prompt_edges, output_edges)
    slices = slice_workload(workload, buckets, n_requests=sample_requests, seed=seed)
    _check_classes(slices, forecast, forecast_path, slo, slo_path)
    t0 = time.perf_counter()
    capacity = measure_capacities(fleet, slices, profiles, slo, engine=engine, method=method,
                                  n_requests=capacity_requests, seed=seed,
                                  cache_dir=cache_dir, min_window_s=min_window_s,
                                  progress=progress, executor=ex)
    if disagg:
        _check_kv_transfer(profiles, profile_paths)
    units = fleet_units([g.name for g in fleet.gpu_types], topologies)
    if disagg:
        capacity = measure_unit_capacities(
            units, slices, profiles, slo, capacity, router=router, link=link, engine=engine,
            n_requests=capacity_requests, seed=seed, cache_dir=cache_dir,
            min_window_s=min_window_s, progress=progress, executor=ex)
    capacity_s = time.perf_counter() - t0
    kw = dict(engine=engine, validate_requests=validate_requests, min_window_s=min_window_s,
              seed=seed, units=units, router=router, link=link, cluster_checks=disagg)
    result = plan_capacity(fleet, forecast, slo, slices, profiles, capacity, growth=growth,
                           budget=budget, progress=progress, executor=ex, **kw)
    single: dict[str, dict[str, Any]] = {}
    compared: dict[str, dict[str, Any]] = {}
    if compare_single and budget is None:
        single = single_type_plans(fleet, forecast, slo, slices, profiles, capacity,
                                   growth=growth, executor=ex, **kw)
        if disagg:
            compared = topology_plans(fleet, forecast, slo, slices, profiles, capacity,
                                      growth=growth, executor=ex, **kw)
        result = _cheapest(result, single, compared)
        if result.instance.types != tuple(units):
            _widen(result, fleet, capacity, slices, units)
    base = out_path.parent if out_path is not None else Path.cwd()
    inputs = {
        name: {"path": _rel(p, base), "sha256": sha256_file(p)}
        for name, p in (("workload", workload_path), ("forecast", forecast_path),
                        ("fleet", fleet_path), ("slo", slo_path))
    }
    sample = {"requests": sample_requests, "seed": seed, "prompt_edges": list(prompt_edges),
              "output_edges": list(output_edges), "capacity_requests": capacity_requests,
              "min_window_s": window_s(min_window_s),
              "capacity_method": sorted({c.method for c in capacity.values()})}
    topology = (topology_section(result, fleet, compared, topologies=topologies,
                                 router=router, link=link) if disagg else None)
    plan = plan_document(result, fleet, slices, single,
                         profile_paths={t: _rel(p, base) for t, p in profile_paths.items()},
                         inputs=inputs, growth=growth, engine=engine, sample=sample,
                         name=f"{fleet.name}-{forecast.name}", topology=topology)
    plan.excluded_gpu_types = excluded
    # the plan above is the scenario of its own growth: the same row, not planned twice
    reused = budget is None and compare_single
    todo = [g for g in sweep or () if not (g == growth and reused)]
    scenarios = dict(zip(todo, ex.map(_growth_task, todo, shared=(
        fleet, forecast, slo, slices, profiles, capacity, kw)), strict=True))
    rows = [_growth_row(g, *scenarios.get(g, (result, best_single(single), None)), fleet,
                        forecast, progress) for g in sweep or ()]
    plan.growth_sweep = rows
    timings = {"capacity_s": capacity_s, "total_s": time.perf_counter() - t_start,
               "solver_s": result.solver_s, "simulation_s": result.simulation_s}
    return PlanRun(plan, result, single, rows, timings, slices)


def _check_disagg_args(engine: str, router: str, link: str) -> None:
    """A disaggregated plan's engine (one that can decode), router and link."""
    if engine not in DISAGG_DECODE_ENGINES:
        decoders = " or ".join(DISAGG_DECODE_ENGINES)
        raise ServetuneError(
            f"argument `topologies`: disaggregated units are simulated with "
            f"{decoders} decode replicas only; use engine {decoders} or topologies agg "
            f"(got engine {engine})")
    if router not in ROUTER_NAMES:
        raise ServetuneError(f"argument `router`: {router!r} is unknown; choose one of "
                             f"{', '.join(ROUTER_NAMES)}")
    _link(link)


def _check_classes(slices: WorkloadSlices, forecast: Forecast, forecast_path: Path,
                   slo: SLOSet, slo_path: Path) -> None:
    """The forecast and the SLO set name every class of the sliced workload (before any
    simulation runs)."""
    try:
        class_rates_for(forecast, slices.class_names, slices.class_weight)
    except ServetuneError as err:
        raise ServetuneError(f"{forecast_path}: {err.message.removeprefix('forecast: ')}") from None
    for c in slices.class_names:
        try:
            slo.for_class(c)
        except KeyError:
            raise ServetuneError(
                f"{slo_path}: classes: no entry for workload class {c!r}; add it or 'default'"
            ) from None


def _check_kv_transfer(profiles: dict[str, Profile], profile_paths: dict[str, Path]) -> None:
    """Every profile can size a disaggregated unit's KV transfer (it has hardware and
    model)."""
    for t, prof in profiles.items():
        try:
            prof.kv_bytes_per_token()
        except ServetuneError:
            raise ServetuneError(
                f"{profile_paths[t]}: GPU type {t}: the profile has no hardware and model, "
                "so a disaggregated unit's KV transfer cannot be sized; add them or plan "
                "with topologies agg") from None


def _cheapest(result: PlanResult, single: dict[str, dict[str, Any]],
              compared: dict[str, dict[str, Any]]) -> PlanResult:
    """The plan to recommend: a validated single-type (or single-topology) plan is also a
    plan for the whole fleet, so never a mix that costs more after validation derated it."""
    best = best_single(single)
    for alt in ([best[1]] if best is not None else []) + [
            v for v in compared.values() if v.get("feasible")]:
        if alt["cost"] < result.solution.cost - 1e-9 and (
            alt["validated"] or not result.validated
        ):
            result = alt["result"]
    return result


def _growth_row(g: float, res_g: PlanResult, best_g: tuple[str, dict[str, Any]] | None,
                infeasible: str | None, fleet: Fleet, forecast: Forecast,
                progress: Progress | None) -> dict[str, Any]:
    """One growth scenario's row of the sweep: its daily cost, peak GPUs per type, the best
    single type's cost and the saving; or why it is infeasible."""
    if infeasible is not None:  # one scenario beyond the limits: say so, go on
        if progress:
            progress(f"growth x{g:g}: infeasible: {infeasible}")
        return {"growth": g, "feasible": False, "reason": infeasible}
    scale = 24.0 / (forecast.n_slots * forecast.slot_s / 3600.0)
    mixed = res_g.solution.cost * scale
    row = {
        "growth": g,
        "feasible": True,
        "daily_usd": _r(mixed, 2),
        "peak_gpus": {
            t: max(res_g.instance.type_replicas(res_g.solution, t, s)
                   for s in range(forecast.n_slots))
            * fleet.type_named(t).replica_gpus for t in res_g.instance.gpu_types()
        },
        "best_single": best_g[0] if best_g else None,
        "best_single_daily_usd": _r(best_g[1]["cost"] * scale, 2) if best_g else None,
        "validated": res_g.validated,
    }
    row["saving_pct"] = (
        _r(100 * (row["best_single_daily_usd"] - mixed) / row["best_single_daily_usd"], 2)
        if best_g else None
    )
    if progress:
        progress(f"growth x{g:g}: ${mixed:,.0f}/day")
    return row


def _growth_task(shared: tuple, g: float
                 ) -> tuple[PlanResult | None, tuple[str, dict] | None, str | None]:
    """The plan of one growth scenario and its best single type, or why it is infeasible."""
    fleet, forecast, slo, slices, profiles, capacity, kw = shared
    best_g = best_single(single_type_plans(fleet, forecast, slo, slices, profiles, capacity,
                                           growth=g, **kw))
    try:
        res_g = plan_capacity(fleet, forecast, slo, slices, profiles, capacity, growth=g, **kw)
    except InfeasibleError as err:
        return None, best_g, err.message
    if best_g is not None and best_g[1]["cost"] < res_g.solution.cost:
        res_g = best_g[1]["result"]  # as for the main plan: never a dearer mix
    return res_g, best_g, None


def _widen(result: PlanResult, fleet: Fleet, capacity: dict, slices: WorkloadSlices,
           units: dict[str, Unit]) -> None:
    """Re-express a single-type (or single-topology) result over every unit of every fleet
    type (the others at 0 replicas), so the plan file always lists the whole fleet."""
    inst, sol = result.instance, result.solution
    names = list(units)
    mu = dict(inst.mu)
    for t in names:
        for b in inst.buckets:
            mu.setdefault((t, b), capacity[t, b].rate_per_s)
    wide = build_instance(fleet, names, slices, inst.lam, mu, inst.n_slots, inst.hours,
                          inst.budget, units)
    replicas = {(t, s): sol.replicas.get((t, s), 0) for t in names for s in range(inst.n_slots)}
    result.instance = wide
    result.solution = CapacitySolution(sol.status, replicas, sol.routing, sol.cost,
                                       sol.served_share, sol.solver_s)
    for t in names:
        result.type_policy.setdefault(t, Policy())
    result.units = dict(units)
