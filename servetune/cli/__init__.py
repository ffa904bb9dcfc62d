"""The ``servetune`` command line: a thin layer over functions the tests call directly.

Each command group lives in its own module with a ``register(app)`` function; the root
app, the sub-command groups and the error handling are :mod:`servetune.cli.root`'s. A
:class:`~servetune.errors.ServetuneError` raised anywhere below a command becomes one
line on stderr and the error's exit code (2 user error, 3 infeasible, 10 kept current);
never a traceback.
"""

from __future__ import annotations

import sys

import typer

from servetune.cli import (
    export_cmd,
    nightly_cmd,
    optimize_cmd,
    plan_cmd,
    profile_cmd,
    simulate_cmd,
    sweep_cmd,
    trace_cmd,
    validate_cmd,
    workload_cmd,
)
from servetune.cli.options import bare_ray_flag
from servetune.cli.root import (
    ARGUMENT_FLAGS,
    COMMAND_FLAGS,
    INTERRUPTED_LINE,
    app,
    error_line,
    new_group,
)
from servetune.errors import EXIT_INTERRUPTED, ServetuneError

__all__ = ["ARGUMENT_FLAGS", "COMMAND_FLAGS", "app", "error_line", "main", "new_group"]

for _module in (
    trace_cmd,
    workload_cmd,
    profile_cmd,
    simulate_cmd,
    optimize_cmd,
    export_cmd,
    nightly_cmd,
    plan_cmd,
    validate_cmd,
    sweep_cmd,
):
    _module.register(app)


def main() -> None:
    """Console-script entry point (errors, usage errors and Ctrl-C as one line: see
    :class:`servetune.cli.root._ErrorsAsLines`)."""
    sys.argv[1:] = bare_ray_flag(sys.argv[1:])
    try:
        app()
    except ServetuneError as err:  # raised outside a command (e.g. in a callback)
        typer.echo(error_line(err), err=True)
        sys.exit(err.exit_code)
    except KeyboardInterrupt:  # before the app started (imports)
        typer.echo(INTERRUPTED_LINE, err=True)
        sys.exit(EXIT_INTERRUPTED)
