"""CLI: ``servetune plan`` (GPU fleet for a forecast at SLOs, lowest cost) and
``servetune place`` (background jobs into the capacity a plan leaves free).

Both are thin layers over :func:`servetune.apps.plan.run_plan` and
:func:`servetune.apps.place.run_place`; the report plots are
:mod:`servetune.apps.plan_report`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

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
from servetune.engines import ENGINE_NAMES
from servetune.errors import ServetuneError
from servetune.io import check_out_dir, check_outputs, require_file, write_text_atomic
from servetune.routers import ROUTER_NAMES

if TYPE_CHECKING:  # imported where used: see the lazy imports
    from servetune.schemas.fleet import CapacityPlan

PLAN_HELP = """Plan how many GPUs of which type serve a forecast at the SLOs, at the lowest cost.

Example:

  servetune plan --workload configs/workloads/azure-conv-2023.yaml \\
    --forecast configs/forecasts/azure-conv-diurnal-100.yaml \\
    --fleet configs/fleets/cloud-4types.yaml \\
    --slo configs/slos/mlperf-llama-3.1-8b-server.yaml -o plan.yaml --growth 1,1.5,2,4

Exits 3 when the forecast cannot be served within the fleet's count limits.
"""

PLACE_HELP = """Place background jobs into the capacity a plan leaves free, without breaking the
interactive SLOs.

Example:

  servetune place --jobs configs/batch_jobs/nightly.yaml --plan plan.yaml \\
    --forecast configs/forecasts/azure-conv-diurnal-100.yaml -o schedule.yaml

