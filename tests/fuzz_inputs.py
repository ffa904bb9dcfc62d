"""Bad inputs for the fuzz harness (tests/test_fuzz.py), and the check every run passes.

A **target** is one kind of input (a document kind, a trace format, a benchmark-result
format) with a valid seed, the companion files a command needs beside it, and the CLI
commands that read it. Hypothesis strategies turn the seed into bad variants: parsed data
with keys dropped, values of the wrong type, unknown keys, huge or empty containers;
YAML/JSON text truncated, with duplicate keys, tabs, alias bombs, recursive aliases, deep
nesting, odd tags; bytes that are not UTF-8, a BOM, UTF-16, gzip, binary junk; CSV/JSONL
rows with bad fields, missing or renamed columns, ragged rows, rows out of order, mixed
line endings.

:func:`run_case` runs one input through the real CLI in-process (typer's ``CliRunner``),
inputs in ``in/`` and outputs pointed into ``out/`` of a fresh folder, and says what
went wrong, if anything: an exit code other than 0, 2 or 3; anything but one
``servetune: error:`` line on failure (a loaded trace's ``servetune: note:`` lines, which
the CLI prints by design as soon as the trace has loaded, may come before it); a traceback
(an exception the CLI let through); a Python warning or a log record the real CLI would
print; a file written (or an input changed) on failure; an exit 0 without its output; no
answer within the time limit. Expensive work (the optimizer's search in optimize and
nightly, the planner's capacity runs, the placement's spare-capacity runs and solver) is
replaced by a stub that raises :class:`ReachedWork`: an input that gets there passed every
input check.

**Output faults** (:data:`FAULTS`, :func:`fault_cases`): valid inputs whose output folder
fails, in-process, as a read-only file system (``os.access`` says no, and creating a
file or folder there raises EROFS) or a full one (a file can still be made, but every
byte written to it goes to ``/dev/full``: ENOSPC). Each command that writes into ``out/``
must then fail with one line (or reach its stubbed work first) and leave ``out/`` empty.
The faults on standard output (``/dev/full``, closed, a pipe closed early) need the
console script, so :func:`stdout_fault_run` runs it as a subprocess.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import copy
import errno
import functools
import gzip
import hashlib
import io
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from hypothesis import strategies as st
from typer.testing import CliRunner

from servetune.cli import app
from servetune.workloads.bench import vllm_detailed_result

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "fuzz_data"
PLACE = DATA / "place"

PROFILE_NAME = "h200-llama-3.1-8b"  # a shipped profile, named: no file needed
MAX_INPUT_BYTES = 4 << 20  # big enough for every size check; a bigger file only costs time
# A hang is no answer in this long; a 4 MiB YAML file alone takes PyYAML's pure-Python
# parser about 20 s on the 2-core development machine, so the limit leaves room for that.
CASE_TIMEOUT_S = float(os.environ.get("SERVETUNE_FUZZ_CASE_TIMEOUT_S", "60"))
# Warnings Python shows by default (the others are hidden outside __main__).
HIDDEN_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def _read(path: Path) -> bytes:
    return path.read_bytes()


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _dump(data: Any) -> bytes:
    return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=100).encode("utf-8")


# ----------------------------------------------------------------------------- outcomes


class ReachedWork(Exception):  # noqa: N818 - not an error: the input passed every check
    """Raised by the stubs that stand in for a command's expensive work."""


class CaseTimeout(Exception):  # noqa: N818
    """The run gave no answer within CASE_TIMEOUT_S."""


@dataclass(frozen=True)
class Case:
    """One run: files written to ``in/`` and the argv (``{in}``/``{out}`` are the folders).
    ``writes`` names the file under ``out/`` that an exit 0 must have written."""

    kind: str
    files: tuple[tuple[str, bytes], ...]
    argv: tuple[str, ...]
    writes: str | None = None
    fault: str | None = None  # one of FAULTS: the output folder fails so

    def digest(self) -> str:
        h = hashlib.sha256()
        for name, data in self.files:
            h.update(name.encode() + b"\0" + data + b"\0")
        h.update("\0".join(self.argv).encode())
        h.update((self.fault or "").encode())
        return h.hexdigest()

    def preview(self, fuzzed: str) -> dict[str, Any]:
        """The argv and the fuzzed file (as text when it is UTF-8, else base64), for a
        failure report: enough to replay the case."""
        data = dict(self.files)[fuzzed]
        shown: dict[str, Any] = {"argv": list(self.argv), "file": fuzzed, "bytes": len(data)}
        if len(data) <= 20_000:
            try:
                shown["text"] = data.decode("utf-8")
            except UnicodeDecodeError:
                shown["base64"] = base64.b64encode(data).decode()
        return shown


@dataclass
class Outcome:
    status: str  # "error" (exit 2/3, one line), "ok" (exit 0), "reached" (stub), "failed"
    exit_code: int
    output: str
    problem: str = ""
    notes: int = 0  # `servetune: note:` lines printed before the error line
    detail: str = ""
    seconds: float = 0.0


def _snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest()
                                     if p.is_file() and not p.is_symlink() else "dir")
        for p in sorted(folder.rglob("*"))
    }


