"""The simulator's public entry points: ``simulate`` one run, ``goodput`` search.

``simulate`` turns a trace (replayed) or a workload (sampled with a seed) plus a policy and
a profile into one engine run (:func:`servetune.sim.engine.run_engine`) and wraps the
engine's per-request arrays in a :class:`SimResult`, which computes the run's summary JSON,
judges an SLO set, and writes records, step logs and timelines (a timeline can be built
while the run is simulated, in memory that grows with its window, not with the run).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from servetune.engines import ENGINE_NAMES
from servetune.errors import ServetuneError
from servetune.io import finite_or_none, plain_data, write_bytes_atomic, write_text_atomic
from servetune.schemas.policy import Policy
from servetune.schemas.slo import SLOSet
from servetune.schemas.workload import Workload
from servetune.sim import metrics as M
from servetune.sim.goodput import GoodputResult, goodput_search
from servetune.sim.records import write_records
from servetune.sim.timeline import (
    StepChunk,
    TimelineBuilder,
    Window,
    build_timeline,
    write_timeline,
)
from servetune.steady_state import steady_window_s
from servetune.workloads.fitting import check_rate_scale, class_stats, sample_trace
from servetune.workloads.trace import Trace

if TYPE_CHECKING:  # the engine is imported where used (see _engine_module)
    from servetune.executor import Executor
    from servetune.profiles.schema import Profile
    from servetune.sim.engine import EngineOutput


def _engine_module():
    # lazy: the engine imports numba (0.5 s), which `import servetune.sim` should not pay
    from servetune.sim import engine

    return engine


def prepare_trace(
    source: Trace | Workload,
    *,
    seed: int = 0,
    n_requests: int | None = None,
    duration_s: float | None = None,
    rate_scale: float = 1.0,
) -> Trace:
    """The trace one run simulates.

    A Trace is replayed: its first ``n_requests`` rows, time-compressed by ``rate_scale``,
    then cut to arrivals before ``duration_s`` (simulated seconds). A Workload is sampled with
    ``seed`` for ``n_requests`` and/or ``duration_s`` at ``rate_scale`` times its rates."""
    check_rate_scale(rate_scale)
    if n_requests is not None and n_requests < 1:
        raise ServetuneError(f"argument `n_requests` must be >= 1 (got {n_requests})")
    if duration_s is not None and not (duration_s > 0 and math.isfinite(duration_s)):
        raise ServetuneError(f"argument `duration_s` must be > 0 seconds (got {duration_s})")
    if isinstance(source, Trace):
        trace = source.head(n_requests) if n_requests is not None else source
        if rate_scale != 1.0:
            trace = trace.rate_scaled(rate_scale)
        if duration_s is not None:
            keep = int(np.searchsorted(trace.arrival_s, duration_s, side="left"))
            trace = trace.take(slice(0, max(keep, 1)))
        return trace
    if isinstance(source, Workload):
        return sample_trace(
            source, n_requests=n_requests, duration_s=duration_s, seed=seed,
            rate_scale=rate_scale,
        )
    raise ServetuneError(
        f"simulate: source must be a Trace or a Workload (got {type(source).__name__})"
    )


def base_rate_per_s(source: Trace | Workload) -> float:
    """Mean arrival rate of ``source`` at rate scale 1 (requests per second)."""
    if isinstance(source, Trace):
        return (len(source) - 1) / source.duration_s if source.duration_s > 0 else 0.0
    return float(source.total_rate_per_s)


def step_lines(records: Iterable[dict[str, Any]]) -> str:
    """Step-log records as JSON lines."""
    # finite=False: a NaN stays NaN, as in every step log written so far
    return "".join(json.dumps(plain_data(rec, finite=False), separators=(",", ":")) + "\n"
                   for rec in records)


class StepsSpool:
    """The step log as JSON lines, written while the engine runs into an unnamed temporary
    file (in ``path``'s folder where that exists, so it uses the output's disk), and later
    copied to ``path`` in blocks: the run never holds the whole log."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        folder = self.path.parent
        self.file = tempfile.TemporaryFile(dir=folder if folder.is_dir() else None)

    def add(self, chunk: StepChunk) -> None:
        try:
            self.file.write(step_lines(chunk.records(0, len(chunk.start_s))).encode())
        except OSError as exc:  # a full disk: the spool shares the output's
            raise ServetuneError(
                f"{self.path}: cannot write the step log ({exc.strerror}); free some space "
                "or choose another folder") from None

    def chunks(self, size: int = 1 << 20) -> Iterator[bytes]:
        self.file.seek(0)
        while block := self.file.read(size):
            yield block


