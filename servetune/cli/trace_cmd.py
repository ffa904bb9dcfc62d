"""CLI: ``servetune trace stats``: load a trace in any supported format and summarize it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from servetune.cli.options import (
    ArrivalUnitOption,
    ColumnsOption,
    JsonOption,
    OnBadRowOption,
    QuietOption,
    TraceFormatOption,
    note_line,
    print_json,
)
from servetune.cli.root import new_group
from servetune.errors import ServetuneError

if TYPE_CHECKING:  # imported where used: see the lazy imports
    from rich.table import Table

    from servetune.workloads.trace import Trace

# Files at least this large show a progress bar while they load.
PROGRESS_MIN_BYTES = 64 << 20


@contextmanager
def load_progress(path: Path, quiet: bool = False) -> Iterator[Callable[[int, int], None] | None]:
    """A progress callback (bytes read of total) for large files, drawn on stderr; none
    under -q."""
    if quiet:
        yield None
        return
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    if size < PROGRESS_MIN_BYTES:
        yield None
        return
    # lazy: rich's progress only for a file large enough to show one
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as progress:
        task = progress.add_task(f"loading {path.name}", total=size)

        def update(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total or size)

        yield update


def load_trace_cli(
    path: Path,
    trace_format: str | None,
    columns: str | None,
    arrival_unit: str | None,
    on_bad_row: str,
    quiet: bool = False,
) -> Trace:
    """Load a trace for a command, with a progress bar for large files and notes on stderr
    (neither under -q)."""
    # lazy: the trace readers cost 10 ms that every other command would pay at start-up
    from servetune.workloads.formats import load_trace

    with load_progress(path, quiet) as progress:
        trace = load_trace(
            path,
            fmt=trace_format,
            on_bad_row=on_bad_row,
            columns=columns,
            arrival_unit=arrival_unit,
            progress=progress,
        )
    if not quiet:
        for notice in trace.notices:
            note_line(f"note: {path}: {notice}")
    return trace


def stats_table(stats: dict[str, Any], title: str) -> Table:
    """A rich table of a ``trace_stats`` object."""
    from rich.table import Table  # lazy: only `trace stats` draws tables

    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("", style="bold")
    for col in ("mean", "p50", "p90", "p99", "max"):
        table.add_column(col, justify="right")
    for key, label in (("prompt_tokens", "prompt tokens"), ("output_tokens", "output tokens")):
        row = stats[key]
        table.add_row(label, *(f"{row[c]:,.1f}" for c in ("mean", "p50", "p90", "p99", "max")))
    table.caption = (
        f"{stats['requests']:,} requests over {stats['duration_s']:,.1f} s; "
        f"mean rate {stats['rate_per_s']:.3f} req/s; "
        f"inter-arrival CV {stats['interarrival_cv']:.2f}"
    )
    return table


def register(app: typer.Typer) -> None:
    """Add this module's commands to the top-level app."""
    group = new_group("Inspect request traces (Azure, BurstGPT, Mooncake, vllm bench, CSV/JSONL).")

    @group.command(
        "stats",
        epilog="Example: servetune trace stats ../shared/traces/AzureLLMInferenceTrace_conv.csv "
        "--json",
    )
    def stats(
        file: Path = typer.Argument(..., help="Trace file (optionally .gz)."),
        as_json: JsonOption = False,
        quiet: QuietOption = False,
        trace_format: TraceFormatOption = None,
        columns: ColumnsOption = None,
        arrival_unit: ArrivalUnitOption = None,
        on_bad_row: OnBadRowOption = "error",
        plot: Path | None = typer.Option(
            None, "--plot", help="write the LRU hit-rate curve as a PNG (a trace with "
            "prefix block ids)"),
    ) -> None:
        """Request count, span, mean rate, burstiness and prompt/output length statistics;
        for a trace with prefix block ids, its reuse and its LRU hit-rate curve."""
        # lazy: numpy and rich's renderers cost 0.1 s that --help should not pay
        from rich.console import Console

        from servetune.io import check_outputs, write_bytes_atomic
        from servetune.workloads.stats import per_class_stats, trace_stats

        check_outputs({"--plot": plot}, {"FILE": file})
        trace = load_trace_cli(file, trace_format, columns, arrival_unit, on_bad_row, quiet)
        if plot is not None and trace.prefix_offsets is None:
            raise ServetuneError(f"--plot: {file} has no prefix block ids (Mooncake hash_ids "
                                 "or a session column), so it has no hit-rate curve")
        result = trace_stats(trace)
        if trace.prefix_offsets is not None:
            from servetune.workloads.reuse import hit_rate_curve, reuse_stats

            result["prefix_reuse"] = reuse_stats(trace).summary()
            result["prefix_reuse"]["hit_rate_curve"] = hit_rate_curve(trace)
            if plot is not None:
                from servetune.apps.report import hit_rate_figure

                write_bytes_atomic(plot, [hit_rate_figure({"trace": trace}, file.name)])
        if as_json:
            print_json(json.dumps(result) + "\n")
            return
        from servetune.workloads.reuse import curve_text

        console = Console()
        console.print(stats_table(result, str(file)))
        if "prefix_reuse" in result:
            reuse = result["prefix_reuse"]
            console.print(
                f"prefix reuse: {reuse['reuse_ratio']:.1%} of {reuse['references']:,} block "
                f"references repeat an earlier id ({reuse['block_tokens']}-token blocks); "
                f"{reuse['sessions']:,} sessions, {reuse['continuing_share']:.1%} of requests "
                f"continue one; {reuse['system_prompts']:,} shared prefixes", highlight=False)
            console.print(curve_text(reuse["hit_rate_curve"]), highlight=False)
        if len(trace.class_names) > 1:
            for name, cls in per_class_stats(trace).items():
                console.print(stats_table(cls, f"class {name}"))

    app.add_typer(group, name="trace")
