"""Fuzzing: whatever bytes a trace or workload file holds, the only exception that escapes
is ServetuneError (and a file that loads gives a valid trace)."""

from __future__ import annotations

import gzip
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import workload_from_yaml_text
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from servetune.errors import ServetuneError
from servetune.workloads.fitting import sample_trace
from servetune.workloads.formats import FORMATS, load_trace
from servetune.workloads.trace import Trace

FUZZ = settings(max_examples=120, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

AZURE = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:15:46.6805900,374,44\n"
    "2023-11-16 18:15:50.9951690,396,109\n"
    "2023-11-16 18:15:51.2224670,879,55\n"
)
BURSTGPT = (
    "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    "5.0,ChatGPT,100,20,120,Conversation log\n"
    "1.5,GPT-4,50,0,50,API log\n"
)
MOONCAKE = (
    '{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]}\n'
    '{"timestamp": 27, "input_length": 600, "output_length": 5, "hash_ids": [1]}\n'
)
VLLM = json.dumps({"input_lens": [10, 20], "output_lens": [5, 6], "errors": ["", ""],
                   "start_times": [1.0, 1.5], "request_rate": 2.0})
GENERIC = "ts,in,out,cls\n0.5,10,3,a\n0.25,20,4,\"b, c\"\n"
GENERIC_COLUMNS = "arrival=ts,prompt=in,output=out,class=cls"

# "1" and 400 zeros: an integer JSON reads exactly and float() cannot hold
ALPHABET = st.sampled_from(list(',\n\r"{}[]:- .0123456789eE+xNaTé\x00\t')
                           + ["1e400", "nan", "1" + "0" * 400])


@st.composite
def mutated(draw, base: str) -> bytes:
    """``base`` with a few random insertions, deletions and replacements."""
    text = list(base)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        pos = draw(st.integers(0, max(len(text) - 1, 0)))
        if op == "insert":
            text.insert(pos, draw(ALPHABET))
        elif op == "delete" and text:
            del text[pos]
        elif text:
            text[pos] = draw(ALPHABET)
    data = "".join(text).encode("utf-8", errors="replace")
    if draw(st.booleans()):
        data = gzip.compress(data, mtime=0)
        if draw(st.booleans()):  # truncated gzip stream
            data = data[: draw(st.integers(0, len(data)))]
    return data


def _check_load(data: bytes, **kwargs) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace"
        path.write_bytes(data)
        try:
            trace = load_trace(path, **kwargs)
        except ServetuneError as err:
            assert err.message and "\n" not in err.message.strip()
            return
    assert isinstance(trace, Trace) and len(trace) >= 1
    assert trace.arrival_s[0] == 0 and np.all(np.diff(trace.arrival_s) >= 0)
    assert np.all(np.isfinite(trace.arrival_s))
    assert trace.prompt_tokens.min() >= 1 and trace.output_tokens.min() >= 1


@FUZZ
@given(st.binary(max_size=400), st.sampled_from([None, *FORMATS]),
       st.sampled_from(["error", "skip"]))
def test_random_bytes(data, fmt, on_bad_row):
    columns = GENERIC_COLUMNS if fmt in ("csv", "jsonl") else None
    _check_load(data, fmt=fmt, on_bad_row=on_bad_row, columns=columns)


@FUZZ
@given(st.sampled_from([AZURE, BURSTGPT, MOONCAKE, VLLM]).flatmap(mutated),
       st.sampled_from(["error", "skip"]))
def test_mutated_known_formats(data, on_bad_row):
    _check_load(data, on_bad_row=on_bad_row)


@FUZZ
@given(mutated(GENERIC), st.sampled_from(["error", "skip"]),
       st.sampled_from([None, "s", "ms", "datetime"]))
def test_mutated_generic_csv(data, on_bad_row, unit):
    _check_load(data, on_bad_row=on_bad_row, columns=GENERIC_COLUMNS, arrival_unit=unit)


@FUZZ
@given(mutated('{"t": 1, "in": 5, "out": 2, "c": "x"}\n{"t": 0.5, "in": 6, "out": 1, "c": 3}\n'),
       st.sampled_from(["error", "skip"]))
