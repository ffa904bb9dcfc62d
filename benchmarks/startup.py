"""Benchmark: start-up and first run (issue 17).

Measures, each in fresh processes, and prints one Markdown table:

- ``servetune --help`` and ``servetune <command> --help`` for every command and group;
- ``servetune optimize configs/jobs/quickstart.yaml`` with an empty simulator cache (the
  compile) and again warm, and whether the two policies are the same bytes;
- a one-request ``servetune simulate`` cold (compile) and warm (loading the cached kernel);
- the floor under every command: a fresh process that only imports, layer by layer, the
  interpreter, numpy, the libraries the project's standards choose for schemas, CLI and
  YAML (pydantic, typer, rich, PyYAML), numba and its first cached-kernel load, then all of
  ``simulate``'s modules;
- loading the shared traces (``../shared/traces``) with servetune's reader against
  pyarrow's CSV / JSON readers (when pyarrow is installed), and what importing pyarrow
  costs a process that has numpy already (every servetune run has).

The package is byte-compiled first and the children run without PYTHONDONTWRITEBYTECODE,
as after ``pip install``. Wall times are the minimum and median of ``--runs`` runs (the
cold runs: one each, in a new cache folder).

``--baseline REPO`` (another checkout with its own ``.venv``, e.g. the main branch) runs
the help pages and the warm one-request simulate there too, alternating with this
checkout's runs, so the two are compared under the same load.

Usage: python benchmarks/startup.py [--runs 5] [--skip-cold] [--baseline ../main]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"
SHARED_TRACES = ("AzureLLMInferenceTrace_code.csv", "AzureLLMInferenceTrace_conv.csv",
                 "mooncake_synthetic_trace.jsonl.gz")
CLI = [sys.executable, "-c", "from servetune.cli import run; run()"]
SIMULATE_ONE = ["simulate", "--trace", "configs/examples/azure-conv-synthetic.csv",
                "--requests", "1", "--profile", "h200-llama-3.1-8b",
                "--policy", "configs/policies/vllm-serve-defaults.yaml"]


def child_env(cache: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONDONTWRITEBYTECODE", "NUMBA_CACHE_DIR")}
    if cache is not None:
        env["SERVETUNE_CACHE_DIR"] = str(cache)
    return env


def run(args: list[str], env: dict[str, str], cwd: Path = REPO
        ) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(args)}\n{proc.stderr}")
    return wall, proc


def seconds(value: float) -> str:
    return f"{value:.2f} s" if value >= 1 else f"{value * 1e3:.0f} ms"


def stats(times: list[float]) -> str:
    return f"{seconds(min(times))} (median {seconds(statistics.median(times))})"


def versus(ours: list[float], theirs: list[float] | None) -> str:
    """This checkout's times, and the baseline's with the ratio of the medians."""
    if not theirs:
        return stats(ours)
    ratio = statistics.median(theirs) / statistics.median(ours)
    return f"{stats(ours)}; baseline {stats(theirs)}; {ratio:.2f}x"


def baseline_cli(repo: Path | None) -> list[str] | None:
    """The other checkout's console script (its entry point may predate ``run``)."""
    return None if repo is None else [str(repo / ".venv" / "bin" / "servetune")]


