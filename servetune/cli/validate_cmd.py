"""CLI: ``servetune validate``: the simulator against a real benchmark run (and a fit).

A thin layer over :mod:`servetune.apps.validate` and :mod:`servetune.workloads.bench`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from servetune.cli.options import (
    JsonOption,
    JsonOutOption,
    JsonTarget,
    QuietOption,
    RayOption,
    SmallWorkersOption,
    compile_notice,
    console_say,
    executor_for,
    print_json,
)
from servetune.cli.simulate_cmd import EngineOption, PolicyOption, ProfileOption
from servetune.engines import ENGINE_NAMES
from servetune.errors import ServetuneError
from servetune.io import (
    check_outputs,
    require_file,
    write_all_or_none,
    write_text_atomic,
)
from servetune.workloads.bench_formats import BENCH_FORMATS


def _fmt_ms(x: Any) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _pct(x: Any) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def comparison_table(comp: dict[str, Any], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("metric (ms)")
    for col in ("mean", "p50", "p90", "p99"):
        table.add_column(f"{col} meas / pred", justify="right")
    table.add_column("per-request |err| p50", justify="right")
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("e2e_s", "E2E")):
        m = comp["metrics"][key]
        cells = [
            f"{_fmt_ms(m['measured'][s])} / {_fmt_ms(m['predicted'][s])} "
            f"({_pct(m['stat_rel_error'][s])})" for s in ("mean", "p50", "p90", "p99")
        ]
        med = m["per_request"]["median_abs_rel"]
        table.add_row(label, *cells, "-" if med is None else f"{med * 100:.1f}%")
    th = comp["throughput"]
    table.add_row("output tok/s", f"{th['measured']['output_tok_s']:.1f} / "
                  f"{th['predicted']['output_tok_s']:.1f} "
                  f"({_pct(th['rel_error']['output_tok_s'])})", "", "", "", "")
    return table


def register(app: typer.Typer) -> None:
    """Add ``validate`` to the top-level app."""

    @app.command("validate")
    def validate_command(
        bench_result: Annotated[Path, typer.Option(
            "--bench-result",
            help="per-request results: vllm bench serve --save-result --save-detailed JSON, "
                 "SGLang bench_serving --output-details JSONL, or AIPerf profile_export.jsonl",
        )],
        profile: ProfileOption,
        policy: PolicyOption,
        engine: EngineOption = "vllm",
        bench_format: str | None = typer.Option(
            None, "--bench-format", help=" | ".join(BENCH_FORMATS) + " (default: detected)"
        ),
        max_concurrency: int | None = typer.Option(
            None, "--max-concurrency",
            help="the client's --max-concurrency, when the file does not say (AIPerf)",
        ),
        report: Path | None = typer.Option(
            None, "--report", help="folder for report.md, CDF plots and validate.json"
        ),
        as_json: JsonOption = False,
        json_out: JsonOutOption = None,
        quiet: QuietOption = False,
        calibrate: bool = typer.Option(
            False, "--calibrate",
            help="fit host_s_per_step, host_s_per_seq, gpu_time_scale and "
                 "decode_attn_s_per_context_token to the run",
        ),
        out: Path | None = typer.Option(
            None, "-o", "--out", help="with --calibrate: the corrected profile YAML"
        ),
        workers: SmallWorkersOption = None,
        ray: RayOption = None,
    ) -> None:
        """Replay a real benchmark run in the simulator and compare the latencies.

        Example: vllm bench serve ... --save-result --save-detailed --result-filename r.json;
        then servetune validate --bench-result r.json --profile h200-llama-3.1-8b
        --policy configs/policies/vllm-serve-defaults.yaml --report validate/
        [--calibrate -o gpu_profiles/h200-llama-3.1-8b-mine.yaml]
        """
        # lazy: the simulator package adds 35 ms to every command's start-up
        from servetune.apps import validate as V
        from servetune.profiles.shipped import load_profile, require_kv_pool
        from servetune.schemas.base import document_to_yaml, load_document
        from servetune.schemas.policy import Policy
        from servetune.workloads.bench import load_bench_run

        if engine not in ENGINE_NAMES:
            raise ServetuneError(
                f"--engine {engine!r}: unknown engine; choose one of {', '.join(ENGINE_NAMES)}"
            )
        if calibrate and out is None:
            raise ServetuneError("--calibrate needs -o P2.yaml (where the corrected profile goes)")
        if out is not None and not calibrate:
            raise ServetuneError("-o writes the corrected profile; give it with --calibrate")
        json_to = JsonTarget.of(as_json, json_out)
        check_outputs(
            {"--json-out": json_to.file, "-o": out},
            {"--bench-result": bench_result, "--profile": profile, "--policy": policy},
            out_dirs={"--report": (report, ("report.md", "validate.json", "cdf_*.png"))},
        )
        # one line per message, piped or not; under -q no status, notes or compile notice
        console = Console(stderr=True, soft_wrap=True, quiet=quiet)
        say = console_say(console)
        run = load_bench_run(
            require_file(bench_result, "given to --bench-result"), bench_format,
            max_concurrency,
            on_notice=lambda n: say(f"note: {n}"),
        )
        prof = load_profile(profile)
        require_kv_pool(prof, profile)
        pol = load_document(require_file(policy, "given to --policy"), Policy)
        with compile_notice(quiet, say):
            with console.status(f"replaying {len(run):,} requests"):
                rep = V.replay(run, pol, prof, engine=engine)
            cal = None
            if calibrate:
                with (console.status("calibrating") as status,
                      executor_for(workers, ray, small=True) as executor):
                    cal = V.calibrate(
                        run, pol, prof, engine=engine, baseline=rep, executor=executor,
                        progress=lambda r, c: status.update(
                            f"calibrating: round {r}, cost {c:.4g}"),
                    )
        summary = V.validation_summary(run, rep, profile=prof, policy=pol, engine=engine,
                                       cal=cal)
        # build everything first, then write: no partial output on an error
        files = V.report_files(summary, run, rep, cal) if report is not None else None
        profile_text = None
        if cal is not None:
            profile_text = document_to_yaml(
                cal.profile,
                header=f"servetune GPU profile {cal.profile.name}, corrected by servetune "
                       f"validate --calibrate against {bench_result.name}",
            )
        writers: list[tuple[Path, Callable[[], None]]] = []
        json_path = json_to.file
        if json_path is not None:
            writers.append((json_path, lambda: write_text_atomic(
                json_path, V.summary_json_text(summary))))
        if profile_text is not None:
            assert out is not None
            writers.append((out, lambda: write_text_atomic(out, profile_text)))
        if files is not None:  # last: a folder's commit cannot be undone
            assert report is not None
            writers.append((report, lambda: V.write_report(report, files)))
        write_all_or_none(writers)
        if json_to.stdout:
            print_json(V.summary_json_text(summary))
            return
        stdout = Console(file=sys.stdout, width=120)
        stdout.print(comparison_table(summary["comparison"],
                                      f"{pol.name} on {prof.name} ({engine}) vs "
                                      f"{bench_result.name}"))
        rp = summary["comparison"]["replay"]
        if rp["closed_loop"]:
            stdout.print(f"closed loop at max_concurrency {rp['max_concurrency']}: "
                         f"{rp['rounds']} rounds, "
                         f"{'converged' if rp['converged'] else 'NOT converged'}")
        fe = summary["comparison"]["fit_error"]
        stdout.print(f"RMS relative error: TTFT {fe['ttft_rms_rel']:.3f}, "
                     f"E2E {fe['e2e_rms_rel']:.3f}")
        if cal is not None:
            fitted = ", ".join(f"{k} {v:.6g}" for k, v in cal.fitted.items())
            stdout.print(f"calibrated: {fitted}; RMS relative error "
                         f"{cal.error_before['rms_rel']:.4f} -> {cal.error_after['rms_rel']:.4f}"
                         f" (profile written to {out})")
        if report is not None:
            stdout.print(f"report: {report / 'report.md'}")