@dataclass(eq=False)
class SimResult:
    """One simulated run: its trace, the engine's output, and derived views."""

    trace: Trace
    output: EngineOutput
    engine: str = "vllm"
    reference: bool = False
    sim_wall_s: float = 0.0
    policy_name: str = ""
    profile_name: str = ""
    _metrics: M.RequestMetrics | None = field(default=None, repr=False)
    # the timeline built while the run was simulated (simulate(..., timeline=True))
    _timeline: TimelineBuilder | None = field(default=None, repr=False)
    # the step log written while the run was simulated (simulate(..., steps_file=...))
    _steps: StepsSpool | None = field(default=None, repr=False)

    @property
    def metrics(self) -> M.RequestMetrics:
        if self._metrics is None:
            self._metrics = M.request_metrics(
                self.trace.arrival_s, self.output.first_token_s, self.output.finish_s,
                M.served_output_tokens(self.trace), self.output.status,
                self.trace.class_ids(),
            )
        return self._metrics

    @property
    def span_s(self) -> float:
        return M.run_span_s(self.trace.arrival_s, np.asarray(self.output.finish_s))

    def slo_met(self, slo: SLOSet) -> np.ndarray:
        """Per request: meets every limit of its class's SLO."""
        return M.slo_met_mask(self.metrics, slo, self.trace.class_names)

    def attainment(self, slo: SLOSet) -> float:
        met = self.slo_met(slo)
        return float(met.mean()) if len(met) else 1.0

    def meets_slo(self, slo: SLOSet) -> bool:
        """Every class in the run meets its SLO (percentile or attainment mode)."""
        return M.meets_slo(self.metrics, slo, self.trace.class_names)

    def slo_verdicts(self, slo: SLOSet) -> dict[str, tuple[bool, dict]]:
        return M.slo_verdicts(self.metrics, slo, self.trace.class_names)

    def summary(self, slo: SLOSet | None = None) -> dict[str, Any]:
        """The run's summary: counts, latency distributions, throughput, attainment and value
        served per second (null without an SLO), per class, KV utilization and
        preemptions."""
        m = self.metrics
        span = self.span_s
        met = self.slo_met(slo) if slo is not None else None
        value = (M.request_values(slo, self.trace.class_names, m.class_id)
                 if slo is not None else None)
        overall = M.group_summary(m, span, None, met, value)
        preemptions = np.asarray(self.output.preemptions, dtype=np.int64)
        per_class: dict[str, Any] = {}
        verdicts = self.slo_verdicts(slo) if slo is not None else {}
        for cid, name in enumerate(self.trace.class_names):
            sel = m.class_id == cid
            if not sel.any():
                continue
            group = M.group_summary(m, span, sel, met, value)
            entry = {k: v for k, v in group.items()}
            entry["preemptions"] = int(preemptions[sel].sum())
            if name in verdicts:
                entry["meets_slo"] = verdicts[name][0]
            per_class[name] = entry
        return {
            "requests": overall["requests"],
            "completed": overall["completed"],
            "shed": overall["shed"],
            "rejected": overall["rejected"],
            "steps": int(self.output.steps),
            "sim_wall_s": float(self.sim_wall_s),
            "overall": {
                k: overall[k]
                for k in ("ttft_s", "tpot_s", "e2e_s", "throughput_tok_s", "throughput_req_s",
                          "attainment", "value_served_per_s")
            },
            "per_class": per_class,
            "kv": {
                "mean_util": finite_or_none(self.output.kv_util_mean),
                "peak_util": finite_or_none(self.output.kv_util_peak),
            },
            "preemptions": int(preemptions.sum()),
            **({"prefix_cache": M.prefix_cache_summary(self.trace.prompt_tokens, self.output)}
               if getattr(self.output, "prefix_caching", False) else {}),
        }

    def turned_away(self) -> dict[str, Any]:
        """The requests turned away (shed or rejected): how many, their share, and which:
        per reason, the count and the range of their prompt lengths. Empty reasons when
        every request was served."""
        status = np.asarray(self.output.status)
        away = status != M.STATUS_COMPLETED
        texts = self.reasons()
        codes = np.asarray(self.output.reason)[away]
        prompts = np.asarray(self.trace.prompt_tokens)[away]
        by_reason: dict[str, Any] = {}
        for code in np.unique(codes):
            sel = codes == code
            text = texts[int(code)] if 0 < int(code) < len(texts) else f"reason {int(code)}"
            by_reason[text] = {
                "requests": int(sel.sum()),
                "prompt_tokens_min": int(prompts[sel].min()),
                "prompt_tokens_max": int(prompts[sel].max()),
            }
        n = len(status)
        return {
            "requests": int(away.sum()),
            "share": float(away.sum() / n) if n else 0.0,
            "by_reason": by_reason,
        }

    def reasons(self) -> tuple[str, ...]:
        try:
            return tuple(_engine_module().REASONS)
        except (ImportError, AttributeError):
            return ()

    def write_records(self, path: str | os.PathLike[str]) -> None:
        """Per-request records as CSV, or Parquet for a ``.parquet`` path (needs pyarrow)."""
        write_records(path, self.trace, self.output, self.reasons())

    def step_log(self) -> list[dict[str, Any]]:
        log = getattr(self.output, "step_log", None)
        if log is None:
            raise ServetuneError(
                "this run kept no step log; simulate with step_log=True (or, for a "
                "timeline, timeline=True)"
            )
        return log

    def write_steps(self, path: str | os.PathLike[str]) -> None:
        """The step log as JSON lines, one record per engine step (or jumped stretch): the
        file spooled while the run was simulated (``simulate(..., steps_file=path)``), else
        from the step log the run kept."""
        if self._steps is not None and Path(path) == self._steps.path:
            write_bytes_atomic(path, self._steps.chunks())
        else:
            write_text_atomic(path, step_lines(self.step_log()))

    def timeline(self, window: Window | None = None) -> dict[str, Any]:
        """The run's timeline (:mod:`servetune.sim.timeline`): the one built while it was
        simulated if that had this window, else from the step log it kept."""
        ending = dict(
            status=np.asarray(self.output.status),
            reason=np.asarray(self.output.reason),
            reasons=self.reasons(),
            title=f"servetune {self.engine} {self.policy_name} on {self.profile_name}",
        )
        if self._timeline is not None and self._timeline.window == window:
            return self._timeline.finish(**ending)
        return build_timeline(
            self.step_log(), self.trace.arrival_s, self.trace.prompt_tokens, window=window,
            **ending,
        )

    def write_timeline(self, path: str | os.PathLike[str], window: Window | None = None) -> None:
        """Chrome trace-event JSON (open in Perfetto or chrome://tracing)."""
        write_timeline(path, self.timeline(window))


