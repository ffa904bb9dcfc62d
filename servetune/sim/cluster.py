"""Many engine replicas behind a router, in one event loop; and disaggregated prefill/decode.

Each replica is one engine model (:mod:`servetune.sim._kernel`, its own policy, profile,
KV pool and prefix cache). Requests reach the replicas in arrival order; at each arrival the
router picks a replica from the replicas' state at that moment: every replica has run the
steps that start before the arrival (the step in progress when it comes is finished first,
so the router sees the state at that step's end, as a real router's stats lag by a step),
then the request joins the chosen replica's queue at its next step boundary, exactly as in a
single-engine run. Routers (:data:`servetune.routers.ROUTERS`):

- ``round_robin``: the i-th request to replica ``i mod N``;
- ``session``: by the request's first prefix id (a conversation or a shared system prompt:
  requests that start alike go to the same replica), ``id mod N``; requests with no prefix
  ids go round robin;
- ``least_loaded``: the fewest waiting + running requests;
- ``least_kv``: the least KV committed: blocks in use plus the blocks of queued prompts, as a
  share of the replica's pool;
- ``prefix_aware``: the lowest cost ``prompt blocks not cached there + blocks committed
  there`` (the form of Dynamo's KV router, with weight 1 on the prefill term): a replica
  that holds the prompt's prefix wins unless it is the busier by more than the prefix.

Ties go to the lowest replica index. ``round_robin`` and ``session`` read no state, so their
replicas run independently (each in one pass); the others advance every replica to each
arrival.

Disaggregated serving (``roles``): prefill replicas run each request's prompt and sample its
first token (the request ends there, its blocks freed into the prefix cache); its KV then
goes to a decode replica chosen by the router among the decode replicas (at the moment the
prefill ends). The decode replica admits it like any request whose first ``prompt - 1``
tokens are in KV already (vLLM recomputes at least the last token), so its KV check counts
the whole prompt; it cannot run until the transfer is done: ``prompt * kv_bytes_per_token /
bandwidth + latency`` after its admission, so a decode replica that cannot take the KV makes
the transfer wait. The client's first token is the decode replica's first token (TTFT
includes the prefill, the wait and the transfer). A request the prefill side turns away is
not forwarded. Decode replicas must be vLLM (the kernel's KV-arrival rule is vLLM's).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from servetune.engines import (
    CLUSTER_BYTES_PER_KV_BLOCK,
    CLUSTER_BYTES_PER_REQUEST,
    DISAGG_DECODE_ENGINES,
    MAX_CLUSTER_STATE_BYTES,
    MAX_REPLICAS,
)
from servetune.errors import ServetuneError
from servetune.executor import default_workers
from servetune.profiles.schema import Profile
from servetune.routers import MAX_ROUTED_REPLICAS, ROUTERS, kernel_code
from servetune.routers import router as router_row
from servetune.schemas.policy import Policy
from servetune.schemas.topology import LINK_NAMES, ROLES
from servetune.sim import _kernel as K
from servetune.sim import engine as E
from servetune.sim.metrics import prefix_cache_summary
from servetune.workloads.trace import Trace


@dataclass(frozen=True)
class Link:
    """A KV transfer path: bytes per second per GPU and a fixed latency per transfer."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float


# Nominal per-GPU rates (one direction): NVLink 4 on H100/H200 is 900 GB/s bidirectional;
# one NDR InfiniBand port per GPU 400 Gb/s; one 200 GbE RoCE port per GPU. Latencies are a
# transfer's fixed cost (connection, descriptors), not the wire's.
LINKS = {link.name: link for link in (
    Link("nvlink", 450e9, 20e-6),
    Link("infiniband", 50e9, 50e-6),
    Link("roce", 25e9, 100e-6),
)}
assert tuple(LINKS) == LINK_NAMES
__all__ = ["LINKS", "ROLES", "ClusterOutput", "Link", "ReplicaSpec",
           "disaggregated_specs", "parse_disagg", "replica_summaries", "run_cluster"]


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica: its engine model, profile and policy, and its role."""

    profile: Profile
    policy: Policy
    engine: str = "vllm"
    role: str = "both"  # both | prefill | decode
    name: str = ""


@dataclass(eq=False)
class ClusterOutput:
    """The cluster's run: per-request arrays over the whole trace (as one engine's
    :class:`~servetune.sim.engine.EngineOutput`, in ``merged``), the replica each request was
    routed to (``replica``; ``decode_replica`` under disaggregation, -1: none), and each
    replica's own engine output over its requests (``rows[k]``: their trace rows)."""

    merged: E.EngineOutput
    replica: np.ndarray
    decode_replica: np.ndarray | None
    specs: tuple[ReplicaSpec, ...]
    outputs: list[E.EngineOutput]
    rows: list[np.ndarray]
    router: str
    link: Link | None = None
    transfer_s: np.ndarray | None = None  # per request (disaggregated), else None
    notes: list[str] = field(default_factory=list)


