"""CLI: ``servetune optimize``: choose the policy with the MILP/CP-SAT loop (or a
baseline), validated in the simulator, written as a policy YAML with provenance.

Either name the inputs with flags, or give one OptimizeJob file whose relative paths
resolve against its own folder, or a shipped job's name (``servetune optimize quickstart``:
``configs/jobs/quickstart.yaml``, found in the package data of an installed wheel). Exit 3
when no policy in the space meets the SLOs, with the binding condition, the best value
reachable and what would help (also in the --json / --json-out summary).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from servetune.cli.options import (
    ColumnsOption,
    JsonOption,
    JsonOutOption,
    JsonTarget,
    QuietOption,
    RayOption,
    SmallWorkersOption,
    TraceFormatOption,
    compile_notice,
    executor_for,
    old_json_hint,
    print_json,
)
from servetune.errors import InfeasibleError, ServetuneError
from servetune.io import check_outputs, require_file, write_text_atomic
from servetune.optimize_options import (
    DEFAULT_MAX_SIMULATIONS,
    DEFAULT_REQUESTS,
    DEFAULT_TIME_LIMIT_S,
    METHODS,
    METHODS_IN_WORDS,
)
from servetune.shipped_data import shipped_job, shipped_job_names

if TYPE_CHECKING:
    from servetune.apps.optimize import OptimizeResult
    from servetune.executor import Executor

EXAMPLE = (
    "Example: servetune optimize --workload configs/workloads/azure-conv-2023.yaml "
    "--profile gpu_profiles/h200-llama-3.1-8b.yaml --slo "
    "configs/slos/mlperf-llama-3.1-8b-server.yaml -o policy.yaml   |   "
    "servetune optimize configs/jobs/quickstart.yaml -o policy.yaml   |   "
    "servetune optimize quickstart -o policy.yaml (a shipped job, by name)"
)


def _file(path: Path, what: str) -> Path:
    return require_file(path, f"given as {what}")


def run_optimize(
    *,
    trace: Path | None,
    workload: Path | None,
    profile: str,
    slo: Path,
    space: Path | None,
    method: str,
    time_limit_s: float,
    seed: int,
    requests: int | None,
    engine: str = "vllm",
    trace_format: str | None = None,
    progress: Callable[[str], None] | None = None,
    max_simulations: int = DEFAULT_MAX_SIMULATIONS,
    columns: str | None = None,
    executor: Executor | None = None,
    per_class: bool | None = None,
) -> OptimizeResult:
    """Check the options, then :func:`~servetune.apps.optimize.optimize_files` (its
    independent simulations on ``executor``; default: in this process)."""
    if (trace is None) == (workload is None):
        raise ServetuneError("give exactly one of --trace FILE or --workload W.yaml")
    if method not in METHODS:
        raise ServetuneError(f"--method {method!r}: choose {METHODS_IN_WORDS}")
    if not time_limit_s > 0:
        raise ServetuneError(f"--time-limit must be > 0 seconds (got {time_limit_s})")
    if max_simulations < 1:
        raise ServetuneError(f"--max-simulations must be >= 1 (got {max_simulations})")
    if requests is not None and requests < 50:
        raise ServetuneError(f"--requests must be >= 50 (got {requests})")
    if trace is not None:
        _file(trace, "--trace")
    else:
        assert workload is not None
        _file(workload, "--workload")
    _file(slo, "--slo")
    if space is not None:
        _file(space, "--space")
    # lazy: the optimizer imports pyomo (0.3 s) that `servetune --help` should not pay
    from servetune.apps.optimize import optimize_files
    from servetune.solvers.drivers import preload_cpsat

    preload_cpsat()  # the lanes step solves CP-SAT: import OR-Tools before the work

    return optimize_files(
        trace=trace, workload=workload, profile=profile, slo=slo, space=space,
        trace_format=trace_format, columns=columns, method=method, time_limit_s=time_limit_s,
        seed=seed,
        n_requests=requests, engine=engine, progress=progress, max_simulations=max_simulations,
        executor=executor, per_class=per_class,
    )


def _model_lines(s: dict[str, Any]) -> list[str]:
    """The figures a user checks the answer by: the model's promise against the
    simulator's, and how far coordinate descent moved the model's answer."""
    lines = []
    error = s.get("model_error")
    if error and error.get("median_ratio") is not None:
        predicted = s.get("predicted_goodput_rate_per_s")
        lines.append(
            f"model error: over the {error['candidates']} candidates simulated, simulated / "
            f"model goodput is {error['median_ratio']:.2f} at the median, worst miss "
            f"{error['worst_miss']:.2f}x"
            + (f"; it predicted {predicted:.2f} req/s for the answer" if predicted else ""))
        near = error.get("near_answer") or {}
        if near.get("worst_miss") is not None:
            lines.append(f"model error near the answer ({near['candidates']} candidates one "
                         f"knob away): worst miss {near['worst_miss']:.2f}x")
    descent = next((it["descent"] for it in s.get("iterations") or []
                    if isinstance(it, dict) and "descent" in it), None)
    if descent:
        lines.append(
            f"coordinate descent: {descent['from_rate_per_s']:.2f} -> "
            f"{descent['to_rate_per_s']:.2f} req/s in {descent['simulations']} simulations "
            f"({descent['moves']} moves)")
    evaluation = s.get("evaluation")
    if evaluation:
        lines.append(
            f"goodput judged on {evaluation['requests']} requests (seed {evaluation['seed']}) "
            f"to {evaluation['tolerance']:.0%}: `servetune goodput` with the same --requests "
            "and --seed prints the same")
    return lines


def _emit_json(to: JsonTarget, summary: dict[str, Any]) -> None:
    """The run's summary (or, when infeasible, what binds) to --json-out and/or stdout."""
    text = json.dumps(summary, indent=2, default=str) + "\n"
    if to.file is not None:
        write_text_atomic(to.file, text)
    if to.stdout:
        print_json(text)


