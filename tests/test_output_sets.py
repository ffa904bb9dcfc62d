"""Output folders committed as one set (servetune.io.commit_files): a new generation
folder, one rename of ``current``, a lock per folder.

The oracle everywhere: whatever happens to a run (an interrupt, a SIGKILL at any step
that changes what a reader sees), a reader of ``OUT/NAME`` finds exactly the previous
set or exactly the new one, and the next run succeeds and leaves no leftovers. Steps are
reached with the test hook ``SERVETUNE_TEST_PAUSE_COMMIT`` (``"<seconds>@<n>"`` sleeps at
the n-th step, after announcing it on stderr)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import output_names
from test_nightly import POOR, SPACE  # the nightly tests' tiny space and poor policy

import servetune.io as io_mod
from servetune.errors import ServetuneError
from servetune.io import (
    FILE_MODE,
    PAUSE_ENV,
    check_outputs,
    commit_files,
    output_folder_lock,
)

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "configs" / "examples" / "azure-conv-synthetic.csv"
PROFILE = REPO / "gpu_profiles" / "h200-llama-3.1-8b.yaml"
SLO = REPO / "configs" / "slos" / "mlperf-llama-3.1-8b-server.yaml"
CLI = [sys.executable, "-c", "from servetune.cli import run; run()"]
# commit_files in a process of its own, so that a test can SIGKILL it mid-commit
COMMIT = [sys.executable, "-c",
          "import json, sys; from servetune.io import commit_files; a = json.loads(sys.argv[1]); "
          "commit_files(a['out'], [(n, d.encode()) for n, d in a['files']], owned=a['owned'])"]


def live(folder: Path) -> dict[str, bytes]:
    """What a reader sees: each output name that opens as a file, and its bytes (a
    dangling link is no file)."""
    return {name: (folder / name).read_bytes() for name in output_names(folder)
            if (folder / name).is_file()}


THEIRS = "mine.txt"  # a user's file in an output folder: never touched


def assert_clean(folder: Path) -> None:
    """A finished commit's layout: nothing hidden but ``.generations`` (no temporary file,
    no lock), ``current`` on the newest of at most three generations, every output name
    servetune's relative link into ``current`` that opens (but the user's own file)."""
    entries = sorted(os.listdir(folder))
    assert [e for e in entries if e.startswith(".")] == [".generations"], entries
    gens = sorted(os.listdir(folder / ".generations"))
    assert 1 <= len(gens) <= 3 and os.readlink(folder / "current") == f".generations/{gens[-1]}"
    for name in output_names(folder):
        if name == THEIRS:
            assert not (folder / name).is_symlink()
            continue
        assert os.readlink(folder / name) == f"current/{name}" and (folder / name).is_file()


def run_to_step(cmd: list[str], step: int, *, env: dict[str, str] | None = None
                ) -> list[str] | None:
    """Run ``cmd`` until it announces commit step ``step``, then SIGKILL it there; the
    steps announced, or None when it finished before reaching that step."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {}),
                                            PAUSE_ENV: f"120@{step}"})
    assert proc.stderr is not None
    steps = []
    for line in proc.stderr:
        if line.startswith("servetune: test pause "):
            steps.append(line.split(": ", 2)[2].strip())
            if len(steps) == step:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return steps
    proc.wait()
    return None


# ------------------------------------------------------------------- commit_files alone


def test_layout_links_modes_and_no_lock_left(tmp_path):
    out = tmp_path / "out"
    assert commit_files(out, [("a.txt", b"1"), ("b.txt", b"2")]) == [out / "a.txt",
                                                                      out / "b.txt"]
    assert sorted(os.listdir(out)) == [".generations", "a.txt", "b.txt", "current"]
    assert os.readlink(out / "current") == ".generations/000001"
    assert os.readlink(out / "a.txt") == "current/a.txt"  # relative: the folder can move
    assert live(out) == {"a.txt": b"1", "b.txt": b"2"}
    assert (out / ".generations" / "000001" / "a.txt").stat().st_mode & 0o777 == FILE_MODE
    moved = tmp_path / "moved"
    out.rename(moved)
    assert live(moved) == {"a.txt": b"1", "b.txt": b"2"}


