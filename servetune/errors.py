"""The one error type a user can cause, and the exit codes the CLI maps it to.

Everything that reaches a user because of their input (a bad file, a missing column,
an impossible SLO) is raised as :class:`ServetuneError` (or a subclass) with a one-line
message that names the file, field or row and what to do. The CLI prints that line to
stderr and exits with ``exit_code``; nothing else escapes as a traceback.

A message names a function argument as ``argument `name```, in the library's own terms; a
front end that took the values under other names (the CLI, by its flags) shows the message
with those names through :meth:`ServetuneError.message_for`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

EXIT_USER_ERROR = 2
EXIT_INFEASIBLE = 3
EXIT_KEPT_CURRENT = 10
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGINT: 128 + 2, as shells report it

_ARGUMENT = re.compile(r"argument `([A-Za-z_][A-Za-z0-9_]*)`")


class ServetuneError(Exception):
    """A user-caused error with a one-line message and the process exit code."""

    exit_code: int = EXIT_USER_ERROR

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        # One line, always: library messages (YAML, OS) may carry newlines.
        super().__init__(" ".join(str(message).split()))
        if exit_code is not None:
            self.exit_code = exit_code

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def message_for(self, names: Mapping[str, str]) -> str:
        """The message with each ``argument `name``` that ``names`` knows written as
        ``names[name]`` (the CLI passes its flags, e.g. ``{"n_requests": "--requests"}``)."""
        return _ARGUMENT.sub(lambda m: names.get(m[1], m[0]), self.message)


class InfeasibleError(ServetuneError):
    """No candidate meets the constraints; the message says which one binds."""

    exit_code = EXIT_INFEASIBLE

    def __init__(self, message: str, *, details: dict | None = None) -> None:
        super().__init__(message)
        self.details = details or {}
