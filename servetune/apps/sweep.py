"""``servetune sweep``: many optimize / nightly / plan jobs on one executor, resumable.

:func:`load_sweep` reads a :class:`~servetune.schemas.sweep.Sweep` file and expands it
into :class:`Job` s: every combination of a product's axes, then the listed jobs, each
with its settings (defaults, then the product's or job's own), its input files resolved
against the sweep file, a stable name (the command and the values of the axes it varies,
or the ``name`` a listed job gives) and an input hash (:func:`input_hash`: the servetune
version, the command, its settings and every input file's name and bytes, a plan's fleet's
profile files included).

:func:`run_sweep` skips the jobs whose ``DIR/jobs/<name>/result.json`` says ``done`` with
the same input hash (a finished job is never rerun; a changed input reruns its job; a
failed job is tried again), runs the rest on the executor, one task per job
(:func:`run_job`, which calls the pipeline the command's CLI calls, in the worker), and
commits each job's files as it finishes, in job order (``DIR/jobs/<name>/``: an output
set, :func:`servetune.io.commit_files`): its policy.yaml (optimize), plan.yaml (plan) or
nightly's set, and result.json (status, error, input hash, inputs and the summary without
wall times). Then the summary over all jobs: ``summary.csv``, ``summary.md`` and
``summary.parquet`` (when pyarrow is installed). Wall times go to the summary only.

A job that fails (a bad input, no feasible policy) is recorded as failed with its one-line
error; the others run. The jobs' files are the same, byte for byte, whatever the executor.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from servetune import __version__
from servetune.errors import InfeasibleError, ServetuneError
from servetune.executor import Executor, SerialExecutor
from servetune.io import (
    check_out_dir,
    check_output_set_folder,
    commit_files,
    drop_timings,
    output_folder_lock,
    require_file,
    sha256_file,
    sha256_json,
    write_bytes_atomic,
)
from servetune.schemas.base import document_to_yaml, load_document
from servetune.schemas.fleet import Fleet
from servetune.schemas.sweep import (
    AXES,
    COMMAND_SETTINGS,
    FILE_SETTINGS,
    Sweep,
    SweepDefaults,
    SweepJob,
)

# Exit code of a sweep in which at least one job failed (the others' outputs and the
# summary are written; the summary's status column says which failed and why).
EXIT_SOME_FAILED = 12
JOBS = "jobs"
RESULT = "result.json"
DONE, CACHED, FAILED, NOT_RUN = "done", "cached", "failed", "not run"
PARQUET_MISSING = "summary.parquet not written: pyarrow is not installed (pip install pyarrow)"

# The settings a job's name and the summary's columns show, in this order.
LABELLED = tuple(dict.fromkeys([*FILE_SETTINGS, *AXES.values()]))
AXIS_OF = {setting: axis for axis, setting in AXES.items()}
_FILE_SUFFIXES = (".yaml", ".yml", ".csv", ".jsonl", ".json", ".txt")
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")

Progress = Callable[[str], Any]
# The sweep setting that feeds each library argument a job's error may name (as
# ``argument `name```), so that the error speaks of the sweep file's fields.
SETTING_OF = {"n_requests": "requests", "engines": "gate_engines", "sim_engine": "engine",
              "fmt": "trace_format", "space_path": "space", "trace_path": "trace",
              "current_path": "current", "profile_path": "profile", "slo_path": "slo"}


@dataclass(frozen=True)
class Job:
    """One expanded job: what :func:`run_job` needs, and what its summary row shows."""

    name: str
    command: str
    settings: dict[str, Any]  # input files as absolute paths
    labels: dict[str, str]  # setting -> its short value (name and summary columns)
    inputs: dict[str, dict[str, str]]  # input -> {"file": name, "sha256": hex}
    input_hash: str


@dataclass(frozen=True)
class LoadedSweep:
    path: Path
    doc: Sweep
    jobs: list[Job]


# ---------------------------------------------------------------------- expansion


# A sweep expands to at most this many jobs (each is a whole optimize, nightly or plan).
MAX_SWEEP_JOBS = 10_000


def load_sweep(path: str | Path) -> LoadedSweep:
    """Read and expand a sweep file; every error is one line naming the file and field."""
    src = Path(path)
    require_file(src, "given as SWEEP")
    doc = load_document(src, Sweep)
    base = src.resolve().parent
    # each input file hashed once, however many jobs read it (a trace may be gigabytes)
    hashes: dict[Path, str] = {}
    jobs: list[Job] = []
    total = sum(math.prod(len(vs) for vs in prod.axes().values()) for prod in doc.products)
    total += len(doc.jobs)
    if total > MAX_SWEEP_JOBS:
        raise ServetuneError(
            f"{src}: expands to {total:,} jobs, more than {MAX_SWEEP_JOBS:,}; split it into "
            "several sweeps or give fewer values per axis")
    for i, prod in enumerate(doc.products):
        where = f"products.{i}"
        fixed = {k: (v, f"{where}.{k}") for k, v in prod.fixed().items()}
        axes = prod.axes()
        _check_takes(src, where, prod.command,
                     {**{k: k for k in fixed}, **{k: AXIS_OF[k] for k in axes}})
        for combo in itertools.product(*(list(enumerate(vs)) for vs in axes.values())):
            given = dict(fixed)
            for setting, (k, value) in zip(axes, combo, strict=True):
                given[setting] = (value, f"{where}.{AXIS_OF[setting]}.{k}")
            jobs.append(_job(src, base, doc.defaults, where, prod.command, given, None,
                             list(axes), hashes))
    for i, job in enumerate(doc.jobs):
        where = f"jobs.{i}"
        given = {k: (getattr(job, k), f"{where}.{k}") for k in SweepJob.model_fields
                 if k not in ("command", "name") and getattr(job, k) is not None}
        _check_takes(src, where, job.command, {k: k for k in given})
        jobs.append(_job(src, base, doc.defaults, where, job.command, given, job.name, None,
                         hashes))
    seen: dict[str, int] = {}
    for k, job in enumerate(jobs):
        if job.name in seen:
            raise ServetuneError(
                f"{src}: jobs {seen[job.name] + 1} and {k + 1} of the expansion are both named "
                f"{job.name!r}; give a listed job its own name:, or drop the repeat")
        seen[job.name] = k
    return LoadedSweep(src, doc, jobs)


def _check_takes(src: Path, where: str, command: str, given: dict[str, str]) -> None:
    """Each setting given (setting -> the field that gives it) is one ``command`` takes."""
    spec = COMMAND_SETTINGS[command]
    for setting, field_name in given.items():
        if not spec.takes(setting):
            raise ServetuneError(f"{src}: {where}.{field_name}: {command} does not take this "
                                 "setting; remove it")


def _job(src: Path, base: Path, defaults: SweepDefaults, where: str, command: str,
         given: dict[str, tuple[Any, str]], name: str | None, varied: list[str] | None,
         hashes: dict[Path, str]) -> Job:
    spec = COMMAND_SETTINGS[command]
    settings = {k: (getattr(defaults, k), f"defaults.{k}") for k in SweepDefaults.model_fields
                if getattr(defaults, k) is not None and spec.takes(k)}
    settings.update(given)
    for need in spec.required:
        options = (need,) if isinstance(need, str) else need
        present = [o for o in options if o in settings]
        if len(present) != 1:
            what = need if isinstance(need, str) else "exactly one of " + " or ".join(options)
            how = "give it" if not present else "give only one"
            raise ServetuneError(f"{src}: {where}: {command} needs {what}; {how} (in the job, "
                                 "as a product axis, or in defaults)")
    resolved: dict[str, Any] = {}
    inputs: dict[str, dict[str, str]] = {}
    for key in sorted(settings, key=_setting_order):
        value, loc = settings[key]
        if key in FILE_SETTINGS:
            path = _input_file(src, base, key, value, loc)
            resolved[key] = str(path)
            if path not in hashes:
                hashes[path] = sha256_file(path)
            inputs[key] = {"file": path.name, "sha256": hashes[path]}
        else:
            resolved[key] = value
    if command == "plan":
        inputs.update(_fleet_profiles(Path(resolved["fleet"])))
    labels = {k: _label(k, settings[k][0]) for k in LABELLED if k in settings}
    shown = varied if varied is not None else list(labels)
    job_name = _safe_name(name or "__".join([command, *(labels[k] for k in shown)]))
    return Job(job_name, command, resolved, labels, inputs,
               input_hash(command, resolved, inputs))


def _setting_order(key: str) -> int:
    fields = list(SweepJob.model_fields)
    return fields.index(key) if key in fields else len(fields)


def input_hash(command: str, settings: dict[str, Any], inputs: dict[str, dict[str, str]]
               ) -> str:
    """The hash that decides whether a finished job is current: the servetune version,
    the command, its settings other than file paths, and each input file's name and
    bytes (so a moved sweep keeps its results, and an edited input reruns its jobs)."""
    plain = {k: v for k, v in settings.items() if k not in FILE_SETTINGS}
    return sha256_json({"servetune": __version__, "command": command, "settings": plain,
                        "inputs": inputs})


def _input_file(src: Path, base: Path, key: str, value: str, loc: str) -> Path:
    p = Path(value)
    p = p if p.is_absolute() else base / p
    if key == "profile" and not p.exists():
        # lazy: the profile schemas are not needed by a sweep without profiles
        from servetune.profiles.shipped import shipped_or_path

        shipped = Path(shipped_or_path(value))
        p = shipped if shipped.is_file() else p
    if not p.is_file():
        also = " or a shipped profile's name" if key == "profile" else ""
        raise ServetuneError(f"{src}: {loc}: {value}: no such file (give a path relative to "
                             f"the sweep file{also})")
    return p.resolve()


def _fleet_profiles(fleet_path: Path) -> dict[str, dict[str, str]]:
    """The profile files a fleet names, for every model (their bytes decide a plan too). A
    fleet that does not load adds none here: the job fails on it when it runs, with the
    fleet's error."""

    try:
        fleet = load_document(fleet_path, Fleet)
    except ServetuneError:
        return {}
    out = {}
    for g in fleet.gpu_types:
        raws = [g.profile] if g.profile is not None else list((g.profiles or {}).values())
        for raw in raws:
            p = Path(raw)
            p = p if p.is_absolute() else fleet_path.parent / p
            if p.is_file():
                out[f"fleet profile {raw}"] = {"file": p.name, "sha256": sha256_file(p)}
    return out


