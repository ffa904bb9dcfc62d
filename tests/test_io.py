"""servetune.io: hashing, JSON cleaning, path checks and atomic writes."""

from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np
import pytest

import servetune.io as io_mod
from servetune.errors import ServetuneError
from servetune.io import (
    check_out_dir,
    check_out_file,
    check_out_files,
    commit_files,
    decode_text,
    drop_timings,
    finite_or_none,
    plain_data,
    read_bytes,
    require_file,
    round_floats,
    sha256_doc,
    sha256_file,
    sha256_json,
    write_all_or_none,
    write_text_atomic,
)
from servetune.schemas.policy import Policy

# ------------------------------------------------------------------------- hashing


def test_file_hash_reads_in_chunks_and_matches_the_whole_file(tmp_path):
    data = bytes(range(256)) * (3 * 4096 + 7)  # 3 MiB and a bit: several 1 MiB chunks
    path = tmp_path / "trace.bin"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()


def test_json_hash_ignores_key_order_and_doc_hash_follows_the_document():
    assert sha256_json({"a": 1, "b": [1, 2]}) == sha256_json({"b": [1, 2], "a": 1})
    assert sha256_json({"a": 1}) != sha256_json({"a": 2})
    policy = Policy(name="p")
    assert sha256_doc(policy) == hashlib.sha256(policy.model_dump_json().encode()).hexdigest()
    assert sha256_doc(policy) != sha256_doc(Policy(name="q"))


# ------------------------------------------------------------------- JSON cleaning


def test_plain_data_makes_numpy_and_tuples_json_safe_in_key_order():
    data = {2: (np.int64(3), np.float32(0.5)), "z": np.array([[1, 2]]), "a": np.bool_(True),
            "bad": [math.nan, math.inf, -math.inf]}
    out = plain_data(data)
    assert out == {"2": [3, 0.5], "z": [[1, 2]], "a": True, "bad": [None, None, None]}
    assert list(out) == ["2", "z", "a", "bad"]
    assert type(out["2"][0]) is int and type(out["a"]) is bool
    json.dumps(out, allow_nan=False)  # no numpy type and no NaN left


def test_plain_data_can_keep_non_finite_values():
    out = plain_data({"x": np.array([np.nan, 1.0])}, finite=False)
    assert math.isnan(out["x"][0]) and out["x"][1] == 1.0


def test_round_floats_keeps_six_significant_digits_and_drops_non_finite():
    out = round_floats({"a": 1.23456789, "b": [np.float64(123456.789), 7], "c": (math.nan,)})
    assert out == {"a": 1.23457, "b": [123457.0, 7], "c": [None]}
    assert round_floats(0.000123456789, digits=3) == 0.000123


def test_finite_or_none():
    assert finite_or_none(None) is None
    assert finite_or_none(np.float64("nan")) is None
    assert finite_or_none(math.inf) is None
    assert finite_or_none(np.int64(2)) == 2.0


def test_drop_timings_removes_wall_clock_figures_at_every_depth():
    summary = {"wall_s": 1.0, "method": "milp",
               "iterations": [{"solve_s": 0.1, "candidates": 3}], "sim": {"sim_wall_s": 2}}
    assert drop_timings(summary) == {"method": "milp", "iterations": [{"candidates": 3}],
                                     "sim": {}}


# --------------------------------------------------------------------------- paths


def test_require_file_names_the_path_and_where_it_came_from(tmp_path):
    f = tmp_path / "slo.yaml"
    f.write_text("x")
    assert require_file(f, "given to --slo") == f
    with pytest.raises(ServetuneError) as err:
        require_file(tmp_path / "missing.yaml", "given to --slo")
    assert err.value.message == f"{tmp_path / 'missing.yaml'}: file not found (given to --slo)"
    with pytest.raises(ServetuneError) as err:
        require_file(tmp_path, "given as JOB")
    assert err.value.message == f"{tmp_path}: is a directory (given as JOB); give a file"


def test_output_checks_refuse_folders_files_in_the_way_and_shared_paths(tmp_path):
    blocker = tmp_path / "report"
    blocker.write_text("a file")
    with pytest.raises(ServetuneError, match="is a folder; give a file path"):
        check_out_file(tmp_path, "-o")
    with pytest.raises(ServetuneError, match="report is a file, not a folder"):
        check_out_file(blocker / "plan.yaml", "-o")
    with pytest.raises(ServetuneError, match="not a folder"):
        check_out_dir(blocker / "sub", "--out-dir")
    check_out_dir(tmp_path / "new" / "folder", "--out-dir")  # created later: fine
    with pytest.raises(ServetuneError, match="given to both --json and --steps"):
        check_out_files({"--json": tmp_path / "a.json", "--records": None,
                         "--steps": tmp_path / "x" / ".." / "a.json"})
    with pytest.raises(ServetuneError, match="is a directory"):
        check_out_files({"--json": tmp_path})