def simulate(
    source: Trace | Workload,
    policy: Policy,
    profile: Profile,
    *,
    engine: str = "vllm",
    reference: bool = False,
    seed: int = 0,
    n_requests: int | None = None,
    duration_s: float | None = None,
    rate_scale: float = 1.0,
    step_log: bool = False,
    steps_file: str | os.PathLike[str] | None = None,
    timeline: bool = False,
    timeline_window: Window | None = None,
    progress: Callable[..., Any] | None = None,
    prefix_caching: bool | None = None,
) -> SimResult:
    """Simulate ``policy`` serving ``source`` (Trace or Workload) on ``profile``.
    ``prefix_caching`` overrides the policy's ``caching.enable_prefix_caching``.

    ``step_log=True`` keeps the whole step log (``SimResult.step_log``, ``write_steps``,
    and a timeline of any window); ``steps_file`` spools it as JSON lines for
    ``SimResult.write_steps(steps_file)`` instead. ``timeline=True`` builds the timeline of
    ``timeline_window`` (None: the whole run) while simulating, without keeping the log,
    so memory grows with the window, not the run (``SimResult.timeline(timeline_window)``).
    """
    if engine not in ENGINE_NAMES:
        raise ServetuneError(
            f"argument `engine` {engine!r}: unknown engine; choose one of "
            f"{', '.join(ENGINE_NAMES)}"
        )
    trace = prepare_trace(
        source, seed=seed, n_requests=n_requests, duration_s=duration_s, rate_scale=rate_scale
    )
    eng = _engine_module()
    extra: dict[str, Any] = {}
    if not isinstance(source, Trace) and policy.long_requests.enabled:
        # A request is long by its class's expected output: the workload's mean, not the
        # mean of this particular sample.
        extra["expected_output"] = np.array([c.output_mean for c in class_stats(source)])
    builder = TimelineBuilder(trace.arrival_s, trace.prompt_tokens, timeline_window
                              ) if timeline else None
    spool = StepsSpool(steps_file) if steps_file is not None else None
    sinks = [sink.add for sink in (builder, spool) if sink is not None]
    if sinks:
        def on_step_log(chunk: StepChunk) -> None:
            for sink in sinks:
                sink(chunk)

        extra["on_step_log"] = on_step_log
    started = time.perf_counter()
    output = eng.run_engine(
        trace,
        policy,
        profile.kv_blocks(),
        profile.block_size,
        profile.step_time,
        engine=engine,
        reference=reference,
        step_log=step_log,
        progress=progress,
        prefix_caching=prefix_caching,
        **extra,
    )
    wall = time.perf_counter() - started
    return SimResult(
        trace=trace,
        output=output,
        engine=engine,
        reference=reference,
        sim_wall_s=wall,
        policy_name=getattr(policy, "name", ""),
        profile_name=getattr(profile, "name", ""),
        _timeline=builder,
        _steps=spool,
    )


