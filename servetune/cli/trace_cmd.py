"""CLI: ``servetune trace stats``: load a trace in any supported format and summarize it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn
from rich.table import Table

from servetune.cli.root import new_group
from servetune.workloads.stats import per_class_stats, trace_stats
from servetune.workloads.trace import Trace

# Files at least this large show a progress bar while they load.
PROGRESS_MIN_BYTES = 64 << 20

TRACE_FORMAT_HELP = (
    "Force the format: azure, burstgpt, mooncake, vllm-bench, csv, jsonl "
    "(default: detected from the header or first record)."
)
COLUMNS_HELP = (
    "Column mapping for csv/jsonl: arrival=COL,prompt=COL,output=COL"
    "[,class=COL,priority=COL,max_tokens=COL]."
)
ARRIVAL_UNIT_HELP = (
    "Unit of the mapped arrival column: s, ms, us, ns or datetime "
    "(default: s for numbers, datetime for text)."
)
ON_BAD_ROW_HELP = "error (default): stop at the first bad row; skip: drop bad rows and count them."

# The options every command that reads a trace file takes (use as parameter annotations).
TraceFormatOption = Annotated[
    str | None, typer.Option("--trace-format", help=TRACE_FORMAT_HELP)
]
ColumnsOption = Annotated[str | None, typer.Option("--columns", help=COLUMNS_HELP)]
ArrivalUnitOption = Annotated[
    str | None, typer.Option("--arrival-unit", help=ARRIVAL_UNIT_HELP)
]
OnBadRowOption = Annotated[str, typer.Option("--on-bad-row", help=ON_BAD_ROW_HELP)]


@contextmanager
def load_progress(path: Path) -> Iterator[Callable[[int, int], None] | None]:
    """A progress callback (bytes read of total) for large files, drawn on stderr."""
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    if size < PROGRESS_MIN_BYTES:
        yield None
        return
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
) -> Trace:
    """Load a trace for a command, with a progress bar for large files and notices on stderr."""
    # lazy: the trace readers cost 10 ms that every other command would pay at start-up
    from servetune.workloads.formats import load_trace

    with load_progress(path) as progress:
        trace = load_trace(
            path,
            fmt=trace_format,
            on_bad_row=on_bad_row,
            columns=columns,
            arrival_unit=arrival_unit,
            progress=progress,
        )
    for notice in trace.notices:
        typer.echo(f"servetune: note: {path}: {notice}", err=True)
    return trace


def stats_table(stats: dict[str, Any], title: str) -> Table:
    """A rich table of a ``trace_stats`` object."""
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
        as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
        trace_format: TraceFormatOption = None,
        columns: ColumnsOption = None,
        arrival_unit: ArrivalUnitOption = None,
        on_bad_row: OnBadRowOption = "error",
    ) -> None:
        """Request count, span, mean rate, burstiness and prompt/output length statistics."""
        trace = load_trace_cli(file, trace_format, columns, arrival_unit, on_bad_row)
        result = trace_stats(trace)
        if as_json:
            typer.echo(json.dumps(result))
            return
        console = Console()
        console.print(stats_table(result, str(file)))
        if len(trace.class_names) > 1:
            for name, cls in per_class_stats(trace).items():
                console.print(stats_table(cls, f"class {name}"))

    app.add_typer(group, name="trace")