# ----------------------------------------------------------------------- atomic writes


def test_atomic_write_gives_a_normal_file_mode_and_leaves_no_temp(tmp_path):
    target = tmp_path / "out" / "policy.yaml"
    write_text_atomic(target, "a: 1\n")
    write_text_atomic(target, "a: 2\n")
    assert target.read_text() == "a: 2\n"
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask
    assert [p.name for p in target.parent.iterdir()] == ["policy.yaml"]


def test_atomic_write_below_a_file_names_the_file(tmp_path):
    blocker = tmp_path / "report"
    blocker.write_text("not a folder")
    with pytest.raises(ServetuneError, match=r"report is a file, not a folder"):
        write_text_atomic(blocker / "sub" / "policy.yaml", "a: 1\n")
    assert blocker.read_text() == "not a folder"


def test_commit_files_writes_the_set_or_leaves_the_previous_one(tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert commit_files(out, [("a.txt", b"1"), ("b.txt", b"2")]) == [out / "a.txt",
                                                                      out / "b.txt"]
    steps = []

    def interrupted(step: str) -> None:
        steps.append(step)
        if step.startswith("writing"):
            raise KeyboardInterrupt  # interrupted between the new set's two files

    monkeypatch.setattr(io_mod, "_pause", interrupted)
    with pytest.raises(KeyboardInterrupt):
        commit_files(out, [("a.txt", b"new 1"), ("b.txt", b"new 2")])
    assert steps == ["writing .generations/000002"]
    # nothing left behind: no unfinished generation, no temporary file, no lock
    assert sorted(p.name for p in out.iterdir()) == [".generations", "a.txt", "b.txt",
                                                     "current"]
    assert [p.name for p in (out / ".generations").iterdir()] == ["000001"]
    assert (out / "a.txt").read_bytes() == b"1"  # the previous set, whole


def test_write_all_or_none_removes_what_it_wrote_when_a_writer_fails(tmp_path):
    first, second = tmp_path / "records.csv", tmp_path / "steps.jsonl"

    def fail() -> None:
        raise ServetuneError("disk full")

    with pytest.raises(ServetuneError, match="disk full"):
        write_all_or_none([(first, lambda: first.write_text("x")), (second, fail)])
    assert not first.exists()
    write_all_or_none([(first, lambda: first.write_text("x"))])
    assert first.read_text() == "x"


def test_a_rollback_that_fails_leaves_the_writers_error(tmp_path, monkeypatch):
    """On a read-only file system even removing a file that was never made fails (EROFS);
    the error that stopped the writes is still the one reported, not the rollback's."""
    import errno

    target = tmp_path / "summary.json"

    def refuse(*_args, **_kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    def write() -> None:
        monkeypatch.setattr(type(target), "unlink", refuse)
        raise ServetuneError(f"{target}: cannot write (Read-only file system)")

    with pytest.raises(ServetuneError, match="cannot write"):
        write_all_or_none([(target, write)])


def test_reading_names_the_file_and_what_was_expected(tmp_path):
    with pytest.raises(ServetuneError) as err:
        read_bytes(tmp_path / "none.yaml", "YAML")
    assert err.value.message == f"{tmp_path / 'none.yaml'}: file not found"
    with pytest.raises(ServetuneError) as err:
        read_bytes(tmp_path, "CSV")
    assert err.value.message == f"{tmp_path}: is a directory, expected a CSV file"
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("name: caf\xe9\r\n".encode("latin-1"))
    with pytest.raises(ServetuneError, match="latin.yaml: not UTF-8 text; expected a YAML"):
        decode_text(read_bytes(latin, "YAML"), latin, "YAML")
    crlf = tmp_path / "crlf.csv"
    crlf.write_bytes("\ufeffa,b\r\n1,2\r3\n".encode())
    # universal newlines, as a file opened in text mode reads; utf-8-sig drops the BOM
    assert decode_text(read_bytes(crlf, "CSV"), crlf, "CSV", "utf-8-sig") == "a,b\n1,2\n3\n"


def test_a_full_disk_at_the_lock_is_one_error_and_leaves_nothing(tmp_path, monkeypatch):
    """The lock file is made, but its pid line does not fit (ENOSPC): one error naming the
    folder, and neither the lock nor the folder the lock made is left (issue 33)."""
    import errno

    import servetune.io as io_mod

    real_write = io_mod.os.write

    def full(fd, data):
        if data.endswith(b"\n") and data[:-1].isdigit():  # the lock's pid line
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(io_mod.os, "write", full)
    out = tmp_path / "new" / "out"
    with pytest.raises(ServetuneError, match=r"cannot write the lock file \.lock \(No space"):
        with io_mod.output_folder_lock(out):
            pass
    assert not (tmp_path / "new").exists()