def test_owned_names_leave_the_set_others_are_carried_and_three_generations_kept(tmp_path):
    out = tmp_path / "out"
    commit_files(out, [("plan.json", b"p1"), ("sweep.png", b"s1")])
    commit_files(out, [("schedule.json", b"x1")])  # another command into the same folder
    assert live(out) == {"plan.json": b"p1", "sweep.png": b"s1", "schedule.json": b"x1"}
    # the plan again, without its optional plot: the old plot must not outlive its plan
    commit_files(out, [("plan.json", b"p2")], owned=["plan.json", "sweep.png"])
    assert live(out) == {"plan.json": b"p2", "schedule.json": b"x1"}
    assert not os.path.lexists(out / "sweep.png")
    # keep: an owned name the new set takes over unchanged from the live one
    commit_files(out, [("report.md", b"r")], owned=["plan.json", "report.md"],
                 keep=["plan.json"])
    assert live(out) == {"plan.json": b"p2", "schedule.json": b"x1", "report.md": b"r"}
    assert sorted(os.listdir(out / ".generations")) == ["000002", "000003", "000004"]
    assert_clean(out)


def test_the_old_layouts_files_are_adopted_and_kept_in_the_history(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("policy.yaml", "vllm.yaml", "notes.txt"):
        (out / name).write_text(f"old {name}")
    (out / ".policy.yaml.ab12cd34.tmp").write_text("a killed run's temporary file")
    commit_files(out, [("policy.yaml", b"new")], owned=["policy.yaml", "vllm.yaml"])
    assert live(out) == {"policy.yaml": b"new", "notes.txt": b"old notes.txt"}
    assert not (out / "notes.txt").is_symlink()  # not ours: left as it was
    old = out / ".generations" / "000001"
    assert sorted(os.listdir(old)) == ["policy.yaml", "vllm.yaml"]
    assert (old / "vllm.yaml").read_text() == "old vllm.yaml"
    assert not (out / ".policy.yaml.ab12cd34.tmp").exists()


@pytest.mark.parametrize("setup, message", [
    (lambda out: (out / "current").mkdir(), "exists and is not servetune's link"),
    (lambda out: (out / "current").symlink_to("elsewhere"), "not servetune's link"),
    (lambda out: (out / ".generations").write_text("x"), ".generations: is not a folder"),
    (lambda out: (out / "a.txt").mkdir(), "a.txt: is a folder"),
    (lambda out: (out / "a.txt").symlink_to(out / "notes.txt"), "servetune did not make"),
])
def test_what_could_lose_data_is_refused_and_left_alone(tmp_path, setup, message):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    setup(out)
    before = sorted(os.listdir(out))
    with pytest.raises(ServetuneError, match=message):
        check_outputs({}, out_dirs={"--out-dir": (out, ["a.txt"])})
    with pytest.raises(ServetuneError, match=message):
        commit_files(out, [("a.txt", b"1")])
    assert sorted(os.listdir(out)) == before  # no lock, no generation, nothing moved
    assert (out / "notes.txt").read_text() == "mine"


def test_an_output_folder_that_is_a_link(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "out").symlink_to(real)
    commit_files(tmp_path / "out", [("a.txt", b"1")])
    assert live(real) == {"a.txt": b"1"}
    (tmp_path / "gone").symlink_to(tmp_path / "missing")
    with pytest.raises(ServetuneError, match="which does not exist"):
        commit_files(tmp_path / "gone", [("a.txt", b"1")])
    assert not (tmp_path / "missing").exists()


def test_an_input_that_is_last_runs_output_link_is_allowed(tmp_path):
    """The cron setup: yesterday's OUT/policy.yaml is today's input; it is a link into a
    generation no commit writes, so it is no clobbered input (a regular file there still
    is refused, as before)."""
    out = tmp_path / "out"
    commit_files(out, [("policy.yaml", b"yesterday")])
    outputs = {"--out-dir": (out, ["policy.yaml", "summary.json"])}
    check_outputs({}, {"--current": out / "policy.yaml"}, out_dirs=outputs)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "policy.yaml").write_text("yesterday")
    with pytest.raises(ServetuneError, match="is a file this run writes there"):
        check_outputs({}, {"--current": plain / "policy.yaml"},
                      out_dirs={"--out-dir": (plain, ["policy.yaml"])})


# ------------------------------------------------------------------ interrupts and kills

Files = list[tuple[str, str]]


def _fresh(out: Path) -> None:
    out.mkdir()


def _set_of_three(out: Path) -> None:
    commit_files(out, [("a.txt", b"a1"), ("b.txt", b"b1"), ("c.txt", b"c1")])


def _old_layout(out: Path) -> None:
    out.mkdir()
    for name in ("a.txt", "b.txt", THEIRS):
        (out / name).write_text(f"{name} 0")


