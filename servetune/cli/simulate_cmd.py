"""CLI: ``servetune simulate`` (one run) and ``servetune goodput`` (highest rate meeting an SLO).

Both read a trace (``--trace``, replayed) or a workload (``--workload``, sampled with
``--seed``), a profile and a policy; they are thin layers over
:func:`servetune.sim.simulate` and :func:`servetune.sim.goodput`.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from servetune.cli.options import (
    ArrivalUnitOption,
    ColumnsOption,
    JsonOption,
    JsonOutOption,
    JsonTarget,
    OnBadRowOption,
    QuietOption,
    RayOption,
    TraceFormatOption,
    WorkersOption,
    compile_notice,
    console_say,
    executor_for,
    print_json,
)
from servetune.cli.trace_cmd import load_trace_cli
from servetune.engines import ENGINE_NAMES, MAX_CLUSTER_STATE_BYTES, MAX_REPLICAS
from servetune.errors import InfeasibleError, ServetuneError
from servetune.io import check_outputs, require_file, write_all_or_none, write_text_atomic
from servetune.routers import MAX_ROUTED_REPLICAS, ROUTER_NAMES, ROUTERS

if TYPE_CHECKING:  # imported where used: see the lazy imports
    from servetune.profiles.schema import Profile
    from servetune.schemas.policy import Policy
    from servetune.schemas.slo import SLOSet
    from servetune.schemas.workload import Workload
    from servetune.sim.goodput import GoodputResult
    from servetune.workloads.trace import Trace

ENGINE_CHOICES = ENGINE_NAMES
# Runs with at least this many requests (or any reference-mode run over REFERENCE_PROGRESS)
# show a progress bar: they take long enough for one to help.
PROGRESS_MIN_REQUESTS = 100_000
REFERENCE_PROGRESS_MIN_REQUESTS = 2_000


def _inputs(trace: Path | None, workload: Path | None, profile: str, policy: Path,
            slo: Path | None) -> dict[str, Path | str | None]:
    """The files a run reads, by option (outputs must not be any of them)."""
    return {"--trace": trace, "--workload": workload, "--profile": profile,
            "--policy": policy, "--slo": slo}


def _need_file(path: Path, option: str) -> Path:
    return require_file(path, f"given to {option}")


@dataclass(frozen=True)
class TraceOptions:
    """How to read --trace (the same options as ``servetune trace stats``), and whether
    to keep its notes and progress off stderr (-q)."""

    trace_format: str | None = None
    columns: str | None = None
    arrival_unit: str | None = None
    on_bad_row: str = "error"
    quiet: bool = False

    @property
    def given(self) -> bool:
        return (self.trace_format, self.columns, self.arrival_unit) != (None, None, None) or (
            self.on_bad_row != "error"
        )


def load_source(
    trace: Path | None, workload: Path | None, options: TraceOptions = TraceOptions()
) -> Trace | Workload:
    """The Trace or Workload named by exactly one of --trace / --workload."""
    if (trace is None) == (workload is None):
        raise ServetuneError("give exactly one of --trace FILE or --workload W.yaml")
    if trace is not None:
        return load_trace_cli(
            _need_file(trace, "--trace"), options.trace_format, options.columns,
            options.arrival_unit, options.on_bad_row, options.quiet,
        )
    if options.given:
        raise ServetuneError(
            "--trace-format, --columns, --arrival-unit and --on-bad-row apply to --trace only"
        )
    # lazy: workload fitting costs 20 ms that every other command would pay at start-up
    from servetune.workloads.fitting import load_workload

    assert workload is not None
    return load_workload(_need_file(workload, "--workload"))


def load_inputs(
    trace: Path | None, workload: Path | None, profile: str, policy: Path, slo: Path | None,
    engine: str, options: TraceOptions = TraceOptions(),
) -> tuple[Trace | Workload, Policy, Profile, SLOSet | None]:
    if engine not in ENGINE_CHOICES:
        raise ServetuneError(
            f"--engine {engine!r}: unknown engine; choose one of {', '.join(ENGINE_CHOICES)}"
        )
    source = load_source(trace, workload, options)
    # lazy: the schemas (pydantic) cost 0.1 s that `servetune --help` should not pay
    from servetune.profiles.shipped import load_profile, require_kv_pool
    from servetune.schemas.base import load_document
    from servetune.schemas.policy import Policy
    from servetune.schemas.slo import SLOSet
    from servetune.workloads.trace import Trace

    prof = load_profile(profile)
    require_kv_pool(prof, profile)
    pol = load_document(_need_file(policy, "--policy"), Policy)
    slo_set = load_document(_need_file(slo, "--slo"), SLOSet) if slo is not None else None
    if slo_set is not None and isinstance(source, Trace):
        # SLO tiers: the set's length bands (if any) name the classes; every class judged
        from servetune.workloads.tiers import check_fits, classify

        source = classify(source, slo_set)
        check_fits(source, slo_set, str(slo))
    return source, pol, prof, slo_set


def _expected_requests(source: Trace | Workload, n_requests: int | None) -> int:
    from servetune.workloads.trace import Trace  # lazy: numpy

    if isinstance(source, Trace):
        return len(source) if n_requests is None else min(n_requests, len(source))
    return n_requests or 0


def _fmt(value: Any, scale: float = 1.0, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value * scale:.{digits}f}"


def summary_table(summary: dict[str, Any], title: str) -> Table:
    """A rich table of one run's summary (latencies in ms)."""
    table = Table(title=title, title_justify="left")
    table.add_column("metric")
    for col in ("mean", "p50", "p90", "p99"):
        table.add_column(col, justify="right")
    overall = summary["overall"]
    for key, label in (("ttft_s", "TTFT (ms)"), ("tpot_s", "TPOT (ms)"), ("e2e_s", "E2E (ms)")):
        dist = overall[key]
        table.add_row(label, *(_fmt(dist[c], 1e3, 1) for c in ("mean", "p50", "p90", "p99")))
    return table


