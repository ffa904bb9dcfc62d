"""Reuse fidelity: does a sample of the workload fitted to a trace with prefix ids re-send
prompt blocks as the trace does, as often and as soon, and does it promise the goodput the
trace gives?

Cases (``cases``): the Mooncake trace (``../shared/traces/mooncake_synthetic_trace.jsonl.gz``,
hash ids of 512-token blocks), each of its halves (A: the first 1,996 requests, B: the
rest), a synthetic chat trace loaded through a session column (the ``chat_rows``
generator of ``tests/test_session_column.py``: 1,500 sessions over an hour, 3 turns on
average, 16-token blocks over prompt and output) and a session trace built from the
Azure 2023 conversation trace (``azure_sessions``: its real arrivals and lengths, each
request continuing the open session with the longest context its prompt holds, at most
2,000 tokens short of it, among those idle at least a seeded 5 s + Exp(60 s); an open
session ends after 600 s idle; else a new session; 19,366 requests, 39% of block
references repeated).

Default: the reuse statistics of each trace and of samples of the same size from its
fitted workloads (``arrival_process`` auto and parametric, seeds ``--seeds``), plus
Mooncake sampled three spans long, the prefix-cache hit rate the simulator measures, and
the time the ids add to sampling 100,000 requests.

``--curves``: the LRU hit-rate curves (:func:`servetune.workloads.reuse.hit_rate_curve`:
hit rate against cache size, 1% to 100% of the trace's distinct blocks) of each trace and
of samples of the same length of its fitted workloads, per seed and the mean over seeds,
with the largest gaps. Issue 31's target: within 10% relative or 2 points at every size.

``--goodput``: ``goodput`` (vLLM defaults, H200 Llama-3.1-8B, p99 TTFT 10 s and TPOT
100 ms, the one evaluator's rules) of each trace and of its fitted workloads (samples of
the trace's size, mean over the seeds), with prefix caching on and off. Target: within
10%. Also Mooncake's workload at its default ``scale_by`` (time) against ``sessions``.

``--lengths``: a sample shorter than the trace takes blocks from every stratum of the
block bootstrap: goodput (vLLM defaults, H200 Llama-3.1-8B, the MLPerf server SLO) of the
workload fitted to the Azure code trace (auto: the bootstrap) with 1/4, 1/2 and all of
the trace's requests, mean over the seeds, against the trace's own.

Usage: python benchmarks/reuse_fidelity.py [--seeds 0,1,2] [--curves] [--goodput] [--lengths]
"""

from __future__ import annotations

import argparse
import bisect
import math
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"
sys.path.insert(0, str(REPO / "tests"))

from test_session_column import chat_rows, write_csv  # noqa: E402

from servetune.profiles.shipped import load_profile  # noqa: E402
from servetune.schemas.policy import Policy  # noqa: E402
from servetune.schemas.workload import Workload  # noqa: E402
from servetune.sim.api import simulate  # noqa: E402
from servetune.workloads.fitting import fit_workload, sample_trace  # noqa: E402
from servetune.workloads.formats import load_trace  # noqa: E402
from servetune.workloads.reuse import reuse_stats  # noqa: E402
from servetune.workloads.trace import Trace  # noqa: E402

TARGET_POINTS, TARGET_RELATIVE = 0.02, 0.10  # issue 31: 2 points or 10% at every size
MIN_THINK_S, MEAN_EXTRA_THINK_S, MAX_THINK_S, MAX_GROWTH = 5.0, 60.0, 600.0, 2000


