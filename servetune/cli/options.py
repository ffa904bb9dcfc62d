"""The options several commands share, defined once, and how a command honours them.

- How to read a trace file: ``--trace-format``, ``--columns``, ``--arrival-unit``,
  ``--on-bad-row`` (every command that reads a trace).
- ``--json``: a flag everywhere: print the result as JSON on stdout, and nothing else
  there; ``--json-out PATH``: write it to a file (``-``: stdout, the same as ``--json``),
  on the commands that can write their JSON to a file.
- ``-q/--quiet``: nothing on stderr but warnings and errors (no progress lines, no
  notes), on every command that prints progress or notes there.
- ``--workers N`` / ``--ray [ADDRESS]``: where a command's independent simulations run
  (:mod:`servetune.executor`): N local processes (default: ``SERVETUNE_WORKERS``, else
  the number of cores for plan, sweep and goodput, 1 for the commands whose batches are
  small; 1: in this process), or Ray tasks. The output is the same, byte
  for byte, whatever they say.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from servetune.errors import ServetuneError
from servetune.io import STDOUT

if TYPE_CHECKING:
    from rich.console import Console

    from servetune.executor import Executor

TRACE_FORMAT_HELP = (
    "Force the format: azure, burstgpt, mooncake, vllm-bench, csv, jsonl "
    "(default: detected from the header or first record)."
)
COLUMNS_HELP = (
    "Column mapping for csv/jsonl: arrival=COL,prompt=COL,output=COL"
    "[,class=COL,priority=COL,max_tokens=COL,session=COL]."
)
ARRIVAL_UNIT_HELP = (
    "Unit of the mapped arrival column: s, ms, us, ns or datetime "
    "(default: s for numbers, datetime for text)."
)
ON_BAD_ROW_HELP = "error (default): stop at the first bad row; skip: drop bad rows and count them."
JSON_HELP = "Print the result as JSON on stdout, and nothing else there."
JSON_OUT_HELP = "Write the result as JSON to this file ('-': stdout, the same as --json)."
QUIET_HELP = "Nothing on stderr but warnings and errors (no progress lines, no notes)."
# Modules a process worker imports before its first task (in the fork server, once): the
# simulator, the schemas and the apps that tasks run.
WORKER_PRELOAD = ("servetune.sim.api", "servetune.apps.optimize", "servetune.apps.plan")
WORKERS_HELP = (
    "Local worker processes for the independent simulations (default: $SERVETUNE_WORKERS, "
    "else the number of cores; 1: all in this process). The output is the same whatever "
    "the count."
)
RAY_HELP = (
    "Run the independent simulations as Ray tasks (pip install 'servetune[ray]'): 'local' "
    "(a Ray started here; what a bare --ray means), 'auto' (the cluster this machine "
    "joined with `ray start`) or an address such as ray://HOST:10001. The output is the "
    "same as without Ray."
)
SMALL_WORKERS_HELP = (
    "Local worker processes for the independent simulations (default: $SERVETUNE_WORKERS, "
    "else 1: in this process, since this command's batches are a few simulations between "
    "solver calls and a pool takes 1-2 s to start; more pays on long runs). The output is "
    "the same whatever the count."
)
WORKERS_ENV = "SERVETUNE_WORKERS"

# The options every command that reads a trace file takes (use as parameter annotations).
TraceFormatOption = Annotated[
    str | None, typer.Option("--trace-format", help=TRACE_FORMAT_HELP)
]
ColumnsOption = Annotated[str | None, typer.Option("--columns", help=COLUMNS_HELP)]
ArrivalUnitOption = Annotated[
    str | None, typer.Option("--arrival-unit", help=ARRIVAL_UNIT_HELP)
]
OnBadRowOption = Annotated[str, typer.Option("--on-bad-row", help=ON_BAD_ROW_HELP)]

JsonOption = Annotated[bool, typer.Option("--json", help=JSON_HELP)]
JsonOutOption = Annotated[
    Path | None, typer.Option("--json-out", metavar="PATH", help=JSON_OUT_HELP)
]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)]
WorkersOption = Annotated[
    int | None, typer.Option("--workers", metavar="N", min=1, help=WORKERS_HELP)
]
# For commands whose parallel batches are small (optimize, nightly, report, validate).
SmallWorkersOption = Annotated[
    int | None, typer.Option("--workers", metavar="N", min=1, help=SMALL_WORKERS_HELP)
]
RayOption = Annotated[str | None, typer.Option("--ray", metavar="[ADDRESS]", help=RAY_HELP)]


@dataclass(frozen=True)
class JsonTarget:
    """Where a command's result JSON goes, from ``--json`` and ``--json-out``."""

    stdout: bool  # --json, or --json-out -
    file: Path | None  # --json-out PATH

    @classmethod
    def of(cls, as_json: bool, json_out: Path | None) -> JsonTarget:
        to_stdout = json_out is not None and str(json_out) == STDOUT
        return cls(as_json or to_stdout, None if json_out is None or to_stdout else json_out)


def print_json(text: str) -> None:
    """A result's JSON text (ending in a newline) on stdout."""
    sys.stdout.write(text)
    sys.stdout.flush()


def note_line(text: str) -> None:
    """One ``servetune: ...`` line on stderr (a progress line or a note)."""
    typer.echo(f"servetune: {text}", err=True)


def console_say(console: Console) -> Callable[[str], None]:
    """:func:`note_line` through a rich console (one that may be drawing a progress bar)."""
    return lambda text: console.print(f"servetune: {text}", highlight=False)


def compile_notice(
    quiet: bool, say: Callable[[str], None] = note_line
) -> AbstractContextManager[None]:
    """Around a command's simulations: the first time numba compiles the simulator (a cold
    cache), one line on stderr saying so and how long it takes; nothing under -q."""
    # lazy: the simulator package adds 35 ms to every command's start-up
    from servetune.sim.compile_notice import compile_notice as notice

    return notice(None if quiet else say)


def executor_for(workers: int | None, ray: str | None, *, small: bool = False) -> Executor:
    """The executor ``--workers`` / ``--ray`` ask for (close it when done: it is a context
    manager). Without ``--workers``, ``SERVETUNE_WORKERS``, or else the number of cores
    (``small``: 1, for the commands of :data:`SmallWorkersOption`)."""
    from servetune.executor import make_executor  # lazy: `--help` needs no executor

    if workers is None and os.environ.get(WORKERS_ENV, "").strip():
        raw = os.environ[WORKERS_ENV].strip()
        try:
            workers = int(raw)
        except ValueError:
            raise ServetuneError(f"{WORKERS_ENV}={raw!r}: give a whole number of processes "
                                 ">= 1, or unset it") from None
        if workers < 1:
            raise ServetuneError(f"{WORKERS_ENV}={raw!r}: give a number of processes >= 1")
    if workers is None and small:
        workers = 1
    return make_executor(workers, ray, preload=WORKER_PRELOAD)


def bare_ray_flag(argv: list[str]) -> list[str]:
    """``--ray`` with no address (last, or followed by another option) as ``--ray local``:
    the option takes an optional value, which click cannot express."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--ray" and (i + 1 == len(out) or out[i + 1].startswith("-")):
            out[i] = "--ray=local"
    return out


def old_json_hint(value: str) -> str:
    """What to type instead of ``--json VALUE`` (before --json became a flag)."""
    if value == STDOUT:
        return "`--json` takes no value now (it prints the JSON on stdout): drop the -"
    return f"`--json` is a flag now (JSON on stdout); to write a file use --json-out {value}"