class _LogRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    def fire(signum, frame):  # pragma: no cover - only on a hang
        raise CaseTimeout(f"no answer in {seconds:g} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@contextlib.contextmanager
def stubbed_work() -> Iterator[None]:
    """Replace the expensive work of optimize, nightly, plan and place with ReachedWork: the fuzzer
    checks the inputs, not the solvers."""
    import servetune.apps.nightly as nightly_app
    import servetune.apps.optimize as optimize_app
    import servetune.apps.place as place_app
    import servetune.apps.plan as plan_app

    def reached(*args: Any, **kwargs: Any) -> Any:
        raise ReachedWork

    patches = [(optimize_app, "Evaluator"), (plan_app, "measure_capacities"),
               (place_app, "measure_spare"), (place_app, "solve_placement"),
               (nightly_app, "optimize_policy")]
    saved = [(mod, name, getattr(mod, name)) for mod, name in patches]
    try:
        for mod, name in patches:
            setattr(mod, name, reached)
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


FAULTS = ("read-only", "full")
_WRITING = os.O_WRONLY | os.O_RDWR | os.O_CREAT


@contextlib.contextmanager
def output_fault(kind: str | None, folder: Path) -> Iterator[None]:
    """While inside, ``folder`` (and everything under it) fails as a read-only or a full
    file system for this process (module docstring); ``kind`` None: no fault.

    Full: files and folders can still be made, as on a real full disk, and keep their
    identity (a lock file's inode); their bytes fail with ENOSPC, written through
    ``os.write``, a file object made on their descriptor by ``os.fdopen`` or ``open`` (the
    descriptor then points at ``/dev/full``) or by ``open`` of their path."""
    if kind is None:
        yield
        return
    assert kind in FAULTS, kind
    root = os.path.realpath(folder)
    real = {"access": os.access, "open": os.open, "mkdir": os.mkdir, "write": os.write,
            "fdopen": os.fdopen, "builtin_open": builtins.open}
    tracked: set[int] = set()  # descriptors of files made under the folder

    def inside(path: Any) -> bool:
        if isinstance(path, int):
            return False
        p = os.path.realpath(os.fspath(path))
        return p == root or p.startswith(root + os.sep)

    def error(code: int, path: Any = None) -> OSError:
        return OSError(code, os.strerror(code), *(() if path is None else (os.fspath(path),)))

    def access(path: Any, mode: int, *args: Any, **kwargs: Any) -> bool:
        if kind == "read-only" and mode & os.W_OK and inside(path):
            return False
        return real["access"](path, mode, *args, **kwargs)

    def os_open(path: Any, flags: int, mode: int = 0o777, *args: Any, **kwargs: Any) -> int:
        writing = flags & _WRITING and not args and not kwargs and inside(path)
        if writing and kind == "read-only":
            raise error(errno.EROFS, path)
        fd = real["open"](path, flags, mode, *args, **kwargs)
        (tracked.add if writing else tracked.discard)(fd)
        return fd

    def os_write(fd: int, data: Any) -> int:
        if fd in tracked:
            raise error(errno.ENOSPC)
        return real["write"](fd, data)

    def to_full(fd: int, mode: str) -> None:
        if fd in tracked and any(c in mode for c in "wax+"):
            full = real["open"]("/dev/full", os.O_WRONLY)
            os.dup2(full, fd)
            os.close(full)

    def fdopen(fd: int, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        to_full(fd, mode)
        return real["fdopen"](fd, mode, *args, **kwargs)

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if kind == "read-only" and inside(path):
            raise error(errno.EROFS, path)
        real["mkdir"](path, *args, **kwargs)

    def builtin_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, int) and kind == "full":  # a descriptor made under the folder
            to_full(file, mode)
        elif any(c in mode for c in "wax+") and inside(file):
            if kind == "read-only":
                raise error(errno.EROFS, file)
            real["builtin_open"](file, mode, *args, **kwargs).close()
            return real["builtin_open"]("/dev/full", mode.replace("x", "w").replace("a", "w"),
                                        *args, **kwargs)
        return real["builtin_open"](file, mode, *args, **kwargs)

    patches = [(os, "access", access), (os, "open", os_open), (os, "mkdir", mkdir),
               (builtins, "open", builtin_open), (io, "open", builtin_open)]
    if kind == "full":
        patches += [(os, "write", os_write), (os, "fdopen", fdopen)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in patches]
    try:
        for mod, name, value in patches:
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def run_case(case: Case, timeout_s: float = CASE_TIMEOUT_S) -> Outcome:
    """Run ``case`` through the CLI in-process and judge it (see the module doc). Call
    inside :func:`stubbed_work`."""
    root = Path(tempfile.mkdtemp(prefix="servetune-fuzz-"))
    try:
        in_dir, out_dir = root / "in", root / "out"
        in_dir.mkdir()
        out_dir.mkdir()
        for name, data in case.files:
            (in_dir / name).write_bytes(data)
        before = _snapshot(in_dir)
        argv = [a.replace("{in}", str(in_dir)).replace("{out}", str(out_dir))
                for a in case.argv]
        logs = _LogRecords()
        logging.getLogger().addHandler(logs)
        start = time.perf_counter()
        try:
            with warnings.catch_warnings(record=True) as caught, _time_limit(timeout_s), \
                    output_fault(case.fault, out_dir):
                warnings.simplefilter("always")
                result = CliRunner().invoke(app, argv)
        finally:
            logging.getLogger().removeHandler(logs)
        seconds = time.perf_counter() - start
        shown_warnings = [w for w in caught if not issubclass(w.category, HIDDEN_WARNINGS)]
        outcome = _judge(case, result, shown_warnings, logs.records, in_dir, out_dir, before)
        outcome.seconds = seconds
        return outcome
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _judge(case: Case, result: Any, caught: list, records: list, in_dir: Path, out_dir: Path,
           before: dict[str, str]) -> Outcome:
    output = result.output
    code = result.exit_code
    exc = result.exception
    lines = [ln for ln in output.splitlines() if ln.strip()]

    def failed(problem: str, detail: str = "") -> Outcome:
        return Outcome("failed", code, output, problem, detail=detail)

    if isinstance(exc, CaseTimeout):
        return failed(f"hang: {exc}")
    if exc is not None and not isinstance(exc, SystemExit | ReachedWork):
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return failed(f"traceback: {type(exc).__name__}: {exc}"[:300], tb[-4000:])
    if caught:
        w = caught[0]
        return failed(f"printed a warning: {w.category.__name__}: {w.message}"[:300],
                      f"{w.filename}:{w.lineno}")
    if records:
        r = records[0]
        return failed(f"printed a log record: {r.name}: {r.getMessage()}"[:300])
    if _snapshot(in_dir) != before:
        return failed("changed or added a file beside the inputs")
    if "Traceback" in output:
        return failed("printed a traceback")
    if isinstance(exc, ReachedWork):
        if any(out_dir.iterdir()):
            return failed("wrote output before the work started")
        return Outcome("reached", code, output)
    if code == 0 and case.fault is not None:
        return failed(f"exit 0 although its output folder is {case.fault}")
    if code == 0:
        if case.writes is not None and not (out_dir / case.writes).is_file():
            return failed(f"exit 0 but {case.writes} was not written")
        if not lines:
            return failed("exit 0 and printed nothing")
        return Outcome("ok", code, output)
    if code not in (2, 3):
        return failed(f"exit code {code}")
    notes = 0
    while notes < len(lines) - 1 and lines[notes].startswith("servetune: note: "):
        notes += 1  # a trace's notices (rows skipped, ...) are printed once it has loaded
    errors = lines[notes:]
    if len(errors) != 1:
        return failed(f"{len(errors)} lines on failure (expected one)")
    if not errors[0].startswith("servetune: error: "):
        return failed("the error line does not start with 'servetune: error: '")
    if "╭" in output:
        return failed("printed a box")
    if any(out_dir.iterdir()):
        return failed("wrote a file although it failed: "
                      + ", ".join(sorted(p.name for p in out_dir.iterdir())))
    return Outcome("error", code, output, notes=notes)


# ----------------------------------------------------------------------------- tally


@dataclass
class Tally:
    """Inputs tried and failed per target, for the report a full run writes."""

    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    distinct: dict[str, set[str]] = field(default_factory=dict)
    failures: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    problems: dict[str, int] = field(default_factory=dict)
    slowest: dict[str, dict[str, Any]] = field(default_factory=dict)

    def record(self, target: str, case: Case, fuzzed: str, outcome: Outcome) -> None:
        c = self.counts.setdefault(target, {"tried": 0, "failed": 0, "error": 0, "ok": 0,
                                            "reached": 0, "with_notes": 0})
        c["tried"] += 1
        c[outcome.status] += 1
        c["with_notes"] += outcome.notes > 0
        self.distinct.setdefault(target, set()).add(case.digest())
        if outcome.seconds > self.slowest.get(target, {}).get("seconds", -1.0):
            shown = case.preview(fuzzed)
            shown.pop("text", None)
            shown.pop("base64", None)
            self.slowest[target] = {"seconds": round(outcome.seconds, 3),
                                    "status": outcome.status, **shown}
        if outcome.status == "failed":
            key = re.sub(r"\d+", "N", outcome.problem)[:120]
            self.problems[key] = self.problems.get(key, 0) + 1
            kept = self.failures.setdefault(target, [])
            if len(kept) < 10:
                kept.append({"problem": outcome.problem, "exit_code": outcome.exit_code,
                             "output": outcome.output[-2000:], "detail": outcome.detail,
                             **case.preview(fuzzed)})

    def failed(self, target: str) -> int:
        return self.counts.get(target, {}).get("failed", 0)

    def report(self) -> dict[str, Any]:
        total = {k: sum(c[k] for c in self.counts.values())
                 for k in ("tried", "failed", "error", "ok", "reached", "with_notes")}
        total["distinct"] = sum(len(d) for d in self.distinct.values())
        per_target = {t: {**c, "distinct": len(self.distinct[t])}
                      for t, c in sorted(self.counts.items())}
        return {"total": total, "per_target": per_target, "problems": self.problems,
                "failures": self.failures, "slowest": self.slowest}


# ----------------------------------------------------------------------------- bad values

HUGE_INT = 10**30
BAD_SCALARS: list[Any] = [
    None, True, False, 0, -1, 1, 2, -(10**12), HUGE_INT, -HUGE_INT, 2**63, 2**64 + 1,
    0.0, -0.0, 0.5, -0.5, 1e-320, 1e308, -1e308, math.nan, math.inf, -math.inf,
    "", " ", "x", "1", "0.5", "1e999", "nan", "inf", "-", "null", "\t", "é", "\u2028",
    "a" * 5000, "../../etc/passwd", "/dev/null", [], {}, [None], [1, "a"], [[1, 2], [3]],
    {"a": 1}, {"": None}, [[[[]]]],
]
scalars = st.one_of(
    # copied: a later mutation must not change the table (or put a list inside itself)
    st.sampled_from(BAD_SCALARS).map(copy.deepcopy),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.booleans(),
)
bad_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=8,
)

# Raw YAML put where a value goes (flow style, one line).
LADDER = 9


def alias_bomb(leaf: str, as_mapping: bool) -> str:
    """Billion laughs: each level lists the previous one nine times (9**9 leaves)."""
    levels = [f"&l0 [{', '.join([leaf] * LADDER)}]"]
    levels += [f"&l{i} [{', '.join([f'*l{i - 1}'] * LADDER)}]" for i in range(1, LADDER)]
    if as_mapping:
        return "{" + ", ".join(f"k{i}: {lv}" for i, lv in enumerate(levels)) + "}"
    return "[" + ", ".join(levels) + "]"