def azure_sessions(path: Path) -> list[tuple]:
    """(arrival, prompt, output, session) rows: the Azure trace's requests linked into
    sessions by the rule in the module docstring (deterministic)."""
    trace = load_trace(path)
    t, p, o = trace.arrival_s.tolist(), trace.prompt_tokens.tolist(), trace.output_tokens.tolist()
    need = MIN_THINK_S + np.random.default_rng(0).exponential(MEAN_EXTRA_THINK_S, len(t))
    open_by_context: list[tuple[int, int]] = []  # sorted (context, session)
    context: list[int] = []
    last: list[float] = []
    turns: deque[tuple[float, int]] = deque()
    session = []
    for j in range(len(t)):
        while turns and t[j] - turns[0][0] > MAX_THINK_S:
            when, sid = turns.popleft()
            if last[sid] == when:  # idle too long: the session ends
                del open_by_context[bisect.bisect_left(open_by_context, (context[sid], sid))]
                last[sid] = -math.inf
        # the open session with the longest context the prompt holds (at most MAX_GROWTH
        # short of it) among those idle long enough
        i = bisect.bisect_right(open_by_context, (p[j], 1 << 62)) - 1
        chosen = None
        while i >= 0 and p[j] - open_by_context[i][0] <= MAX_GROWTH:
            if t[j] - last[open_by_context[i][1]] >= need[j]:
                chosen = open_by_context[i][1]
                break
            i -= 1
        if chosen is None:
            chosen = len(context)
            context.append(0)
            last.append(t[j])
        else:
            del open_by_context[bisect.bisect_left(open_by_context, (context[chosen], chosen))]
        context[chosen], last[chosen] = p[j] + o[j], t[j]
        bisect.insort(open_by_context, (context[chosen], chosen))
        turns.append((t[j], chosen))
        session.append(chosen)
    return [(round(t[j], 6), p[j], o[j], f"s{session[j]}") for j in range(len(t))]


def cases(tmp: Path) -> dict[str, Trace]:
    """The benchmark's traces (module docstring)."""
    columns = "arrival=ts,prompt=in,output=out,session=conv"
    mooncake = load_trace(TRACES / "mooncake_synthetic_trace.jsonl.gz")
    half = len(mooncake) // 2
    return {
        "mooncake": mooncake,
        "mooncake A": mooncake.take(slice(0, half)),
        "mooncake B": mooncake.take(slice(half, len(mooncake))),
        "chat (session column)": load_trace(
            write_csv(tmp / "chat.csv", chat_rows(1500, seed=1)), columns=columns),
        "azure conv sessions": load_trace(write_csv(
            tmp / "azure.csv", azure_sessions(TRACES / "AzureLLMInferenceTrace_conv.csv")),
            columns=columns),
    }


def row(name: str, trace: Trace) -> str:
    s = reuse_stats(trace).summary()
    return (f"| {name} | {s['reuse_ratio']:.1%} | {s['continuing_share']:.1%} | "
            f"{s['sessions']:,} | {s['think_time_p50_s']:.0f} | {s['growth_p50_tokens']:.0f} | "
            f"{s['system_prompts']} |")


