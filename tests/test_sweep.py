"""``servetune sweep``: expansion of a Sweep file (products and listed jobs, names, input
hashes), resumability, failed jobs, one-line errors for bad sweep files, and the same job
files whatever the executor (serial, two processes, Ray)."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from servetune.apps.sweep import (
    EXIT_SOME_FAILED,
    LoadedSweep,
    load_sweep,
    run_sweep,
    summary_csv,
    summary_markdown,
)
from servetune.cli import app
from servetune.errors import ServetuneError
from servetune.executor import ray_available
from servetune.shipped_data import configs_dir

REPO = Path(__file__).resolve().parents[1]
SWEEPS = REPO / "configs" / "sweeps"
CONFIGS = REPO / "configs"
SERVER_SLO = CONFIGS / "slos" / "mlperf-llama-3.1-8b-server.yaml"
CONV = CONFIGS / "workloads" / "azure-conv-2023.yaml"
runner = CliRunner()

# Small jobs: the random baseline, a 100-request sample, a budget of 4 simulations.
FAST = "defaults: {requests: 100, max_simulations: 4, method: random}\n"


def _sweep(folder: Path, body: str, name: str = "s.yaml") -> Path:
    path = folder / name
    path.write_text("apiVersion: servetune/v1\nkind: Sweep\nname: t\n" + body)
    return path


def _inputs(folder: Path) -> None:
    """Two SLO files of the same content and a workload, beside the sweep file."""
    shutil.copy(SERVER_SLO, folder / "slo-a.yaml")
    shutil.copy(SERVER_SLO, folder / "slo-b.yaml")
    shutil.copy(CONV, folder / "conv.yaml")


PRODUCT = FAST + """products:
  - command: optimize
    profiles: [h200-llama-3.1-8b, l40s-llama-3.1-8b]
    workloads: [conv.yaml]
    slos: [slo-a.yaml, slo-b.yaml]
jobs:
  - command: optimize
    profile: h100-80gb-llama-3.1-8b
    workload: conv.yaml
    slo: slo-a.yaml
    seed: 3
"""


def _sweep_cli(*args: str):
    return runner.invoke(app, ["sweep", *args])


def _job_files(out: Path) -> dict[str, bytes]:
    """Every job's files (through the output-set links), by relative name."""
    return {f"{d.name}/{f.name}": f.read_bytes()
            for d in sorted((out / "jobs").iterdir())
            for f in sorted(d.iterdir()) if not f.name.startswith(".") and f.name != "current"}


def _summary(out: Path) -> list[dict[str, str]]:
    with open(out / "summary.csv", newline="") as fh:
        return list(csv.DictReader(fh))


# ------------------------------------------------------------------------ expansion


def test_a_product_expands_in_axis_order_then_the_listed_jobs(tmp_path):
    _inputs(tmp_path)
    loaded = load_sweep(_sweep(tmp_path, PRODUCT))
    assert [j.name for j in loaded.jobs] == [
        # every axis the product declares, even one of one value
        "optimize__h200-llama-3.1-8b__conv__slo-a", "optimize__h200-llama-3.1-8b__conv__slo-b",
        "optimize__l40s-llama-3.1-8b__conv__slo-a", "optimize__l40s-llama-3.1-8b__conv__slo-b",
        # a listed job without a name: every setting it shows
        "optimize__h100-80gb-llama-3.1-8b__conv__slo-a__seed3__random",
    ]
    first = loaded.jobs[0]
    assert first.command == "optimize"
    assert first.settings["requests"] == 100 and first.settings["method"] == "random"
    assert Path(first.settings["slo"]) == (tmp_path / "slo-a.yaml").resolve()
    assert first.labels == {"profile": "h200-llama-3.1-8b", "workload": "conv",
                            "slo": "slo-a", "method": "random"}
    assert set(first.inputs) == {"profile", "workload", "slo"}
    assert len({j.input_hash for j in loaded.jobs}) == 5


def test_hashes_are_stable_and_follow_the_input_bytes(tmp_path):
    _inputs(tmp_path)
    path = _sweep(tmp_path, PRODUCT)
    before = {j.name: j.input_hash for j in load_sweep(path).jobs}
    assert before == {j.name: j.input_hash for j in load_sweep(path).jobs}
    # the same files elsewhere: the same hashes (a moved sweep keeps its results)
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path, moved, ignore=shutil.ignore_patterns("moved"))
    assert before == {j.name: j.input_hash for j in load_sweep(moved / "s.yaml").jobs}
    # one input's bytes change: exactly the jobs that read it get a new hash
    with open(tmp_path / "slo-b.yaml", "a") as fh:
        fh.write("# edited\n")
    after = {j.name: j.input_hash for j in load_sweep(path).jobs}
    changed = sorted(n for n in before if before[n] != after[n])
    assert changed == ["optimize__h200-llama-3.1-8b__conv__slo-b",
                       "optimize__l40s-llama-3.1-8b__conv__slo-b"]