YAML_FRAGMENTS = [
    alias_bomb("1", False), alias_bomb("1.5", True), alias_bomb("x", False),
    alias_bomb("true", True),
    "&r [*r]", "&r {a: *r}", "&r [1, [2, *r]]",
    "[" * 100 + "]" * 100, "[" * 5000 + "]" * 5000, "{a: " * 3000 + "1" + "}" * 3000,
    "!!python/object/apply:os.system [echo hi]", "!!python/name:os.system", "!!binary aGVsbG8=",
    "!!set {a, b}", "!!timestamp 2001-12-14", "!!str 5", "!!int '12'", "!!float 'x'",
    "!custom 1", "!!map [1, 2]", "!!null 5",
    "1" + "0" * 5000, "0x1F", "0o17", "0b101", "1_000", "+.inf", "-.inf", ".nan", "~",
    "1e400", "-0", "12:30:00", "190:20:30", "2001-12-14t21:59:43.10-05:00", "2001-12-14",
    "yes", "no", "on", "off", "*undefined", "&a 7", "'\x07'", '"\\x00\\u2028"',
    "{? [1, 2]: 3}", "{[1]: 2}", "[a, {b: c}, [d]]", "{a: 1, a: 2}",
]
SENTINEL = "zzSENTINELzz"

NON_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80abc", b"\xf5\x80\x80\x80"]


# ----------------------------------------------------------------------------- data mutations


def _paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    """Paths into nested data: every dict key, every list, and the first elements of each
    list (a long list would otherwise swamp the choice)."""
    out: list[tuple] = []
    if isinstance(data, dict):
        for k, v in data.items():
            out.append((*prefix, k))
            out += _paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data[:3]):
            out.append((*prefix, i))
            out += _paths(v, (*prefix, i))
    return out


def _parent(data: Any, path: tuple) -> Any:
    for part in path[:-1]:
        data = data[part]
    return data


def _containers(data: Any, kind: type) -> list[tuple]:
    found = [()] if isinstance(data, kind) else []
    return found + [p for p in _paths(data) if isinstance(_get(data, p), kind)]


def _get(data: Any, path: tuple) -> Any:
    for part in path:
        data = data[part]
    return data