def _three_generations(out: Path) -> None:
    for i in range(3):
        commit_files(out, [("a.txt", f"a{i}".encode())])


# (the previous state, the new set, the names the command owns); the old layout is first
# adopted as a set of its own (a swap that shows a reader the same bytes), so its new set
# is live after its second swap
SCENARIOS: dict[str, tuple[Callable[[Path], None], Files, list[str]]] = {
    "first set": (_fresh, [("a.txt", "a2"), ("b.txt", "b2")], ["a.txt", "b.txt"]),
    "names come and go": (_set_of_three, [("a.txt", "a2"), ("d.txt", "d2"), ("b.txt", "b2")],
                          ["a.txt", "b.txt", "c.txt", "d.txt"]),
    "old layout": (_old_layout, [("a.txt", "a2"), ("c.txt", "c2")], ["a.txt", "b.txt", "c.txt"]),
    "pruning": (_three_generations, [("a.txt", "a9"), ("b.txt", "b9")], ["a.txt", "b.txt"]),
}


def committed(scenario: str, steps: list[str]) -> bool:
    """Whether the new set's swap of ``current`` ran before the last step (the one the
    process was stopped at, not run)."""
    swaps = [s for s in steps[:-1] if s.startswith("swap current -> ")]
    return len(swaps) == (2 if scenario == "old layout" else 1)


def _expected(tmp_path: Path, prepare: Callable[[Path], None], files: Files,
              owned: list[str]) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """The reader's view before and after an uninterrupted commit."""
    ref = tmp_path / "reference"
    prepare(ref)
    before = live(ref)
    commit_files(ref, [(n, d.encode()) for n, d in files], owned=owned)
    return before, live(ref)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_sigkill_at_every_step_leaves_one_whole_set(tmp_path, scenario):
    prepare, files, owned = SCENARIOS[scenario]
    before, after = _expected(tmp_path, prepare, files, owned)
    assert before != after
    step = 0
    while True:
        step += 1
        out = tmp_path / f"step{step}"
        prepare(out)
        arg = json.dumps({"out": str(out), "files": files, "owned": owned})
        steps = run_to_step([*COMMIT, arg], step)
        if steps is None:  # the commit has fewer steps: it finished
            assert live(out) == after
            assert_clean(out)
            break
        assert live(out) == (after if committed(scenario, steps) else before), steps
        commit_files(out, [(n, d.encode()) for n, d in files], owned=owned)  # the next run
        assert live(out) == after
        assert_clean(out)
    assert step > 2


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_an_interrupt_at_every_step_leaves_one_whole_set(tmp_path, monkeypatch, scenario):
    """The in-process twin (Ctrl-C): the same oracle, and an interrupt before the commit
    point takes its own unfinished generation and links away at once."""
    prepare, files, owned = SCENARIOS[scenario]
    before, after = _expected(tmp_path, prepare, files, owned)
    step = 0
    while True:
        step += 1
        out = tmp_path / f"step{step}"
        prepare(out)
        listing = sorted(os.listdir(out))
        steps: list[str] = []

        def interrupt(what: str, at: int = step, steps: list[str] = steps) -> None:
            steps.append(what)
            if len(steps) == at:
                raise KeyboardInterrupt

        monkeypatch.setattr(io_mod, "_pause", interrupt)
        try:
            commit_files(out, [(n, d.encode()) for n, d in files], owned=owned)
        except KeyboardInterrupt:
            pass
        else:
            monkeypatch.undo()
            assert live(out) == after
            break
        monkeypatch.undo()
        assert live(out) == (after if committed(scenario, steps) else before), steps
        if not any(s.startswith("swap") for s in steps[:-1]):
            assert sorted(os.listdir(out)) == listing, steps  # nothing left behind
        commit_files(out, [(n, d.encode()) for n, d in files], owned=owned)
        assert live(out) == after
        assert_clean(out)


# --------------------------------------------------------------------------------- lock

HOLD = [sys.executable, "-c",
        "import sys, time; from servetune.io import output_folder_lock\n"
        "with output_folder_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(120)"]