def simulate_cluster(
    source: Trace | Workload,
    specs: Sequence[Any],
    *,
    router: str = "round_robin",
    link: Any = None,
    reference: bool = False,
    seed: int = 0,
    n_requests: int | None = None,
    duration_s: float | None = None,
    rate_scale: float = 1.0,
    prefix_caching: bool | None = None,
    progress: Callable[..., Any] | None = None,
) -> tuple[SimResult, Any]:
    """Serve ``source`` on a cluster of replicas (:mod:`servetune.sim.cluster`): the
    whole cluster's run as a :class:`SimResult` (its per-request arrays, the replicas'
    totals) and the :class:`~servetune.sim.cluster.ClusterOutput` with each replica's."""
    # lazy: the cluster imports the engine (numba), as _engine_module does
    from servetune.sim.cluster import run_cluster

    trace = prepare_trace(
        source, seed=seed, n_requests=n_requests, duration_s=duration_s, rate_scale=rate_scale
    )
    started = time.perf_counter()
    out = run_cluster(trace, specs, router=router, link=link, reference=reference,
                      prefix_caching=prefix_caching, progress=progress)
    wall = time.perf_counter() - started
    first = specs[0]
    result = SimResult(trace=trace, output=out.merged, engine=first.engine,
                       reference=reference, sim_wall_s=wall,
                       policy_name=getattr(first.policy, "name", ""),
                       profile_name=getattr(first.profile, "name", ""))
    return result, out


