"""The command-line frame: version, and user errors as one stderr line + exit code."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from servetune import __version__
from servetune.cli import ARGUMENT_FLAGS, COMMAND_FLAGS, app, error_line, new_group
from servetune.errors import InfeasibleError, ServetuneError

runner = CliRunner()


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"servetune {__version__}"


def test_errors_become_one_line_and_exit_code():
    group = new_group("test group")

    @group.command("bad")
    def bad() -> None:
        raise ServetuneError("trace.csv: row 7: prompt tokens must be >= 1\n(second line)")

    @group.command("hopeless")
    def hopeless() -> None:
        raise InfeasibleError("p99 TPOT cannot go below 41 ms; target 30 ms")

    outer = new_group("outer")
    outer.add_typer(group, name="t")
    result = runner.invoke(outer, ["t", "bad"])
    assert result.exit_code == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [
        "servetune: error: trace.csv: row 7: prompt tokens must be >= 1 (second line)"
    ]
    assert "Traceback" not in result.output
    result = runner.invoke(outer, ["t", "hopeless"])
    assert result.exit_code == 3
    assert "41 ms" in result.stderr


def test_library_argument_names_become_the_flags_of_the_command(monkeypatch):
    err = ServetuneError("argument `n_requests` must be >= 1 (got 0); or set argument `method`")
    assert error_line(err) == "servetune: error: --requests must be >= 1 (got 0); or set --method"
    assert error_line(err, "plan").endswith("or set --capacity-method")
    unknown = ServetuneError("argument `colour` is not a knob")
    assert unknown.message_for(ARGUMENT_FLAGS) == "argument `colour` is not a knob"

    # the frame looks the flags up by the path of the sub-command that raised
    group = new_group("test group")

    @group.command("bad")
    def bad() -> None:
        raise ServetuneError("argument `colour` 'mauve': choose red or blue")

    outer = new_group("outer")
    outer.add_typer(group, name="t")
    monkeypatch.setitem(COMMAND_FLAGS, "t bad", {"colour": "--color"})
    result = runner.invoke(outer, ["t", "bad"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "servetune: error: --color 'mauve': choose red or blue"


def test_console_script_runs_as_a_module():
    out = subprocess.run(
        [sys.executable, "-c", "from servetune.cli import main; main()", "--version"],
        capture_output=True, text=True, check=False,
    )
    assert out.returncode == 0 and __version__ in out.stdout