def test_a_second_writer_fails_at_once_naming_the_holder(tmp_path):
    out = tmp_path / "out"
    commit_files(out, [("a.txt", b"1")])
    holder = subprocess.Popen([*HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(ServetuneError) as err:
            commit_files(out, [("a.txt", b"2")])
        assert err.value.exit_code == 2
        assert err.value.message == (
            f"{out}: another servetune run (pid {holder.pid}) is writing this folder; wait "
            "for it or choose another folder")
    finally:
        holder.send_signal(signal.SIGKILL)  # the kernel lets go of a dead holder's lock
        holder.wait()
    assert (out / ".lock").read_text() == f"{holder.pid}\n"  # stale, and harmless:
    commit_files(out, [("a.txt", b"2")])
    assert live(out) == {"a.txt": b"2"}
    assert_clean(out)


def test_the_lock_nests_and_removes_the_folders_it_made_when_nothing_was_written(tmp_path):
    out = tmp_path / "new" / "out"
    with pytest.raises(ServetuneError, match="bad input"), output_folder_lock(out):
        assert (out / ".lock").read_text() == f"{os.getpid()}\n"
        raise ServetuneError("bad input")
    assert not (tmp_path / "new").exists()  # an input error leaves no folder behind
    with output_folder_lock(out):
        commit_files(out, [("a.txt", b"1")])  # uses the lock this process holds
        assert (out / ".lock").exists()
    assert live(out) == {"a.txt": b"1"}
    assert_clean(out)


# ------------------------------------------------------------------ nightly, end to end



@pytest.fixture(scope="module")
def night(tmp_path_factory):
    """Inputs for two nights (a.csv and b.csv: two 400-request windows), and the folder
    after night one: a new policy (exit 0)."""
    if not PROFILE.exists() or not TRACE.exists():
        pytest.skip("shipped profile or example trace missing")
    d = tmp_path_factory.mktemp("night")
    lines = TRACE.read_text().splitlines()
    (d / "a.csv").write_text("\n".join(lines[:401]) + "\n")
    (d / "b.csv").write_text("\n".join([lines[0], *lines[401:801]]) + "\n")
    (d / "space.yaml").write_text(SPACE)
    (d / "poor.yaml").write_text(POOR)
    (d / "profile.yaml").write_bytes(PROFILE.read_bytes())
    proc = subprocess.run(nightly(d, d / "first", "a.csv", d / "poor.yaml"),
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return d


def nightly(d: Path, out: Path, trace: str, current: Path, *extra: str,
            quiet: bool = True) -> list[str]:
    return [*CLI, "nightly", "--trace", str(d / trace), "--profile", str(d / "profile.yaml"),
            "--slo", str(SLO), "--current", str(current), "--out-dir", str(out), "--space",
            str(d / "space.yaml"), "--engines", "vllm", "--max-simulations", "10",
            *(["-q"] if quiet else []), *extra]


def assert_one_run(out: Path) -> dict:
    """The live files tell one run's story: the report and the policy are about the
    summary's trace, and the policy present is the one written or the one kept."""
    summary = json.loads((out / "summary.json").read_text())
    trace = summary["inputs"]["trace"]
    assert f"| trace | `{trace}` |" in (out / "report.md").read_text()
    kept = (summary["live_policy"] or {}).get("kept_in_folder", [])
    names = set(live(out))
    assert names == {*summary["files_written"], *kept}
    if "policy.yaml" in summary["files_written"]:
        policy = (out / "policy.yaml").read_text()
        assert f"trace: {trace}" in policy
    return summary


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def test_exit_10_never_leaves_an_earlier_policy_beside_a_new_report(night):
    """The issue's case: night two (another trace) keeps the policy in production, which
    is not the folder's policy.yaml; SIGKILL before and after the commit point, then a
    clean run."""
    first = live(night / "first")
    assert_one_run(night / "first")
    args = ("b.csv", night / "poor.yaml", "--min-gain", "1000")
    out = _copy(night / "first", night / "killed")
    steps = run_to_step(nightly(night, out, *args), 1)  # writing the new generation
    assert steps == ["writing .generations/000002"]
    assert live(out) == first
    # the next run, killed after its commit point (removing policy.yaml's link), removes
    # the unfinished generation first
    steps = run_to_step(nightly(night, out, *args), 3)
    assert steps == ["writing .generations/000002", "swap current -> .generations/000002",
                     "remove the link policy.yaml (not in the new set)"]
    second = live(out)
    assert set(second) == {"report.md", "summary.json", "ttft_cdf.png", "tpot_cdf.png",
                           "kv_queue.png", "goodput.png"}
    assert os.path.islink(out / "vllm.yaml")  # dangling: a reader finds no file there
    summary = assert_one_run(out)
    assert summary["live_policy"] == {
        "file": "poor.yaml", "name": "poor", "sha256": io_mod.sha256_file(night / "poor.yaml"),
        "engines": ["vllm"], "kept_in_folder": []}
    assert "`poor` (`poor.yaml`, sha256 " in second["report.md"].decode()
    # the same run again, uninterrupted: the same set (same inputs, same bytes), tidied;
    # only the check of the last run's promise differs, since the last run is now the
    # killed one (its promise: the policy it kept), no longer night one
    proc = subprocess.run(nightly(night, out, *args), capture_output=True, text=True)
    assert proc.returncode == 10, proc.stderr
    third = live(out)
    assert set(third) == set(second)
    assert {k: v for k, v in third.items() if not k.endswith((".md", ".json"))} == {
        k: v for k, v in second.items() if not k.endswith((".md", ".json"))}
    before, after = (json.loads(files["summary.json"]) for files in (second, third))
    assert before["last_promise"]["promised_rate_per_s"] == json.loads(
        first["summary.json"])["promise"]["goodput_rate_per_s"]
    assert after["last_promise"]["promised_rate_per_s"] == before["promise"][
        "goodput_rate_per_s"]
    assert ({k: v for k, v in after.items() if k != "last_promise"}
            == {k: v for k, v in before.items() if k != "last_promise"})

    def without_promise(report: bytes) -> list[str]:
        return [line for line in report.decode().splitlines()
                if not line.startswith("Last run promised")]

    assert without_promise(third["report.md"]) == without_promise(second["report.md"])
    assert_clean(out)


def test_cron_setup_keeps_the_policy_in_production_in_the_folder(night):
    """Last night's OUT/policy.yaml is tonight's --current: read before anything is
    written; on exit 10 it (and its engine config) stays live, marked as the policy in
    production, so tomorrow's run finds it again."""
    out = _copy(night / "first", night / "cron")
    policy = (out / "policy.yaml").read_bytes()
    for _ in range(2):
        proc = subprocess.run(nightly(night, out, "b.csv", out / "policy.yaml", "--min-gain",
                                      "1000"), capture_output=True, text=True)
        assert proc.returncode == 10, proc.stderr
        summary = assert_one_run(out)
        assert summary["live_policy"]["kept_in_folder"] == ["policy.yaml", "vllm.yaml"]
        assert (out / "policy.yaml").read_bytes() == policy
    assert "`policy.yaml`, `vllm.yaml` are that policy's" in (out / "report.md").read_text()
    assert_clean(out)


def test_two_nightly_runs_into_one_folder(night):
    """The second fails at once (exit 2, one line with the first's pid), before its own
    optimization; the first, held up meanwhile, completes intact."""
    out = _copy(night / "first", night / "busy")
    first = subprocess.Popen(
        nightly(night, out, "b.csv", night / "poor.yaml", "--min-gain", "1000", quiet=False),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    assert first.stderr is not None
    line = first.stderr.readline()
    assert line.startswith("servetune: loading"), line  # the lock is held from here on
    first.send_signal(signal.SIGSTOP)
    try:
        second = subprocess.run(nightly(night, out, "a.csv", night / "poor.yaml"),
                                capture_output=True, text=True)
    finally:
        first.send_signal(signal.SIGCONT)
    assert second.returncode == 2
    assert second.stderr.splitlines() == [
        f"servetune: error: {out}: another servetune run (pid {first.pid}) is writing this "
        "folder; wait for it or choose another folder"]
    first.stderr.read()
    assert first.wait() == 10
    summary = assert_one_run(out)
    assert summary["inputs"]["trace"].startswith("b.csv")
    assert_clean(out)


@pytest.mark.slow
@pytest.mark.parametrize("direction", ["kept after new", "new after kept"])
def test_nightly_sigkill_at_every_step(night, direction):
    """Every step of both nights' commits, with a run after each kill."""
    keep = ("b.csv", night / "poor.yaml", "--min-gain", "1000")
    new = ("a.csv", night / "poor.yaml")
    start = night / "first"
    if direction == "new after kept":
        start = _copy(night / "first", night / "start-kept")
        assert subprocess.run(nightly(night, start, *keep)).returncode == 10
    args = keep if direction == "kept after new" else new
    ref = _copy(start, night / f"ref-{direction}")
    subprocess.run(nightly(night, ref, *args), check=False)
    before, after = live(start), live(ref)
    step = 0
    while True:
        step += 1
        out = _copy(start, night / f"{direction}-{step}")
        steps = run_to_step(nightly(night, out, *args), step)
        if steps is None:
            break
        assert live(out) in (before, after), steps
        assert_one_run(out)
        subprocess.run(nightly(night, out, *args), check=False)
        assert live(out) == after, steps
        assert_clean(out)
    assert step > 3