def test_a_setting_changes_the_hash_and_defaults_yield_to_the_job(tmp_path):
    _inputs(tmp_path)
    one = load_sweep(_sweep(tmp_path, PRODUCT)).jobs[-1]
    two = load_sweep(_sweep(tmp_path, PRODUCT.replace("seed: 3", "seed: 3\n    requests: 200"),
                            "t.yaml")).jobs[-1]
    assert one.name == two.name
    assert two.settings["requests"] == 200 and one.settings["requests"] == 100
    assert one.input_hash != two.input_hash


def test_plan_jobs_hash_the_fleets_profiles(tmp_path):
    fleet = CONFIGS / "fleets" / "cloud-4types.yaml"
    body = f"""products:
  - command: plan
    workload: {CONV}
    forecast: {CONFIGS / 'forecasts' / 'azure-conv-peak-100.yaml'}
    fleets: [{fleet}]
    slo: {SERVER_SLO}
    growth: [1, 1.5]
"""
    jobs = load_sweep(_sweep(tmp_path, body)).jobs
    assert [j.name for j in jobs] == ["plan__cloud-4types__x1", "plan__cloud-4types__x1.5"]
    assert any(k.startswith("fleet profile ") for k in jobs[0].inputs)
    assert jobs[1].settings["growth"] == 1.5


@pytest.mark.parametrize("sweep", sorted(SWEEPS.glob("*.yaml")), ids=lambda p: p.name)
def test_the_shipped_sweeps_expand(sweep):
    loaded = load_sweep(sweep)
    assert loaded.jobs and len({j.name for j in loaded.jobs}) == len(loaded.jobs)
    assert (configs_dir() / "sweeps" / sweep.name).is_file()  # shipped as package data


def test_the_shipped_sweep_covers_the_shipped_8b_profiles_azure_workloads_and_slos():
    loaded = load_sweep(SWEEPS / "shipped.yaml")
    used = {Path(j.settings[k]).name for j in loaded.jobs for k in ("profile", "workload", "slo")}
    assert {p.name for p in (REPO / "gpu_profiles").glob("*llama-3.1-8b.yaml")} <= used
    assert {p.name for p in (CONFIGS / "workloads").glob("azure-*.yaml")} <= used
    # the MLPerf sets; the tiers-* sets judge classes (chat, longctx, ...) these lack
    assert {p.name for p in (CONFIGS / "slos").glob("mlperf-*.yaml")} <= used
    assert len(loaded.jobs) == 15


# ------------------------------------------------------------------- bad sweep files

HEAD = "products:\n  - command: optimize\n"
BAD = [
    ("unknown key", FAST + HEAD + "    profiles: [h200-llama-3.1-8b]\n    colour: red\n",
     "products.0.colour: unknown key"),
    ("axis and fixed", FAST + HEAD + "    profiles: [h200-llama-3.1-8b]\n"
     "    profile: h200-llama-3.1-8b\n", "give profile (one value) or profiles"),
    ("not taken", FAST + HEAD + "    profile: h200-llama-3.1-8b\n    workload: conv.yaml\n"
     "    slo: slo-a.yaml\n    forecasts: [x.yaml]\n",
     "products.0.forecasts: optimize does not take this setting"),
    ("missing setting", HEAD + "    profile: h200-llama-3.1-8b\n    slo: slo-a.yaml\n",
     "products.0: optimize needs exactly one of workload or trace"),
    ("missing file", HEAD + "    profile: h200-llama-3.1-8b\n    slo: slo-a.yaml\n"
     "    workloads: [conv.yaml, nope.yaml]\n", "products.0.workloads.1: nope.yaml: no such file"),
    ("unknown profile", HEAD + "    profile: no-such-gpu\n    slo: slo-a.yaml\n"
     "    workload: conv.yaml\n", "products.0.profile: no-such-gpu: no such file"),
    ("same name twice", "jobs:\n" + 2 * ("  - command: optimize\n    name: a\n"
                                         "    profile: h200-llama-3.1-8b\n    slo: slo-a.yaml\n"
                                         "    workload: conv.yaml\n"), "both named 'a'"),
    ("no jobs", "defaults: {seed: 1}\n", "give at least one job"),
    ("bad number", FAST + HEAD + "    profile: h200-llama-3.1-8b\n    slo: slo-a.yaml\n"
     "    workload: conv.yaml\n    seeds: [1, -2]\n", "seeds: give seeds >= 0"),
    ("empty axis", HEAD + "    profiles: []\n", "products.0.profiles"),
    ("bad command", "jobs:\n  - command: simulate\n", "jobs.0.command"),
]