def test_mutated_generic_jsonl(data, on_bad_row):
    _check_load(data, on_bad_row=on_bad_row, columns="arrival=t,prompt=in,output=out,class=c")


# ---------------------------------------------------------- the pyarrow reader of large CSVs

ARROW_BASES = [
    (AZURE, {}),
    (BURSTGPT.replace("Model,", "Note,"), {"columns": "arrival=Timestamp,prompt=Request tokens,"
                                           "output=Response tokens"}),
    ("ts,in,out,cap,prio\n0.5,10,3,64,1\n0.25,20,4,32,-2\n1e1,+7,\"8\",16,0\n",
     {"columns": "arrival=ts,prompt=in,output=out,max_tokens=cap,priority=prio"}),
]


def _load_or_error(path: Path, **kwargs) -> tuple:
    try:
        trace = load_trace(path, **kwargs)
    except ServetuneError as err:
        return ("error", err.message)
    columns = (trace.arrival_s, trace.prompt_tokens, trace.output_tokens, trace.priority,
               trace.max_tokens)
    return ("trace", trace.class_names, *(None if c is None else (c.dtype.str, c.tobytes())
                                          for c in columns))


@FUZZ
@given(st.sampled_from(range(len(ARROW_BASES))).flatmap(
           lambda i: st.tuples(st.just(i), mutated(ARROW_BASES[i][0]))),
       st.sampled_from(["error", "skip"]), st.sampled_from([None, "s", "ms", "datetime"]))
def test_the_pyarrow_reader_reads_as_the_own_reader_does(base_and_data, on_bad_row, unit):
    # Whatever a CSV holds, reading it with pyarrow (a large file's reader) gives the same
    # trace, or the same one-line error, as this project's own reader.
    pytest.importorskip("pyarrow")
    import servetune.workloads.formats as formats

    i, data = base_and_data
    kwargs = dict(ARROW_BASES[i][1], on_bad_row=on_bad_row)
    if "columns" in kwargs:
        kwargs["arrival_unit"] = unit
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.csv"
        path.write_bytes(data)
        results = []
        for threshold in (0, 1 << 62):  # every file through pyarrow, then none
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(formats, "ARROW_MIN_BYTES", threshold)
                results.append(_load_or_error(path, **kwargs))
    assert results[0] == results[1]


@st.composite
def clean_csv(draw) -> tuple[bytes, dict]:
    """A well-formed trace whose values take the spellings real files use: date-times
    with 0-9 fractional digits or numbers in any float notation, token counts with a
    sign, leading zeros or a decimal point, quoted or not, LF or CRLF, gzipped or not."""
    n = draw(st.integers(1, 12))
    dated = draw(st.booleans())
    arrivals = []
    for _ in range(n):
        if dated:
            digits = draw(st.integers(0, 9))
            stamp = f"2023-{draw(st.integers(1, 12)):02d}-{draw(st.integers(1, 28)):02d}" + \
                f"{draw(st.sampled_from([' ', 'T']))}{draw(st.integers(0, 23)):02d}:" + \
                f"{draw(st.integers(0, 59)):02d}:{draw(st.integers(0, 59)):02d}"
            if digits:
                stamp += "." + "".join(str(draw(st.integers(0, 9))) for _ in range(digits))
            arrivals.append(stamp)
        else:
            value = draw(st.floats(0, 1e7, allow_nan=False))
            arrivals.append(draw(st.sampled_from([repr(value), f"{value:e}", f"{value:.3f}",
                                                  str(int(value))])))

    def count(low: int) -> str:
        v = draw(st.integers(low, 10**6))
        return draw(st.sampled_from([str(v), f"+{v}", f"00{v}", f"{v}.0", f'"{v}"']))

    eol = draw(st.sampled_from(["\n", "\r\n"]))
    lines = ["ts,in,out"] + [f"{a},{count(1)},{count(1)}" for a in arrivals]
    unit = "datetime" if dated else draw(st.sampled_from([None, "s", "ms"]))
    data = (eol.join(lines) + eol).encode()
    if draw(st.booleans()):
        data = gzip.compress(data, mtime=0)
    return data, {"columns": "arrival=ts,prompt=in,output=out", "arrival_unit": unit}


