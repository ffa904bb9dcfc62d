"""CLI: ``servetune nightly`` (the unattended tuning job) and ``servetune report``."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from servetune.cli.options import (
    ArrivalUnitOption,
    ColumnsOption,
    JsonOption,
    OnBadRowOption,
    QuietOption,
    RayOption,
    SmallWorkersOption,
    TraceFormatOption,
    compile_notice,
    executor_for,
    note_line,
    print_json,
)
from servetune.engines import ENGINE_NAMES


def _para(text: str) -> str:
    """One help paragraph on one line (the help renderer wraps it to the terminal)."""
    return " ".join(text.split())


NIGHTLY_HELP = "\n\n".join([
    "Re-optimize the policy on a trace and replace the current one only if better.",
    _para("""Fits a workload to TRACE, optimizes a new policy, and, for each engine in
    --engines, simulates the current and the new policy with that engine's admission
    model (on the KV pool its exported config gives) on the trace and at +20% and +50%
    rate, and compares their goodput. An engine's config is written to --out-dir only
    when, under that engine, the new policy's goodput is higher by at least --min-gain
    and its SLO attainment is no lower on the stress runs (its gate); policy.yaml is
    written when at least one engine's gate passes. report.md (with PNG plots and one gate
    row per engine) and summary.json are always written. Each run's files are committed
    as one set (a new generation under --out-dir/.generations, made live by one rename
    of the `current` link; the names in --out-dir link through it), so a reader sees the
    previous run's set or the new one, never a mix, and an interrupted run leaves the
    previous set intact. A second run into the same folder while one is running exits 2
    naming its pid. The same inputs give the same files."""),
    """\b
Exit codes:
   0  new policy written: policy.yaml, every <engine> config, report
  11  new policy written for some engines only: policy.yaml, the
      configs of the engines whose gate passed (the others are not
      written; the report says why), report
  10  current policy kept (every gate failed, or the safety time
      limit fired): report and summary.json, which names the policy
      in production (live_policy)
   2  user error (bad file or option): nothing written
   3  infeasible, no policy in the space meets the SLOs: report""",
    _para("""The report is report.md, its plots (ttft_cdf.png, tpot_cdf.png, kv_queue.png,
    goodput.png) and summary.json."""),
    """\b
Example:
  servetune nightly --trace configs/examples/azure-conv-synthetic.csv \\
      --profile gpu_profiles/h200-llama-3.1-8b.yaml \\
      --slo configs/slos/mlperf-llama-3.1-8b-server.yaml \\
      --current configs/policies/vllm-serve-defaults.yaml --out-dir nightly/""",
])

REPORT_HELP = "\n\n".join([
    "Compare two policies on a trace: report.md with PNG plots and summary.json.",
    _para("""Simulates CURRENT and NEW on the trace at its own rate and at +20% and +50%
    rate, searches both policies' goodput, and writes the report (TTFT/TPOT CDFs, KV
    utilization and queue length over time, goodput versus rate, the knob changes with the
    fluid model's reasons) to --out-dir."""),
    """\b
Example:
  servetune report --trace configs/examples/azure-conv-synthetic.csv \\
      --profile gpu_profiles/h200-llama-3.1-8b.yaml \\
      --slo configs/slos/mlperf-llama-3.1-8b-server.yaml \\
      --current configs/policies/vllm-serve-defaults.yaml --new policy.yaml \\
      --out-dir report/""",
])


def _trace_read(trace_format: str | None, columns: str | None, arrival_unit: str | None,
                on_bad_row: str) -> dict[str, object]:
    """How to read --trace: the options of ``servetune trace stats``, as load_trace takes
    them (a generic CSV or JSONL trace needs --columns)."""
    return {"fmt": trace_format, "columns": columns, "arrival_unit": arrival_unit,
            "on_bad_row": on_bad_row}


