"""CLI: ``servetune sweep``: many optimize / nightly / plan jobs from one Sweep file, on
local processes or Ray, resumable, with one summary table (:mod:`servetune.apps.sweep`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from servetune.cli.options import (
    JsonOption,
    QuietOption,
    RayOption,
    WorkersOption,
    compile_notice,
    executor_for,
    note_line,
    print_json,
)


def _para(text: str) -> str:
    return " ".join(text.split())


SWEEP_HELP = "\n\n".join([
    "Run the jobs of a Sweep file (products of profiles, workloads, SLO sets, growth "
    "factors, ...) and write one summary table.",
    _para("""Expands SWEEP.yaml (kind: Sweep; see configs/sweeps/) into optimize, nightly
    and plan jobs, skips those whose --out-dir/jobs/<name>/result.json is done with the
    same input hash (the settings and every input file's bytes: rerun the same command
    to resume; an edited input reruns its jobs; a failed job is tried again), runs the
    rest as one task each on local processes (--workers) or Ray (--ray), and writes each
    job's files (policy.yaml, plan.yaml or nightly's report, and result.json) to
    --out-dir/jobs/<name>/ as it finishes, then summary.csv, summary.md and
    summary.parquet (with pyarrow) in --out-dir. One progress line per job, in job
    order. Ctrl-C keeps the finished jobs. The jobs' files are the same, byte for byte,
    whatever --workers or --ray; wall times go to the summary only."""),
    """\b
Exit codes:
   0  every job done (or already done)
  12  some jobs failed: the summary's status and error columns say
      which and why; the others' outputs and the summary are written
   2  bad sweep file or option: nothing run""",
    """\b
Example:
  servetune sweep configs/sweeps/shipped.yaml --out-dir sweep/ --workers 2
  ray start --head && servetune sweep configs/sweeps/shipped.yaml \\
      --out-dir sweep/ --ray auto""",
])


def register(app: typer.Typer) -> None:
    """Add ``sweep`` to the top-level app."""

    @app.command("sweep", help=SWEEP_HELP)
    def sweep_cmd(
        sweep: Path = typer.Argument(..., metavar="SWEEP.yaml", help="Sweep YAML."),
        out_dir: Path = typer.Option(..., "--out-dir",
                                     help="Folder of the jobs' outputs and the summary."),
        workers: WorkersOption = None,
        ray: RayOption = None,
        as_json: JsonOption = False,
        quiet: QuietOption = False,
    ) -> None:
        # lazy: the pipelines import pyomo (0.3 s) that `servetune --help` should not pay
        from servetune.apps.sweep import check_out, load_sweep, run_sweep

        loaded = load_sweep(sweep)  # a bad sweep file fails before Ray or a pool starts
        check_out(out_dir, loaded)
        if not quiet:
            note_line(f"{loaded.doc.name}: {len(loaded.jobs):,} jobs")
        with compile_notice(quiet), executor_for(workers, ray) as executor:
            run = run_sweep(loaded, out_dir, executor=executor,
                            progress=None if quiet else note_line)
        for note in [] if quiet else run.notes:
            note_line(f"note: {note}")
        if as_json:
            print_json(json.dumps({"name": loaded.doc.name, "exit_code": run.exit_code,
                                   "counts": run.counts(), "jobs": run.rows}, indent=2) + "\n")
        else:
            counts = ", ".join(f"{n} {s}" for s, n in run.counts().items() if n)
            typer.echo(f"{len(run.rows)} jobs: {counts}")
            for path in run.files:
                typer.echo(f"wrote {path}")
        raise typer.Exit(run.exit_code)