@pytest.mark.parametrize(("body", "said"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_sweep_file_is_one_line_naming_the_file_and_field(tmp_path, body, said):
    _inputs(tmp_path)
    path = _sweep(tmp_path, body)
    out = tmp_path / "out"
    result = _sweep_cli(str(path), "--out-dir", str(out))
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0].startswith(f"servetune: error: {path}: ") and said in lines[0], lines[0]
    assert not out.exists()


def test_a_missing_sweep_file_is_one_line(tmp_path):
    result = _sweep_cli(str(tmp_path / "none.yaml"), "--out-dir", str(tmp_path / "o"))
    assert result.exit_code == 2 and "none.yaml" in result.stderr
    with pytest.raises(ServetuneError, match="kind: expected 'Sweep'"):
        load_sweep(REPO / "configs" / "jobs" / "quickstart.yaml")


# ---------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def two_job(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("two")
    _inputs(folder)
    return _sweep(folder, FAST + """products:
  - command: optimize
    profile: h200-llama-3.1-8b
    workload: conv.yaml
    slos: [slo-a.yaml, slo-b.yaml]
""")


def test_a_second_run_skips_every_job_and_an_edited_input_reruns_only_its_job(two_job,
                                                                            tmp_path):
    folder = tmp_path / "in"
    shutil.copytree(two_job.parent, folder)
    sweep, out = folder / "s.yaml", tmp_path / "out"
    first = _sweep_cli(str(sweep), "--out-dir", str(out))
    assert first.exit_code == 0, first.output
    assert [r["status"] for r in _summary(out)] == ["done", "done"]
    assert all(r["wall_s"] for r in _summary(out))
    files = _job_files(out)
    assert set(files) == {f"optimize__slo-{x}/{f}" for x in "ab"
                          for f in ("policy.yaml", "result.json")}
    result = json.loads(files["optimize__slo-a/result.json"])
    assert result["status"] == "done" and result["input_hash"]
    assert result["numbers"]["goodput_rate_per_s"] > 0
    assert "wall_s" not in json.dumps(result)  # wall times go to the summary only

    again = _sweep_cli(str(sweep), "--out-dir", str(out))
    assert again.exit_code == 0
    assert [r["status"] for r in _summary(out)] == ["cached", "cached"]
    assert "cached (input unchanged)" in again.stderr
    assert _job_files(out) == files
    assert [p.name for p in (out / "jobs" / "optimize__slo-a" / ".generations").iterdir()] \
        == ["000001"]  # nothing rewritten

    with open(folder / "slo-b.yaml", "a") as fh:
        fh.write("# edited: the same SLOs, other bytes\n")
    third = _sweep_cli(str(sweep), "--out-dir", str(out), "--json")
    assert third.exit_code == 0
    report = json.loads(third.stdout)
    assert [j["status"] for j in report["jobs"]] == ["cached", "done"]
    assert report["counts"] == {"done": 1, "cached": 1, "failed": 0, "not run": 0}
    assert sorted(p.name for p in (out / "jobs" / "optimize__slo-b" / ".generations").iterdir()
                  ) == ["000001", "000002"]


def test_a_failing_job_is_recorded_and_the_others_run(two_job, tmp_path):
    folder = tmp_path / "in"
    shutil.copytree(two_job.parent, folder)
    (folder / "slo-b.yaml").write_text("apiVersion: servetune/v1\nkind: SLOSet\nname: x\n"
                                       "targets: nonsense\n")
    out = tmp_path / "out"
    result = _sweep_cli(str(folder / "s.yaml"), "--out-dir", str(out), "-q")
    assert result.exit_code == EXIT_SOME_FAILED, result.output
    assert result.stderr == ""  # -q: no progress lines, no notes
    rows = _summary(out)
    assert [r["status"] for r in rows] == ["done", "failed"]
    assert "slo-b.yaml" in rows[1]["error"] and "\n" not in rows[1]["error"]
    failed = json.loads((out / "jobs" / "optimize__slo-b" / "result.json").read_text())
    assert failed["status"] == "failed" and failed["error"] == rows[1]["error"]
    assert not (out / "jobs" / "optimize__slo-b" / "policy.yaml").exists()
    assert "1 failed" in (out / "summary.md").read_text()
    # a failed job is tried again; the done one is not
    again = _sweep_cli(str(folder / "s.yaml"), "--out-dir", str(out), "-q")
    assert again.exit_code == EXIT_SOME_FAILED
    assert [r["status"] for r in _summary(out)] == ["cached", "failed"]


class _InterruptedAfterOne:
    """An executor on which Ctrl-C arrives after the first job finished."""

    name, workers = "test", 1

    def map(self, fn, items, *, shared, each):
        each(0, fn(shared, items[0]))
        raise KeyboardInterrupt


def test_ctrl_c_keeps_the_finished_jobs_and_a_rerun_resumes(two_job, tmp_path):
    out = tmp_path / "out"
    loaded = load_sweep(two_job)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(loaded, out, executor=_InterruptedAfterOne())
    assert [r["status"] for r in _summary(out)] == ["done", "not run"]
    assert (out / "jobs" / "optimize__slo-a" / "policy.yaml").is_file()
    assert not (out / "jobs" / "optimize__slo-b").exists()
    assert not (out / ".lock").exists()
    run = run_sweep(loaded, out)
    assert [r["status"] for r in run.rows] == ["cached", "done"] and run.exit_code == 0


def test_serial_and_two_workers_write_the_same_files(tmp_path):
    serial, parallel = tmp_path / "serial", tmp_path / "parallel"
    smoke = str(SWEEPS / "smoke.yaml")
    one = _sweep_cli(smoke, "--out-dir", str(serial), "--workers", "1")
    two = _sweep_cli(smoke, "--out-dir", str(parallel), "--workers", "2")
    assert one.exit_code == 0 and two.exit_code == 0, two.output
    assert _job_files(serial) == _job_files(parallel)
    assert _summary_wo_wall(serial) == _summary_wo_wall(parallel)
    # one progress line per job, in job order, whatever finished first
    progress = [line for line in two.stderr.splitlines() if "] " in line]
    assert [line.split("]")[0].split("[")[1] for line in progress] == ["1/3", "2/3", "3/3"]


def _summary_wo_wall(out: Path) -> list[dict[str, str]]:
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in _summary(out)]