def goodput(
    source: Trace | Workload,
    policy: Policy,
    profile: Profile,
    slo: SLOSet,
    *,
    engine: str = "vllm",
    seeds: Sequence[int] = (0,),
    n_requests: int | None = None,
    duration_s: float | None = None,
    reference: bool = False,
    rel_tol: float | None = None,
    start: float = 1.0,
    min_scale: float = 1.0 / 1024,
    max_scale: float = 1024.0,
    prune_at: float | None = None,
    on_point: Callable[[dict[str, Any]], Any] | None = None,
    executor: Executor | None = None,
) -> GoodputResult:
    """Highest rate scale at which ``policy`` meets ``slo`` (every seed, for a workload),
    judged by the one evaluator's rules (:mod:`servetune.sim.evaluator`: its sample, window,
    verdict and search, to ``rel_tol``, default ``EVAL_REL_TOL``), so that with the same
    ``n_requests`` and seed it is the goodput ``optimize`` prints. ``duration_s`` instead
    cuts each run to the arrivals before that many simulated seconds (no window rule).
    ``prune_at``: a scale that only matters to beat (:func:`servetune.search.search_scale`:
    the search stops once a scale at or below it fails; the answer is then a lower bound).

    A trace is replayed once per scale (seeds do not change a replay); a workload is sampled
    with each seed, the seeds of a scale side by side on ``executor`` (default: in this
    process). Each point records its verdict, per-seed attainment and the summary of
    every run (without wall-clock fields, so the result is deterministic)."""
    # lazy: the evaluator imports this module
    from servetune.sim.evaluator import EVAL_REL_TOL, base_sample, judging_window_s

    if not seeds:
        raise ServetuneError("goodput: give at least one seed")
    rel_tol = EVAL_REL_TOL if rel_tol is None else rel_tol
    run_seeds = (seeds[0],) if isinstance(source, Trace) else tuple(seeds)
    if executor is None:
        from servetune.executor import SerialExecutor

        executor = SerialExecutor()
    # Each seed's base sample, drawn once for the whole search (None: --duration cuts
    # each run instead).
    samples = None if duration_s is not None else {
        s: base_sample(source, seed=s, n_requests=n_requests) for s in run_seeds}
    shared = (source, policy, profile, slo, samples, judging_window_s(slo),
              dict(engine=engine, reference=reference, n_requests=n_requests,
                   duration_s=duration_s))

    def evaluate(scale: float) -> tuple[bool, dict[str, Any]]:
        runs = executor.map(_seed_run, [(s, scale) for s in run_seeds], shared=shared)
        ok = all(meets for meets, _summary, _window in runs)
        summaries = [{"seed": s, **summary} for s, (_ok, summary, _w) in zip(
            run_seeds, runs, strict=True)]
        point = {"attainment": min(sm["overall"]["attainment"] for sm in summaries),
                 "window_s": min(window for _ok, _sm, window in runs), "seeds": summaries}
        if on_point is not None:
            on_point({"rate_scale": scale, "meets_slo": ok, **point})
        return ok, point

    if samples is None:
        base = (base_rate_per_s(prepare_trace(source, n_requests=n_requests,
                                              duration_s=duration_s))
                if isinstance(source, Trace) else base_rate_per_s(source))
    else:
        base = base_rate_per_s(samples[run_seeds[0]])
    result = goodput_search(
        evaluate, base, start=start, rel_tol=rel_tol,
        min_scale=min_scale, max_scale=max_scale, prune_at=prune_at,
    )
    result.warnings.extend(_short_window_warnings(result, slo))
    return result


def _seed_run(shared: tuple, job: tuple[int, float]) -> tuple[bool, dict[str, Any], float]:
    """One seed of one goodput point: (meets the SLOs, summary without wall time, window).
    The trace is the one evaluator's (:func:`servetune.sim.evaluator.judged_sample` of
    the seed's base sample) or, with ``duration_s``, the first ``n_requests`` arrivals at
    the scale cut to that many simulated seconds."""
    from servetune.sim.evaluator import judged_sample  # lazy: as in goodput

    source, policy, profile, slo, samples, window_s, kw = shared
    seed, scale = job
    if samples is None:
        trace = prepare_trace(source, seed=seed, n_requests=kw["n_requests"],
                              duration_s=kw["duration_s"], rate_scale=scale)
        own_scale = 1.0
    else:
        trace, own_scale = judged_sample(source, samples[seed], scale, window_s, seed=seed)
    result = simulate(trace, policy, profile, seed=seed, rate_scale=own_scale,
                      engine=kw["engine"], reference=kw["reference"])
    summary = result.summary(slo)
    summary.pop("sim_wall_s", None)
    return result.meets_slo(slo), summary, float(result.trace.duration_s)


# The steady-state window a goodput point should span before ``servetune goodput`` trusts
# it without a warning (servetune.steady_state): a minute, or 30 TTFT targets if longer.
WARN_WINDOW_FLOOR_S = 60.0
WARN_WINDOW_TTFTS = 30.0


def _short_window_warnings(result: GoodputResult, slo: SLOSet) -> list[str]:
    best = result.best_point
    if best is None:
        return []
    need = steady_window_s(slo, floor_s=WARN_WINDOW_FLOOR_S, ttft_multiple=WARN_WINDOW_TTFTS)
    if best["window_s"] >= need:
        return []
    return [
        f"at the goodput rate the simulated arrivals span only {best['window_s']:.0f} s "
        f"(< {need:.0f} s), so queues may not reach steady state and the goodput may be "
        "optimistic; give more requests (--requests) or a longer --duration"
    ]