class _Replica:
    """One replica's kernel state, fed rows as the router sends them."""

    def __init__(self, index: int, spec: ReplicaSpec, trace: Trace, *, reference: bool,
                 prefix_caching: bool | None, horizon_s: float,
                 prefix: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        self.index = index
        self.spec = spec
        profile = spec.profile
        self.block_size = profile.block_size
        self.total = profile.kv_blocks()
        E._validate(trace, self.total, self.block_size, spec.engine)
        role_trace = trace
        if spec.role == "prefill":  # the prefill side samples the first token only
            ones = np.ones(len(trace), dtype=np.int64)
            role_trace = replace(trace, output_tokens=ones, max_tokens=ones)
        self.km = E._kernel_module(reference)
        self.params = E.kernel_params(
            spec.policy, engine=spec.engine, kv_blocks=self.total, block_size=self.block_size,
            step_time=profile.step_time, reference=reference, prefix_caching=prefix_caching,
            prefix_block_tokens=trace.prefix_block_tokens, class_names=trace.class_names)
        full = E.kernel_requests(role_trace, spec.policy, engine=spec.engine,
                                 block_size=self.block_size, prefix=prefix)
        if spec.role == "decode":
            full = full._replace(precomputed=np.maximum(full.prompt - 1, 0))
        self.full = full
        n = len(trace)
        width = int(full.prefix_start[-1])
        self.rq = K.Requests(**{
            name: (np.zeros(n + 1, np.int64) if name == "prefix_start"
                   else np.zeros(max(width, 1), np.int64) if name == "prefix_ids"
                   else np.zeros(n, getattr(full, name).dtype))
            for name in K.Requests._fields
        })
        # the lanes' queues have room for every row of their lane the router may send
        self.state = E._initial_state(self.params, self.rq, reference, known=0,
                                      horizon_s=horizon_s, lanes=full.lane)
        # which requests this replica could never run: its own checks on its empty engine
        self.km.reject_at_arrival(self.params, full, self.state)
        self.log = E._new_step_log(False, len(self.state.running), reference)
        self.scalars = self.state.scalars[0]
        # the scalars the loop reads and writes, as 1-element views (a record's field
        # access costs microseconds, and the router reads them at every arrival)
        holder = self.state.scalars
        self._view = {} if reference else {
            name: holder[name] for name in ("now", "known", "next_arrival", "n_running",
                                            "until")}
        self.waiting = self.state.lanes[:, K.LANE_WAITING]  # a view
        self.rows: list[int] = []

    def _get(self, name: str) -> Any:
        if self.km is not K:  # reference mode: a namespace of scalars
            return getattr(self.scalars, name)
        return self._view[name][0]

    def _set(self, name: str, value: Any) -> None:
        if self.km is not K:
            setattr(self.scalars, name, value)
        else:
            self._view[name][0] = value

    def append(self, row: int, arrival_s: float, ready_delay_s: float = 0.0) -> None:
        """Route trace row ``row`` here, arriving at ``arrival_s``."""
        m = self.km.append_row(self.rq, self.state, self.full, row, arrival_s)
        self.rq.ready_delay[m] = ready_delay_s
        self.rows.append(row)

    def append_all(self, rows: np.ndarray, arrival_s: np.ndarray) -> None:
        """Route trace rows ``rows`` (ascending) here, each arriving at ``arrival_s[row]``."""
        self.km.append_rows(self.rq, self.state, self.full, rows, arrival_s)
        self.rows.extend(rows.tolist())

    def idle(self) -> bool:
        return (self._get("next_arrival") >= self._get("known") and self._get("n_running") == 0
                and not self.waiting.any())

    def advance(self, until: float) -> None:
        """Run the steps that start before ``until`` (all of them: ``inf``)."""
        if self._get("now") >= until or self.idle():
            return
        self._set("until", until)
        sc = self.scalars
        while True:
            rc = self.km.run_kernel(self.params, self.rq, self.state, self.log, 1 << 40)
            if rc in (K.RC_DONE, K.RC_UNTIL):
                return
            if rc == K.RC_STUCK:
                raise RuntimeError(f"replica {self.index} made no progress at t={sc.now:.6f} "
                                   "(a bug)")

    def completed_since(self, start: int) -> np.ndarray:
        """Local rows completed after the first ``start`` completions, in order."""
        return self.state.done_order[start:int(self.scalars.n_done)]

    def output(self) -> E.EngineOutput:
        """This replica's engine output over its rows (in routing order)."""
        m = len(self.rows)
        st, sc = self.state, self.scalars
        sim_end = float(sc.now)
        kv_mean = float(sc.kv_integral) / (sim_end * self.total) if sim_end > 0 else 0.0
        return E.EngineOutput(
            admitted_s=st.admitted_s[:m], first_token_s=st.first_token_s[:m],
            finish_s=st.finish_s[:m], preemptions=st.preemptions[:m], status=st.status[:m],
            reason=st.reason[:m], generated=st.generated[:m], steps=int(sc.steps),
            kv_blocks_total=self.total, kv_util_mean=min(kv_mean, float(sc.peak) / self.total),
            kv_util_peak=float(sc.peak) / self.total, sim_end_s=sim_end,
            series=E._series(st.series, float(sc.bin_width), sim_end, self.total),
            engine=self.spec.engine, jumps=int(sc.jumps), kv_blocks_in_use_end=int(sc.used),
            prefix_caching=bool(self.params.prefix_caching),
            hit_tokens=st.hit_tokens[:m] if self.params.prefix_caching else None,
            cache_evictions=int(sc.evictions), block_size=self.block_size,
        )


class _Router:
    """Picks a replica among ``pool`` for each request: round robin and session here, the
    routers that read the replicas' state in the kernel (``pick_replica``)."""

    def __init__(self, name: str, pool: list[_Replica],
                 prefix: tuple[np.ndarray, np.ndarray]) -> None:
        self.name = name
        self.reads_replicas = router_row(name).reads_replicas
        self.pool = pool
        self.prefix_start, self.prefix_ids = prefix
        self.count = 0
        self.tuples: tuple[tuple[Any, ...], ...] | None = None

    def static_picks(self, rows: np.ndarray) -> np.ndarray:
        """A static router's picks (indices into ``pool``) for ``rows``, in order: round
        robin by turn; session by the request's first prefix id (its turn without ids)."""
        turn = self.count + np.arange(len(rows), dtype=np.int64)
        self.count += len(rows)
        if self.name == "session":
            start, end = self.prefix_start[rows], self.prefix_start[rows + 1]
            first = self.prefix_ids[np.minimum(start, len(self.prefix_ids) - 1)]
            turn = np.where(end > start, first, turn)
        return turn % len(self.pool)

    def pick(self, row: int) -> _Replica:
        pool = self.pool
        if not self.reads_replicas:
            return pool[int(self.static_picks(np.array([row]))[0])]
        if self.tuples is None:
            self.tuples = (tuple(r.params for r in pool), tuple(r.rq for r in pool),
                           tuple(r.state for r in pool), tuple(r.full for r in pool))
        return pool[int(pool[0].km.pick_replica(*self.tuples, row, kernel_code(self.name)))]


def _check(specs: Sequence[ReplicaSpec], router: str) -> tuple[list[int], list[int]]:
    reads = router_row(router).reads_replicas
    if not specs:
        raise ServetuneError("a cluster needs at least one replica")
    for k, spec in enumerate(specs):
        if spec.role not in ROLES:
            raise ServetuneError(f"replica {k}: role {spec.role!r}; choose one of "
                                 f"{', '.join(ROLES)}")
    prefill = [k for k, s in enumerate(specs) if s.role == "prefill"]
    decode = [k for k, s in enumerate(specs) if s.role == "decode"]
    both = [k for k, s in enumerate(specs) if s.role == "both"]
    # (a disaggregated cluster routes in Python, not in the compiled loop)
    if reads and not prefill and len(specs) > MAX_ROUTED_REPLICAS:
        raise ServetuneError(
            f"router {router!r} with {len(specs):,} replicas: it reads every replica at every "
            f"arrival in a compiled loop built per replica count, which takes minutes and "
            f"gigabytes to build beyond {MAX_ROUTED_REPLICAS}; give at most "
            f"{MAX_ROUTED_REPLICAS} replicas with it, or a static router "
            f"({', '.join(r.name for r in ROUTERS if not r.reads_replicas)}) for up to "
            f"{MAX_REPLICAS:,}")
    if (prefill or decode) and (both or not prefill or not decode):
        raise ServetuneError(
            "a disaggregated cluster has prefill and decode replicas only (at least one "
            f"of each); got {len(prefill)} prefill, {len(decode)} decode, {len(both)} both")
    for k in decode:
        if specs[k].engine not in DISAGG_DECODE_ENGINES:
            raise ServetuneError(f"replica {k}: decode replicas are simulated as vLLM's "
                                 f"(got engine {specs[k].engine!r})")
    return prefill, decode


def _check_state_bytes(specs: Sequence[ReplicaSpec], n: int) -> None:
    """Refuse, before allocating, a cluster whose replicas' state would pass
    MAX_CLUSTER_STATE_BYTES: each holds arrays over all ``n`` requests and its KV pool."""
    if len(specs) < 2:
        return
    blocks = sum(spec.profile.kv_blocks() for spec in specs)
    need = len(specs) * n * CLUSTER_BYTES_PER_REQUEST + blocks * CLUSTER_BYTES_PER_KV_BLOCK
    if need > MAX_CLUSTER_STATE_BYTES:
        per_replica = need / len(specs)
        fits = int(MAX_CLUSTER_STATE_BYTES // per_replica)
        raise ServetuneError(
            f"{len(specs):,} replicas x {n:,} requests: the replicas' state would take about "
            f"{need / 2**30:.1f} GiB (each holds {CLUSTER_BYTES_PER_REQUEST} bytes per "
            f"request and {CLUSTER_BYTES_PER_KV_BLOCK} per KV block; at most "
            f"{MAX_CLUSTER_STATE_BYTES / 2**30:g} GiB in one simulation): give fewer "
            f"requests or at most {fits:,} replicas")


def run_cluster(
    trace: Trace,
    specs: Sequence[ReplicaSpec],
    *,
    router: str = "round_robin",
    link: Link | None = None,
    reference: bool = False,
    prefix_caching: bool | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> ClusterOutput:
    """Serve ``trace`` on the replicas ``specs`` behind ``router`` (module docstring);
    a disaggregated cluster (prefill and decode roles) moves KV over ``link`` (default
    InfiniBand). ``prefix_caching`` overrides every replica's policy."""
    prefill_idx, decode_idx = _check(specs, router)
    disagg = bool(prefill_idx)
    n = len(trace)
    _check_state_bytes(specs, n)
    horizon = float(trace.arrival_s[-1]) if n else 0.0
    prefix = E.prefix_columns(trace)
    replicas = [_Replica(k, spec, trace, reference=reference, prefix_caching=prefix_caching,
                         horizon_s=horizon, prefix=prefix) for k, spec in enumerate(specs)]
    front = [replicas[k] for k in prefill_idx] if disagg else replicas
    route = _Router(router, front, prefix)
    arrival = trace.arrival_s
    replica_of = np.full(n, -1, dtype=np.int64)
    local_of = np.full(n, -1, dtype=np.int64)
    every = max(n // 100, 1)

    if not disagg:
        if not route.reads_replicas:
            replica_of = route.static_picks(np.arange(n))
            for rep in replicas:
                rows = np.flatnonzero(replica_of == rep.index)
                local_of[rows] = np.arange(len(rows))
                rep.append_all(rows, arrival)
        else:  # the router reads every replica at every arrival: one compiled loop
            rc = replicas[0].km.route_arrivals(
                tuple(r.params for r in replicas), tuple(r.rq for r in replicas),
                tuple(r.state for r in replicas), tuple(r.log for r in replicas),
                tuple(r.full for r in replicas), np.ascontiguousarray(arrival),
                kernel_code(router), replica_of, local_of)
            if rc == K.RC_STUCK:
                raise RuntimeError("a replica made no progress (a bug)")
            for rep in replicas:
                rep.rows = np.flatnonzero(replica_of == rep.index).tolist()
        if progress is not None:
            progress(n, n)
        _finish_all(replicas, side_by_side=not route.reads_replicas and not reference)
        outputs = [rep.output() for rep in replicas]
        merged = _merge(trace, replicas, outputs, replica_of, local_of)
        return ClusterOutput(merged=merged, replica=replica_of, decode_replica=None,
                             specs=tuple(specs), outputs=outputs,
                             rows=[np.asarray(rep.rows, dtype=np.int64) for rep in replicas],
                             router=router)

    # disaggregated: prefill pool -> KV transfer -> decode pool
    link = link or LINKS["infiniband"]
    back = [replicas[k] for k in decode_idx]
    decode_route = _Router(router, back, prefix)
    kv_bytes = np.array([specs[k].profile.kv_bytes_per_token() for k in decode_idx])
    transfer = np.full(n, np.nan)
    decode_of = np.full(n, -1, dtype=np.int64)
    decode_local = np.full(n, -1, dtype=np.int64)
    seen = dict.fromkeys(prefill_idx, 0)
    pending: list[tuple[float, int]] = []  # (prefill end, trace row)

    def collect() -> None:
        for k in prefill_idx:
            rep = replicas[k]
            done = rep.completed_since(seen[k])
            seen[k] += len(done)
            for local in done.tolist():
                row = rep.rows[local]
                heapq.heappush(pending, (float(rep.state.first_token_s[local]), row))

    def hand_over(until: float) -> None:
        while pending and pending[0][0] <= until:
            t, row = heapq.heappop(pending)
            if decode_route.reads_replicas:
                for rep in back:
                    rep.advance(t)
            rep = decode_route.pick(row)
            pos = back.index(rep)
            seconds = int(trace.prompt_tokens[row]) * kv_bytes[pos] / link.bandwidth_bytes_per_s
            transfer[row] = seconds + link.latency_s
            decode_of[row] = rep.index
            decode_local[row] = len(rep.rows)
            rep.append(row, t, float(transfer[row]))

    for row in range(n):
        t = float(arrival[row])
        for rep in front:
            rep.advance(t)
        collect()
        hand_over(t)
        rep = route.pick(row)
        local_of[row] = len(rep.rows)
        replica_of[row] = rep.index
        rep.append(row, t)
        if progress is not None and row % every == 0:
            progress(row, n)
    for rep in front:
        rep.advance(np.inf)
    collect()
    hand_over(np.inf)
    for rep in back:
        rep.advance(np.inf)
    outputs = [rep.output() for rep in replicas]
    merged = _merge(trace, replicas, outputs, replica_of, local_of, decode_of, decode_local)
    return ClusterOutput(merged=merged, replica=replica_of, decode_replica=decode_of,
                         specs=tuple(specs), outputs=outputs,
                         rows=[np.asarray(rep.rows, dtype=np.int64) for rep in replicas],
                         router=router, link=link, transfer_s=transfer)


def _finish_all(replicas: list[_Replica], *, side_by_side: bool) -> None:
    """Run every replica to its end. Under a static router the replicas never meet again,
    so they run side by side in threads (the compiled kernel releases the GIL), one per
    core; each replica's run is the same whatever the thread count."""
    threads = min(len(replicas), default_workers()) if side_by_side else 1
    if threads < 2:
        for rep in replicas:
            rep.advance(np.inf)
        return
    from concurrent.futures import ThreadPoolExecutor  # (only a static router's run)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        for _ in pool.map(lambda rep: rep.advance(np.inf), replicas):
            pass  # (re-raises a replica's error here)


def _merge(trace: Trace, replicas: list[_Replica], outputs: list[E.EngineOutput],
           replica_of: np.ndarray, local_of: np.ndarray,
           decode_of: np.ndarray | None = None,
           decode_local: np.ndarray | None = None) -> E.EngineOutput:
    """The per-request arrays over the whole trace. Under disaggregation a forwarded
    request's timestamps and status are its decode replica's (its admission and hits are
    the prefill side's; preemptions are summed)."""
    n = len(trace)

    def gather(name: str, dtype: Any, fill: Any, which: np.ndarray, local: np.ndarray,
               out: np.ndarray | None = None) -> np.ndarray:
        col = np.full(n, fill, dtype=dtype) if out is None else out
        for k, output in enumerate(outputs):
            sel = which == k
            values = getattr(output, name)
            if values is not None and sel.any():
                col[sel] = values[local[sel]]
        return col

    cols = {name: gather(name, dtype, fill, replica_of, local_of)
            for name, dtype, fill in (("admitted_s", np.float64, np.nan),
                                      ("first_token_s", np.float64, np.nan),
                                      ("finish_s", np.float64, np.nan),
                                      ("preemptions", np.int32, 0),
                                      ("status", np.int8, K.PENDING),
                                      ("reason", np.int8, 0),
                                      ("generated", np.int64, 0),
                                      ("hit_tokens", np.int64, 0))}
    if decode_of is not None and decode_local is not None:
        forwarded = decode_of >= 0
        prefill_preemptions = cols["preemptions"].copy()
        for name in ("first_token_s", "finish_s", "status", "reason", "generated",
                     "preemptions"):
            col = cols[name]
            dec = gather(name, col.dtype, 0, decode_of, decode_local)
            col[forwarded] = dec[forwarded]
        cols["preemptions"][forwarded] += prefill_preemptions[forwarded]
    caching = any(o.prefix_caching for o in outputs)
    totals = sum(o.kv_blocks_total for o in outputs)
    sim_end = max(o.sim_end_s for o in outputs)
    kv_mean = (sum(o.kv_util_mean * o.kv_blocks_total * o.sim_end_s for o in outputs)
               / (sim_end * totals)) if sim_end > 0 else 0.0
    return E.EngineOutput(
        admitted_s=cols["admitted_s"], first_token_s=cols["first_token_s"],
        finish_s=cols["finish_s"], preemptions=cols["preemptions"], status=cols["status"],
        reason=cols["reason"], generated=cols["generated"],
        steps=sum(o.steps for o in outputs), kv_blocks_total=totals, kv_util_mean=kv_mean,
        kv_util_peak=max(o.kv_util_peak for o in outputs), sim_end_s=sim_end,
        series=outputs[0].series, engine=outputs[0].engine,
        jumps=sum(o.jumps for o in outputs),
        kv_blocks_in_use_end=sum(o.kv_blocks_in_use_end for o in outputs),
        prefix_caching=caching, hit_tokens=cols["hit_tokens"] if caching else None,
        cache_evictions=sum(o.cache_evictions for o in outputs),
        block_size=replicas[0].block_size,
        replica=replica_of,
        decode_replica=decode_of,
    )


def disaggregated_specs(profile: Profile, policy: Policy, engine: str, prefill: int,
                        decode: int) -> list[ReplicaSpec]:
    """``prefill`` prefill replicas, then ``decode`` decode replicas, all alike."""
    return ([ReplicaSpec(profile, policy, engine, "prefill")] * prefill
            + [ReplicaSpec(profile, policy, engine, "decode")] * decode)


def replica_summaries(out: ClusterOutput, trace: Trace) -> list[dict[str, Any]]:
    """Per replica: its role, engine, profile and policy names, the requests routed to it
    and how they ended, steps, KV use, and prefix-cache hits (the share of its admitted
    prompt tokens served from its cache)."""
    rows = []
    for k, (spec, output, routed) in enumerate(zip(out.specs, out.outputs, out.rows,
                                                   strict=True)):
        status = np.asarray(output.status)
        entry: dict[str, Any] = {
            "replica": k,
            "name": spec.name or f"{spec.role}-{k}",
            "role": spec.role,
            "engine": spec.engine,
            "profile": spec.profile.name,
            "policy": spec.policy.name,
            "requests": int(len(routed)),
            "completed": int((status == K.COMPLETED).sum()),
            "shed": int((status == K.SHED).sum()),
            "rejected": int((status == K.REJECTED).sum()),
            "steps": int(output.steps),
            "kv_mean_util": float(output.kv_util_mean),
            "kv_peak_util": float(output.kv_util_peak),
            "preemptions": int(np.asarray(output.preemptions).sum()),
        }
        if output.prefix_caching and len(routed):
            cache = prefix_cache_summary(trace.prompt_tokens[routed], output)
            entry["hit_rate_tokens"] = cache["hit_rate_tokens"]
            entry["cache_evictions"] = cache["evictions"]
        rows.append(entry)
    return rows


def parse_disagg(spec: str) -> tuple[int, int]:
    """``"P:D"`` -> (prefill replicas, decode replicas), each at least 1."""
    parts = spec.split(":")
    try:
        prefill, decode = (int(x) for x in parts)
    except ValueError:
        raise ServetuneError(f"argument `--disagg` {spec!r}: expected P:D, two whole numbers "
                             "of replicas such as 2:2") from None
    if prefill < 1 or decode < 1:
        raise ServetuneError(f"argument `--disagg` {spec!r}: need at least one prefill and "
                             "one decode replica")
    if prefill + decode > MAX_REPLICAS:
        raise ServetuneError(f"argument `--disagg` {spec!r}: {prefill + decode:,} replicas; "
                             f"at most {MAX_REPLICAS:,} in one simulation")
    return prefill, decode