def _label(key: str, value: Any) -> str:
    if key in FILE_SETTINGS:
        text = Path(str(value)).name
        for suffix in _FILE_SUFFIXES:
            if text.endswith(suffix):
                return text[: -len(suffix)]
        return text
    if key == "growth":
        return f"x{value:g}"
    if key == "seed":
        return f"seed{value}"
    return str(value)


def _safe_name(text: str) -> str:
    """A job name usable as one folder name anywhere."""
    return _UNSAFE.sub("-", text).lstrip(".-") or "job"


# ------------------------------------------------------------------------ one job


@dataclass(frozen=True)
class JobResult:
    """What a worker sends back: the job's files (result.json last) and its numbers."""

    name: str
    status: str  # done | failed
    error: str
    numbers: dict[str, Any]
    files: tuple[tuple[str, bytes], ...]
    wall_s: float


@dataclass
class _Output:
    files: list[tuple[str, bytes]]
    numbers: dict[str, Any]
    summary: dict[str, Any]
    failure: str = ""  # a job that ran but did not succeed (nightly's infeasible run)
    exit_code: int = 0


def _path(settings: dict[str, Any], key: str) -> Path | None:
    return Path(settings[key]) if settings.get(key) is not None else None


def _run_optimize(job: Job, jobs_dir: Path) -> _Output:
    # lazy: the optimizer imports pyomo and OR-Tools
    from servetune.apps.optimize import optimize_files
    from servetune.optimize_options import (
        DEFAULT_MAX_SIMULATIONS,
        DEFAULT_REQUESTS,
        DEFAULT_TIME_LIMIT_S,
    )
    from servetune.solvers.drivers import preload_cpsat

    preload_cpsat()
    s = job.settings
    result = optimize_files(
        trace=_path(s, "trace"), workload=_path(s, "workload"), profile=s["profile"],
        slo=Path(s["slo"]), space=_path(s, "space"), trace_format=s.get("trace_format"),
        method=s.get("method") or "milp",
        time_limit_s=s.get("time_limit_s") or DEFAULT_TIME_LIMIT_S,
        max_simulations=s.get("max_simulations") or DEFAULT_MAX_SIMULATIONS,
        seed=s.get("seed") or 0, n_requests=s.get("requests") or DEFAULT_REQUESTS,
        engine=s.get("engine") or "vllm",
    )
    summary = drop_timings(result.summary)
    return _Output([("policy.yaml", result.policy_yaml.encode())],
                   _optimize_numbers(summary), summary)