def _set(data: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    _parent(data, path)[path[-1]] = value
    return data


def _neighbours(x: float) -> list[Any]:
    """Values near a number that break it: its negative, zero, a million times more or
    less, half a unit off, as text, astronomically large."""
    out: list[Any] = [0, -1e-9, str(x), 10**400 if x > 0 else -(10**400)]
    for make in (lambda: -x, lambda: x * 1e6, lambda: x / 1e6 if x else 1e-9,
                 lambda: x + 0.5, lambda: x * 10**20, lambda: int(x)):
        try:
            out.append(make())
        except (OverflowError, ValueError):  # x is already huge, inf or nan
            pass
    return out


@st.composite
def mutated_data(draw: Any, seed: Any) -> Any:
    """``seed`` (parsed YAML/JSON) with one to three structural mutations."""
    data = copy.deepcopy(seed)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(data)
        op = draw(st.sampled_from([
            "replace", "replace", "replace", "drop", "drop", "unknown_key", "rename_key",
            "number", "list", "dict", "kind", "wrap",
        ]))
        if op in ("replace", "drop", "number", "rename_key") and not paths:
            op = "wrap"
        if op == "replace":
            data = _set(data, draw(st.sampled_from(paths)), draw(bad_values))
        elif op == "drop":
            path = draw(st.sampled_from(paths))
            parent = _parent(data, path)
            del parent[path[-1]]
        elif op == "rename_key":
            dict_paths = [p for p in paths if isinstance(_parent(data, p), dict)]
            if dict_paths:
                path = draw(st.sampled_from(dict_paths))
                parent = _parent(data, path)
                key = path[-1]
                new = draw(st.sampled_from([str(key).upper(), f"{key}_", f" {key}", f"{key}s",
                                            str(key)[:-1] or "k", str(key).replace("_", "-")]))
                parent[new] = parent.pop(key)
        elif op == "unknown_key":
            target = _get(data, draw(st.sampled_from(_containers(data, dict) or [()])))
            if isinstance(target, dict):
                target[draw(st.text(min_size=1, max_size=10))] = draw(bad_values)
        elif op == "number":
            numeric = [p for p in paths if isinstance(_get(data, p), int | float)
                       and not isinstance(_get(data, p), bool)]
            if numeric:
                path = draw(st.sampled_from(numeric))
                x = _get(data, path)
                data = _set(data, path, draw(st.sampled_from(_neighbours(x))))
        elif op == "list":
            lists = _containers(data, list)
            if lists:
                path = draw(st.sampled_from(lists))
                xs = _get(data, path)
                how = draw(st.sampled_from(["empty", "huge", "reverse", "repeat", "append"]))
                if how == "empty":
                    xs.clear()
                elif how == "huge" and xs:
                    xs.extend([copy.deepcopy(xs[0])] * draw(st.sampled_from([1000, 20000])))
                elif how == "reverse":
                    xs.reverse()
                elif how == "repeat" and xs:
                    xs.insert(0, copy.deepcopy(xs[0]))
                else:
                    xs.append(draw(bad_values))
        elif op == "dict":
            dicts = _containers(data, dict)
            if dicts:
                target = _get(data, draw(st.sampled_from(dicts)))
                how = draw(st.sampled_from(["empty", "clone"]))
                if how == "empty":
                    target.clear()
                elif target:
                    key, value = next(iter(target.items()))
                    for i in range(draw(st.sampled_from([2, 50, 500]))):
                        target[f"{key}{i}"] = copy.deepcopy(value)
        elif op == "kind" and isinstance(data, dict):
            key = draw(st.sampled_from(["apiVersion", "kind"]))
            data[key] = draw(st.sampled_from([
                "servetune/v2", "Policy", "Workload", "Profile", "SLOSet", "CapacityPlan",
                None, 1, "", ["Policy"],
            ]).map(copy.deepcopy))
        else:  # wrap: the document is not a mapping
            data = draw(st.sampled_from([[data], "text", 42, None, [], {"doc": data}]))
    return data


# ----------------------------------------------------------------------------- text mutations


@st.composite
def yaml_fragment_doc(draw: Any, seed: Any) -> bytes:
    """``seed`` with one value replaced by raw YAML: an alias bomb, a recursive alias, deep
    nesting, a tag, an odd literal."""
    data = copy.deepcopy(seed)
    paths = _paths(data)
    if paths:
        data = _set(data, draw(st.sampled_from(paths)), SENTINEL)
    else:
        data = SENTINEL
    text = _dump(data).decode()
    return text.replace(SENTINEL, draw(st.sampled_from(YAML_FRAGMENTS)), 1).encode()


@st.composite
def text_mutation(draw: Any, data: bytes) -> bytes:
    """``data`` with one byte/line-level change."""
    op = draw(st.sampled_from([
        "truncate", "dup_key_line", "tab", "noise", "bom", "utf16", "non_utf8", "nul",
        "crlf", "cr", "multi_doc", "gzip", "dup_line",
    ]))
    if op == "truncate":
        return data[: draw(st.integers(0, max(len(data) - 1, 0)))]
    lines = data.split(b"\n")
    if op in ("dup_key_line", "tab", "dup_line"):
        pattern = {"dup_key_line": rb"^\s*[A-Za-z_][\w.\-]*:", "tab": rb"^ +\S",
                   "dup_line": rb"\S"}[op]
        candidates = [i for i, ln in enumerate(lines) if re.match(pattern, ln)]
        if candidates:
            i = draw(st.sampled_from(candidates))
            if op == "tab":
                lines[i] = b"\t" + lines[i].lstrip(b" ")
            else:
                lines.insert(i + 1, lines[i])
            return b"\n".join(lines)
        return data + b"\n\t"
    if op == "noise":
        out = bytearray(data)
        for _ in range(draw(st.integers(1, 4))):
            pos = draw(st.integers(0, len(out)))
            junk = draw(st.sampled_from([b":", b"-", b"[", b"{", b"}", b"]", b",", b"#", b"&",
                                         b"*", b"!", b"|", b">", b"'", b'"', b"%", b"@", b"`",
                                         b" ", b"\n", b"?", b"0", b"e", b"\\"]))
            if out and draw(st.booleans()):
                out[min(pos, len(out) - 1)] = junk[0]
            else:
                out[pos:pos] = junk
        return bytes(out)
    if op == "bom":
        return b"\xef\xbb\xbf" + data
    if op == "utf16":
        return data.decode("utf-8", errors="replace").encode("utf-16")
    if op in ("non_utf8", "nul"):
        pos = draw(st.integers(0, len(data)))
        junk = draw(st.sampled_from(NON_UTF8)) if op == "non_utf8" else b"\x00"
        return data[:pos] + junk + data[pos:]
    if op == "crlf":
        return data.replace(b"\n", b"\r\n")
    if op == "cr":
        return data.replace(b"\n", b"\r")
    if op == "multi_doc":
        return data + b"\n---\n" + data
    return gzip.compress(data, mtime=0)


JUNK_FILES = [
    b"", b"\n\n", b"   \n", b"# only a comment\n", b"---\n", b"...\n", b"--- |\n  text\n",
    b"[]\n", b"{}\n", b"- 1\n- 2\n", b"42\n", b"just a string\n", b"~\n", b"null\n",
    b"\x00\x01\x02\x03", b"\xef\xbb\xbf", b"\x1f\x8b\x08\x00", b"PK\x03\x04",
    b"---\na: 1\n---\nb: 2\n", b"a: 1\n\tb: 2\n", b"%YAML 1.1\n---\na: 1\n", b"%TAG ! x\n",
]


def yaml_documents(seed: Any) -> st.SearchStrategy[bytes]:
    """Bad (and some accidentally valid) variants of the YAML document ``seed``."""
    as_text = _dump(seed)
    return st.one_of(
        mutated_data(seed).map(_dump),
        mutated_data(seed).map(_dump).flatmap(text_mutation),
        yaml_fragment_doc(seed),
        text_mutation(as_text),
        st.sampled_from(JUNK_FILES),
        st.binary(max_size=300),
        st.just(json.dumps(seed).encode()),  # JSON is YAML: valid
    )


# ----------------------------------------------------------------------------- traces


@dataclass(frozen=True)
class TraceSeed:
    """A valid trace in one format: CSV (``header`` + ``rows``) or JSON (``records``, one
    per line, or one ``document``), with the options it needs."""

    fmt: str
    header: tuple[str, ...] = ()
    rows: tuple[tuple[str, ...], ...] = ()
    records: tuple[dict, ...] = ()
    document: dict | None = None
    columns: str | None = None


def _azure_rows() -> tuple[tuple[str, ...], ...]:
    lines = (REPO / "configs/examples/azure-conv-synthetic.csv").read_text().splitlines()
    return tuple(tuple(ln.split(",")) for ln in lines[1:9])


TRACE_SEEDS = {
    "azure": TraceSeed("azure", ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
                       _azure_rows()),
    "burstgpt": TraceSeed(
        "burstgpt",
        ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type"),
        (("5.0", "ChatGPT", "100", "20", "120", "Conversation log"),
         ("1.5", "GPT-4", "50", "7", "57", "API log"),
         ("7.25", "ChatGPT", "640", "0", "640", "Conversation log"),
         ("9.0", "GPT-4", "3000", "412", "3412", "Conversation log"),
         ("9.0", "ChatGPT", "12", "1", "13", "API log")),
    ),
    "mooncake": TraceSeed("mooncake", records=(
        {"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1]},
        {"timestamp": 27, "input_length": 5000, "output_length": 300,
         "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]},
        {"timestamp": 3100, "input_length": 77, "output_length": 1, "hash_ids": []},
    )),
    "vllm-bench": TraceSeed("vllm-bench", document={
        "input_lens": [10, 20, 300, 4], "output_lens": [5, 6, 70, 1],
        "errors": ["", "", "", ""], "start_times": [1.0, 1.5, 1.75, 4.0],
        "request_rate": 2.0, "duration": 4.0, "completed": 4,
    }),
    "csv": TraceSeed(
        "csv", ("ts", "in", "out", "cls", "prio", "max"),
        (("0.5", "10", "3", "a", "0", "16"), ("0.25", "20", "4", "b, c", "1", "8"),
         ("1.5", "900", "40", "a", "-2", "64"), ("2", "33", "1", "", "0", "1")),
        columns="arrival=ts,prompt=in,output=out,class=cls,priority=prio,max_tokens=max",
    ),
    "csv-datetime": TraceSeed(
        "csv", ("when", "prompt_tokens", "output_tokens"),
        (("2024-05-01 10:00:00.000", "100", "10"), ("2024-05-01 10:00:00.250", "200", "20"),
         ("2024-05-01T10:00:01.5", "300", "30"), ("2024-05-01 10:00:03", "5", "2")),
        columns="arrival=when,prompt=prompt_tokens,output=output_tokens",
    ),
    "jsonl": TraceSeed("jsonl", records=(
        {"t": 1, "in": 5, "out": 2, "c": "x", "p": 0},
        {"t": 0.5, "in": 6, "out": 1, "c": 3, "p": 2},
        {"t": 2.5, "in": 4000, "out": 120, "c": "y", "p": -1},
    ), columns="arrival=t,prompt=in,output=out,class=c,priority=p"),
}

CSV_BAD_FIELDS = [
    "", " ", "-1", "0", "-0", "1.5", "nan", "NaN", "inf", "-inf", "1e400", "1e30", "9" * 70,
    "abc", "0x10", '"1,2"', '"', '""', "１２", "\x00", "٣", "2023-13-45 99:99:99",
    "2023-11-16T18:15:46Z", "2023-11-16 18:15:46+05:00", "1677-09-21 00:12:43",
    "2262-04-12 00:00:00", "9999-12-31 23:59:59", "0001-01-01", "1700000000",
    "18446744073709551616", "-9223372036854775808", "true", "null", "1_000", "+5", " 7",
    "7 ", "5e0", "1e9", "1e-9", "4294967296", "2147483648", "-2147483649", "1.0000000001",
]
JSON_BAD_VALUES: list[Any] = [
    None, True, False, "x", "", "5", -1, 0, 1.5, 2**70, -(2**70), 2**31, [], {}, [1], {"a": 1},
    1e308, -1e-300, "NaN", "2024-05-01 10:00:00", "2024-13-01", [1, "a"], [True], [2**64],
    [-1, 0.5], 1e9, 1e15,
]
NEWLINES = [b"\n", b"\r\n", b"\r"]


def _csv_line(fields: list[str]) -> str:
    return ",".join(fields)


@st.composite
def csv_trace_bytes(draw: Any, seed: TraceSeed) -> bytes:
    header = list(seed.header)
    rows = [list(r) for r in seed.rows]
    header_line: str | None = None
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from([
            "field", "field", "field", "drop_column", "rename_header", "dup_header",
            "swap_columns", "shuffle", "dup_row", "ragged", "blank", "only_header", "no_header",
            "empty", "long_field", "many_rows", "separator", "quoted_header",
        ]))
        if op == "field" and rows:
            r = draw(st.integers(0, len(rows) - 1))
            c = draw(st.integers(0, len(rows[r]) - 1)) if rows[r] else 0
            value = draw(st.sampled_from(CSV_BAD_FIELDS) | st.text(max_size=8))
            if rows[r]:
                rows[r][c] = value
        elif op == "drop_column" and header:
            c = draw(st.integers(0, len(header) - 1))
            del header[c]
            for row in rows:
                if c < len(row):
                    del row[c]
        elif op == "rename_header" and header:
            c = draw(st.integers(0, len(header) - 1))
            header[c] = draw(st.sampled_from(["", " ", header[c].lower(), header[c] + " ",
                                              header[c].upper(), "x", header[c][::-1]]))
        elif op == "dup_header" and header:
            header.append(header[0])
            for row in rows:
                row.append(row[0] if row else "")
        elif op == "swap_columns" and len(header) > 1:
            header[0], header[1] = header[1], header[0]  # the values stay: wrong columns
        elif op == "shuffle":  # a drawn order for a few rows, reversed for many
            rows = list(draw(st.permutations(rows))) if len(rows) <= 20 else rows[::-1]
        elif op == "dup_row" and rows:
            rows.insert(draw(st.integers(0, len(rows))), list(draw(st.sampled_from(rows))))
        elif op == "ragged" and rows:
            r = draw(st.integers(0, len(rows) - 1))
            if draw(st.booleans()) and rows[r]:
                rows[r].pop()
            else:
                rows[r].append(draw(st.sampled_from(["", "1", "extra"])))
        elif op == "blank":
            rows.insert(draw(st.integers(0, len(rows))), [])
        elif op == "only_header":
            rows = []
        elif op == "no_header":
            header_line = ""
        elif op == "empty":
            header, rows, header_line = [], [], ""
        elif op == "long_field" and rows and rows[0]:
            rows[0][0] = "1" * draw(st.sampled_from([65, 1000, 100_000]))
        elif op == "many_rows" and 0 < len(rows) <= 100:  # once: rows grow to <= 300,000
            rows = [list(r) for r in rows * draw(st.sampled_from([100, 3000]))]
        elif op == "separator":
            sep = draw(st.sampled_from([";", "\t", "|"]))
            header_line = sep.join(header)
            rows = [[sep.join(r)] for r in rows]
        elif op == "quoted_header":
            header_line = ",".join(f'"{h}"' for h in header)
    lines = ([] if header_line == "" else [header_line if header_line is not None
                                          else _csv_line(header)])
    lines += [_csv_line(r) for r in rows]
    return draw(serialised(lines))


@st.composite
def serialised(draw: Any, lines: list[str]) -> bytes:
    """Lines joined with a drawn line ending (or a mix), then maybe a BOM, no final
    newline, bytes that are not UTF-8, a NUL, gzip (maybe truncated)."""
    ending = draw(st.sampled_from([*NEWLINES, None]))
    encoded = [ln.encode("utf-8") for ln in lines]
    if ending is None:  # mixed
        data = b"".join(ln + draw(st.sampled_from(NEWLINES)) for ln in encoded)
    else:
        data = ending.join(encoded) + (ending if draw(st.booleans()) else b"")
    extra = draw(st.sampled_from(["none", "none", "none", "bom", "non_utf8", "nul", "gzip",
                                  "gzip_truncated", "trailing_garbage"]))
    if extra == "bom":
        data = b"\xef\xbb\xbf" + data
    elif extra in ("non_utf8", "nul"):
        pos = draw(st.integers(0, len(data)))
        junk = draw(st.sampled_from(NON_UTF8)) if extra == "non_utf8" else b"\x00"
        data = data[:pos] + junk + data[pos:]
    elif extra == "gzip":
        data = gzip.compress(data, mtime=0)
    elif extra == "gzip_truncated":
        packed = gzip.compress(data, mtime=0)
        data = packed[: draw(st.integers(0, len(packed) - 1))]
    elif extra == "trailing_garbage":
        data += draw(st.binary(min_size=1, max_size=20))
    return data


def _json_line(value: Any) -> str:
    return json.dumps(value, allow_nan=True)


@st.composite
def jsonl_trace_bytes(draw: Any, seed: TraceSeed) -> bytes:
    records: list[Any] = [copy.deepcopy(r) for r in seed.records]
    raw: dict[int, str] = {}  # line index -> raw text instead of the record
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from([
            "value", "value", "value", "drop_key", "add_key", "raw_line", "not_object",
            "shuffle", "blank", "empty", "deep", "many", "mutate",
        ]))
        if not records and op not in ("blank", "raw_line", "deep"):
            op = "raw_line"
        if op == "value":
            r = draw(st.integers(0, len(records) - 1))
            if isinstance(records[r], dict) and records[r]:
                key = draw(st.sampled_from(sorted(records[r])))
                records[r][key] = draw(st.sampled_from(JSON_BAD_VALUES).map(copy.deepcopy)
                                       | bad_values)
        elif op == "drop_key":
            r = draw(st.integers(0, len(records) - 1))
            if isinstance(records[r], dict) and records[r]:
                del records[r][draw(st.sampled_from(sorted(records[r])))]
        elif op == "add_key":
            r = draw(st.integers(0, len(records) - 1))
            if isinstance(records[r], dict):
                records[r][draw(st.text(max_size=8))] = draw(bad_values)
        elif op == "raw_line":
            records.append(None)
            raw[len(records) - 1] = draw(st.sampled_from([
                "{", "}", "{\"timestamp\": 1,", "[1, 2]", "42", "\"text\"", "null", "NaN",
                '{"t": 1e400, "in": 1e400, "out": 1}', '{"a": 1} {"b": 2}', "{'t': 1}",
                '{"timestamp": Infinity, "input_length": 1, "output_length": 1}',
                '{"timestamp": 1, "input_length": 1, "input_length": 2, "output_length": 1}',
            ]))
        elif op == "not_object":
            r = draw(st.integers(0, len(records) - 1))
            records[r] = draw(st.sampled_from([[records[r]], 1, "x", None, []]))
        elif op == "shuffle":
            records = (list(draw(st.permutations(records))) if len(records) <= 20
                       else records[::-1])
            raw = {}
        elif op == "blank":
            records.append(None)
            raw[len(records) - 1] = draw(st.sampled_from(["", "   ", "\t"]))
        elif op == "empty":
            records, raw = [], {}
        elif op == "deep":
            records.append(None)
            depth = draw(st.sampled_from([50, 5000, 200_000]))
            raw[len(records) - 1] = "[" * depth + "]" * depth
        elif op == "many" and len(records) <= 100:  # once: records grow to <= 200,000
            records = records * draw(st.sampled_from([100, 2000]))
            raw = {}
        else:
            records = draw(mutated_data(records))
            records = records if isinstance(records, list) else [records]
            raw = {}
    lines = [raw[i] if i in raw else _json_line(r) for i, r in enumerate(records)]
    return draw(serialised(lines))


@st.composite
def json_document_bytes(draw: Any, seed: dict) -> bytes:
    """A JSON document (vllm bench output): mutated data, then maybe mutated text."""
    data = draw(mutated_data(seed))
    text = json.dumps(data, allow_nan=True).encode()
    if draw(st.integers(0, 3)) == 0:
        text = draw(text_mutation(text))
    return text


def trace_bytes(seed: TraceSeed) -> st.SearchStrategy[bytes]:
    if seed.header:
        body = csv_trace_bytes(seed)
    elif seed.records:
        body = jsonl_trace_bytes(seed)
    else:
        assert seed.document is not None
        body = json_document_bytes(seed.document)
    return st.one_of(body, body, body, st.sampled_from(JUNK_FILES), st.binary(max_size=300))


# ----------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """A kind of input: its fuzzed file name, the strategy for its bytes, the companion
    files, and the strategy for the argv of a command that reads it."""

    name: str
    fuzzed: str
    inputs: st.SearchStrategy[bytes]
    companions: tuple[tuple[str, bytes], ...]
    commands: st.SearchStrategy[tuple[tuple[str, ...], str | None]]

    def cases(self) -> st.SearchStrategy[Case]:
        return st.builds(
            lambda data, cmd: Case(self.name, ((self.fuzzed, data[:MAX_INPUT_BYTES]),
                                               *self.companions), cmd[0], cmd[1]),
            self.inputs, self.commands,
        )


def _cmd(*argv: str, writes: str | None = None) -> tuple[tuple[str, ...], str | None]:
    return tuple(argv), writes


POLICY = _read(REPO / "configs/policies/vllm-serve-defaults.yaml")
PROFILE = _read(REPO / "gpu_profiles/h200-llama-3.1-8b.yaml")
SLO = _read(REPO / "configs/slos/mlperf-llama-3.1-8b-server.yaml")
SPACE = _read(REPO / "configs/spaces/default.yaml")
TRACE_LINES = (REPO / "configs/examples/azure-conv-synthetic.csv").read_text().splitlines()
TINY_TRACE = "\n".join(TRACE_LINES[:21]).encode() + b"\n"
NIGHTLY_TRACE = "\n".join(TRACE_LINES[:121]).encode() + b"\n"  # nightly needs >= 100
SMALL_WORKLOAD = _read(PLACE / "workload.yaml")
QUICK_SPACE = _dump({"apiVersion": "servetune/v1", "kind": "SearchSpace", "name": "quick",
                     "knobs": {"batching.max_num_seqs": [64, 256],
                               "batching.max_num_batched_tokens": [2048, 8192]}})
JOB = _dump({"apiVersion": "servetune/v1", "kind": "OptimizeJob", "name": "fuzz",
             "workload": "workload.yaml", "profile": PROFILE_NAME, "slo": "slo.yaml",
             "space": "space.yaml", "method": "milp", "max_simulations": 10,
             "time_limit_s": 30, "seed": 0, "requests": 200})
JOB_WITH_TRACE = _dump({"apiVersion": "servetune/v1", "kind": "OptimizeJob",
                        "trace": "trace.csv", "profile": "profile.yaml", "slo": "slo.yaml",
                        "trace_format": "azure", "engine": "sglang", "requests": 50})

SIM = ("simulate", "--profile", PROFILE_NAME, "--requests", "20")
PLAN = ("plan", "--workload", "{in}/workload.yaml", "--forecast", "{in}/forecast.yaml",
        "--fleet", "{in}/fleet.yaml", "--slo", "{in}/slo.yaml", "-o", "{out}/plan.yaml",
        "--cache-dir", "{out}/cache", "--capacity-method", "candidates",
        "--prompt-edges", "2048", "--output-edges", "128", "-q")
PLACE_CMD = ("place", "--jobs", "{in}/jobs.yaml", "--plan", "{in}/plan.yaml", "--forecast",
             "{in}/forecast.yaml", "-o", "{out}/schedule.yaml", "--cache-dir", "{out}/cache",
             "-q")
OPTIMIZE = ("optimize", "--profile", PROFILE_NAME, "--slo", "{in}/slo.yaml",
            "-o", "{out}/policy.yaml", "-q", "--requests", "50")
NIGHTLY = ("nightly", "--trace", "{in}/nightly.csv", "--profile", "{in}/profile.yaml", "--slo",
           "{in}/slo.yaml", "--current", "{in}/policy.yaml", "--out-dir", "{out}/nightly",
           "-q")
NIGHTLY_FILES = (("nightly.csv", NIGHTLY_TRACE), ("profile.yaml", PROFILE),
                 ("slo.yaml", SLO), ("policy.yaml", POLICY), ("space.yaml", SPACE))
PLACE_FILES = tuple((p.name, p.read_bytes()) for p in sorted(PLACE.glob("*.yaml")))


def _doc_target(name: str, fuzzed: str, seeds: list[Path | bytes],
                companions: tuple[tuple[str, bytes], ...],
                commands: list[tuple[tuple[str, ...], str | None]]) -> Target:
    parsed = [yaml.safe_load(s) if isinstance(s, bytes) else _yaml(s) for s in seeds]
    return Target(name, fuzzed, st.one_of(*(yaml_documents(p) for p in parsed)),
                  tuple((n, d) for n, d in companions if n != fuzzed), st.sampled_from(commands))


def document_targets() -> list[Target]:
    """Every YAML document kind the CLI reads, with the commands that read it."""
    return [
        _doc_target("Policy", "policy.yaml", [REPO / "configs/policies/vllm-serve-defaults.yaml",
                                              REPO / "configs/policies/"
                                              "vllm-serve-defaults-small-gpu.yaml"],
                    (("trace.csv", TINY_TRACE), *NIGHTLY_FILES), [
            _cmd(*NIGHTLY),
            _cmd("export", "--policy", "{in}/policy.yaml", "--engine", "vllm", "-o",
                 "{out}/vllm.yaml", writes="vllm.yaml"),
            _cmd("export", "--policy", "{in}/policy.yaml", "--engine", "tgi", "--json"),
            _cmd(*SIM, "--trace", "{in}/trace.csv", "--policy", "{in}/policy.yaml"),
            _cmd(*SIM, "--trace", "{in}/trace.csv", "--policy", "{in}/policy.yaml",
                 "--engine", "sglang"),
        ]),
        _doc_target("Profile", "profile.yaml", [REPO / "gpu_profiles/h200-llama-3.1-8b.yaml",
                                                REPO / "gpu_profiles/"
                                                "h100-80gb-llama-3.1-70b-tp4.yaml",
                                                PLACE / "big.yaml"],
                    (("trace.csv", TINY_TRACE), *NIGHTLY_FILES), [
            _cmd(*NIGHTLY),
            _cmd("profile", "show", "{in}/profile.yaml"),
            _cmd("profile", "show", "{in}/profile.yaml", "--json"),
            _cmd("simulate", "--profile", "{in}/profile.yaml", "--requests", "20", "--trace",
                 "{in}/trace.csv", "--policy", "{in}/policy.yaml"),
            _cmd("export", "--policy", "{in}/policy.yaml", "--engine", "vllm", "--profile",
                 "{in}/profile.yaml", "-o", "{out}/vllm.yaml", writes="vllm.yaml"),
        ]),
        _doc_target("Workload", "workload.yaml", [REPO / "configs/workloads/azure-conv-2023.yaml",
                                                  DATA / "workload-modulated.yaml",
                                                  DATA / "workload-empirical.yaml",
                                                  DATA / "workload-bootstrap.yaml",
                                                  PLACE / "workload.yaml"],
                    (("policy.yaml", POLICY),), [
            _cmd("workload", "show", "{in}/workload.yaml"),
            _cmd("workload", "show", "{in}/workload.yaml", "--sample", "30", "--json"),
            _cmd(*SIM, "--workload", "{in}/workload.yaml", "--policy", "{in}/policy.yaml"),
        ]),
        _doc_target("SLOSet", "slo.yaml", [REPO / "configs/slos/mlperf-llama-3.1-8b-server.yaml",
                                           PLACE / "slo.yaml"],
                    (("trace.csv", TINY_TRACE), *NIGHTLY_FILES), [
            _cmd(*SIM, "--trace", "{in}/trace.csv", "--policy", "{in}/policy.yaml", "--slo",
                 "{in}/slo.yaml"),
            _cmd(*NIGHTLY),
        ]),
        _doc_target("SearchSpace", "space.yaml", [REPO / "configs/spaces/default.yaml",
                                                  QUICK_SPACE],
                    (("workload.yaml", SMALL_WORKLOAD), *NIGHTLY_FILES), [
            _cmd(*OPTIMIZE, "--workload", "{in}/workload.yaml", "--space", "{in}/space.yaml"),
            _cmd(*NIGHTLY, "--space", "{in}/space.yaml"),
        ]),
        _doc_target("OptimizeJob", "job.yaml", [JOB, JOB_WITH_TRACE],
                    (("workload.yaml", SMALL_WORKLOAD), ("slo.yaml", SLO), ("space.yaml", SPACE),
                     ("trace.csv", TINY_TRACE), ("profile.yaml", _read(PLACE / "big.yaml"))), [
            _cmd("optimize", "{in}/job.yaml", "-o", "{out}/policy.yaml", "-q"),
        ]),
        _doc_target("Fleet", "fleet.yaml", [PLACE / "fleet.yaml"], PLACE_FILES, [_cmd(*PLAN)]),
        _doc_target("Forecast", "forecast.yaml", [PLACE / "forecast.yaml", PLACE / "day.yaml"],
                    PLACE_FILES, [_cmd(*PLAN), _cmd(*PLACE_CMD)]),
        _doc_target("Jobs", "jobs.yaml", [PLACE / "jobs.yaml",
                                          REPO / "configs/batch_jobs/nightly.yaml"],
                    PLACE_FILES, [_cmd(*PLACE_CMD)]),
        _doc_target("CapacityPlan", "plan.yaml", [PLACE / "plan.yaml"], PLACE_FILES,
                    [_cmd(*PLACE_CMD)]),
    ]


# Options a trace command may take: drawn per case, including wrong ones.
@st.composite
def trace_options(draw: Any, seed: TraceSeed) -> tuple[str, ...]:
    opts: list[str] = ["--on-bad-row", draw(st.sampled_from(["error", "error", "skip"]))]
    fmt = draw(st.sampled_from([None, None, None, seed.fmt, "azure", "mooncake", "csv",
                                "vllm-bench", "parquet"]))
    if fmt is not None:
        opts += ["--trace-format", fmt]
    columns = seed.columns
    if columns is None and draw(st.integers(0, 5)) == 0:
        columns = "arrival=TIMESTAMP,prompt=ContextTokens,output=GeneratedTokens"
    if columns is not None and draw(st.integers(0, 4)) == 0:
        columns = draw(st.sampled_from([
            columns.replace("arrival=", "arrivals="), columns.split(",prompt")[0],
            columns + ",prompt=x", columns.replace("output=", "output=missing_"), "",
            "arrival=,prompt=in,output=out", ",,,",
        ]))
    if columns is not None:
        opts += ["--columns", columns]
    if seed.columns is not None or draw(st.integers(0, 5)) == 0:
        unit = draw(st.sampled_from([None, None, "s", "ms", "us", "ns", "datetime", "weeks"]))
        if unit is not None:
            opts += ["--arrival-unit", unit]
    return tuple(opts)


def _trace_commands(seed: TraceSeed) -> st.SearchStrategy[tuple[tuple[str, ...], str | None]]:
    def build(which: int, opts: tuple[str, ...]) -> tuple[tuple[str, ...], str | None]:
        if which == 0:
            return _cmd("trace", "stats", "{in}/trace", *opts)
        if which == 1:
            return _cmd("trace", "stats", "{in}/trace", "--json", *opts)
        if which == 2:
            return _cmd("workload", "fit", "{in}/trace", "-o", "{out}/w.yaml", *opts,
                        writes="w.yaml")
        if which == 3:
            return _cmd("workload", "fit", "{in}/trace", "-o", "{out}/w.yaml", "--split-by",
                        "class", "--rate-windows", "1", *opts, writes="w.yaml")
        return _cmd(*SIM, "--trace", "{in}/trace", "--policy", "{in}/policy.yaml", *opts)

    return st.builds(build, st.integers(0, 4), trace_options(seed))


def trace_targets() -> list[Target]:
    return [Target(f"trace:{name}", "trace", trace_bytes(seed), (("policy.yaml", POLICY),),
                   _trace_commands(seed))
            for name, seed in TRACE_SEEDS.items()]


# ----------------------------------------------------------------------------- bench results


def bench_seeds() -> dict[str, bytes]:
    send = np.array([0.0, 0.4, 0.9, 1.3])
    vllm = vllm_detailed_result(send, np.array([120, 800, 40, 2000]), np.array([30, 5, 60, 2]),
                                send + 0.05, send + np.array([0.6, 0.2, 1.1, 0.3]),
                                request_rate=2.0)
    sglang = {"backend": "sglang", "request_rate": "inf", "max_concurrency": 2,
              "input_lens": [100, 200, 50], "output_lens": [4, 2, 9],
              "ttfts": [0.05, 0.06, 0.02], "itls": [[0.01] * 3, [0.02], [0.01] * 8],
              "errors": ["", "", ""]}
    aiperf = [
        {"metadata": {"request_start_ns": 1_759_813_207_000_000_000 + i * 250_000_000},
         "metrics": {"input_sequence_length": {"value": 100 + 50 * i, "unit": "tokens"},
                     "output_sequence_length": {"value": 10 + i, "unit": "tokens"},
                     "time_to_first_token": {"value": 40.0 + i, "unit": "ms"},
                     "request_latency": {"value": 200.0 + 10 * i, "unit": "ms"}},
         "error": None}
        for i in range(4)
    ]
    return {
        "vllm-bench": json.dumps(vllm).encode(),
        "sglang-bench": (json.dumps(sglang) + "\n").encode(),
        "aiperf": "".join(json.dumps(r) + "\n" for r in aiperf).encode(),
    }


@st.composite
def bench_bytes(draw: Any, fmt: str, seed: bytes) -> bytes:
    if fmt == "aiperf":
        records = [json.loads(ln) for ln in seed.decode().splitlines()]
        data = draw(mutated_data(records))
        lines = [json.dumps(r, allow_nan=True) for r in (data if isinstance(data, list)
                                                          else [data])]
        out = ("\n".join(lines) + "\n").encode()
    else:
        out = draw(json_document_bytes(json.loads(seed)))
        if fmt == "sglang-bench":
            out += b"\n"
    if draw(st.integers(0, 4)) == 0:
        out = draw(text_mutation(out))
    return out


def bench_targets() -> list[Target]:
    targets = []
    for fmt, seed in bench_seeds().items():
        commands = st.builds(
            lambda bench_format, concurrency: _cmd(
                "validate", "--bench-result", "{in}/result", "--profile", PROFILE_NAME,
                "--policy", "{in}/policy.yaml", *bench_format, *concurrency),
            st.sampled_from([(), (), ("--bench-format", fmt), ("--bench-format", "aiperf")]),
            st.sampled_from([(), (), ("--max-concurrency", "2"), ("--max-concurrency", "0")]),
        )
        inputs = st.one_of(bench_bytes(fmt, seed), bench_bytes(fmt, seed),
                           st.sampled_from(JUNK_FILES))
        targets.append(Target(f"bench:{fmt}", "result", inputs, (("policy.yaml", POLICY),),
                              commands))
    return targets


def measurement_targets() -> list[Target]:
    """The whole-step timings `profile check --measured` compares a profile with."""
    lines = (REPO / "gpu_profiles/calibration/h200/step_graph_llama-3.1-8b.csv"
             ).read_text().splitlines()
    seed = TraceSeed("csv", tuple(lines[0].split(",")),
                     tuple(tuple(ln.split(",")) for ln in lines[1:13]))
    commands = st.sampled_from([
        _cmd("profile", "check", "--profile", PROFILE_NAME, "--measured", "{in}/steps.csv"),
        _cmd("profile", "check", "--profile", PROFILE_NAME, "--measured", "{in}/steps.csv",
             "--json"),
        _cmd("profile", "check", "--profile", PROFILE_NAME, "--measured", "{in}/steps.csv",
             "--model", "llama-3.1-70b"),
    ])
    return [Target("measured:step-csv", "steps.csv", trace_bytes(seed), (), commands)]


def all_targets() -> list[Target]:
    return [*document_targets(), *trace_targets(), *bench_targets(), *measurement_targets()]


# ----------------------------------------------------------------------------- output faults

def _bench_result() -> bytes:
    return bench_seeds()["vllm-bench"]


# Valid runs of every command that writes into out/: (files, argv). Under each fault each
# must fail in one line, or reach its (stubbed) work before writing, and leave out/ empty.
WRITERS: list[tuple[tuple[tuple[str, bytes], ...], tuple[str, ...]]] = [
    ((("policy.yaml", POLICY),),
     ("export", "--policy", "{in}/policy.yaml", "--engine", "vllm", "-o", "{out}/vllm.yaml")),
    ((("policy.yaml", POLICY),),
     ("export", "--policy", "{in}/policy.yaml", "--engine", "sglang", "-o",
      "{out}/deep/er/sglang.yaml")),
    ((("policy.yaml", POLICY),),
     ("export", "--policy", "{in}/policy.yaml", "--engine", "trtllm", "--profile",
      PROFILE_NAME, "-o", "{out}/trtllm.yaml", "--gateway-rules", "{out}/rules.yaml")),
    ((("trace.csv", TINY_TRACE), ("policy.yaml", POLICY)),
     (*SIM, "--trace", "{in}/trace.csv", "--policy", "{in}/policy.yaml", "--json-out",
      "{out}/summary.json", "--records", "{out}/records.csv", "--steps", "{out}/steps.jsonl",
      "--timeline", "{out}/timeline.json", "-q")),
    ((("trace.csv", TINY_TRACE), ("policy.yaml", POLICY), ("slo.yaml", SLO)),
     ("goodput", "--profile", PROFILE_NAME, "--requests", "20", "--trace", "{in}/trace.csv",
      "--policy", "{in}/policy.yaml", "--slo", "{in}/slo.yaml", "--json-out",
      "{out}/goodput.json", "-q")),
    ((("trace.csv", TINY_TRACE),), ("workload", "fit", "{in}/trace.csv", "-o", "{out}/w.yaml")),
    ((("result.json", _bench_result()), ("policy.yaml", POLICY)),
     ("validate", "--bench-result", "{in}/result.json", "--profile", PROFILE_NAME, "--policy",
      "{in}/policy.yaml", "--calibrate", "-o", "{out}/mine.yaml")),
    ((("workload.yaml", SMALL_WORKLOAD), ("slo.yaml", SLO)),
     (*OPTIMIZE, "--workload", "{in}/workload.yaml")),
    (NIGHTLY_FILES, NIGHTLY),
    (PLACE_FILES, PLAN),
    (PLACE_FILES, PLACE_CMD),
]


def fault_cases() -> list[Case]:
    """Each writer of WRITERS under each of FAULTS."""
    return [Case(f"fault:{fault}", files, argv, None, fault)
            for files, argv in WRITERS for fault in FAULTS]


# Commands that print to standard output, for the stdout faults (a subprocess each).
PRINTERS: list[tuple[tuple[tuple[str, bytes], ...], tuple[str, ...]]] = [
    ((), ("profile", "show", PROFILE_NAME)),
    ((("trace.csv", TINY_TRACE),), ("trace", "stats", "{in}/trace.csv", "--json")),
    ((("workload.yaml", SMALL_WORKLOAD),),
     ("workload", "show", "{in}/workload.yaml", "--sample", "30", "--json")),
    ((("trace.csv", TINY_TRACE), ("policy.yaml", POLICY)),
     (*SIM, "--trace", "{in}/trace.csv", "--policy", "{in}/policy.yaml")),
    ((("policy.yaml", POLICY),), ("export", "--policy", "{in}/policy.yaml", "--engine", "tgi",
                                  "--json")),
]
STDOUT_FAULTS = ("full", "closed", "pipe closed early")


def stdout_fault_run(files: tuple[tuple[str, bytes], ...], argv: tuple[str, ...],
                     fault: str, timeout_s: float = CASE_TIMEOUT_S) -> tuple[int, str]:
    """Run the console script's entry point in a subprocess with standard output on
    ``/dev/full``, closed, or a pipe whose reader left before the first byte: (exit
    code, stderr)."""
    with tempfile.TemporaryDirectory(prefix="servetune-fuzz-") as tmp:
        in_dir = Path(tmp) / "in"
        in_dir.mkdir()
        for name, data in files:
            (in_dir / name).write_bytes(data)
        cmd = [sys.executable, "-c", "from servetune.cli import run; run()",
               *(a.replace("{in}", str(in_dir)).replace("{out}", tmp) for a in argv)]
        run = {"stderr": subprocess.PIPE, "timeout": timeout_s, "check": False}
        if fault == "full":
            with open("/dev/full", "wb") as full:
                done = subprocess.run(cmd, stdout=full, **run)
        elif fault == "closed":
            done = subprocess.run(cmd, preexec_fn=lambda: os.close(1), **run)  # noqa: PLW1509
        else:
            assert fault == "pipe closed early", fault
            read, write = os.pipe()
            os.close(read)
            try:
                done = subprocess.run(cmd, stdout=write, **run)
            finally:
                os.close(write)
        return done.returncode, done.stderr.decode(errors="replace")


# ----------------------------------------------------------------------------- resource bounds
# The largest value each size flag accepts must run to completion (or, for a sweep of the
# most jobs a file may expand to, run its first jobs) in a bounded process: peak RSS under
# MEMORY_BOUND_BYTES. Each case runs the console script in a subprocess; the rusage of
# that child gives its peak.

MEMORY_BOUND_BYTES = 4 << 30
WORKLOAD = str(REPO / "configs/workloads/azure-conv-2023.yaml")
POLICY_PATH = str(REPO / "configs/policies/vllm-serve-defaults.yaml")
SLO_PATH = str(REPO / "configs/slos/mlperf-llama-3.1-8b-server.yaml")


@functools.cache
def _h200_blocks() -> int:
    from servetune.profiles.shipped import load_profile

    return load_profile(PROFILE_NAME).kv_blocks()


def _largest_cluster(replicas: int) -> int:
    """The most requests the cluster-state bound admits on ``replicas`` H200 8B replicas
    (servetune.sim.cluster._check_state_bytes)."""
    from servetune.engines import (
        CLUSTER_BYTES_PER_KV_BLOCK,
        CLUSTER_BYTES_PER_REQUEST,
        MAX_CLUSTER_STATE_BYTES,
    )
    left = MAX_CLUSTER_STATE_BYTES - replicas * _h200_blocks() * CLUSTER_BYTES_PER_KV_BLOCK
    return int(left // (replicas * CLUSTER_BYTES_PER_REQUEST))


def bound_cases() -> list[tuple[str, list[str], float]]:
    """(what, argv with {out} for the output folder, seconds to let it run; 0: to the
    end) for every size flag at its largest accepted value."""
    from servetune.apps.sweep import MAX_SWEEP_JOBS
    from servetune.routers import MAX_ROUTED_REPLICAS
    from servetune.workloads.fitting import MAX_SAMPLE_REQUESTS

    sim = ["--profile", PROFILE_NAME, "--policy", POLICY_PATH]
    most = str(MAX_SAMPLE_REQUESTS)
    # the most H200 replicas the state bound admits for a run of 20 requests a replica,
    # and the requests it then admits
    replicas = 1
    while _largest_cluster(replicas + 1) >= 20 * (replicas + 1):
        replicas += 1
    half = replicas // 2
    return [
        ("workload show --sample at its cap", ["workload", "show", WORKLOAD, "--sample", most,
                                               "--json"], 0.0),
        ("simulate --requests at its cap", ["simulate", "--workload", WORKLOAD, "--requests",
                                            most, *sim, "--json-out", "{out}/s.json"], 0.0),
        (f"simulate --replicas {replicas} (the state bound)",
         ["simulate", "--workload", WORKLOAD, "--requests", str(_largest_cluster(replicas)),
          "--rate-scale", "100", "--replicas", str(replicas), *sim,
          "--json-out", "{out}/s.json"], 0.0),
        (f"simulate --disagg {half}:{half}",
         ["simulate", "--workload", WORKLOAD, "--requests",
          str(_largest_cluster(2 * half)), "--rate-scale", "100", "--disagg", f"{half}:{half}",
          *sim, "--json-out", "{out}/s.json"], 0.0),
        (f"simulate --router least_loaded --replicas {MAX_ROUTED_REPLICAS}",
         ["simulate", "--workload", WORKLOAD, "--requests",
          str(min(MAX_SAMPLE_REQUESTS, _largest_cluster(MAX_ROUTED_REPLICAS))),
          "--rate-scale", str(MAX_ROUTED_REPLICAS), "--replicas", str(MAX_ROUTED_REPLICAS),
          "--router", "least_loaded", *sim, "--json-out", "{out}/s.json"], 0.0),
        ("goodput --requests at its cap",
         ["goodput", "--workload", WORKLOAD, "--requests", most, *sim, "--slo", SLO_PATH,
          "--tolerance", "0.2", "--json-out", "{out}/g.json"], 0.0),
        (f"sweep of {MAX_SWEEP_JOBS:,} jobs (its first minute)",
         ["sweep", "{out}/sweep.yaml", "--out-dir", "{out}/sweep", "--workers", "1"], 60.0),
    ]


def write_largest_sweep(folder: Path) -> Path:
    """A sweep file that expands to exactly MAX_SWEEP_JOBS optimize jobs (seeds)."""
    from servetune.apps.sweep import MAX_SWEEP_JOBS

    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump({
        "apiVersion": "servetune/v1", "kind": "Sweep", "name": "largest",
        "defaults": {"requests": 100, "max_simulations": 4},
        "products": [{"command": "optimize", "method": "random",
                      "profiles": [PROFILE_NAME], "workloads": [WORKLOAD], "slos": [SLO_PATH],
                      "seeds": list(range(MAX_SWEEP_JOBS))}],
    }), encoding="utf-8")
    return path


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def bounded_run(argv: list[str], stop_after_s: float = 0.0, timeout_s: float = 1800.0
                ) -> tuple[int, int, float, str]:
    """Run the console script with ``argv`` ({out}: a fresh folder); stop it with SIGINT
    after ``stop_after_s`` seconds if given. (exit code, peak RSS in bytes, seconds,
    stderr)."""
    with tempfile.TemporaryDirectory(prefix="servetune-bound-") as tmp:
        out = Path(tmp)
        if "{out}/sweep.yaml" in argv:
            write_largest_sweep(out)
        cmd = [sys.executable, "-c", "from servetune.cli import run; run()",
               *(a.replace("{out}", tmp) for a in argv)]
        err_path = out / "stderr.txt"
        started = time.perf_counter()
        with open(err_path, "wb") as err:
            # SIGINT as a terminal sends it (a background shell job starts its children
            # with it ignored, and Python then never raises KeyboardInterrupt)
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err,
                                    preexec_fn=_default_sigint)  # noqa: PLW1509
            limit = stop_after_s or timeout_s
            # reaped here, not by Popen, so that the child's rusage (its peak RSS) is read
            done, status, usage = os.wait4(proc.pid, os.WNOHANG)
            while not done and time.perf_counter() - started < limit:
                time.sleep(0.2)
                done, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if not done:
                proc.send_signal(signal.SIGINT if stop_after_s else signal.SIGKILL)
                _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - started
        code = os.waitstatus_to_exitcode(status)
        proc.returncode = code  # (reaped above)
        return code, usage.ru_maxrss * 1024, seconds, err_path.read_text(errors="replace")