def hit_rate(trace: Trace) -> float:
    """Prompt tokens served from the prefix cache: vLLM defaults with prefix caching on,
    H200 Llama-3.1-8B."""
    result = simulate(trace, Policy(), load_profile("h200-llama-3.1-8b"), prefix_caching=True)
    return float(result.summary()["prefix_cache"]["hit_rate_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--curves", action="store_true", help="the hit-rate curves only")
    parser.add_argument("--goodput", action="store_true", help="the goodput table only")
    parser.add_argument("--lengths", action="store_true", help="the sample-length table only")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.lengths:
        lengths(seeds)
        return
    with tempfile.TemporaryDirectory() as tmp:
        traces = cases(Path(tmp))
    if args.curves:
        curves(traces, seeds)
        return
    if args.goodput:
        goodputs(traces, seeds)
        return
    print("| trace / sample | reuse | later turns | sessions | think p50 (s) | "
          "growth p50 (tokens) | system prompts |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, trace in traces.items():
        print(row(f"{name}: trace", trace))
        for arrival in ("auto", "parametric"):
            workload = fit_workload(trace, arrival_process=arrival)
            for seed in seeds:
                sample = sample_trace(workload, seed=seed, n_requests=len(trace))
                print(row(f"{name}: {arrival}, seed {seed}", sample))
            if name == "mooncake" and arrival == "auto":
                long = sample_trace(workload, seed=0, duration_s=3 * trace.duration_s)
                print(row(f"{name}: auto, seed 0, 3 spans ({len(long):,} requests)", long))
    print("\n| simulated prefix-cache hit rate (tokens) | trace | auto, seeds | parametric, "
          "seeds |\n|---|---:|---|---|")
    mooncake = traces["mooncake"]
    fits = {a: fit_workload(mooncake, arrival_process=a) for a in ("auto", "parametric")}
    for scale in (0.05, 1.0):
        cells = []
        for arrival in ("auto", "parametric"):
            rates = [hit_rate(sample_trace(fits[arrival], seed=s, n_requests=len(mooncake),
                                           rate_scale=scale)) for s in seeds]
            cells.append(" / ".join(f"{r:.1%}" for r in rates))
        print(f"| Mooncake at {scale:g}x its rate | {hit_rate(mooncake.rate_scaled(scale)):.1%} "
              f"| {cells[0]} | {cells[1]} |")
    workload = fits["parametric"]
    plain = workload.model_copy(update={"prefix_reuse": None})
    timings = []
    for w in (plain, workload):
        started = time.perf_counter()
        sample_trace(w, seed=0, n_requests=100_000)
        timings.append(time.perf_counter() - started)
    print(f"\nsampling 100,000 Mooncake requests (parametric): {timings[0]:.2f} s without ids, "
          f"{timings[1]:.2f} s with ids")


def curves(traces: dict[str, Trace], seeds: list[int]) -> None:
    """The hit-rate curve table (module docstring, ``--curves``): per seed, and the mean
    over the seeds, which the target is judged on (one sample of a few thousand requests
    holds a few hundred later turns, and its curve moves by points from seed to seed)."""
    from servetune.workloads.reuse import CURVE_FRACTIONS, hit_rate_curve

    print("| trace / sample | " + " | ".join(f"{f:.0%}" for f in CURVE_FRACTIONS)
          + " | worst gap (points) | worst gap (relative) | within target |")
    print("|---|" + "---:|" * (len(CURVE_FRACTIONS) + 2) + "---|")
    for name, trace in traces.items():
        curve = hit_rate_curve(trace)
        truth = np.array([p["hit_rate"] for p in curve["points"]])
        sizes = tuple(p["blocks"] for p in curve["points"])
        print(f"| {name}: trace | " + " | ".join(f"{r:.1%}" for r in truth) + " | | | |")
        for arrival in ("auto", "parametric"):
            workload = fit_workload(trace, arrival_process=arrival)
            runs = []
            for seed in seeds:
                sample = sample_trace(workload, seed=seed, n_requests=len(trace))
                # the sample's curve at the trace's cache sizes (blocks), not its own
                got = [p["hit_rate"] for p in hit_rate_curve(sample, (), sizes)["points"]]
                runs.append(got)
                print(f"| {name}: {arrival}, seed {seed} | "
                      + " | ".join(f"{r:.1%}" for r in got) + " | | | |")
            mean = np.mean(runs, axis=0)
            gap = np.abs(mean - truth)
            rel = np.divide(gap, truth, out=np.zeros_like(gap), where=truth > 0)
            ok = bool(np.all(gap <= np.maximum(TARGET_POINTS, TARGET_RELATIVE * truth)))
            print(f"| **{name}: {arrival}, mean of {len(seeds)} seeds** | "
                  + " | ".join(f"{r:.1%}" for r in mean)
                  + f" | {100 * gap.max():.1f} | {rel.max():.0%} | {'yes' if ok else 'no'} |")


def goodputs(traces: dict[str, Trace], seeds: list[int]) -> None:
    """The goodput table (module docstring, ``--goodput``)."""
    from servetune.schemas.slo import SLOSet
    from servetune.sim.api import goodput
    from servetune.workloads.fitting import workload_scaled_by

    profile = load_profile("h200-llama-3.1-8b")
    slo = SLOSet(name="ttft10-tpot100", classes={
        "default": {"ttft_s": 10.0, "tpot_s": 0.1, "percentile": 99.0}})
    policies = {on: Policy.model_validate({"caching": {"enable_prefix_caching": on}})
                for on in (True, False)}

    def goodputs_of(source: Trace | Workload, policy: Policy, n: int) -> list[float]:
        if isinstance(source, Trace):
            return [goodput(source, policy, profile, slo).rate_per_s]
        return [goodput(source, policy, profile, slo, seeds=(s,), n_requests=n).rate_per_s
                for s in seeds]

    def cell(got: list[float], truth: float) -> str:
        mean = float(np.mean(got))
        error = float(np.std(got, ddof=1) / np.sqrt(len(got))) if len(got) > 1 else 0.0
        return (f"{mean:.3f} ± {error:.3f} ({min(got):.3f}-{max(got):.3f}) | "
                f"{mean / truth:.2f} | "
                f"{'yes' if abs(mean / truth - 1) <= TARGET_RELATIVE else 'no'}")

    print("| trace | fit | caching on: trace | fitted, mean ± s.e. (seeds' range) | ratio | "
          "within 10% | caching off: trace | fitted | ratio | within 10% |")
    print("|---|---|---:|---:|---:|---|---:|---:|---:|---|")
    for name, trace in traces.items():
        truth = {on: goodputs_of(trace, p, len(trace))[0] for on, p in policies.items()}
        for arrival in ("auto", "parametric"):
            workload = fit_workload(trace, arrival_process=arrival)
            got = {on: goodputs_of(workload, p, len(trace)) for on, p in policies.items()}
            print(f"| {name} | {arrival} | {truth[True]:.3f} | {cell(got[True], truth[True])} "
                  f"| {truth[False]:.3f} | {cell(got[False], truth[False])} |")
    mooncake = traces["mooncake"]
    workload = fit_workload(mooncake)
    by = {scale_by: float(np.mean(goodputs_of(workload_scaled_by(workload, scale_by),
                                              policies[True], len(mooncake))))
          for scale_by in ("time", "sessions")}
    print(f"\nMooncake, caching on: goodput scaled by time {by['time']:.3f} req/s, by sessions "
          f"{by['sessions']:.3f} req/s ({by['sessions'] / by['time']:.2f}x)")


def lengths(seeds: list[int]) -> None:
    """The sample-length table (module docstring, ``--lengths``)."""
    from servetune.schemas.base import load_document
    from servetune.schemas.slo import SLOSet
    from servetune.sim.api import goodput

    trace = load_trace(TRACES / "AzureLLMInferenceTrace_code.csv")
    workload = fit_workload(trace)
    assert workload.block_bootstrap is not None, "auto chose the bootstrap before"
    profile = load_profile("h200-llama-3.1-8b")
    slo = load_document(REPO / "configs" / "slos" / "mlperf-llama-3.1-8b-server.yaml", SLOSet)
    truth = goodput(trace, Policy(), profile, slo).rate_per_s
    print(f"| requests | goodput, mean (seeds) | against the trace's {truth:.3f} |\n"
          "|---:|---:|---:|")
    for share in (0.25, 0.5, 1.0):
        n = int(share * len(trace))
        got = [goodput(workload, Policy(), profile, slo, seeds=(s,), n_requests=n).rate_per_s
               for s in seeds]
        print(f"| {n:,} ({share:g}) | {np.mean(got):.3f} ({min(got):.3f}-{max(got):.3f}) | "
              f"{np.mean(got) / truth:.2f}x |")


if __name__ == "__main__":
    main()