@FUZZ
@given(clean_csv())
def test_the_pyarrow_reader_reads_clean_files_as_the_own_reader_does(file):
    pytest.importorskip("pyarrow")
    import servetune.workloads.formats as formats

    data, kwargs = file
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.csv"
        path.write_bytes(data)
        results = []
        for threshold in (0, 1 << 62):
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(formats, "ARROW_MIN_BYTES", threshold)
                results.append(_load_or_error(path, **kwargs))
    assert results[0] == results[1]


def test_a_clean_file_is_read_by_pyarrow_and_a_bad_one_by_the_own_reader(monkeypatch, tmp_path):
    pytest.importorskip("pyarrow")
    import servetune.workloads.formats as formats

    monkeypatch.setattr(formats, "ARROW_MIN_BYTES", 0)
    took = []
    read = formats._load_csv_arrow
    monkeypatch.setattr(formats, "_load_csv_arrow", lambda *a: took.append(read(*a)) or took[-1])
    clean = tmp_path / "clean.csv"
    clean.write_text(AZURE)
    trace = load_trace(clean)
    assert took == [True] and trace.prompt_tokens.tolist() == [374, 396, 879]
    assert trace.arrival_s.tolist() == pytest.approx([0.0, 4.314579, 4.541877], abs=1e-9)
    # without pyarrow the own reader reads it, to the same trace
    with monkeypatch.context() as mp:
        for module in ("pyarrow", "pyarrow.compute", "pyarrow.csv"):
            mp.setitem(sys.modules, module, None)
        alone = load_trace(clean)
    assert took == [True, False] and alone.arrival_s.tolist() == trace.arrival_s.tolist()
    bad = tmp_path / "bad.csv"
    bad.write_text(AZURE.replace(",396,", ",3x6,"))
    with pytest.raises(ServetuneError, match=r"row 2 \(line 3\): ContextTokens: expected a whole"):
        load_trace(bad)
    assert took == [True, False, False]


# ----------------------------------------------------------------------------- workloads

WORKLOAD = yaml.safe_dump(
    {
        "apiVersion": "servetune/v1",
        "kind": "Workload",
        "name": "fuzz",
        "duration_s": 60.0,
        "classes": {
            "a": {
                "priority": 0,
                "arrival": {"process": "gamma", "rate_per_s": 2.0, "interarrival_cv": 3.0,
                            "windows": {"window_s": 10.0, "rate_multipliers": [1.0, 0.0, 2.0]}},
                "prompt_tokens": {"quantiles": [0.0, 0.5, 1.0], "values": [1.0, 50.0, 900.0]},
                "output_tokens": {"quantiles": [0.0, 1.0], "values": [1.0, 30.0]},
            },
            "b": {
                "arrival": {"rate_per_s": 0.5},
                "prompt_tokens": {"quantiles": [0.0, 1.0], "values": [7.0, 7.0]},
                "output_tokens": {"quantiles": [0.0, 1.0], "values": [2.0, 9.0]},
            },
        },
    },
    sort_keys=False,
)

YAML_ALPHABET = st.sampled_from(list(":-[]{},\n 0123456789.eE+aq#'\"&*!|>%@`\t") +
                                ["1e308", ".inf", "null", "~", "- ", ": "])


@st.composite
def mutated_yaml(draw) -> str:
    text = list(WORKLOAD)
    for _ in range(draw(st.integers(1, 5))):
        pos = draw(st.integers(0, len(text) - 1))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        if op == "insert":
            text.insert(pos, draw(YAML_ALPHABET))
        elif op == "delete":
            del text[pos]
        else:
            text[pos] = draw(YAML_ALPHABET)
    return "".join(text)


def _check_workload(text: str) -> None:
    try:
        w = workload_from_yaml_text(text, "w.yaml")
    except ServetuneError as err:
        assert err.message.startswith("w.yaml")
        return
    try:
        t = sample_trace(w, n_requests=50, seed=1)
    except ServetuneError:
        return
    assert len(t) == 50 and t.prompt_tokens.min() >= 1


@FUZZ
@given(mutated_yaml())
def test_mutated_workload_yaml(text):
    _check_workload(text)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**20, 10**20),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