def class_table(summary: dict[str, Any]) -> Table:
    """One row per request class: counts, p99 latencies (ms), attainment."""
    table = Table(title="per class", title_justify="left")
    for col in ("class", "requests", "done", "shed", "rejected", "TTFT p99", "TPOT p99",
                "E2E p99", "attainment"):
        table.add_column(col, justify="left" if col == "class" else "right")
    for name, c in summary["per_class"].items():
        attainment = c["attainment"]
        if attainment is not None:
            verdict = "" if "meets_slo" not in c else (" ok" if c["meets_slo"] else " MISS")
            attainment_text = _fmt(attainment, 100, 2) + "%" + verdict
        else:
            attainment_text = "-"
        table.add_row(
            name, f"{c['requests']:,}", f"{c['completed']:,}", f"{c['shed']:,}",
            f"{c['rejected']:,}", _fmt(c["ttft_s"]["p99"], 1e3, 1),
            _fmt(c["tpot_s"]["p99"], 1e3, 1), _fmt(c["e2e_s"]["p99"], 1e3, 1), attainment_text,
        )
    return table


def counts_table(summary: dict[str, Any], meets: bool | None) -> Table:
    table = Table(show_header=False, box=None)
    table.add_column("key")
    table.add_column("value", justify="right")
    overall = summary["overall"]
    rows = [
        ("requests", f"{summary['requests']:,}"),
        ("completed / shed / rejected",
         f"{summary['completed']:,} / {summary['shed']:,} / {summary['rejected']:,}"),
        ("engine steps", f"{summary['steps']:,}"),
        ("preemptions", f"{summary['preemptions']:,}"),
        ("throughput (output tok/s)", _fmt(overall["throughput_tok_s"], 1, 1)),
        ("throughput (req/s)", _fmt(overall["throughput_req_s"], 1, 3)),
        ("KV utilization mean / peak",
         f"{_fmt(summary['kv']['mean_util'], 100, 1)}% / "
         f"{_fmt(summary['kv']['peak_util'], 100, 1)}%"),
        ("simulation wall time (s)", _fmt(summary["sim_wall_s"], 1, 3)),
    ]
    if overall["attainment"] is not None:
        rows.append(("SLO attainment", _fmt(overall["attainment"], 100, 2) + "%"))
    if overall.get("value_served_per_s") is not None:
        rows.append(("value served (per s)", _fmt(overall["value_served_per_s"], 1, 3)))
    if meets is not None:
        rows.append(("meets SLO", "yes" if meets else "NO"))
    for key, value in rows:
        table.add_row(key, value)
    return table


