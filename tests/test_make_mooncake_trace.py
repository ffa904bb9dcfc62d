"""benchmarks/make_mooncake_trace.py: the tiled Mooncake trace is deterministic, valid
Mooncake JSON Lines that servetune loads, its copies share no prefix id, and every
source request is in every copy, shifted in time and ids only."""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

from servetune.errors import ServetuneError
from servetune.workloads.formats import load_trace

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "make_mooncake_trace.py"

# Two requests share a 2-block prefix; arrivals 0, 0, 40, 90 ms (span 90, mean gap 30).
SOURCE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 6, "hash_ids": [0, 1, 2]},
    {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [3, 4]},
    {"timestamp": 40, "input_length": 1500, "output_length": 20, "hash_ids": [0, 1, 5]},
    {"timestamp": 90, "input_length": 512, "output_length": 3, "hash_ids": [6]},
]


def load_script():
    spec = importlib.util.spec_from_file_location("make_mooncake_trace", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_source(path: Path, rows=SOURCE) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return [json.loads(x) for x in data.decode().splitlines()]


def test_small_case_exactly(tmp_path):
    mod = load_script()
    out = mod.tile(SOURCE, 3)
    # period = span 90 + mean gap 30 = 120 ms; id stride = max id 6 + 1 = 7
    assert [r["timestamp"] for r in out] == [0, 0, 40, 90, 120, 120, 160, 210, 240, 240, 280, 330]
    assert out[4] == {"timestamp": 120, "input_length": 1100, "output_length": 6,
                      "hash_ids": [7, 8, 9]}
    assert out[10]["hash_ids"] == [14, 15, 19]
    assert SOURCE[0]["hash_ids"] == [0, 1, 2]  # the source rows are not changed
    assert mod.tile(SOURCE, 2, gap_ms=0)[4]["timestamp"] == 90  # next copy starts at once


def test_deterministic_bytes_plain_and_gzip(tmp_path):
    mod = load_script()
    src = write_source(tmp_path / "src.jsonl")
    outs = []
    for name in ("a.jsonl", "b.jsonl", "a.jsonl.gz", "b.jsonl.gz"):
        assert mod.main([str(tmp_path / name), "--source", str(src), "--copies", "4"]) == 0
        outs.append((tmp_path / name).read_bytes())
    assert outs[0] == outs[1] and outs[2] == outs[3]
    assert gzip.decompress(outs[2]) == outs[0]
    # copy 0 is the source, byte for byte
    assert outs[0].startswith(src.read_bytes())


def test_format_valid_and_loads_as_mooncake(tmp_path):
    mod = load_script()
    src = write_source(tmp_path / "src.jsonl")
    out = tmp_path / "long.jsonl.gz"
    assert mod.main([str(out), "--source", str(src), "--copies", "5"]) == 0
    rows = lines(out)
    assert len(rows) == 5 * len(SOURCE)
    stamps = [r["timestamp"] for r in rows]
    assert stamps == sorted(stamps)
    for r in rows:
        assert list(r) == ["timestamp", "input_length", "output_length", "hash_ids"]
        assert len(r["hash_ids"]) * 512 >= r["input_length"]  # ids cover the prompt
    trace = load_trace(out, "mooncake")
    assert len(trace) == 20
    assert trace.prefix_offsets is not None
    assert trace.prefix_block_ids.tolist() == [i for r in rows for i in r["hash_ids"]]
    assert trace.arrival_s[-1] == pytest.approx(stamps[-1] / 1000.0)


def copy_of(rows: list[dict], stride: int) -> list[int]:
    """Which copy each output row came from (ids of copy c lie in [c*stride, (c+1)*stride))."""
    return [r["hash_ids"][0] // stride for r in rows]


@pytest.mark.parametrize("jitter", [0, 25])
def test_copies_share_no_id_and_nothing_is_lost(jitter):
    mod = load_script()
    copies = 6
    rows = mod.tile(SOURCE, copies, jitter_ms=jitter, seed=3)
    stride = 7  # max id 6 + 1
    ids_by_copy: dict[int, set[int]] = {}
    restored: Counter = Counter()
    for r, c in zip(rows, copy_of(rows, stride), strict=True):
        ids = set(r["hash_ids"])
        assert all(c * stride <= i < (c + 1) * stride for i in ids)
        ids_by_copy.setdefault(c, set()).update(ids)
        back = {**r, "hash_ids": [i - c * stride for i in r["hash_ids"]]}
        if jitter == 0:
            back["timestamp"] -= c * 120
        else:
            del back["timestamp"]
        restored[json.dumps(back, sort_keys=True)] += 1
    for a in ids_by_copy:
        for b in ids_by_copy:
            if a < b:
                assert not ids_by_copy[a] & ids_by_copy[b]
    expected: Counter = Counter()
    for r in SOURCE:
        key = dict(r) if jitter == 0 else {k: v for k, v in r.items() if k != "timestamp"}
        expected[json.dumps(key, sort_keys=True)] += copies
    assert restored == expected


def test_jitter_depends_on_the_seed_only_when_asked():
    mod = load_script()
    assert mod.tile(SOURCE, 4, seed=1) == mod.tile(SOURCE, 4, seed=2)
    a = mod.tile(SOURCE, 4, jitter_ms=30, seed=1)
    assert a == mod.tile(SOURCE, 4, jitter_ms=30, seed=1)
    assert a != mod.tile(SOURCE, 4, jitter_ms=30, seed=2)
    assert a[: len(SOURCE)] == SOURCE  # copy 0 is never moved
    assert all(r["timestamp"] >= 0 for r in a)


def test_sessions_stay_apart():
    mod = load_script()
    rows = mod.tile([{**SOURCE[0], "session_id": "s"}], 2)
    assert [r["session_id"] for r in rows] == ["s-c0", "s-c1"]


def test_errors_name_the_file_and_line(tmp_path, capsys):
    mod = load_script()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(SOURCE[0]) + "\n" + '{"timestamp": 1, "input_length": 0, '
                   '"output_length": 1, "hash_ids": [1]}\n')
    out = tmp_path / "out.jsonl"
    assert mod.main([str(out), "--source", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"make_mooncake_trace: error: {bad}: line 2: field input_length must be an "
                   "integer >= 1, got 0")
    assert not out.exists()  # no partial output
    with pytest.raises(ServetuneError, match="above the replay peer's u32 token ids"):
        mod.tile([{**SOURCE[0], "hash_ids": [2**31]}], 2)
    with pytest.raises(ServetuneError, match="copies"):
        mod.tile(SOURCE, 0)


def test_shared_trace_tiles_without_loss(tmp_path):
    mod = load_script()
    if not mod.SHARED_TRACE.exists():
        pytest.skip("shared Mooncake trace not present")
    source = mod.read_rows(mod.SHARED_TRACE)
    rows = mod.tile(source, 2)
    assert len(rows) == 2 * len(source) == 7986
    assert rows[: len(source)] == source
    stride = 1 + max(i for r in source for i in r["hash_ids"])
    period = source[-1]["timestamp"] - source[0]["timestamp"] + mod.mean_gap_ms(source)
    shifted = [{**r, "timestamp": r["timestamp"] - period,
                "hash_ids": [i - stride for i in r["hash_ids"]]} for r in rows[len(source):]]
    assert shifted == source