def _optimize_numbers(summary: dict[str, Any]) -> dict[str, Any]:
    return {"goodput_rate_per_s": summary.get("goodput_rate_per_s"),
            "simulations": summary.get("simulations")}


def _run_nightly(job: Job, jobs_dir: Path) -> _Output:
    # lazy: a sweep loads the pipelines of the kinds of job it holds, no others
    from servetune.apps.nightly import run_nightly

    s = job.settings
    with tempfile.TemporaryDirectory(prefix="servetune-sweep-") as tmp:
        outcome = run_nightly(
            s["trace"], s["profile"], s["slo"], s["current"], tmp,
            engines=s.get("gate_engines") or ("vllm", "sglang"),
            min_gain=0.02 if s.get("min_gain") is None else s["min_gain"],
            space_path=s.get("space"), time_limit_s=s.get("time_limit_s"),
            max_simulations=s.get("max_simulations"), seed=s.get("seed") or 0,
            sim_engine=s.get("engine") or "vllm",
            trace_read={"fmt": s.get("trace_format")},
        )
        files = [(p.name, p.read_bytes()) for p in outcome.files]
    summary = drop_timings(outcome.summary)
    gates = summary.get("gates") or []
    new = gates[0].get("goodput_rate_per_s", {}).get("new") if gates else None
    numbers = {"goodput_rate_per_s": new, "verdict": outcome.status,
               "nightly_exit_code": outcome.exit_code}
    failure = "" if outcome.exit_code != InfeasibleError.exit_code else (
        summary.get("verdict") or "no policy in the search space meets the SLOs")
    return _Output(files, numbers, summary, failure, outcome.exit_code)


