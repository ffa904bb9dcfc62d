"""CLI: ``servetune profile fit | check | measure | show | derive``.

- ``fit``: a measured profile from a folder of timing CSVs (servetune.profiles.fit).
- ``check``: a profile's predicted step times against a whole-step CSV.
- ``measure``: time the operations and whole steps on this machine's CUDA GPU.
- ``show``: memory, KV pool and step times at a few shapes.
- ``derive``: a profile for another GPU / TP degree from measured per-op curves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from servetune.cli.options import JsonOption, QuietOption, print_json
from servetune.cli.root import new_group
from servetune.io import check_outputs

if TYPE_CHECKING:  # imported where used: see the lazy imports
    from servetune.profiles.schema import Profile


def _save(profile: Profile, output: Path) -> None:
    # lazy: profile building imports HiGHS (25 ms) that every other command would pay
    from servetune.profiles.build import profile_header
    from servetune.profiles.shipped import require_kv_pool
    from servetune.schemas.base import save_document

    require_kv_pool(profile, f"{output} (not written)")
    save_document(profile, output, header=profile_header(profile))


def _check_profile_output(output: Path, measurements: Path, model: str) -> None:
    """The profile YAML must not overwrite a measurement file or the --model YAML."""
    inputs: dict[str, Path | str | None] = {"--model": model}
    if measurements.is_dir():
        inputs.update({f"--measurements ({f.name})": f for f in sorted(measurements.iterdir())})
    else:
        inputs["--measurements"] = measurements
    check_outputs({"-o/--output": output}, inputs)


def register(app: typer.Typer) -> None:
    """Add ``servetune profile ...`` to the top-level app."""
    group = new_group("GPU profiles: fit from measurements, check, measure, show, derive.")

    @group.command(
        "fit",
        epilog="Example: servetune profile fit --measurements ../shared/gpu_measurements/h200 "
        "--model llama-3.1-8b -o h200-llama-3.1-8b.yaml",
    )
    def fit_cmd(
        measurements: Path = typer.Option(..., "--measurements", "-m",
                                          help="Folder of timing CSVs (linear.csv, ...)."),
        model: str = typer.Option(..., "--model",
                                  help="Architecture: llama-3.1-8b, qwen2.5-32b, "
                                       "llama-3.1-70b, or a YAML file of ModelArch fields."),
        output: Path = typer.Option(..., "-o", "--output", help="Profile YAML to write."),
        gpu: str | None = typer.Option(None, "--gpu",
                                       help="GPU datasheet key (h200, h100-80gb, a100-80gb, "
                                            "l40s); default: the device in env.txt."),
        tp: int = typer.Option(1, "--tp", min=1, help="Tensor-parallel degree."),
        name: str | None = typer.Option(None, "--name", help="Profile name."),
        utilization: float = typer.Option(0.92, "--gpu-memory-utilization", min=0.01, max=1.0),
    ) -> None:
        """Fit a measured profile from per-operation (and whole-step) timings."""
        # lazy: as in _save
        from servetune.profiles.build import fit_profile

        _check_profile_output(output, measurements, model)
        profile, report = fit_profile(
            measurements, model, gpu=gpu, tensor_parallel=tp, name=name,
            gpu_memory_utilization=utilization,
            paths_relative_to=output.resolve().parent,
        )
        _save(profile, output)
        msg = f"wrote {output}: {profile.name}, {profile.kv_blocks():,} KV blocks"
        if report.check:
            msg += (f"; whole steps: median {report.check['median_abs_pct_error']:.2f}%, "
                    f"max {report.check['max_abs_pct_error']:.2f}% abs error "
                    f"({report.check['rows']} rows)")
        typer.echo(msg)

    @group.command(
        "derive",
        epilog="Example: servetune profile derive --measurements ../shared/gpu_measurements/h200 "
        "--model llama-3.1-70b --gpu h100-80gb --tp 4 -o h100-llama-3.1-70b-tp4.yaml",
    )
    def derive_cmd(
        measurements: Path = typer.Option(..., "--measurements", "-m"),
        model: str = typer.Option(..., "--model"),
        gpu: str = typer.Option(..., "--gpu", help="Target GPU datasheet key."),
        output: Path = typer.Option(..., "-o", "--output"),
        tp: int = typer.Option(1, "--tp", min=1),
        name: str | None = typer.Option(None, "--name"),
        utilization: float = typer.Option(0.92, "--gpu-memory-utilization", min=0.01, max=1.0),
    ) -> None:
        """Derive a profile for another GPU / TP degree from measured per-op timings."""
        # lazy: as in _save
        from servetune.profiles.build import derive_profile

        _check_profile_output(output, measurements, model)
        profile = derive_profile(measurements, model, gpu, tensor_parallel=tp, name=name,
                                 gpu_memory_utilization=utilization,
                                 paths_relative_to=output.resolve().parent)
        _save(profile, output)
        typer.echo(f"wrote {output}: {profile.name}, {profile.kv_blocks():,} KV blocks")

    @group.command(
        "check",
        epilog="Example: servetune profile check --profile h200-llama-3.1-8b --measured "
        "../shared/gpu_measurements/h200/step_graph_llama-3.1-8b.csv --json",
    )
    def check_cmd(
        profile_path: Path = typer.Option(..., "--profile", "-p", help="Profile YAML."),
        measured: Path = typer.Option(..., "--measured",
                                      help="Whole-step CSV (model, decode_seqs, context, "
                                           "prefill_tokens, graph_ms)."),
        model: str | None = typer.Option(None, "--model",
                                         help="Only rows of this model (default: the "
                                              "profile's model if present, else all)."),
        as_json: JsonOption = False,
    ) -> None:
        """Compare a profile's step times with measured whole steps."""
        # lazy: the fitting code imports HiGHS (20 ms) that every other command would pay
        from servetune.profiles.fit import check_profile
        from servetune.profiles.shipped import load_profile

        report = check_profile(load_profile(profile_path), measured, model)
        if as_json:
            print_json(json.dumps(report, indent=2) + "\n")
            return
        typer.echo(f"{'line':>5} {'decode':>6} {'context':>7} {'prefill':>7} "
                   f"{'measured_ms':>11} {'predicted_ms':>12} {'error':>7}")
        for r in report["per_row"]:
            typer.echo(f"{r['line']:>5} {r['decode_seqs']:>6} {r['context']:>7} "
                       f"{r['prefill_tokens']:>7} {r['measured_ms']:>11.3f} "
                       f"{r['predicted_ms']:>12.3f} {r['error_pct']:>+6.1f}%")
        typer.echo(f"{report['rows']} rows: median abs error "
                   f"{report['median_abs_pct_error']:.2f}%, max {report['max_abs_pct_error']:.2f}%")

    @group.command("show", epilog="Example: servetune profile show h200-llama-3.1-8b --json")
    def show_cmd(
        profile_path: Path = typer.Argument(..., help="Profile YAML or shipped profile name."),
        as_json: JsonOption = False,
    ) -> None:
        """Print a profile's memory, KV pool and step times at a few shapes."""
        # lazy: the Profile schema adds 20 ms to every command's start-up
        from servetune.profiles.shipped import load_profile, profile_summary

        profile = load_profile(profile_path)
        data = profile_summary(profile)
        if as_json:
            print_json(json.dumps(data, indent=2) + "\n")
            return
        typer.echo(f"{data['name']} ({data['calibration']}; TP {data['tensor_parallel']})")
        typer.echo(f"source: {data['source']}")
        mem = data["memory"]
        if "gpu_memory_bytes" in mem:
            typer.echo(
                f"GPU memory {mem['gpu_memory_bytes'] / 2**30:.2f} GiB x "
                f"{mem['gpu_memory_utilization']} - weights "
                f"{mem['weight_bytes_per_gpu'] / 2**30:.2f} GiB - reserve "
                f"{mem['activation_reserve_bytes'] / 2**30:.2f} GiB = KV "
                f"{mem['kv_pool_bytes'] / 2**30:.2f} GiB at "
                f"{mem['kv_bytes_per_token']:,.0f} B/token"
            )
        typer.echo(f"KV pool: {mem['kv_blocks']:,} usable blocks of {mem['block_size']} tokens "
                   f"({mem['kv_tokens']:,} tokens)")
        if profile.step_time.constant_s is not None:
            typer.echo(f"step time: constant {profile.step_time.constant_s * 1e3:.3f} ms")
            return
        typer.echo(f"{'step':<34} {'tokens':>7} {'ms':>9} {'tokens/s':>10}")
        for r in data["steps"]:
            typer.echo(f"{r['shape']:<34} {r['tokens']:>7} {r['step_ms']:>9.3f} "
                       f"{r['tokens_per_s']:>10.0f}")

    @group.command("measure", epilog="Example: servetune profile measure -o my-gpu "
                   "--model llama-3.1-8b, then: servetune profile fit --measurements my-gpu "
                   "--model llama-3.1-8b -o my-gpu-llama-3.1-8b.yaml")
    def measure_cmd(
        output: Path = typer.Option(..., "-o", "--output", help="Folder to write CSVs into."),
        model: list[str] = typer.Option(["llama-3.1-8b"], "--model",
                                        help="Architectures to time (repeatable)."),
        steps: bool = typer.Option(True, "--steps/--no-steps",
                                   help="Also time whole CUDA-graph steps."),
        budget_s: float = typer.Option(600.0, "--budget-s", min=1.0,
                                       help="Stop starting new timings after this long."),
        quiet: QuietOption = False,
    ) -> None:
        """Time per-operation kernels and whole steps on this machine's CUDA GPU (needs the
        ``gpu`` extra: torch)."""
        # lazy: a command run once per GPU; torch, which it needs, is an optional extra
        from servetune.profiles.measure import measure

        written = measure(output, models=model, whole_steps=steps, budget_s=budget_s,
                          log=(lambda m: None) if quiet else lambda m: typer.echo(m, err=True))
        typer.echo(f"wrote {', '.join(str(p) for p in written)}")

    app.add_typer(group, name="profile")