class _Progress:
    """A rich progress bar fed by the engine's progress callback (done, total)."""

    def __init__(self, console: Console, total: int, label: str) -> None:
        # lazy: rich's progress module only where a bar is drawn
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn(label), BarColumn(), TextColumn("{task.completed:,}/{task.total:,}"),
            TimeElapsedColumn(), console=console, transient=True,
        )
        self.task = self.progress.add_task(label, total=max(total, 1))

    def __enter__(self) -> _Progress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def __call__(self, done: float, total: float | None = None) -> None:
        if total is not None:
            self.progress.update(self.task, total=max(int(total), 1))
        self.progress.update(self.task, completed=int(done))


def topology_specs(path: Path, profile: Profile, policy: Policy
                   ) -> tuple[list[Any], str, str, str]:
    """The replicas of a Topology file (groups without a profile or policy get the
    command's), its router and link, and a one-line description."""
    # lazy: the schemas and profiles load when a command runs, not at start-up
    from servetune.profiles.shipped import load_profile, require_kv_pool
    from servetune.schemas.base import load_document
    from servetune.schemas.policy import Policy
    from servetune.schemas.topology import Topology
    from servetune.sim.cluster import ReplicaSpec

    topo = load_document(_need_file(path, "--topology"), Topology)
    base = path.parent

    def near(value: str) -> str:  # a path relative to the file, else a shipped name
        candidate = base / value
        return str(candidate) if candidate.exists() else value

    specs: list[Any] = []
    for k, group in enumerate(topo.replicas):
        where = f"{path}: replicas.{k}"
        prof = profile
        if group.profile is not None:
            prof = load_profile(near(group.profile))
            require_kv_pool(prof, where)
        pol = policy
        if group.policy is not None:
            pol = load_document(require_file(Path(near(group.policy)), f"named by {where}"),
                                Policy)
        specs += [ReplicaSpec(prof, pol, group.engine, group.role,
                              name=f"{topo.name}.{k}")] * group.count
    prefill = sum(g.count for g in topo.replicas if g.role == "prefill")
    decode = sum(g.count for g in topo.replicas if g.role == "decode")
    shape = (f"{topo.name}: {len(specs)} replicas" if prefill == 0 else
             f"{topo.name}: disaggregated {prefill}:{decode} over {topo.link}")
    return specs, topo.router, topo.link, shape


def _on_off(value: str | None, option: str) -> bool | None:
    if value is None:
        return None
    if value.lower() in ("on", "true", "yes", "1"):
        return True
    if value.lower() in ("off", "false", "no", "0"):
        return False
    raise ServetuneError(f"argument `{option}` {value!r}: give on or off")


def replica_table(cluster: dict[str, Any]) -> Table:
    """The cluster's replicas, one row each."""
    table = Table(title=f"{cluster['topology']}, router {cluster['router']}")
    for name in ("replica", "role", "requests", "completed", "turned away", "KV mean",
                 "KV peak", "prefix hits"):
        table.add_column(name, justify="left" if name == "role" else "right")
    for rep in cluster["replicas"]:
        hits = rep.get("hit_rate_tokens")
        table.add_row(str(rep["replica"]), rep["role"], str(rep["requests"]),
                      str(rep["completed"]), str(rep["shed"] + rep["rejected"]),
                      f"{rep['kv_mean_util']:.1%}", f"{rep['kv_peak_util']:.1%}",
                      "-" if hits is None else f"{hits:.1%}")
    return table


def _json_text(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, allow_nan=False) + "\n"


