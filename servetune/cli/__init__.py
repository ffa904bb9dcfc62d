"""The ``servetune`` command line: a thin layer over functions the tests call directly.

Each command group lives in its own module with a ``register(app)`` function; the root
app, the sub-command groups and the error handling are :mod:`servetune.cli.root`'s. A
:class:`~servetune.errors.ServetuneError` raised anywhere below a command becomes one
line on stderr and the error's exit code (2 user error, 3 infeasible, 10 kept current);
never a traceback.

The console script is :func:`run`: :func:`main`, then :func:`exit_quickly`.
"""

from __future__ import annotations

import atexit
import io
import os
import sys
import threading
from typing import Any, NoReturn

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
from servetune.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, ServetuneError

__all__ = ["ARGUMENT_FLAGS", "COMMAND_FLAGS", "app", "error_line", "exit_quickly", "main",
           "new_group", "run"]

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


def exit_quickly(code: object = 0) -> NoReturn:
    """End the process as ``sys.exit(code)`` would, without the interpreter's teardown.

    Tearing down numba's and llvmlite's modules takes 0.2-0.45 s on the development
    machine, more than a replay of 4,000 requests (benchmarks/RESULTS.md, "Cluster replay
    speed"). Nothing is lost by skipping it: every file servetune writes is complete before
    a command returns (written by atomic rename and closed, :mod:`servetune.io`), the
    atexit handlers (temporary folders, worker pools, Ray) run here, and stdout and stderr
    are flushed. With other threads still running, it is the ordinary exit, which waits
    for them."""
    if threading.active_count() > 1 or not hasattr(atexit, "_run_exitfuncs"):
        sys.exit(code)
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message"): the message on stderr, status 1
        print(code, file=sys.stderr)
        status = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`servetune ... | head`) or stream
            pass
    os._exit(status)


class StdoutSink(io.RawIOBase):
    """File descriptor 1 for writing, where a write that fails (the reader of a pipe went
    away, a full device such as /dev/full, a closed descriptor) is recorded in
    :attr:`failed` and the rest of the output dropped, instead of raising in the middle
    of a command: what the command did (its files, its exit code) stands."""

    def __init__(self, fd: int = 1) -> None:
        super().__init__()
        self.fd = fd
        self.failed: OSError | None = None

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:  # a terminal's size and colours are read from it
        return self.fd

    def isatty(self) -> bool:
        try:
            return os.isatty(self.fd)
        except OSError:
            return False

    def write(self, data: Any) -> int:
        if self.failed is None:
            try:
                return os.write(self.fd, data)
            except OSError as exc:
                self.failed = exc
        return len(data)


def guard_stdout() -> StdoutSink:
    """Make ``sys.stdout`` a text stream over a :class:`StdoutSink` (the encoding and
    line buffering as they were), and return the sink."""
    sink = StdoutSink(1)
    old = sys.stdout
    sys.stdout = io.TextIOWrapper(
        io.BufferedWriter(sink), encoding=getattr(old, "encoding", None) or "utf-8",
        errors=getattr(old, "errors", None) or "strict",
        line_buffering=bool(getattr(old, "line_buffering", False)))
    return sink


def stdout_verdict(sink: StdoutSink, code: object) -> object:
    """The exit code once the command is done, given what happened to stdout: a closed
    pipe (``servetune ... | head``) ends quietly with the command's own code; another
    failure (a full device, a closed descriptor) is one error line, and exit 2 unless the
    command already failed."""
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    failed = sink.failed
    if failed is None or isinstance(failed, BrokenPipeError):
        return code
    reason = failed.strerror or type(failed).__name__
    typer.echo(f"servetune: error: stdout: {reason}; what the command printed there is lost",
               err=True)
    return code if code not in (0, None) else EXIT_USER_ERROR


def run() -> NoReturn:
    """The ``servetune`` console script: :func:`main` in a process of its own, which it
    ends with :func:`exit_quickly` (``main`` itself raises SystemExit, for callers that
    stay). Its stdout is guarded (:func:`guard_stdout`), so a closed pipe or a full device
    cannot end a command half way."""
    sink = guard_stdout()
    try:
        main()
    except SystemExit as done:
        exit_quickly(stdout_verdict(sink, done.code))
    exit_quickly(stdout_verdict(sink, 0))
