"""CLI: ``servetune workload fit`` (trace -> Workload YAML) and ``workload show``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from servetune.cli.options import (
    ArrivalUnitOption,
    ColumnsOption,
    JsonOption,
    OnBadRowOption,
    QuietOption,
    TraceFormatOption,
    print_json,
)
from servetune.cli.root import new_group
from servetune.cli.trace_cmd import load_trace_cli, stats_table
from servetune.errors import ServetuneError
from servetune.io import check_outputs

if TYPE_CHECKING:
    from rich.table import Table

    from servetune.schemas.workload import Arrival, Workload
    from servetune.workloads.fitting import ClassStats

SPLITS = ("none", "class", "prompt-quantiles")


def class_table(workload: Workload, title: str) -> Table:
    """Classes as columns, statistics as rows (fits a terminal for a few classes)."""
    # lazy: workload fitting costs 20 ms that every other command would pay at start-up
    from rich.table import Table

    from servetune.workloads.fitting import class_stats

    stats = class_stats(workload)
    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("", style="bold")
    for s in stats:
        table.add_column(s.name, justify="right")
    rows: list[tuple[str, Callable[[ClassStats], str]]] = [
        ("priority", lambda s: str(s.priority)),
        ("rate (req/s)", lambda s: f"{s.rate_per_s:.3f}"),
        ("share", lambda s: f"{s.share:.1%}"),
        ("arrivals", lambda s: _arrival_text(workload.classes[s.name].arrival)),
    ]
    for kind in ("prompt", "output"):
        for q in ("mean", "p50", "p90", "p99", "max"):
            rows.append((f"{kind} {q}", lambda s, a=f"{kind}_{q}": f"{getattr(s, a):,.1f}"))
    for label, cell in rows:
        table.add_row(label, *(cell(s) for s in stats))
    return table


def _arrival_text(arrival: Arrival) -> str:
    text = arrival.process if arrival.process == "poisson" else (
        f"{arrival.process} CV {arrival.interarrival_cv:.2f}"
    )
    if arrival.windows is not None:
        text += f", {len(arrival.windows.rate_multipliers)} x {arrival.windows.window_s:g} s"
    if arrival.modulation is not None:
        text += (f", modulated: {len(arrival.modulation.levels)} levels x "
                 f"{arrival.modulation.window_s:g} s, gap CV {arrival.gaps_cv:.2f}")
    return text


def register(app: typer.Typer) -> None:
    """Add this module's commands to the top-level app."""
    group = new_group("Fit workloads (classes, arrivals, length distributions) and inspect them.")

    @group.command(
        "fit",
        epilog="Example: servetune workload fit ../shared/traces/AzureLLMInferenceTrace_conv.csv "
        "-o conv.yaml --rate-windows 300",
    )
    def fit(
        trace_path: Path = typer.Argument(
            ..., metavar="TRACE", help="Trace file (optionally .gz)."
        ),
        output: Path = typer.Option(..., "-o", "--output", help="Workload YAML to write."),
        split_by: str = typer.Option(
            "none", "--split-by", help="none (one class), class (the trace's class column) or "
            "prompt-quantiles (bands of prompt length)."
        ),
        bands: int = typer.Option(3, "--bands", help="Number of prompt-length bands."),
        rate_windows: str = typer.Option(
            "auto", "--rate-windows", help="Slow rate profile: auto (windows of <= 5 min, "
            "at least 6 over the trace, when the trace is long enough and its windowed rate "
            "or length mix drifts significantly), none (stationary), or S seconds."
        ),
        name: str | None = typer.Option(None, "--name", help="Workload name (default: file stem)."),
        arrival: str = typer.Option(
            "auto", "--arrival", help="Arrival process: auto (bootstrap when the parametric "
            "fit misses the trace's bursts or where its longest prompts fall, else "
            "parametric), bootstrap (the trace's own requests in 60 s blocks, shuffled within "
            "its slow windows), parametric (a Markov-modulated rate when windowed counts show "
            "sustained bursts, else renewal), renewal (empirical gaps when the gap CV is over "
            "2, else gamma or poisson), modulated, poisson, gamma or empirical."
        ),
        scale_by: str = typer.Option(
            "time", "--scale-by", help="Traces with sessions (prefix ids): what a rate "
            "scale compresses. time (the default: every gap, think times too; the same "
            "sessions faster, so the hit-rate curve is the trace's at every load) or "
            "sessions (more sessions at once, each with the trace's think times; fewer cache "
            "hits at high load)."
        ),
        quiet: QuietOption = False,
        trace_format: TraceFormatOption = None,
        columns: ColumnsOption = None,
        arrival_unit: ArrivalUnitOption = None,
        on_bad_row: OnBadRowOption = "error",
    ) -> None:
        """Fit a Workload to a trace: classes, arrival process, length distributions."""
        # lazy: as in class_table
        from rich.console import Console

        from servetune.schemas.workload import SCALE_BY
        from servetune.workloads.fitting import arrival_model, fit_workload, save_workload
        from servetune.workloads.prefixes import describe as describe_prefix_reuse

        if split_by not in SPLITS:
            raise ServetuneError(
                f"--split-by must be one of {', '.join(SPLITS)} (got {split_by!r})"
            )
        if bands < 1:
            raise ServetuneError(f"--bands must be >= 1 (got {bands})")
        if scale_by not in SCALE_BY:
            raise ServetuneError(
                f"--scale-by must be one of {', '.join(SCALE_BY)} (got {scale_by!r})")
        windows: float | str = rate_windows
        if rate_windows not in ("auto", "none"):
            try:
                windows = float(rate_windows)
            except ValueError:
                raise ServetuneError(
                    f"--rate-windows must be auto, none or a number of seconds (got "
                    f"{rate_windows!r})"
                ) from None
        check_outputs({"-o/--output": output}, {"TRACE": trace_path})
        trace = load_trace_cli(trace_path, trace_format, columns, arrival_unit, on_bad_row, quiet)
        workload = fit_workload(
            trace,
            split=None if split_by == "none" else split_by,
            bands=bands,
            rate_windows_s=windows,
            name=name or output.stem,
            source=trace_path.name,
            arrival_process=arrival,
            scale_by=scale_by,
        )
        header = (
            f"Fitted by servetune from {trace_path.name}: {len(trace)} requests over "
            f"{trace.duration_s:.1f} s (split: {split_by})."
        )
        save_workload(workload, output, header=header)
        if not quiet:
            Console(stderr=True).print(class_table(workload, f"wrote {output}"))
            Console(stderr=True).print(f"arrivals: {arrival_model(workload)}")
            if workload.prefix_reuse is not None:
                Console(stderr=True).print(describe_prefix_reuse(workload.prefix_reuse))

    @group.command(
        "show",
        epilog="Example: servetune workload show configs/workloads/azure-conv-2023.yaml "
        "--sample 200000 --seed 1 --json",
    )
    def show(
        path: Path = typer.Argument(..., metavar="W.yaml", help="Workload YAML."),
        sample: int | None = typer.Option(
            None, "--sample", help="Sample N requests and print their statistics."
        ),
        seed: int = typer.Option(0, "--seed", help="Seed for --sample."),
        rate_scale: float = typer.Option(
            1.0, "--rate-scale", help="Multiply every rate of the --sample."
        ),
        as_json: JsonOption = False,
        plot: Path | None = typer.Option(
            None, "--plot", help="write the sample's LRU hit-rate curve as a PNG (a workload "
            "with prefix_reuse)"),
    ) -> None:
        """Show a workload's classes, or sample it and show the sample's statistics. A
        workload with prefix reuse also shows the LRU hit-rate curve of a sample (--sample
        N, else as many requests as `goodput` judges on)."""
        # lazy: as in class_table
        from rich.console import Console

        from servetune.apps.report import hit_rate_figure
        from servetune.io import check_outputs, write_bytes_atomic
        from servetune.sim.evaluator import default_requests
        from servetune.workloads.fitting import class_stats_json, load_workload, sample_trace
        from servetune.workloads.reuse import curve_text, hit_rate_curve
        from servetune.workloads.stats import trace_stats

        check_outputs({"--plot": plot}, {"W.yaml": path})
        workload = load_workload(path)
        console = Console()
        if sample is None and rate_scale != 1.0:
            raise ServetuneError(
                "--rate-scale applies to the sampled requests; add --sample N (e.g. --sample "
                "100000) to see the statistics at that rate"
            )
        if sample is not None and sample < 1:
            raise ServetuneError(f"--sample must be >= 1 (got {sample})")
        if plot is not None and workload.prefix_reuse is None:
            raise ServetuneError(f"--plot: {path} has no prefix_reuse section, so its samples "
                                 "have no hit-rate curve")
        sampled = None
        if sample is not None or workload.prefix_reuse is not None:
            size = sample if sample is not None else default_requests(workload)
            sampled = sample_trace(workload, n_requests=size, seed=seed, rate_scale=rate_scale)
        curve = (hit_rate_curve(sampled) if sampled is not None
                 and sampled.prefix_offsets is not None else None)
        n_sampled = len(sampled) if sampled is not None else 0
        title = f"{workload.name}: {n_sampled:,} sampled, seed {seed}"
        if plot is not None:
            write_bytes_atomic(plot, [hit_rate_figure({"sample": sampled}, title)])
        if sample is None:
            if as_json:
                data = class_stats_json(workload)
                if curve is not None:
                    data["prefix_reuse_sample"] = {"requests": len(sampled), "seed": seed,
                                                   "hit_rate_curve": curve}
                print_json(json.dumps(data) + "\n")
            else:
                console.print(class_table(workload, f"{workload.name} ({path})"))
                if workload.prefix_reuse is not None:
                    from servetune.workloads.prefixes import describe

                    console.print(describe(workload.prefix_reuse))
                if curve is not None:
                    console.print(f"{title}: {curve_text(curve)}", highlight=False)
            return
        result = trace_stats(sampled)
        if curve is not None:
            result["prefix_reuse"] = {"hit_rate_curve": curve}
        if as_json:
            print_json(json.dumps(result) + "\n")
        else:
            console.print(stats_table(result, title))
            if curve is not None:
                console.print(curve_text(curve), highlight=False)

    app.add_typer(group, name="workload")