# Options both commands take (parameter annotations).
ProfileOption = Annotated[
    str, typer.Option("--profile", help="GPU profile YAML (or shipped name)")
]
PolicyOption = Annotated[Path, typer.Option("--policy", help="Policy YAML")]
TraceOption = Annotated[Path | None, typer.Option("--trace", help="trace file to replay")]
WorkloadOption = Annotated[
    Path | None, typer.Option("--workload", help="Workload YAML to sample")
]
EngineOption = Annotated[str, typer.Option("--engine", help=" | ".join(ENGINE_NAMES))]
RequestsOption = Annotated[
    int | None, typer.Option("--requests", help="trace: replay the first N; workload: sample N")
]
DurationOption = Annotated[
    float | None,
    typer.Option("--duration", help="only arrivals in the first S simulated seconds"),
]


def register(app: typer.Typer) -> None:
    """Add ``simulate`` and ``goodput`` to the top-level app."""

    @app.command("simulate")
    def simulate_command(
        profile: ProfileOption,
        policy: PolicyOption,
        trace: TraceOption = None,
        workload: WorkloadOption = None,
        engine: EngineOption = "vllm",
        rate_scale: float = typer.Option(1.0, "--rate-scale", help="arrival-rate multiplier"),
        seed: int = typer.Option(0, "--seed", help="sampling seed (workloads)"),
        requests: RequestsOption = None,
        duration: DurationOption = None,
        reference: bool = typer.Option(
            False, "--reference", help="step-by-step reference mode (slow; for checking)"
        ),
        slo: Path | None = typer.Option(None, "--slo", help="SLO set YAML: attainment, verdict"),
        as_json: JsonOption = False,
        json_out: JsonOutOption = None,
        quiet: QuietOption = False,
        records: Path | None = typer.Option(
            None, "--records", help="per-request records (.csv, or .parquet with pyarrow)"
        ),
        steps: Path | None = typer.Option(None, "--steps", help="step log as JSON lines"),
        timeline: Path | None = typer.Option(
            None, "--timeline", help="Chrome trace-event JSON (open in Perfetto)"
        ),
        timeline_window: str | None = typer.Option(
            None, "--timeline-window", help="START:END seconds kept in the timeline"
        ),
        trace_format: TraceFormatOption = None,
        columns: ColumnsOption = None,
        arrival_unit: ArrivalUnitOption = None,
        on_bad_row: OnBadRowOption = "error",
        prefix_caching: str | None = typer.Option(
            None, "--prefix-caching", help="on | off (default: the policy's "
            "caching.enable_prefix_caching, else the engine's own)"),
        replicas: int = typer.Option(
            1, "--replicas", min=1, max=MAX_REPLICAS, help="engine replicas behind a router "
            f"(at most {MAX_REPLICAS}, and as many as fit {MAX_CLUSTER_STATE_BYTES / 2**30:g} "
            "GiB of replica state: each holds ~100 B per request and ~89 B per KV block; "
            "same profile and policy)"),
        router: str = typer.Option(
            "round_robin", "--router", help=f"{' | '.join(ROUTER_NAMES)} (those that read "
            f"the replicas, {', '.join(r.name for r in ROUTERS if r.reads_replicas)}: at "
            f"most {MAX_ROUTED_REPLICAS} replicas)"),
        disagg: str | None = typer.Option(
            None, "--disagg", help="P:D prefill and decode replicas (disaggregated "
            "serving; replaces --replicas)"),
        link: str = typer.Option(
            "infiniband", "--link", help="KV transfer link under --disagg: nvlink | "
            "infiniband | roce"),
        topology: Path | None = typer.Option(
            None, "--topology", help="Topology YAML: replica groups (profile, policy, "
            "engine, role, count), router and link; replaces --replicas/--disagg/--router/"
            "--link"),
    ) -> None:
        """Simulate a policy serving a trace or a sampled workload, on one engine or a
        cluster of replicas behind a router (--replicas, --router, --disagg).

        Example: servetune simulate --trace ../shared/traces/AzureLLMInferenceTrace_conv.csv
        --profile h200-llama-3.1-8b --policy configs/policies/vllm-serve-defaults.yaml
        --slo configs/slos/mlperf-llama-3.1-8b-server.yaml --json-out out.json
        --timeline t.json --timeline-window 600:660   (open t.json in ui.perfetto.dev)

        A cluster: servetune simulate --trace mooncake_trace.jsonl --profile
        h200-llama-3.1-8b --policy configs/policies/vllm-serve-defaults.yaml
        --prefix-caching on --replicas 4 --router prefix_aware (or --disagg 2:2, or
        --topology configs/topologies/h200-1p3d.yaml)
        """
        # lazy: the simulator package adds 35 ms to every command's start-up
        from servetune.sim import simulate
        from servetune.sim.api import simulate_cluster
        from servetune.sim.cluster import (
            LINKS,
            ReplicaSpec,
            disaggregated_specs,
            parse_disagg,
            replica_summaries,
        )
        from servetune.sim.records import check_records_path
        from servetune.sim.timeline import parse_window

        caching = _on_off(prefix_caching, "--prefix-caching")
        if router not in ROUTER_NAMES:
            raise ServetuneError(f"argument `--router` {router!r}: choose one of "
                                 f"{', '.join(ROUTER_NAMES)}")
        if link not in LINKS:
            raise ServetuneError(f"argument `--link` {link!r}: choose one of "
                                 f"{', '.join(LINKS)}")
        split = parse_disagg(disagg) if disagg is not None else None
        if split is not None and replicas != 1:
            raise ServetuneError("give --replicas or --disagg P:D, not both")
        if topology is not None and (split is not None or replicas != 1):
            raise ServetuneError("give --topology or --replicas / --disagg, not both")
        clustered = split is not None or replicas > 1 or topology is not None
        if clustered and (steps is not None or timeline is not None):
            raise ServetuneError("--steps and --timeline show one engine; drop them, or "
                                 "simulate one replica (no --replicas / --disagg)")

        window = parse_window(timeline_window) if timeline_window is not None else None
        if window is not None and timeline is None:
            raise ServetuneError("--timeline-window needs --timeline T.json")
        json_to = JsonTarget.of(as_json, json_out)
        check_outputs({"--json-out": json_to.file, "--records": records, "--steps": steps,
                       "--timeline": timeline},
                      {**_inputs(trace, workload, profile, policy, slo),
                       "--topology": topology})
        if records is not None:
            check_records_path(records)
        options = TraceOptions(trace_format, columns, arrival_unit, on_bad_row, quiet)
        source, pol, prof, slo_set = load_inputs(
            trace, workload, profile, policy, slo, engine, options
        )
        console = Console(stderr=True, soft_wrap=True)  # one line per message, piped or not
        expected = _expected_requests(source, requests)
        show = not quiet and (expected >= PROGRESS_MIN_REQUESTS or (
            reference and expected >= REFERENCE_PROGRESS_MIN_REQUESTS
        ))
        kwargs = dict(
            engine=engine, reference=reference, seed=seed, n_requests=requests,
            duration_s=duration, rate_scale=rate_scale,
            # both written while simulating: the run never holds the whole step log
            steps_file=steps, timeline=timeline is not None, timeline_window=window,
        )
        cluster = None
        with compile_notice(quiet, console_say(console)):
            if clustered:
                if topology is not None:
                    specs, router, link, shape = topology_specs(topology, prof, pol)
                elif split is not None:
                    specs = disaggregated_specs(prof, pol, engine, *split)
                    shape = f"disaggregated {split[0]}:{split[1]} over {link}"
                else:
                    specs = [ReplicaSpec(prof, pol, engine)] * replicas
                    shape = f"{replicas} replicas"
                result, cluster = simulate_cluster(
                    source, specs, router=router, link=LINKS[link], reference=reference,
                    seed=seed, n_requests=requests, duration_s=duration,
                    rate_scale=rate_scale, prefix_caching=caching)
            elif show:
                with _Progress(console, expected, "simulating") as bar:
                    result = simulate(source, pol, prof, progress=bar,
                                      prefix_caching=caching, **kwargs)
            else:
                result = simulate(source, pol, prof, prefix_caching=caching, **kwargs)
        summary = result.summary(slo_set)
        if "prefix_cache" in summary and result.trace.prefix_offsets is not None:
            summary["prefix_cache"].update(_cache_bounds(result.trace, prof))
        if cluster is not None:
            summary["cluster"] = {
                "router": router,
                "topology": shape,
                "replicas": replica_summaries(cluster, result.trace),
            }
        meets = result.meets_slo(slo_set) if slo_set is not None else None
        writers: list[tuple[Path, Callable[[], None]]] = []
        file = json_to.file
        if file is not None:  # per-class verdicts are in per_class
            writers.append((file, lambda: write_text_atomic(file, _json_text(summary))))
        if records is not None:
            writers.append((records, lambda: result.write_records(records)))
        if steps is not None:
            writers.append((steps, lambda: result.write_steps(steps)))
        if timeline is not None:
            writers.append((timeline, lambda: result.write_timeline(timeline, window)))
        if not quiet and (steps is not None or timeline is not None):
            with console.status("writing the step log / timeline"):
                write_all_or_none(writers)
        else:
            write_all_or_none(writers)
        end_s = float(result.output.sim_end_s)
        if not quiet and window is not None and window[0] >= end_s:
            console.print(
                f"servetune: note: --timeline-window starts at {window[0]:g} s, after the run "
                f"ended ({end_s:.1f} s): the timeline has no steps", highlight=False,
            )
        if json_to.stdout:
            print_json(_json_text(summary))
            return
        out = Console(file=sys.stdout, width=100)
        title = f"{pol.name} on {prof.name} ({engine}{', reference' if reference else ''})"
        out.print(summary_table(summary, title))
        if len(summary["per_class"]) > 1:
            out.print(class_table(summary))
        out.print(counts_table(summary, meets))
        if "prefix_cache" in summary:
            pc = summary["prefix_cache"]
            out.print(f"prefix cache: {pc['hit_rate_tokens']:.1%} of admitted prompt tokens "
                      f"served from the cache ({pc['evictions']} evictions)", highlight=False)
            if "trace_bound" in pc:
                out.print(f"the trace's own reuse: an unbounded cache would hit "
                          f"{pc['trace_bound']:.1%} of its block references, an LRU cache of "
                          f"this KV pool's size {pc['lru_hit_rate_at_pool']:.1%}",
                          highlight=False)
        if cluster is not None:
            out.print(replica_table(summary["cluster"]))

    @app.command("goodput")
    def goodput_command(
        profile: ProfileOption,
        policy: PolicyOption,
        slo: Path = typer.Option(..., "--slo", help="SLO set YAML"),
        trace: TraceOption = None,
        workload: WorkloadOption = None,
        engine: EngineOption = "vllm",
        seed: int = typer.Option(0, "--seed", help="first sampling seed (workloads)"),
        seeds: int = typer.Option(
            1, "--seeds", help="number of seeds per point (workloads; a point passes only "
            "when every seed passes; optimize judges one)"),
        requests: RequestsOption = None,
        duration: DurationOption = None,
        reference: bool = typer.Option(False, "--reference", help="step-by-step reference mode"),
        scale_by: str | None = typer.Option(
            None, "--scale-by", help="workloads with sessions: what the rate scale "
            "compresses, time (think times too) or sessions (more sessions at once); "
            "default: the workload's sessions.scale_by (time unless fitted otherwise)"),
        rel_tol: float = typer.Option(
            0.01, "--tolerance", help="relative bisection tolerance (optimize prints its "
            "goodput at 0.01)"),
        as_json: JsonOption = False,
        json_out: JsonOutOption = None,
        quiet: QuietOption = False,
        trace_format: TraceFormatOption = None,
        columns: ColumnsOption = None,
        arrival_unit: ArrivalUnitOption = None,
        on_bad_row: OnBadRowOption = "error",
        workers: WorkersOption = None,
        ray: RayOption = None,
    ) -> None:
        """Find the highest arrival-rate scale at which a policy meets an SLO set.

        Example: servetune goodput --workload configs/workloads/azure-conv-2023.yaml
        --requests 5000 --seeds 3 --profile h200-llama-3.1-8b
        --policy configs/policies/vllm-serve-defaults.yaml
        --slo configs/slos/mlperf-llama-3.1-8b-interactive.yaml --json-out goodput.json
        """
        # lazy: the simulator package adds 35 ms to every command's start-up
        from servetune.sim import goodput
        from servetune.sim.goodput import seeds_for

        seed_list = seeds_for(seeds, seed)
        if not rel_tol > 0:
            raise ServetuneError(f"--tolerance must be > 0 (got {rel_tol})")
        json_to = JsonTarget.of(as_json, json_out)
        check_outputs({"--json-out": json_to.file},
                      _inputs(trace, workload, profile, policy, slo))
        options = TraceOptions(trace_format, columns, arrival_unit, on_bad_row, quiet)
        source, pol, prof, slo_set = load_inputs(
            trace, workload, profile, policy, slo, engine, options
        )
        assert slo_set is not None
        if scale_by is not None:
            if trace is not None:
                raise ServetuneError("--scale-by applies to --workload (a trace replays its "
                                     "own sessions, scaled by time)")
            from servetune.workloads.fitting import workload_scaled_by

            source = workload_scaled_by(source, scale_by)
        console = Console(stderr=True, soft_wrap=True)  # one line per message, piped or not

        def on_point(point: dict[str, Any]) -> None:
            if quiet:
                return
            verdict = "meets" if point["meets_slo"] else "misses"
            console.print(
                f"rate scale {point['rate_scale']:.4g}: {verdict} SLO "
                f"(attainment {_fmt(point['attainment'], 100, 2)}%)"
            )

        with compile_notice(quiet, console_say(console)), executor_for(workers, ray) as executor:
            result = goodput(
                source, pol, prof, slo_set, engine=engine, seeds=seed_list,
                n_requests=requests, duration_s=duration, reference=reference,
                rel_tol=rel_tol, on_point=on_point, executor=executor,
            )
        data = {
            "policy": pol.name, "profile": prof.name, "slo": slo_set.name, "engine": engine,
            "seeds": list(seed_list), **result.to_dict(),
        }
        if json_to.file is not None:
            write_text_atomic(json_to.file, _json_text(data))
        out = Console(file=sys.stdout, width=100)
        if json_to.stdout:
            print_json(_json_text(data))
        else:
            out.print(_points_table(result, pol, prof, engine))
        if result.rate_scale == 0.0:
            raise InfeasibleError(
                f"no rate scale down to 1/1024 meets {slo_set.name!r} with policy {pol.name!r}; "
                "relax the SLO or change the policy"
            )
        for warning in result.warnings:
            console.print(f"warning: {warning}")
        if not json_to.stdout:
            out.print(
                f"goodput: rate scale {result.rate_scale:.4g} = {result.rate_per_s:.3f} req/s"
                + ("" if result.bracketed else " (search hit the scale limit)")
            )


