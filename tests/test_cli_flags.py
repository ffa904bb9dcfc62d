"""One meaning per flag across commands: --json (a flag: JSON on stdout), --json-out PATH,
-q/--quiet, the trace-reading options; the hint for the old `--json PATH`; the compile
notice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from servetune.cli import app
from servetune.cli.options import JSON_HELP, JSON_OUT_HELP, QUIET_HELP, compile_notice
from servetune.sim import compile_notice as cn

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "configs" / "examples" / "azure-conv-synthetic.csv"
POLICY = REPO / "configs" / "policies" / "vllm-serve-defaults.yaml"
PROFILE = "h200-llama-3.1-8b"

runner = CliRunner()


def commands() -> dict[str, typer.core.TyperCommand]:
    """Every leaf command by its path (``"trace stats"``)."""
    found = {}

    def walk(group, prefix: str) -> None:
        for name, cmd in group.commands.items():
            path = f"{prefix} {name}".strip()
            if hasattr(cmd, "commands"):
                walk(cmd, path)
            else:
                found[path] = cmd

    walk(typer.main.get_command(app), "")
    return found


def options(cmd) -> dict[str, object]:
    return {opt: p for p in cmd.params for opt in getattr(p, "opts", []) if opt.startswith("-")}


# ----------------------------------------------------------------------- flag definitions


def test_json_is_a_flag_with_one_help_text_everywhere() -> None:
    with_json = {path: options(c)["--json"] for path, c in commands().items()
                 if "--json" in options(c)}
    assert {"simulate", "goodput", "optimize", "validate", "nightly", "report", "plan",
            "place", "export", "trace stats", "workload show", "profile check",
            "profile show"} <= set(with_json)
    for path, opt in with_json.items():
        assert opt.is_flag and opt.help == JSON_HELP, path


def test_json_out_where_a_command_writes_its_json_to_a_file() -> None:
    with_out = {path: options(c)["--json-out"] for path, c in commands().items()
                if "--json-out" in options(c)}
    assert set(with_out) == {"simulate", "goodput", "optimize", "validate"}
    for path, opt in with_out.items():
        assert not opt.is_flag and opt.help == JSON_OUT_HELP, path


def test_quiet_on_every_command_that_prints_progress_or_notes() -> None:
    with_q = {path: options(c) for path, c in commands().items() if "-q" in options(c)}
    assert {"simulate", "goodput", "optimize", "validate", "nightly", "report", "plan",
            "place", "trace stats", "workload fit", "profile measure"} <= set(with_q)
    for path, opts in with_q.items():
        assert opts["-q"] is opts["--quiet"] and opts["-q"].help == QUIET_HELP, path


def test_every_command_that_reads_a_trace_takes_the_trace_options() -> None:
    readers = {path for path, c in commands().items() if "--trace" in options(c)}
    readers |= {"trace stats", "workload fit"}  # the trace is their argument
    assert {"simulate", "goodput", "optimize", "nightly", "report"} <= readers
    for path in readers:
        opts = options(commands()[path])
        for flag in ("--trace-format", "--columns"):
            assert flag in opts, f"{path} lacks {flag}"
        helps = {flag: opts[flag].help for flag in ("--trace-format", "--columns")}
        assert helps == {flag: options(commands()["trace stats"])[flag].help
                         for flag in helps}, path


# ----------------------------------------------------------------------- the old form


def _sim_args(*extra: str) -> list[str]:
    return ["simulate", "--trace", str(TRACE), "--profile", PROFILE, "--policy", str(POLICY),
            "--requests", "40", *extra]


def _error_line(args: list[str]) -> str:
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("servetune: error:"), res.output
    assert res.stdout == ""
    return lines[0]


def test_the_old_json_path_form_says_what_to_type_instead(tmp_path) -> None:
    line = _error_line(_sim_args("--json", str(tmp_path / "s.json")))
    assert f"use --json-out {tmp_path / 's.json'}" in line
    assert line.endswith(" simulate --help)")
    assert "drop the -" in _error_line(_sim_args("--json", "-"))
    # optimize takes a JOB argument, which the old form's path would fill
    line = _error_line(["optimize", "--json", "s.json", "-o", str(tmp_path / "p.yaml")])
    assert "use --json-out s.json" in line
    assert not (tmp_path / "p.yaml").exists()


def test_the_hint_names_only_the_value_given_after_json() -> None:
    line = _error_line(_sim_args("--json", "stray"))
    assert "--json-out stray" in line
    line = _error_line(_sim_args("stray", "--json"))
    assert "unexpected extra argument" in line and "--json-out" not in line
    # `trace stats` always had the flag (and has no --json-out): no hint
    line = _error_line(["trace", "stats", str(TRACE), "--json", "x.json"])
    assert "unexpected extra argument" in line and "--json-out" not in line


# ----------------------------------------------------------------------- --json output


def test_simulate_json_prints_what_json_out_writes(tmp_path) -> None:
    out = tmp_path / "s.json"
    res = runner.invoke(app, _sim_args("--json", "--json-out", str(out), "--seed", "1"))
    assert res.exit_code == 0, res.output
    assert res.stdout == out.read_text()  # the JSON and nothing else on stdout
    assert json.loads(res.stdout)["requests"] == 40
    dash = runner.invoke(app, _sim_args("--json-out", "-"))
    assert dash.exit_code == 0, dash.output
    assert json.loads(dash.stdout)["requests"] == 40
    table = runner.invoke(app, _sim_args())
    assert "TTFT (ms)" in table.stdout


def test_goodput_json_prints_the_result_only(tmp_path) -> None:
    slo = tmp_path / "slo.yaml"
    slo.write_text("apiVersion: servetune/v1\nkind: SLOSet\nname: loose\nclasses:\n"
                   "  default: {ttft_s: 10.0, tpot_s: 0.2, attainment: 0.9}\n")
    out = tmp_path / "g.json"
    args = ["goodput", "--trace", str(TRACE), "--profile", PROFILE, "--policy", str(POLICY),
            "--slo", str(slo), "--requests", "100", "--tolerance", "0.2"]
    res = runner.invoke(app, [*args, "--json", "--json-out", str(out)])
    assert res.exit_code == 0, res.output
    assert res.stdout == out.read_text()
    assert json.loads(res.stdout)["rate_scale"] > 0
    assert "rate scale" in res.stderr  # the search's points, on stderr
    quiet = runner.invoke(app, [*args, "--json", "-q"])
    assert quiet.exit_code == 0, quiet.output
    assert quiet.stdout == res.stdout
    # -q leaves the warnings (100 requests is a short run), drops the points
    assert quiet.stderr.splitlines() == [ln for ln in res.stderr.splitlines()
                                         if ln.startswith("warning:")]
    assert quiet.stderr.startswith("warning:")


# ----------------------------------------------------------------------- -q


def test_quiet_silences_notes_and_the_fit_table(tmp_path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE.read_text().replace("\n", "\n\n", 3))  # blank lines: a note
    res = runner.invoke(app, ["trace", "stats", str(trace), "--json"])
    assert res.exit_code == 0 and "note:" in res.stderr and "blank" in res.stderr
    quiet = runner.invoke(app, ["trace", "stats", str(trace), "--json", "-q"])
    assert quiet.exit_code == 0 and quiet.stderr == "" and quiet.stdout == res.stdout
    fit = runner.invoke(app, ["workload", "fit", str(trace), "-o", str(tmp_path / "w.yaml"),
                              "-q"])
    assert fit.exit_code == 0, fit.output
    assert fit.stderr == "" and fit.stdout == ""
    assert (tmp_path / "w.yaml").exists()


# ----------------------------------------------------------------------- compile notice


def _jit_in(module: str):
    """A fresh numba function that claims to live in ``module`` (not compiled yet)."""
    import numba

    def add_one(x):
        return x + 1

    add_one.__module__ = module
    return numba.njit(add_one)


def test_the_notice_comes_once_when_a_servetune_function_compiles() -> None:
    said: list[str] = []
    first, second = _jit_in("servetune.fake"), _jit_in("servetune.fake")
    with cn.compile_notice(said.append):
        assert first(1) == 2
        assert second(1) == 2  # another compile in the same run: no second line
    assert said == [cn.NOTICE]
    with cn.compile_notice(said.append):
        assert first(2) == 3  # compiled already: nothing to say
    assert said == [cn.NOTICE]


def test_no_notice_for_other_packages_or_under_quiet() -> None:
    said: list[str] = []
    with cn.compile_notice(said.append):
        assert _jit_in("someone_else")(1) == 2
    with compile_notice(True, said.append):  # -q
        assert _jit_in("servetune.fake")(1) == 2
    assert said == []
    assert cn.is_simulator_function(cn.is_simulator_function)
    assert not cn.is_simulator_function(json.dumps)
    assert cn.NOTICE == "compiling the simulator once, 25-75 s on 2 cores (cached afterwards)"


@pytest.mark.slow
def test_a_cold_cache_prints_the_notice_once(tmp_path) -> None:
    """A fresh NUMBA_CACHE_DIR compiles (the notice, on stderr); the second run loads the
    cache (no notice); the outputs are the same bytes."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    runs = []
    for name in ("cold", "warm"):
        records = tmp_path / f"{name}.csv"
        proc = subprocess.run(
            [sys.executable, "-c", "from servetune.cli import run; run()",
             *_sim_args("--records", str(records))],
            env=env, capture_output=True, text=True, timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        runs.append((proc.stderr.count(cn.NOTICE), records.read_bytes(), proc.stdout))
    assert [r[0] for r in runs] == [1, 0]
    assert runs[0][1] == runs[1][1]
    assert cn.NOTICE not in runs[0][2]  # stdout stays the result