def register(app: typer.Typer) -> None:
    """Add this module's commands to the top-level app."""

    @app.command("nightly", help=NIGHTLY_HELP)
    def nightly_cmd(
        trace: Path = typer.Option(..., "--trace", help="Request trace (Azure CSV, ...)."),
        profile: Path = typer.Option(..., "--profile", help="GPU profile YAML (or shipped name)."),
        slo: Path = typer.Option(..., "--slo", help="SLO set YAML."),
        current: Path = typer.Option(..., "--current", help="The policy in production."),
        out_dir: Path = typer.Option(..., "--out-dir", help="Where the outputs go."),
        engines: str = typer.Option(
            "vllm,sglang", "--engines",
            help="Engines to gate and write configs for, comma-separated."
        ),
        min_gain: float = typer.Option(
            0.02, "--min-gain", help="Required relative goodput gain (0.02 = 2%)."
        ),
        space: Path | None = typer.Option(
            None, "--space", help="Search space YAML (default: the optimizer's)."
        ),
        time_limit: float | None = typer.Option(
            None, "--time-limit",
            help="Wall-clock safety stop for the optimizer, seconds (default 600); when it "
            "fires the current policy is kept (exit 10).",
        ),
        max_simulations: int | None = typer.Option(
            None, "--max-simulations",
            help="The optimizer's work budget in simulations (default 20000); it, not time, "
            "decides the result.",
        ),
        seed: int = typer.Option(0, "--seed", help="Seed for every random choice."),
        sim_engine: str = typer.Option(
            "vllm", "--sim-engine",
            help="Engine scheduler model to optimize under "
            f"({', '.join(ENGINE_NAMES)}); each engine in --engines is gated under its own.",
        ),
        as_json: JsonOption = False,
        quiet: QuietOption = False,
        trace_format: TraceFormatOption = None,
        columns: ColumnsOption = None,
        arrival_unit: ArrivalUnitOption = None,
        on_bad_row: OnBadRowOption = "error",
        workers: SmallWorkersOption = None,
        ray: RayOption = None,
    ) -> None:
        # lazy: the pipeline imports pyomo (0.3 s) that `servetune --help` should not pay
        from servetune.apps.nightly import run_nightly
        from servetune.apps.report import pyplot
        from servetune.solvers.drivers import preload_cpsat

        preload_cpsat()  # OR-Tools and matplotlib imported before the work begins
        pyplot()

        with compile_notice(quiet), executor_for(workers, ray, small=True) as executor:
            outcome = run_nightly(
                trace, profile, slo, current, out_dir, engines=engines, min_gain=min_gain,
                space_path=space, time_limit_s=time_limit, max_simulations=max_simulations,
                seed=seed, sim_engine=sim_engine,
                progress=None if quiet else note_line,
                trace_read=_trace_read(trace_format, columns, arrival_unit, on_bad_row),
                executor=executor,
            )
        if as_json:
            print_json(json.dumps(outcome.summary, indent=2) + "\n")
        else:
            typer.echo(outcome.summary.get("verdict", outcome.status))
            for reason in outcome.summary.get("reasons", []):
                typer.echo(f"  - {reason}")
            for path in outcome.files:
                typer.echo(f"wrote {path}")
        raise typer.Exit(outcome.exit_code)

    @app.command("report", help=REPORT_HELP)
    def report_cmd(
        trace: Path = typer.Option(..., "--trace", help="Request trace (Azure CSV, ...)."),
        profile: Path = typer.Option(..., "--profile", help="GPU profile YAML (or shipped name)."),
        slo: Path = typer.Option(..., "--slo", help="SLO set YAML."),
        current: Path = typer.Option(..., "--current", help="Policy in production."),
        new: Path = typer.Option(..., "--new", help="Proposed policy."),
        out_dir: Path = typer.Option(..., "--out-dir", help="Where the report goes."),
        engine: str = typer.Option("vllm", "--engine", help="Engine model to simulate."),
        as_json: JsonOption = False,
        quiet: QuietOption = False,
        trace_format: TraceFormatOption = None,
        columns: ColumnsOption = None,
        arrival_unit: ArrivalUnitOption = None,
        on_bad_row: OnBadRowOption = "error",
        workers: SmallWorkersOption = None,
        ray: RayOption = None,
    ) -> None:
        # lazy: the pipeline imports pyomo (0.3 s) that `servetune --help` should not pay
        from servetune.apps.nightly import run_report

        with compile_notice(quiet), executor_for(workers, ray, small=True) as executor:
            outcome = run_report(trace, profile, slo, current, new, out_dir, engine=engine,
                                 progress=None if quiet else note_line,
                                 trace_read=_trace_read(trace_format, columns, arrival_unit,
                                                        on_bad_row),
                                 executor=executor)
        if as_json:
            print_json(json.dumps(outcome.summary, indent=2) + "\n")
        else:
            typer.echo(outcome.headline)
            for path in outcome.files:
                typer.echo(f"wrote {path}")
