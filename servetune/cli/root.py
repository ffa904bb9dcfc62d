"""The root ``servetune`` app, the sub-command groups, and how errors become one line.

A :class:`~servetune.errors.ServetuneError` raised anywhere below a command becomes one
line on stderr (its argument names written as the flags the user typed) and the error's
exit code; never a traceback. The command modules build their groups with
:func:`new_group`; :mod:`servetune.cli` registers them on :data:`app`.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import typer
from typer.core import TyperGroup

try:  # typer >= 0.22 carries its own click
    from typer._click import exceptions as click_exceptions
except ImportError:  # pragma: no cover - older typer on click
    from click import exceptions as click_exceptions  # type: ignore[no-redef]

from servetune import __version__
from servetune.cli.options import old_json_hint
from servetune.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, ServetuneError

INTERRUPTED_LINE = "servetune: interrupted; previous outputs kept"

# The flag that feeds each library argument an error message may name (as
# ``argument `name```): the library speaks of its arguments, the user typed flags.
ARGUMENT_FLAGS = {
    "arrival_process": "--arrival",
    "arrival_unit": "--arrival-unit",
    "bands": "--bands",
    "base_gpu": "--base-gpu",
    "bench_format": "--bench-format",
    "class_field": "--class-field",
    "class_header": "--class-header",
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
    "role": "--role",
    "sim_engine": "--sim-engine",
    "slo_path": "--slo",
    "space_path": "--space",
    "trace_path": "--trace",
    "current_path": "--current",
    "new_path": "--new",
    "profile_path": "--profile",
    "split": "--split-by",
    "time_limit_s": "--time-limit",
    "window": "--timeline-window",
}
# Commands whose flag for an argument differs from the table above.
COMMAND_FLAGS = {
    "plan": {**ARGUMENT_FLAGS, "method": "--capacity-method", "topologies": "--topologies",
             "router": "--router", "link": "--link"},
}


def error_line(err: ServetuneError, command: str | None = None) -> str:
    """The stderr line for ``err`` raised under ``command`` (e.g. ``"profile fit"``),
    with the library's argument names written as the flags the user typed."""
    return f"servetune: error: {err.message_for(COMMAND_FLAGS.get(command, ARGUMENT_FLAGS))}"


# click's "Got unexpected extra argument(s) (a b)"; older clicks say argument / arguments
_EXTRA_ARGUMENTS = re.compile(r"unexpected extra argument(?:s|\(s\))? \((.*)\)")


def usage_line(err: click_exceptions.ClickException, argv: Sequence[str] = ()) -> str:
    """One stderr line for a framework (typer/click) error: an unknown or missing option,
    a value of the wrong type, ...; with the command whose ``--help`` lists the options.
    ``argv`` (the command line) lets it say what to type instead of an old form."""
    message = " ".join(err.format_message().split())
    ctx = getattr(err, "ctx", None)
    hint = f" (see {ctx.command_path if ctx is not None else 'servetune'} --help)"
    return f"servetune: error: {message}{_old_form(message, ctx, argv)}{hint}"


def _old_form(message: str, ctx: Any, argv: Sequence[str]) -> str:
    """``: <what to type instead>`` when the extra argument click refused is the value of
    ``--json PATH`` given to a command that takes --json-out (the form before --json
    became a flag), else nothing."""
    extra = _EXTRA_ARGUMENTS.search(message)
    if extra is None or ctx is None:
        return ""
    if not any("--json-out" in getattr(p, "opts", ()) for p in ctx.command.params):
        return ""
    for flag, value in pairwise(argv):
        if flag == "--json" and value in extra[1].split():
            return f": {old_json_hint(value)}"
    return ""


class _ErrorsAsLines(TyperGroup):
    """Turns ServetuneError into one stderr line and its exit code, at every depth; at the
    top, framework usage errors into one line (exit 2) and Ctrl-C into one line (exit
    130), never a box or a traceback."""

    def get_help_option(self, ctx: typer.Context) -> Any:
        option = super().get_help_option(ctx)
        # An unset flag's value is None, which typer >= 0.22 coerces through a pydantic
        # TypeAdapter: importing pydantic for it cost `servetune CMD --help` 0.1 s (the
        # group's own --help is unset there). False, the value the flag means, skips that.
        if option is not None and option.default is None:
            option.default = False
        return option

    def invoke(self, ctx: typer.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except ServetuneError as err:
            # the innermost group catches first: its path plus the sub-command it ran
            command = " ".join([*ctx.command_path.split()[1:], ctx.invoked_subcommand or ""])
            typer.echo(error_line(err, command.strip()), err=True)
            ctx.exit(err.exit_code)
        except KeyboardInterrupt:
            # every output is committed by an atomic rename (servetune.io), so an
            # interrupted run leaves the previous files as they were
            typer.echo(INTERRUPTED_LINE, err=True)
            ctx.exit(EXIT_INTERRUPTED)

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        argv = list(args) if args is not None else sys.argv[1:]
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click_exceptions.NoArgsIsHelpError as err:  # `servetune` alone: the help
            text = err.format_message()  # typer's rich help prints itself and returns ""
            if text.strip():
                typer.echo(text, err=True)
            sys.exit(EXIT_USER_ERROR)
        except click_exceptions.ClickException as err:
            typer.echo(usage_line(err, argv), err=True)
            sys.exit(EXIT_USER_ERROR)
        except (typer.Abort, KeyboardInterrupt):
            typer.echo(INTERRUPTED_LINE, err=True)
            sys.exit(EXIT_INTERRUPTED)
        except ServetuneError as err:  # raised outside a command (e.g. in a callback)
            typer.echo(error_line(err), err=True)
            sys.exit(err.exit_code)
        sys.exit(rv if isinstance(rv, int) else 0)


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