def _run_plan(job: Job, jobs_dir: Path) -> _Output:
    from servetune.apps.plan import parse_topologies, run_plan  # lazy: as _run_nightly

    s = job.settings
    extra: dict[str, Any] = {}
    if s.get("topologies") is not None:
        extra["topologies"] = parse_topologies(s["topologies"])
    run = run_plan(
        Path(s["workload"]), Path(s["forecast"]), Path(s["fleet"]), Path(s["slo"]),
        # the plan records its inputs relative to where it is read: the job's folder
        out_path=jobs_dir / job.name / "plan.yaml", growth=s.get("growth") or 1.0,
        engine=s.get("engine") or "vllm", method=s.get("capacity_method") or "auto",
        budget=s.get("budget"), model=s.get("model"), seed=s.get("seed") or 0, **extra,
    )
    cost = run.plan.cost
    return _Output([("plan.yaml", document_to_yaml(run.plan).encode())],
                   {"daily_usd": cost.get("daily_usd")}, {"cost": cost})


_RUNNERS: dict[str, Callable[[Job, Path], _Output]] = {
    "optimize": _run_optimize, "nightly": _run_nightly, "plan": _run_plan,
}


def run_job(jobs_dir: Path, job: Job) -> JobResult:
    """Run one job in this process (an executor's task): its files and numbers, or, when
    it fails, its one-line error. ``jobs_dir`` is where its folder will be (a plan records
    its inputs relative to it); nothing is written here."""
    start = time.perf_counter()
    try:
        out = _RUNNERS[job.command](job, jobs_dir)
    except ServetuneError as err:
        summary = err.details.get("summary", {}) if isinstance(err, InfeasibleError) else {}
        numbers = _optimize_numbers(summary) if job.command == "optimize" else {}
        out = _Output([], numbers, drop_timings(summary), err.message_for(SETTING_OF),
                      err.exit_code)
    except Exception as exc:  # noqa: BLE001 - one job's bug must not cost the others
        text = " ".join(str(exc).split())
        out = _Output([], {}, {}, f"internal error ({type(exc).__name__}): {text}", 1)
    status = FAILED if out.failure else DONE
    result = {
        "name": job.name, "command": job.command, "status": status, "error": out.failure,
        "exit_code": out.exit_code, "input_hash": job.input_hash, "servetune": __version__,
        "inputs": job.inputs,
        "settings": {k: v for k, v in job.settings.items() if k not in FILE_SETTINGS},
        "numbers": out.numbers, "summary": out.summary,
    }
    text = json.dumps(result, indent=2, default=str) + "\n"
    files = (*out.files, (RESULT, text.encode()))
    return JobResult(job.name, status, out.failure, out.numbers, files,
                     time.perf_counter() - start)