def _job_file(job: Path) -> Path:
    """The job file: ``job`` itself when it exists, else the shipped job of that bare name
    (``quickstart``), else a one-line error that lists the shipped jobs for a bare name."""
    if job.exists():
        return _file(job, "JOB")
    shipped = shipped_job(str(job))
    if shipped is not None:
        return shipped
    if job.parent == Path(".") and job.suffix not in (".yaml", ".yml"):
        names = ", ".join(shipped_job_names()) or "none"
        raise ServetuneError(f"{job}: no such file or shipped job (shipped: {names})")
    return _file(job, "JOB")


def _resolve(base: Path, value: str | None) -> Path | None:
    if value is None:
        return None
    p = Path(value)
    return p if p.is_absolute() else base / p


def _profile_arg(base: Path, value: str) -> str:
    """A profile path relative to the job file, or a shipped profile's bare name."""
    # lazy: the Profile schema adds 20 ms to every command's start-up
    from servetune.profiles.shipped import shipped_or_path

    p = _resolve(base, value)
    assert p is not None
    if p.exists():
        return str(p)
    return shipped_or_path(value)


def register(app: typer.Typer) -> None:
    """Add ``optimize`` to the top-level app."""

    @app.command("optimize", help="Choose the scheduling policy that maximises goodput at "
                 "the SLOs (MILP + CP-SAT, validated in the simulator). " + EXAMPLE)
    def optimize_command(
        job: Path | None = typer.Argument(
            None, help="an OptimizeJob YAML naming all inputs, or a shipped job's name "
            "(quickstart)"),
        trace: Path | None = typer.Option(None, "--trace", help="request trace file"),
        workload: Path | None = typer.Option(None, "--workload", help="Workload YAML"),
        profile: str | None = typer.Option(None, "--profile", help="Profile YAML or name"),
        slo: Path | None = typer.Option(None, "--slo", help="SLOSet YAML"),
        space: Path | None = typer.Option(None, "--space", help="SearchSpace YAML"),
        method: str | None = typer.Option(None, "--method", help=" | ".join(METHODS)),
        max_simulations: int | None = typer.Option(
            None, "--max-simulations",
            help=f"work budget: simulations the search may start (default "
            f"{DEFAULT_MAX_SIMULATIONS}); it, not time, decides the result",
        ),
        time_limit: float | None = typer.Option(
            None, "--time-limit",
            help=f"wall-clock safety stop, seconds (default {DEFAULT_TIME_LIMIT_S:g}); when "
            "it fires, the policy's metadata.stopped_by says time_limit",
        ),
        seed: int | None = typer.Option(None, "--seed", help="seed of the workload sample"),
        requests: int | None = typer.Option(
            None, "--requests",
            help=f"requests per simulation (default: a workload's {DEFAULT_REQUESTS}, or one "
            "cycle of its block bootstrap, sampled longer at rates where they would span less "
            "than the TTFT target / 3%; a trace's every row; at most 20000); `servetune "
            "goodput` takes the same"
        ),
        output: Path | None = typer.Option(None, "-o", "--output", help="policy YAML to write"),
        as_json: JsonOption = False,
        json_out: JsonOutOption = None,
        quiet: QuietOption = False,
        trace_format: TraceFormatOption = None,
        columns: ColumnsOption = None,
        workers: SmallWorkersOption = None,
        ray: RayOption = None,
        per_class: bool | None = typer.Option(
            None, "--per-class/--single-class",
            help="also choose per-class priorities, chunk caps, caps and reservations "
            "(default: when the SLO set gives the trace's classes different tiers)"),
    ) -> None:
        # lazy: the schemas (pydantic) and the knob table cost 0.15 s that --help should not pay
        from rich.console import Console

        from servetune.knobs import summary_text
        from servetune.schemas.base import load_document
        from servetune.schemas.job import OptimizeJob

        console = Console(stderr=True, soft_wrap=True)  # one line per message, piped or not
        engine = "vllm"
        if as_json and job is not None and job.suffix == ".json":
            # `--json s.json` from before --json was a flag: s.json was taken for JOB
            raise ServetuneError(f"{old_json_hint(str(job))} (a job file is YAML)")
        if job is not None:
            if trace or workload or profile or slo or space:
                raise ServetuneError(
                    "give either a job file or --trace/--workload/--profile/--slo/--space, "
                    "not both"
                )
            job = _job_file(job)
            doc = load_document(job, OptimizeJob)
            base = job.resolve().parent
            trace = _resolve(base, doc.trace)
            workload = _resolve(base, doc.workload)
            profile = _profile_arg(base, doc.profile)
            slo = _resolve(base, doc.slo)
            space = _resolve(base, doc.space)
            method = method or doc.method
            time_limit = time_limit if time_limit is not None else doc.time_limit_s
            max_simulations = (max_simulations if max_simulations is not None
                               else doc.max_simulations)
            seed = seed if seed is not None else doc.seed
            requests = requests if requests is not None else doc.requests
            output = output or _resolve(base, doc.output)
            json_out = json_out or _resolve(base, doc.summary_json)
            trace_format = trace_format or doc.trace_format
            engine = doc.engine
            per_class = per_class if per_class is not None else doc.per_class
        if profile is None or slo is None:
            raise ServetuneError("give --profile and --slo (or a job file); see --help")
        if output is None:
            raise ServetuneError("give -o POLICY.yaml (where to write the chosen policy)")

        json_to = JsonTarget.of(as_json, json_out)
        check_outputs({"-o/--output": output, "--json-out": json_to.file},
                      {"JOB": job, "--trace": trace, "--workload": workload, "--profile": profile,
                       "--slo": slo, "--space": space})

        def say(msg: str) -> None:
            if not quiet:
                console.print(f"[dim]optimize:[/dim] {msg}", highlight=False)

        try:
            with compile_notice(quiet, say), executor_for(workers, ray, small=True) as executor:
                result = run_optimize(
                    trace=trace, workload=workload, profile=profile, slo=slo, space=space,
                    method=method or "milp",
                    time_limit_s=DEFAULT_TIME_LIMIT_S if time_limit is None else time_limit,
                    max_simulations=(DEFAULT_MAX_SIMULATIONS if max_simulations is None
                                     else max_simulations),
                    seed=0 if seed is None else seed,
                    requests=requests,
                    engine=engine, trace_format=trace_format, columns=columns, progress=say,
                    executor=executor, per_class=per_class,
                )
        except InfeasibleError as err:
            _emit_json(json_to, err.details.get("summary", {"status": "infeasible"}))
            raise
        write_text_atomic(output, result.policy_yaml)
        _emit_json(json_to, result.summary)
        if json_to.stdout:
            return
        s = result.summary
        defaults = s.get("defaults_goodput_rate_per_s")
        gain = (
            f" ({s['goodput_rate_per_s'] / defaults:.2f}x vLLM defaults' {defaults:.2f})"
            if defaults else ""
        )
        typer.echo(
            f"wrote {output}: {summary_text(s['policy'])}; goodput "
            f"{s['goodput_rate_per_s']:.2f} req/s{gain}; {s['simulations']} simulations, "
            f"solver {s['solver_s']:.1f} s, simulation {s['simulation_s']:.1f} s, "
            f"wall {s['wall_s']:.1f} s; stopped by {s['stopped_by']}"
        )
        knobs = s["policy"]
        if knobs.get("long_requests.threshold_tokens") is not None:
            typer.echo(f"long-request lane: requests of {knobs['long_requests.threshold_tokens']}"
                       f"+ tokens (prompt + expected output) hold at most "
                       f"{knobs['long_requests.max_seqs']} seat(s), "
                       f"{knobs['long_requests.reserved_seqs']} reserved")
        for line in _model_lines(s):
            typer.echo(line)
        if s.get("classes"):
            typer.echo("per class: " + "; ".join(
                f"{name}: " + ", ".join(f"{k} {v}" for k, v in c.items())
                for name, c in s["classes"].items()))
