"""The ``servetune`` command line: a thin layer over functions the tests call directly.

Each command group lives in its own module with a ``register(app)`` function. A
:class:`~servetune.errors.ServetuneError` raised anywhere below a command becomes one
line on stderr and the error's exit code (2 user error, 3 infeasible, 10 kept current);
never a traceback.
"""

from __future__ import annotations

import sys

import typer
from typer.core import TyperGroup

from servetune import __version__
from servetune.errors import ServetuneError


class _ErrorsAsLines(TyperGroup):
    """Turns ServetuneError into one stderr line and its exit code, at every depth."""

    def invoke(self, ctx: typer.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except ServetuneError as err:
            typer.echo(f"servetune: error: {err.message}", err=True)
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


def _register_all() -> None:
    from servetune.cli import (
        export_cmd,
        nightly_cmd,
        optimize_cmd,
        plan_cmd,
        profile_cmd,
        simulate_cmd,
        trace_cmd,
        workload_cmd,
    )

    for module in (
        trace_cmd,
        workload_cmd,
        profile_cmd,
        simulate_cmd,
        optimize_cmd,
        export_cmd,
        nightly_cmd,
        plan_cmd,
    ):
        module.register(app)


_register_all()


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except ServetuneError as err:  # raised outside a command (e.g. in a callback)
        typer.echo(f"servetune: error: {err.message}", err=True)
        sys.exit(err.exit_code)