# ------------------------------------------------------------------------ the sweep


@dataclass
class SweepRun:
    rows: list[dict[str, Any]]
    exit_code: int
    files: list[Path]
    notes: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out = {DONE: 0, CACHED: 0, FAILED: 0, NOT_RUN: 0}
        for row in self.rows:
            out[row["status"]] += 1
        return out


def check_out(out_dir: Path, sweep: LoadedSweep) -> None:
    """Fail before any work when ``out_dir`` or a job's folder cannot take the outputs."""
    check_out_dir(out_dir, "--out-dir")
    for job in sweep.jobs:
        check_output_set_folder(out_dir / JOBS / job.name, ["*"], "--out-dir")


def cached_result(out_dir: Path, job: Job) -> dict[str, Any] | None:
    """The job's result.json when it is done with the same input hash, else None."""
    try:
        data = json.loads((out_dir / JOBS / job.name / RESULT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and data.get("status") == DONE \
        and data.get("input_hash") == job.input_hash
    return data if ok else None


def run_sweep(sweep: LoadedSweep, out_dir: str | Path, *, executor: Executor | None = None,
              progress: Progress | None = None) -> SweepRun:
    """Run the sweep's jobs that are not done yet into ``out_dir`` and write the summary
    (module docstring). Ctrl-C keeps the jobs finished so far (and writes the summary)."""
    out = Path(out_dir)
    check_out(out, sweep)
    ex = executor or SerialExecutor()
    say = progress or (lambda _msg: None)
    total = len(sweep.jobs)
    position = {job.name: k + 1 for k, job in enumerate(sweep.jobs)}
    rows: dict[str, dict[str, Any]] = {}
    with output_folder_lock(out):
        todo = []
        for job in sweep.jobs:
            cached = cached_result(out, job)
            if cached is None:
                todo.append(job)
                continue
            rows[job.name] = _row(job, CACHED, "", cached.get("numbers") or {}, None)
            say(f"[{position[job.name]}/{total}] {job.name}: cached (input unchanged)")
        if todo:
            say(f"{len(todo)} of {total} jobs to run on {ex.name} ({ex.workers} worker"
                f"{'s' if ex.workers != 1 else ''})")

        def each(i: int, res: JobResult) -> None:
            job = todo[i]
            commit_files(out / JOBS / job.name, list(res.files), owned=["*"])
            rows[job.name] = _row(job, res.status, res.error, res.numbers, res.wall_s)
            say(f"[{position[job.name]}/{total}] {job.name}: {_row_text(rows[job.name])}")

        try:
            ex.map(run_job, todo, shared=(out / JOBS).resolve(), each=each)
        finally:  # also on Ctrl-C: the summary of what is finished
            all_rows = [rows.get(j.name) or _row(j, NOT_RUN, "", {}, None)
                        for j in sweep.jobs]
            files, notes = write_summary(out, sweep.doc.name, all_rows)
    failed = any(r["status"] == FAILED for r in all_rows)
    return SweepRun(all_rows, EXIT_SOME_FAILED if failed else 0, files, notes)


# ----------------------------------------------------------------------- the summary

NUMBER_COLUMNS = ("goodput_req_s", "daily_usd", "simulations", "wall_s")


def _row(job: Job, status: str, error: str, numbers: dict[str, Any],
         wall_s: float | None) -> dict[str, Any]:
    return {"job": job.name, "command": job.command, **job.labels, "status": status,
            "error": error, "goodput_req_s": numbers.get("goodput_rate_per_s"),
            "daily_usd": numbers.get("daily_usd"), "simulations": numbers.get("simulations"),
            "wall_s": None if wall_s is None else round(wall_s, 2),
            "input_hash": job.input_hash[:16]}


def _row_text(row: dict[str, Any]) -> str:
    if row["status"] == FAILED:
        return f"FAILED: {row['error']}"
    parts = [row["status"]]
    if row["goodput_req_s"] is not None:
        parts.append(f"goodput {row['goodput_req_s']:.2f} req/s")
    if row["daily_usd"] is not None:
        parts.append(f"${row['daily_usd']:,.2f}/day")
    if row["simulations"] is not None:
        parts.append(f"{row['simulations']} simulations")
    if row["wall_s"] is not None:
        parts.append(f"{row['wall_s']:.1f} s")
    return ", ".join(parts)


def summary_columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    """job, command, the settings any job shows (in :data:`LABELLED` order), status,
    error, the numbers, the input hash."""
    labelled = [k for k in LABELLED if any(k in r for r in rows)]
    return ["job", "command", *labelled, "status", "error", *NUMBER_COLUMNS, "input_hash"]


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def summary_csv(rows: Sequence[dict[str, Any]]) -> str:
    cols = summary_columns(rows)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(cols)
    for r in rows:
        writer.writerow([_cell(r.get(c)) for c in cols])
    return buf.getvalue()


def summary_markdown(name: str, rows: Sequence[dict[str, Any]]) -> str:
    cols = summary_columns(rows)
    counts = {s: sum(r["status"] == s for r in rows) for s in (DONE, CACHED, FAILED, NOT_RUN)}
    said = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    lines = [f"# Sweep {name}", "", f"{len(rows)} jobs: {said}.", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [_cell(r.get(c)).replace("|", "\\|") for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def summary_parquet(rows: Sequence[dict[str, Any]]) -> bytes | None:
    """The summary as Parquet bytes, or None without pyarrow (an optional dependency)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return None
    cols = summary_columns(rows)
    types = {"goodput_req_s": pa.float64(), "daily_usd": pa.float64(),
             "simulations": pa.int64(), "wall_s": pa.float64()}
    table = pa.table({c: pa.array([r.get(c) for r in rows], type=types.get(c, pa.string()))
                      for c in cols})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()


def write_summary(out: Path, name: str, rows: Sequence[dict[str, Any]]
                  ) -> tuple[list[Path], list[str]]:
    """summary.csv, summary.md and (with pyarrow) summary.parquet in ``out``; returns the
    files written and the notes (a stale summary.parquet is removed without pyarrow)."""
    written = []
    notes = []
    for fname, data in (("summary.csv", summary_csv(rows).encode()),
                        ("summary.md", summary_markdown(name, rows).encode()),
                        ("summary.parquet", summary_parquet(rows))):
        path = out / fname
        if data is None:
            path.unlink(missing_ok=True)  # an older run's would not match this summary
            notes.append(PARQUET_MISSING)
            continue
        write_bytes_atomic(path, data)
        written.append(path)
    return written, notes
