"""The root ``servetune`` app, the sub-command groups, and how errors become one line.

A :class:`~servetune.errors.ServetuneError` raised anywhere below a command becomes one
line on stderr (its argument names written as the flags the user typed) and the error's
exit code; never a traceback. The command modules build their groups with
:func:`new_group`; :mod:`servetune.cli` registers them on :data:`app`.
"""

from __future__ import annotations

import typer
from typer.core import TyperGroup

from servetune import __version__
from servetune.errors import ServetuneError

# The flag that feeds each library argument an error message may name (as
# ``argument `name```): the library speaks of its arguments, the user typed flags.
ARGUMENT_FLAGS = {
    "arrival_process": "--arrival",
    "arrival_unit": "--arrival-unit",
    "bands": "--bands",
    "base_gpu": "--base-gpu",
    "bench_format": "--bench-format",
    "columns": "--columns",
    "duration_s": "--duration",
    "engine": "--engine",
    "engines": "--engines",
    "fmt": "--trace-format",
    "gpu": "--gpu",
    "growth": "--growth",
    "max_concurrency": "--max-concurrency",
    "max_simulations": "--max-simulations",
    "method": "--method",
    "min_gain": "--min-gain",
    "model": "--model",
    "models": "--model",
    "n_requests": "--requests",
    "n_seeds": "--seeds",
    "on_bad_row": "--on-bad-row",
    "out_dir": "--out-dir",
    "output_edges": "--output-edges",
    "profile": "--profile",
    "prompt_edges": "--prompt-edges",
    "rate_scale": "--rate-scale",
    "rate_windows_s": "--rate-windows",
    "sim_engine": "--sim-engine",
    "split": "--split-by",
    "time_limit_s": "--time-limit",
    "window": "--timeline-window",
}
# Commands whose flag for an argument differs from the table above.
COMMAND_FLAGS = {
    "plan": {**ARGUMENT_FLAGS, "method": "--capacity-method"},
}


def error_line(err: ServetuneError, command: str | None = None) -> str:
    """The stderr line for ``err`` raised under ``command`` (e.g. ``"profile fit"``),
    with the library's argument names written as the flags the user typed."""
    return f"servetune: error: {err.message_for(COMMAND_FLAGS.get(command, ARGUMENT_FLAGS))}"


class _ErrorsAsLines(TyperGroup):
    """Turns ServetuneError into one stderr line and its exit code, at every depth."""

    def invoke(self, ctx: typer.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except ServetuneError as err:
            # the innermost group catches first: its path plus the sub-command it ran
            command = " ".join([*ctx.command_path.split()[1:], ctx.invoked_subcommand or ""])
            typer.echo(error_line(err, command.strip()), err=True)
            ctx.exit(err.exit_code)


def new_group(help_text: str) -> typer.Typer:
    """A sub-command group with the same error handling as the top level."""
    return typer.Typer(
        cls=_ErrorsAsLines,
        help=help_text,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        add_completion=False,
    )


app = typer.Typer(
    cls=_ErrorsAsLines,
    help="servetune: choose an LLM-serving engine's scheduling policy with MILP and CP-SAT, "
    "check it in a continuous-batching simulator, export engine configs.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"servetune {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """servetune command line."""