def _cache_bounds(trace: Trace, profile: Profile) -> dict[str, float]:
    """What the replayed trace's own reuse allows (:func:`servetune.workloads.reuse.
    hit_rate_curve`): the infinite-cache bound, and the LRU hit rate of a cache as large
    as the profile's KV pool (in the trace's blocks), both shares of block references."""
    from servetune.workloads.reuse import hit_rate_curve, pool_blocks  # lazy: as above

    pool = pool_blocks(int(profile.kv_blocks()) * int(profile.block_size), trace)
    curve = hit_rate_curve(trace, fractions=(), sizes=(pool,))
    return {"trace_bound": curve["bound"], "lru_hit_rate_at_pool": curve["points"][0]["hit_rate"]}


def _points_table(result: GoodputResult, pol: Policy, prof: Profile, engine: str) -> Table:
    """The goodput search's points, by rate scale."""
    table = Table(title=f"goodput of {pol.name} on {prof.name} ({engine})",
                  title_justify="left")
    for col in ("rate scale", "rate (req/s)", "meets SLO", "attainment"):
        table.add_column(col, justify="right")
    for p in sorted(result.points, key=lambda p: p["rate_scale"]):
        table.add_row(
            f"{p['rate_scale']:.4g}", f"{p['rate_per_s']:.3f}",
            "yes" if p["meets_slo"] else "no", _fmt(p["attainment"], 100, 2) + "%",
        )
    return table