def best(fn: Callable[[], object], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def help_pages() -> list[list[str]]:
    """Every command path of the app (the root, the groups, their commands)."""
    import typer.main

    from servetune.cli import app

    def walk(cmd: object, prefix: list[str]) -> list[list[str]]:
        found = [prefix]
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            found += walk(sub, [*prefix, name])
        return found

    return walk(typer.main.get_command(app), [])


def measure_help(rows: list[tuple[str, str]], runs: int, baseline: Path | None) -> None:
    env = child_env()
    worst = 0.0
    other = baseline_cli(baseline)
    for path in help_pages():
        times, theirs = [], []
        for _ in range(runs):
            times.append(run([*CLI, *path, "--help"], env)[0])
            if other is not None and baseline is not None:
                theirs.append(run([*other, *path, "--help"], env, baseline)[0])
        worst = max(worst, statistics.median(times))
        rows.append((f"`servetune {' '.join(path)} --help`".replace("  ", " "),
                     versus(times, theirs)))
    rows.append(("slowest help page (median)", f"**{seconds(worst)}**"))


def measure_first_run(rows: list[tuple[str, str]], runs: int, skip_cold: bool,
                      baseline: Path | None) -> None:
    from servetune.sim.compile_notice import NOTICE

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        cache = out / "cache"
        if not skip_cold:
            wall, proc = run([*CLI, "optimize", "configs/jobs/quickstart.yaml",
                              "-o", str(out / "cold.yaml")], child_env(cache))
            rows.append(("`optimize quickstart`, empty cache (compiles)",
                         f"{wall:.1f} s; notice: {'yes' if NOTICE in proc.stderr else 'NO'}"))
        if skip_cold:  # fill the cache first: the runs below are the warm ones
            run([*CLI, "optimize", "configs/jobs/quickstart.yaml", "-q",
                 "-o", str(out / "warm.yaml")], child_env(cache))
        warm = []
        for k in range(max(1, runs // 2)):
            wall, proc = run([*CLI, "optimize", "configs/jobs/quickstart.yaml",
                              "-o", str(out / "warm.yaml")], child_env(cache))
            warm.append(wall)
            if k == 0:
                notice = "yes" if NOTICE in proc.stderr else "no"
        rows.append(("`optimize quickstart`, warm", f"{stats(warm)}; notice: {notice}"))
        if not skip_cold:
            same = (out / "cold.yaml").read_bytes() == (out / "warm.yaml").read_bytes()
            rows.append(("policy YAML cold vs warm", "same bytes" if same else "**DIFFERENT**"))
            cache2 = out / "cache2"
            wall, proc = run([*CLI, *SIMULATE_ONE], child_env(cache2))
            rows.append(("one-request `simulate`, empty cache (compiles)",
                         f"{wall:.1f} s; notice: {'yes' if NOTICE in proc.stderr else 'NO'}"))
        else:
            cache2 = cache
        other = baseline_cli(baseline)
        if other is not None and baseline is not None:  # its own cache, warmed first
            run([*other, *SIMULATE_ONE, "-q"], child_env(), baseline)
        times, theirs = [], []
        for _ in range(runs):
            times.append(run([*CLI, *SIMULATE_ONE, "-q"], child_env(cache2))[0])
            if other is not None and baseline is not None:
                theirs.append(run([*other, *SIMULATE_ONE, "-q"], child_env(), baseline)[0])
        rows.append(("one-request `simulate`, warm", versus(times, theirs)))


# Each layer runs the lines of every layer above it, then its own. The numba layer loads
# a one-line kernel from numba's cache (filled by an untimed run first), which is when
# numba sets up its typing and lowering registries, as servetune's first simulation does.
FLOOR_LAYERS = (
    ("the interpreter (`python -c pass`)", "pass"),
    ("+ numpy", "import numpy"),
    ("+ pydantic, typer, rich, PyYAML", "import pydantic, typer, rich.console, rich.table, yaml"),
    ("+ numba", "import numba"),
    ("+ numba's first cached-kernel load",
     "@numba.njit(cache=True)\ndef one(x):\n    return x + 1\none(1)"),
    ("+ all of `simulate`'s modules (nothing run)",
     "import servetune.cli, servetune.cli.simulate_cmd, servetune.sim.cluster"),
)


def measure_floor(rows: list[tuple[str, str]], runs: int) -> None:
    """Fresh processes that only import: what every ``servetune`` command pays first."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "floor.py"  # numba caches only functions defined in a file
        env = {**child_env(), "NUMBA_CACHE_DIR": str(Path(tmp) / "numba")}
        for k, (name, _) in enumerate(FLOOR_LAYERS):
            script.write_text("\n".join(code for _, code in FLOOR_LAYERS[: k + 1]) + "\n")
            run([sys.executable, str(script)], env)  # untimed: fills numba's cache
            times = [run([sys.executable, str(script)], env)[0] for _ in range(runs)]
            rows.append((f"floor: {name}", stats(times)))


def measure_traces(rows: list[tuple[str, str]], runs: int) -> None:
    from servetune.workloads.formats import load_trace

    try:
        import pyarrow.csv as pa_csv
        import pyarrow.json as pa_json
    except ImportError:
        pa_csv = pa_json = None
    probe = ("import time, numpy; t0 = time.perf_counter(); import pyarrow.csv, pyarrow.json; "
             "print(time.perf_counter() - t0)")
    if pa_csv is not None:
        imports = [float(run([sys.executable, "-c", probe], child_env())[1].stdout)
                   for _ in range(runs)]
        rows.append(("`import pyarrow.csv, pyarrow.json` (numpy already imported)",
                     stats(imports)))
    with tempfile.TemporaryDirectory() as tmp:
        files = [TRACES / name for name in SHARED_TRACES if (TRACES / name).exists()]
        conv = TRACES / "AzureLLMInferenceTrace_conv.csv"
        if conv.exists():  # a larger file: the conversation trace 50 times over
            header, *body = conv.read_bytes().splitlines()
            big = Path(tmp) / "conv_x50.csv"
            big.write_bytes(b"\n".join([header, *body * 50]) + b"\n")
            files.append(big)
        for path in files:
            n = len(load_trace(path))
            ours = best(lambda p=path: load_trace(p), runs)
            text = f"{n:,} rows: servetune {stats(ours)}"
            if pa_csv is not None:
                if ".csv" in path.name:
                    theirs = best(lambda p=path: pa_csv.read_csv(p), runs)
                else:  # pyarrow decompresses a .gz path, as servetune does
                    theirs = best(lambda p=path: pa_json.read_json(p), runs)
                text += (f"; pyarrow (parse only) {stats(theirs)}; "
                         f"ratio {min(ours) / min(theirs):.1f}x")
            rows.append((f"load `{path.name}` ({path.stat().st_size / 2**20:.1f} MiB)", text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--skip-cold", action="store_true", help="no compile runs")
    parser.add_argument("--baseline", type=Path, help="another checkout with a .venv")
    args = parser.parse_args()
    import servetune

    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(servetune.__file__)
                    .parent)], check=True, env=child_env(), stdout=subprocess.DEVNULL)
    rows: list[tuple[str, str]] = []
    started = time.strftime("%Y-%m-%d %H:%M")
    load = os.getloadavg()
    if args.baseline is not None:  # as installed there, too
        subprocess.run([str(args.baseline / ".venv" / "bin" / "python"), "-m", "compileall",
                        "-q", str(args.baseline / "servetune")], check=True, env=child_env(),
                       stdout=subprocess.DEVNULL)
    measure_floor(rows, args.runs)
    measure_help(rows, args.runs, args.baseline)
    measure_first_run(rows, args.runs, args.skip_cold, args.baseline)
    measure_traces(rows, args.runs)
    print(f"{started}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average at start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}, at end "
          f"{os.getloadavg()[0]:.2f}; Python {platform.python_version()}")
    print("\n| measurement | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