values = st.recursive(scalars, lambda c: st.lists(c, max_size=4) |
                      st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12)


@FUZZ
@given(st.dictionaries(st.sampled_from(["name", "classes", "duration_s", "source", "x"]),
                       values, max_size=4),
       st.dictionaries(st.sampled_from(["priority", "arrival", "prompt_tokens",
                                        "output_tokens"]), values, max_size=4))
def test_random_workload_structures(top, cls):
    data = {"apiVersion": "servetune/v1", "kind": "Workload", **top}
    if "classes" not in top:
        data["classes"] = {"c": cls}
    _check_workload(yaml.safe_dump(data))


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_as_workload(data):
    _check_workload(data.decode("utf-8", errors="replace"))


# ----------------------------------------------------------------------------- fitting


@FUZZ
@given(
    st.lists(st.tuples(st.floats(0, 1e6), st.integers(1, 2 * 10**7), st.integers(1, 10**5),
                       st.integers(0, 2)), min_size=1, max_size=60),
    st.sampled_from([None, "class", "prompt-quantiles"]),
    st.integers(1, 5),
    st.sampled_from([None, 0.001, 1.0, 1e5]),
)
def test_fit_any_trace(rows, split, bands, window):
    from servetune.workloads.fitting import class_stats, fit_workload
    from servetune.workloads.trace import from_arrays

    arr = np.array(rows, dtype=np.float64)
    trace = from_arrays(arr[:, 0], arr[:, 1].astype(np.int64), arr[:, 2].astype(np.int64),
                        class_id=arr[:, 3].astype(np.int32), class_names=("a", "b", ""))
    try:
        w = fit_workload(trace, split=split, bands=bands, rate_windows_s=window)
    except ServetuneError as err:
        assert "\n" not in err.message
        return
    stats = class_stats(w)
    assert sum(s.share for s in stats) == pytest.approx(1.0)
    assert all(s.prompt_max <= trace.prompt_tokens.max() for s in stats)
    try:
        t = sample_trace(w, n_requests=100, seed=0)
    except ServetuneError:
        return
    assert len(t) == 100


def _per_line(chunk: bytes) -> list[object]:
    """What ``json.loads`` makes of each stripped line of ``chunk`` ("bad": it raises)."""
    out: list[object] = []
    for line in chunk.split(b"\n")[:-1]:
        try:
            out.append(json.loads(line.strip()) if line.strip() else "blank")
        except (ValueError, RecursionError):
            out.append("bad")
    return out


LINE_BYTES = st.sampled_from(
    [b'{"a": 1}', b"[1, 2]", b'"x"', b"7", b"\xef\xbb\xbf", b"\x00", b"\xff", b"\xc3\xa9",
     b"\xc2\xa0", b"\xe2\x80\xa8", b"\x0b", b"\x0c", b" ", b"\t", b"\r", b"\n", b"{", b"}",
     b'"', b"\\", b"\\u00e9", b"\\ud800", b"\xed\xa0\x80", b":", b",", b"1e400", b"NaN"])


@FUZZ
@given(st.lists(LINE_BYTES, max_size=30).map(lambda parts: b"".join(parts) + b"\n"))
@example(b'\xef\xbb\xbf{"a": 1}\n')  # json.loads drops a leading byte-order mark
@example(b"\x00{\x00}\n")  # and reads this as UTF-16: {}
def test_json_lines_parse_as_json_loads_does_line_by_line(chunk):
    """The JSON Lines reader parses a plain UTF-8 chunk's lines as text (no per-line
    decoding): the same values, and the same lines rejected, as ``json.loads`` of each
    line's bytes (byte-order marks, NUL, invalid UTF-8, surrogates and Unicode spaces
    included)."""
    from servetune.workloads.formats import _ASCII_SPACE, _json_lines, _json_value

    ours: list[object] = []
    for line in _json_lines(chunk):
        text = line.strip(_ASCII_SPACE[type(line)])
        try:
            ours.append(_json_value(text) if text else "blank")
        except (ValueError, RecursionError):
            ours.append("bad")
    assert repr(ours) == repr(_per_line(chunk))  # (repr: NaN is not equal to itself)