Exits 3 when a job's deadline is not after its release.
"""


# The files each command's --report folder receives (an input must not be one of them).
PLAN_REPORT_FILES = ("cost_by_type.png", "replicas_over_day.png", "cost_vs_growth.png",
                     "plan.json")
PLACE_REPORT_FILES = ("spare_and_work.png", "schedule.json")


def _check_outputs(output: Path, report: Path | None, report_files: tuple[str, ...],
                   inputs: dict[str, Path]) -> None:
    """Refuse unusable output paths (a folder, a device, one of the inputs) before the
    (long) run, so nothing is half written and no input is overwritten."""
    check_outputs({"-o/--output": output}, inputs,
                  out_dirs={"--report": (report, report_files)})


def _items(text: str, option: str) -> list[str]:
    """A comma-separated list's items (none for an empty text); an empty item (``1,,2``,
    a trailing comma) is an error rather than skipped."""
    if not text.strip():
        return []
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise ServetuneError(f"{option}: an item of {text!r} is empty; give comma-separated "
                             "values such as 1,1.5,2")
    return items


def _floats(text: str, option: str) -> list[float]:
    items = _items(text, option)
    try:
        vals = [float(x) for x in items]
    except ValueError:
        raise ServetuneError(f"{option}: give comma-separated numbers (got {text!r})") from None
    if not vals or any(not (v > 0 and v < float("inf")) for v in vals):
        raise ServetuneError(f"{option}: give numbers > 0 (got {text!r})")
    return vals


def _ints(text: str, option: str) -> list[int]:
    items = _items(text, option)
    try:
        return [int(x) for x in items]
    except ValueError:
        raise ServetuneError(f"{option}: give comma-separated integers (got {text!r})") from None


def _plan_lines(plan: CapacityPlan) -> list[str]:
    cost = plan.cost
    peak = {t: max(v) for t, v in plan.gpus.items() if max(v) > 0}
    lines = [
        f"plan: ${cost['daily_usd']:,.2f}/day (peak ${cost['peak_hourly_usd']:,.2f}/h), "
        f"peak GPUs " + ", ".join(f"{t} {n}" for t, n in peak.items()),
    ]
    for t, why in plan.excluded_gpu_types.items():
        lines.append(f"not in this plan: {t} ({why})")
    solver = plan.solver
    if solver.get("budget_usd") is not None:
        lines.append(f"budget ${solver['budget_usd']:,.2f}: serves "
                     f"{100 * solver['served_share']:.1f}% of the forecast requests")
    single = plan.single_type
    if "best" in single:
        b = single["best"]
        lines.append(f"best single type: {b} ${single[b]['daily_usd']:,.2f}/day "
                     f"(mixed saves {single['saving_pct']:.1f}%)")
    topo = plan.topology
    if topo:
        comp = topo["comparison"]
        parts = [f"{k} ${v['daily_usd']:,.2f}/day" if v.get("feasible") else f"{k} infeasible"
                 for k, v in comp.items() if k != "cheapest"]
        lines.append("topologies: " + ", ".join(parts) + f" (cheapest: {comp['cheapest']})")
        lines.append("topology per GPU type: "
                     + ", ".join(f"{t} {x}" for t, x in topo["per_type"].items()))
    v = plan.validation
    lines.append(f"validated in simulation: {'yes' if v['validated'] else 'NO'} "
                 f"after {v['rounds']} round(s)")
    if plan.growth_sweep and solver.get("budget_usd") is not None:
        lines.append("growth sweep: the cost of serving every request (the budget does not "
                     "apply):")
    for r in plan.growth_sweep:
        if not r.get("feasible", True):
            lines.append(f"growth x{r['growth']:g}: infeasible: {r['reason']}")
            continue
        gpus = ", ".join(f"{t} {n}" for t, n in r["peak_gpus"].items() if n)
        lines.append(f"growth x{r['growth']:g}: ${r['daily_usd']:,.2f}/day, peak GPUs {gpus}; "
                     f"best single {r['best_single']} ${r['best_single_daily_usd'] or 0:,.2f}"
                     f"/day")
    return lines


# ------------------------------------------------------------------------ commands


def register(app: typer.Typer) -> None:
    """Add ``plan`` and ``place`` to the top-level app."""

    @app.command("plan", help=PLAN_HELP)
    def plan_cmd(
        workload: Path = typer.Option(..., "--workload", help="Workload YAML (request shapes)."),
        forecast: Path = typer.Option(..., "--forecast", help="Forecast YAML (rates per hour)."),
        fleet: Path = typer.Option(..., "--fleet", help="Fleet YAML (GPU types and prices)."),
        slo: Path = typer.Option(..., "--slo", help="SLO set YAML."),
        output: Path = typer.Option(..., "-o", "--output", help="Plan YAML to write."),
        as_json: JsonOption = False,
        report: Path | None = typer.Option(None, "--report", help="Folder for plots."),
        growth: str | None = typer.Option(
            None, "--growth",
            help="What-if load multipliers, e.g. 1,1.5,2,4 (one line each); 'forecast' uses "
            "the forecast file's growth list.",
        ),
        cache_dir: Path | None = typer.Option(
            None, "--cache-dir",
            help="Capacity cache (default $SERVETUNE_CACHE_DIR or ~/.cache/servetune/capacity).",
        ),
        engine: str = typer.Option("vllm", "--engine", help=" | ".join(ENGINE_NAMES) + "."),
        method: str = typer.Option(
            "auto", "--capacity-method",
            help="auto | optimizer | candidates: how each replica's policy is chosen.",
        ),
        prompt_edges: str = typer.Option("1024,4096", "--prompt-edges",
                                         help="Bucket edges on prompt tokens."),
        output_edges: str = typer.Option("256", "--output-edges",
                                         help="Bucket edges on output tokens."),
        budget: float | None = typer.Option(
            None, "--budget", help="$ over the forecast's slots: maximize served rate instead."
        ),
        model: str | None = typer.Option(
            None, "--model", help="Which model's profiles to use (overrides the fleet's)."
        ),
        topologies: str = typer.Option(
            "agg", "--topologies",
            help="Serving topologies to compare per GPU type: agg (one replica) and/or "
            "prefill:decode units, e.g. agg,1:1,1:2,2:1.",
        ),
        router: str = typer.Option(
            "least_kv", "--router",
            help="Router of disaggregated units (capacity and validation): "
            f"{' | '.join(ROUTER_NAMES)}.",
        ),
        link: str = typer.Option(
            "infiniband", "--link", help="KV link of P:D units: infiniband | nvlink | roce."
        ),
        seed: int = typer.Option(0, "--seed"),
        workers: WorkersOption = None,
        ray: RayOption = None,
        quiet: QuietOption = False,
    ) -> None:
        for p, opt in ((workload, "--workload"), (forecast, "--forecast"), (fleet, "--fleet"),
                       (slo, "--slo")):
            require_file(p, f"given to {opt}")
        _check_outputs(output, report, PLAN_REPORT_FILES,
                       {"--workload": workload, "--forecast": forecast, "--fleet": fleet,
                        "--slo": slo})
        if method not in ("auto", "optimizer", "candidates"):
            raise ServetuneError(
                f"--capacity-method {method!r}: choose auto, optimizer or candidates"
            )
        if budget is not None and not budget > 0:
            raise ServetuneError(f"--budget must be > 0 dollars (got {budget})")
        if cache_dir is not None:  # a file there would fail only after the work
            check_out_dir(cache_dir, "--cache-dir")
        if growth == "forecast":
            # lazy: the fleet schemas add 20 ms to every command's start-up
            from servetune.schemas.base import load_document
            from servetune.schemas.fleet import Forecast

            sweep = list(load_document(forecast, Forecast).growth)
        else:
            sweep = _floats(growth, "--growth") if growth else None
        # lazy: the planning pipeline imports pyomo (0.3 s) that `servetune --help` and
        # the other commands should not pay
        from servetune.apps.plan import parse_topologies, run_plan
        from servetune.apps.plan_report import plan_json_text, write_plan_report
        from servetune.schemas.base import save_document

        topology_list = parse_topologies(topologies)  # a bad list fails before any work

        with compile_notice(quiet), executor_for(workers, ray) as executor:
            run = run_plan(
                workload, forecast, fleet, slo, out_path=output, sweep=sweep,
                cache_dir=cache_dir, engine=engine, method=method,
                prompt_edges=_ints(prompt_edges, "--prompt-edges"),
                output_edges=_ints(output_edges, "--output-edges"), budget=budget, seed=seed,
                model=model, progress=None if quiet else note_line,
                topologies=topology_list, router=router, link=link, executor=executor,
            )
        save_document(run.plan, output)
        if report is not None:
            write_plan_report(run.plan, report)
        if as_json:
            print_json(plan_json_text(run.plan) + "\n")
        else:
            for line in _plan_lines(run.plan):
                typer.echo(line)
            typer.echo(f"wrote {output} in {run.timings['total_s']:.1f} s")

    @app.command("place", help=PLACE_HELP)
    def place_cmd(
        jobs: Path = typer.Option(..., "--jobs", help="Jobs YAML (background work)."),
        plan: Path = typer.Option(..., "--plan", help="Plan YAML from `servetune plan`."),
        forecast: Path = typer.Option(..., "--forecast", help="Forecast YAML."),
        output: Path = typer.Option(..., "-o", "--output", help="Schedule YAML to write."),
        as_json: JsonOption = False,
        report: Path | None = typer.Option(None, "--report", help="Folder for plots."),
        cache_dir: Path | None = typer.Option(None, "--cache-dir", help="Spare-capacity cache."),
        levels: int = typer.Option(5, "--levels", min=2, max=9,
                                   help="Interactive load levels measured per GPU type."),
        seed: int = typer.Option(0, "--seed"),
        quiet: QuietOption = False,
    ) -> None:
        for p, opt in ((jobs, "--jobs"), (plan, "--plan"), (forecast, "--forecast")):
            require_file(p, f"given to {opt}")
        _check_outputs(output, report, PLACE_REPORT_FILES,
                       {"--jobs": jobs, "--plan": plan, "--forecast": forecast})
        if cache_dir is not None:
            check_out_dir(cache_dir, "--cache-dir")
        # lazy: placement imports pyomo and OR-Tools (0.6 s)
        from servetune.apps.place import run_place
        from servetune.apps.plan_report import write_schedule_report
        from servetune.schemas.base import dump_yaml
        from servetune.solvers.drivers import preload_cpsat

        preload_cpsat()  # placement solves CP-SAT: import OR-Tools before the work

        with compile_notice(quiet):
            run = run_place(jobs, plan, forecast, out_path=output, cache_dir=cache_dir,
                            levels=levels, seed=seed, progress=None if quiet else note_line)
        write_text_atomic(output, dump_yaml(run.schedule))
        if report is not None:
            write_schedule_report(run.schedule, report)
        if as_json:
            print_json(json.dumps(run.schedule, indent=2) + "\n")
            return
        s = run.schedule["summary"]
        typer.echo(f"scheduled {s['scheduled']} of {s['jobs']} jobs, value "
                   f"{s['value_completed']:g} of {s['value_total']:g}")
        for r in run.schedule["jobs"]:
            if r["scheduled"]:
                day, hour = divmod(int(r["finish_s"] // 3600), 24)
                when = f"{hour:02d}:00" + (f" (+{day} day)" if day else "")
                early_h = -r["lateness_s"] / 3600
                margin = f"{early_h:.0f} h before its deadline" if early_h >= 0.5 else \
                    "at its deadline"
                typer.echo(f"  {r['id']}: done by {when}, {margin}")
            else:
                typer.echo(f"  {r['id']}: NOT scheduled: {r['reason']}")
        for t, c in run.schedule["validation"]["per_type"].items():
            typer.echo(f"  check {t} slot {c['slot']}: interactive SLOs "
                       f"{'hold' if c['meets_slo'] else 'MISSED'} with background")
        if "note" in run.schedule:
            typer.echo(f"note: {run.schedule['note']}")
        typer.echo(f"wrote {output}")