@pytest.mark.skipif(not ray_available(), reason="ray is not installed (pip install "
                    "'servetune[ray]')")
def test_ray_writes_the_same_files_as_serial(two_job, tmp_path):
    serial, on_ray = tmp_path / "serial", tmp_path / "ray"
    assert _sweep_cli(str(two_job), "--out-dir", str(serial), "-q").exit_code == 0
    result = runner.invoke(app, ["sweep", str(two_job), "--out-dir", str(on_ray), "-q",
                                 "--ray", "local", "--workers", "2"])
    assert result.exit_code == 0, result.output
    assert _job_files(serial) == _job_files(on_ray)
    assert _summary_wo_wall(serial) == _summary_wo_wall(on_ray)


def test_the_summary_tables(tmp_path):
    _inputs(tmp_path)
    loaded: LoadedSweep = load_sweep(_sweep(tmp_path, PRODUCT))
    rows = [{"job": j.name, "command": j.command, **j.labels, "status": "done", "error": "",
             "goodput_req_s": 1.0 / 3, "daily_usd": None, "simulations": 7, "wall_s": 1.25,
             "input_hash": j.input_hash[:16]} for j in loaded.jobs[:2]]
    rows[1].update(status="failed", error="a | b")
    text = summary_csv(rows)
    assert text.splitlines()[0] == ("job,command,profile,workload,slo,method,status,error,"
                                    "goodput_req_s,daily_usd,simulations,wall_s,input_hash")
    assert ",done,,0.333333,,7,1.25," in text.splitlines()[1]
    md = summary_markdown("t", rows)
    assert "2 jobs: 1 done, 1 failed." in md and "a \\| b" in md


def test_the_parquet_summary_holds_the_csv_rows(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet", reason="pyarrow is optional (pip install pyarrow)")
    from servetune.apps.sweep import write_summary

    rows = [{"job": "a", "command": "optimize", "profile": "p", "status": "done", "error": "",
             "goodput_req_s": 2.5, "daily_usd": None, "simulations": 7, "wall_s": 1.0,
             "input_hash": "ab"},
            {"job": "b", "command": "plan", "fleet": "f", "status": "failed", "error": "x",
             "goodput_req_s": None, "daily_usd": 10.0, "simulations": None, "wall_s": None,
             "input_hash": "cd"}]
    files, notes = write_summary(tmp_path, "t", rows)
    assert notes == [] and tmp_path / "summary.parquet" in files
    table = pq.read_table(tmp_path / "summary.parquet").to_pydict()
    assert table["job"] == ["a", "b"] and table["profile"] == ["p", None]
    assert table["goodput_req_s"] == [2.5, None] and table["simulations"] == [7, None]
    assert list(table) == next(csv.reader(open(tmp_path / "summary.csv")))
