"""The command-line frame: version, and user errors as one stderr line + exit code."""

from __future__ import annotations

import subprocess
import sys

import pytest
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
        [sys.executable, "-c", "from servetune.cli import run; run()", "--version"],
        capture_output=True, text=True, check=False,
    )
    assert out.returncode == 0 and __version__ in out.stdout


def _exit_with(tmp_path, body: str) -> subprocess.CompletedProcess:
    """A fresh interpreter that registers an atexit handler writing ``atexit.txt``, keeps
    an object whose teardown writes ``teardown.txt``, then runs ``body``."""
    code = (
        "import atexit, sys, threading, time\n"
        "from servetune.cli import exit_quickly\n"
        f"folder = {str(tmp_path)!r}\n"
        "atexit.register(lambda: open(folder + '/atexit.txt', 'w').write('ran'))\n"
        "class Teardown:\n"
        "    def __del__(self, open=open, folder=folder):  # globals are gone by then\n"
        "        open(folder + '/teardown.txt', 'w').write('ran')\n"
        "kept = Teardown()\n"
        "sys.stdout.write('unflushed')\n"
        f"{body}\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.mark.parametrize(("code", "status", "stderr"),
                         [("3", 3, ""), ("None", 0, ""), ("'bye'", 1, "bye\n")])
def test_exit_quickly_keeps_status_output_and_atexit_but_skips_teardown(tmp_path, code,
                                                                        status, stderr):
    proc = _exit_with(tmp_path, f"exit_quickly({code})")
    assert (proc.returncode, proc.stdout, proc.stderr) == (status, "unflushed", stderr)
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    assert not (tmp_path / "teardown.txt").exists()  # the interpreter's teardown: skipped
    (tmp_path / "plain").mkdir()
    plain = _exit_with(tmp_path / "plain", "sys.exit(3)")  # the ordinary exit runs it
    assert plain.returncode == 3 and (tmp_path / "plain" / "teardown.txt").exists()


def test_exit_quickly_waits_for_other_threads(tmp_path):
    proc = _exit_with(tmp_path, (
        "threading.Thread(target=lambda: (time.sleep(0.3), "
        "open(folder + '/thread.txt', 'w').write('done'))).start()\n"
        "exit_quickly(4)"))
    assert proc.returncode == 4 and proc.stdout == "unflushed"
    assert (tmp_path / "thread.txt").read_text() == "done"
    assert (tmp_path / "atexit.txt").exists()
