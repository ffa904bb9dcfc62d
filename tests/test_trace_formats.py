"""Every trace loader on tiny fixtures written here: values, detection, gzip, bad rows."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from servetune.errors import ServetuneError
from servetune.workloads.formats import detect_format, load_trace, parse_columns

AZURE = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:15:46.6805900,374,44\n"
    "2023-11-16 18:15:50.9951690,396,109\n"
    "2023-11-16 18:15:50.9951690,879,55\n"
    "2023-11-16 18:15:52.0000000,91,16\n"
)
BURSTGPT = (
    "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    "5.0,ChatGPT,100,20,120,Conversation log\n"
    "1.5,GPT-4,50,0,50,API log\n"
    "2.0,GPT-4,70,7,77,API log\n"
    "2.0,ChatGPT,30,3,33,Conversation log\n"
)
MOONCAKE = (
    '{"timestamp": 0, "input_length": 1024, "output_length": 10, "hash_ids": [1, 2]}\n'
    '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1]}\n'
    "\n"
    '{"timestamp": 1500, "input_length": 100, "output_length": 5, "hash_ids": []}\n'
)


def write(tmp_path: Path, name: str, text: str, *, gz: bool = False) -> Path:
    path = tmp_path / (name + (".gz" if gz else ""))
    data = text.encode()
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


# ----------------------------------------------------------------------------- azure


@pytest.mark.parametrize("gz", [False, True])
def test_azure_values_and_gzip(tmp_path, gz):
    trace = load_trace(write(tmp_path, "azure.csv", AZURE, gz=gz))
    # 18:15:50.9951690 - 18:15:46.6805900 = 4.3145790 s, 100 ns ticks kept
    np.testing.assert_allclose(trace.arrival_s, [0.0, 4.314579, 4.314579, 5.31941], atol=1e-9)
    assert trace.prompt_tokens.tolist() == [374, 396, 879, 91]
    assert trace.output_tokens.tolist() == [44, 109, 55, 16]
    assert trace.class_id is None and trace.notices == ()


def test_azure_week_long_form_with_zone_and_crlf(tmp_path):
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
        "2024-05-10 00:00:00.009930+00:00,10,2\r\n"
        "2024-05-10 00:00:01.509930+00:00,20,3\r\n"
    )
    trace = load_trace(write(tmp_path, "week.csv", text))
    np.testing.assert_allclose(trace.arrival_s, [0.0, 1.5])
    assert trace.prompt_tokens.tolist() == [10, 20]


def test_unsorted_rows_are_sorted_stably(tmp_path):
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:00:02,1,1\n"
        "2023-11-16 18:00:01,2,1\n"
        "2023-11-16 18:00:02,3,1\n"
        "2023-11-16 18:00:01,4,1\n"
    )
    trace = load_trace(write(tmp_path, "u.csv", text))
    assert trace.prompt_tokens.tolist() == [2, 4, 1, 3]  # ties keep file order
    assert trace.arrival_s.tolist() == [0.0, 0.0, 1.0, 1.0]


def test_chunk_boundaries_do_not_lose_or_split_rows(tmp_path, monkeypatch):
    import servetune.workloads.formats as tf

    monkeypatch.setattr(tf, "CHUNK_BYTES", 37)  # a row or so per chunk
    monkeypatch.setattr(tf, "HEAD_BYTES", 50)
    rows = "".join(f"2023-11-16 18:00:{i:02d}.5,{i + 1},{2 * i + 1}\n" for i in range(40))
    trace = load_trace(write(tmp_path, "c.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows))
    assert len(trace) == 40
    assert trace.prompt_tokens.tolist() == list(range(1, 41))
    assert trace.output_tokens.tolist() == [2 * i + 1 for i in range(40)]
    np.testing.assert_allclose(trace.arrival_s, np.arange(40.0))


def test_bad_row_names_file_and_row(tmp_path):
    text = AZURE + "2023-11-16 18:15:53.0,12,oops\n"
    path = write(tmp_path, "bad.csv", text)
    with pytest.raises(ServetuneError) as err:
        load_trace(path)
    msg = err.value.message
    assert str(path) in msg and "row 5 (line 6)" in msg and "GeneratedTokens" in msg
    assert "'oops'" in msg and "argument `on_bad_row` skip" in msg and "\n" not in msg


@pytest.mark.parametrize(
    ("row", "what"),
    [
        ("2023-11-16 18:15:53.0,12", "fields"),  # too few fields
        ("2023-11-16 18:15:53.0,12,3,4", "fields"),  # too many
        ("2023-13-16 18:15:53.0,12,3", "TIMESTAMP"),  # month 13
        ("yesterday,12,3", "TIMESTAMP"),
        # past datetime64[ns]'s years: numpy would wrap them around to 1678 and 1794
        ("2263-01-01 00:00:00.0,12,3", "TIMESTAMP"),
        ("99999-11-16 18:15:53.0,12,3", "TIMESTAMP"),
        ("2023-11-16 18:15:53.0,0,3", "ContextTokens"),  # zero prompt
        ("2023-11-16 18:15:53.0,12,0", "GeneratedTokens"),  # zero output
        ("2023-11-16 18:15:53.0,-4,3", "ContextTokens"),
        ("2023-11-16 18:15:53.0,1.5,3", "ContextTokens"),
        ("2023-11-16 18:15:53.0,nan,3", "ContextTokens"),
        ("2023-11-16 18:15:53.0,1e12,3", "ContextTokens"),
        ("2023-11-16 18:15:53.0," + "9" * 80 + ",3", "fields"),
    ],
)
def test_each_kind_of_bad_row(tmp_path, row, what):
    path = write(tmp_path, "bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:52.0,1,1\n" + row + "\n2023-11-16 18:15:54.0,2,2\n")
    with pytest.raises(ServetuneError, match=rf"row 2 \(line 3\): .*{what}"):
        load_trace(path)
    trace = load_trace(path, on_bad_row="skip")
    assert trace.prompt_tokens.tolist() == [1, 2]
    assert any("skipped 1 bad row(s)" in n and "row 2" in n for n in trace.notices)


def test_skip_counts_every_bad_row_and_blank_lines(tmp_path):
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:52.0,1,1\n"
        "\n"
        "2023-11-16 18:15:53.0,x,1\n"
        "2023-11-16 18:15:54.0,2,y\n"
        "bad\n"
        "2023-11-16 18:15:55.0,3,3\n"
        "2023-11-16 18:15:56.0,0,0\n"
    )
    trace = load_trace(write(tmp_path, "s.csv", text), on_bad_row="skip")
    assert trace.prompt_tokens.tolist() == [1, 3]
    assert "skipped 1 blank line(s)" in trace.notices
    skipped = [n for n in trace.notices if n.startswith("skipped 4 bad row(s)")]
    assert skipped and "row 3 (line 4)" in skipped[0]  # the first one is named


def test_first_bad_row_is_reported_across_checks(tmp_path):
    text = (
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:52.0,1,1\n"
        "2023-11-16 18:15:53.0,5,bad\n"  # row 2: output
        "garbage,x,1\n"  # row 3: time and prompt
    )
    with pytest.raises(ServetuneError, match=r"row 2 \(line 3\): GeneratedTokens"):
        load_trace(write(tmp_path, "f.csv", text))


def test_header_only_and_empty_files(tmp_path):
    with pytest.raises(ServetuneError, match="no requests"):
        load_trace(write(tmp_path, "h.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"))
    with pytest.raises(ServetuneError, match="empty"):
        load_trace(write(tmp_path, "e.csv", ""))


def test_missing_file_directory_and_binary(tmp_path):
    with pytest.raises(ServetuneError, match="file not found"):
        load_trace(tmp_path / "nope.csv")
    with pytest.raises(ServetuneError, match="is a directory"):
        load_trace(tmp_path)
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"\x00\x01\x02garbage")
    with pytest.raises(ServetuneError, match="binary"):
        load_trace(binary)


def test_truncated_gzip_is_one_error(tmp_path):
    data = gzip.compress((AZURE * 200).encode(), mtime=0)
    path = tmp_path / "t.csv.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ServetuneError, match="gzip"):
        load_trace(path)


# ----------------------------------------------------------------------------- burstgpt


@pytest.mark.parametrize("gz", [False, True])
def test_burstgpt_drops_failed_rows_with_notice(tmp_path, gz):
    trace = load_trace(write(tmp_path, "BurstGPT_1.csv", BURSTGPT, gz=gz))
    # the 0-response row (t=1.5) is dropped; rows sorted by Timestamp, ties stable
    assert trace.arrival_s.tolist() == [0.0, 0.0, 3.0]
    assert trace.prompt_tokens.tolist() == [70, 30, 100]
    assert trace.output_tokens.tolist() == [7, 3, 20]
    names = [trace.class_names[i] for i in trace.class_id]
    assert names == ["GPT-4", "ChatGPT", "ChatGPT"]
    assert "dropped 1 failed request(s) with 0 output tokens" in trace.notices


# ----------------------------------------------------------------------------- mooncake


@pytest.mark.parametrize("gz", [False, True])
def test_mooncake_keeps_hash_ids_as_csr(tmp_path, gz):
    trace = load_trace(write(tmp_path, "conversation_trace.jsonl", MOONCAKE, gz=gz))
    assert trace.arrival_s.tolist() == [0.0, 0.0, 1.5]  # ms -> s
    assert trace.prompt_tokens.tolist() == [1024, 600, 100]
    assert trace.prefix_offsets.tolist() == [0, 2, 3, 3]
    assert trace.prefix_block_ids.tolist() == [1, 2, 1]
    assert "skipped 1 blank line(s)" in trace.notices


def test_mooncake_unsorted_reorders_prefixes(tmp_path):
    text = (
        '{"timestamp": 900, "input_length": 512, "output_length": 1, "hash_ids": [7]}\n'
        '{"timestamp": 100, "input_length": 1024, "output_length": 2, "hash_ids": [3, 4]}\n'
    )
    trace = load_trace(write(tmp_path, "m.jsonl", text))
    assert trace.prompt_tokens.tolist() == [1024, 512]
    assert trace.prefix_offsets.tolist() == [0, 2, 3]
    assert trace.prefix_block_ids.tolist() == [3, 4, 7]


@pytest.mark.parametrize(
    ("line", "what"),
    [
        ("not json", "not a JSON object"),
        ("[1, 2]", "not a JSON object"),
        ('{"timestamp": 5, "input_length": 3}', "output_length"),
        ('{"timestamp": "x", "input_length": 3, "output_length": 1}', "timestamp"),
        # an integer past float's range (it raised OverflowError, a traceback)
        ('{"timestamp": 1' + "0" * 400 + ', "input_length": 3, "output_length": 1}',
         "timestamp: expected a number"),
        ('{"timestamp": 5, "input_length": 0, "output_length": 1}', "input_length"),
        ('{"timestamp": 5, "input_length": 3, "output_length": true}', "output_length"),
        ('{"timestamp": 5, "input_length": 3, "output_length": 1, "hash_ids": "x"}', "hash_ids"),
    ],
)
def test_mooncake_bad_rows(tmp_path, line, what):
    text = MOONCAKE.splitlines()[0] + "\n" + line + "\n"
    path = write(tmp_path, "m.jsonl", text)
    with pytest.raises(ServetuneError, match=rf"row 2: .*{what}"):
        load_trace(path, fmt="mooncake")
    trace = load_trace(path, fmt="mooncake", on_bad_row="skip")
    assert len(trace) == 1 and any("skipped 1 bad row(s)" in n for n in trace.notices)


# ----------------------------------------------------------------------------- vllm bench


def test_vllm_bench_with_start_times_and_errors(tmp_path):
    doc = {
        "input_lens": [10, 20, 30, 40],
        "output_lens": [5, 6, 0, 8],
        "errors": ["", "timeout", "", ""],
        "start_times": [100.0, 100.5, 101.0, 100.25],
        "ttfts": [0.1, 0.0, 0.0, 0.2],
    }
    trace = load_trace(write(tmp_path, "bench.json", json.dumps(doc, indent=2)))
    assert trace.arrival_s.tolist() == [0.0, 0.25]
    assert trace.prompt_tokens.tolist() == [10, 40]
    assert "dropped 2 failed request(s) with 0 output tokens" in trace.notices


def test_vllm_bench_without_start_times_spaces_evenly(tmp_path):
    doc = {"input_lens": [10, 20, 30], "output_lens": [5, 6, 7], "request_rate": 4.0}
    trace = load_trace(write(tmp_path, "bench.json", json.dumps(doc)), fmt="vllm-bench")
    np.testing.assert_allclose(trace.arrival_s, [0.0, 0.25, 0.5])
    assert any("spaced evenly at 4 req/s" in n for n in trace.notices)
    doc = {"input_lens": [10, 20, 30], "output_lens": [5, 6, 7], "request_rate": "inf",
           "duration": 2.0, "completed": 3}
    trace = load_trace(write(tmp_path, "bench2.json", json.dumps(doc)))
    np.testing.assert_allclose(trace.arrival_s, [0.0, 2 / 3, 4 / 3])


def test_vllm_bench_rejections(tmp_path):
    bad = write(tmp_path, "b.json", json.dumps({"input_lens": [1, 2], "output_lens": [1]}))
    with pytest.raises(ServetuneError, match="input_lens has 2 entries but output_lens has 1"):
        load_trace(bad, fmt="vllm-bench")
    no_time = write(tmp_path, "n.json", json.dumps({"input_lens": [1], "output_lens": [1]}))
    with pytest.raises(ServetuneError, match="--save-detailed"):
        load_trace(no_time)
    bad_len = write(tmp_path, "l.json", json.dumps(
        {"input_lens": [1, "x"], "output_lens": [1, 1], "request_rate": 1}))
    with pytest.raises(ServetuneError, match=r"request 2: input_lens"):
        load_trace(bad_len)
    # Integers past float's range: float() of them raised OverflowError, a traceback.
    huge = 10**400
    for i, (doc, what) in enumerate([({"start_times": [0, huge]}, "request 2: start_times"),
                                     ({"request_rate": huge}, "--save-detailed"),
                                     ({"duration": huge, "completed": 2}, "--save-detailed"),
                                     ({"duration": 1.0, "completed": huge}, "--save-detailed")]):
        path = write(tmp_path, f"huge{i}.json",
                     json.dumps({"input_lens": [1, 2], "output_lens": [1, 1], **doc}))
        with pytest.raises(ServetuneError, match=what):
            load_trace(path, fmt="vllm-bench")


# ----------------------------------------------------------------------------- generic


def test_generic_csv_with_mapping_units_class_priority_max_tokens(tmp_path):
    text = (
        "ts_ms,in,out,cls,prio,cap\n"
        "1500,10,3,\"chat, long\",1,64\n"
        "500,20,4,batch,0,128\n"
    )
    path = write(tmp_path, "g.csv", text)
    cols = "arrival=ts_ms,prompt=in,output=out,class=cls,priority=prio,max_tokens=cap"
    trace = load_trace(path, columns=cols, arrival_unit="ms")
    assert trace.arrival_s.tolist() == [0.0, 1.0]
    assert trace.prompt_tokens.tolist() == [20, 10]
    assert [trace.class_names[i] for i in trace.class_id] == ["batch", "chat, long"]
    assert trace.priority.tolist() == [0, 1]
    assert trace.max_tokens.tolist() == [128, 64]


def test_generic_csv_datetime_detected_and_mapping_dict(tmp_path):
    text = "when,p,o\n2024-01-01 00:00:10,5,1\n2024-01-01 00:00:00,6,2\n"
    trace = load_trace(write(tmp_path, "d.csv", text),
                       columns={"arrival": "when", "prompt": "p", "output": "o"})
    assert trace.arrival_s.tolist() == [0.0, 10.0]


def test_generic_jsonl(tmp_path):
    text = (
        '{"t": 2.0, "in": 10, "out": 2, "c": "x"}\n'
        '{"t": 1.0, "in": 20, "out": 3, "c": "y"}\n'
    )
    trace = load_trace(write(tmp_path, "g.jsonl", text, gz=True),
                       columns="arrival=t,prompt=in,output=out,class=c")
    assert trace.arrival_s.tolist() == [0.0, 1.0]
    assert [trace.class_names[i] for i in trace.class_id] == ["y", "x"]


def test_generic_jsonl_date_times_and_one_past_2262(tmp_path):
    text = (
        '{"t": "2024-01-01 00:00:10.5", "in": 10, "out": 2}\n'
        '{"t": "2024-01-01T00:00:00+01:00", "in": 20, "out": 3}\n'
        '{"t": "2263-01-01 00:00:00", "in": 30, "out": 4}\n'
    )
    path = write(tmp_path, "g.jsonl", text)
    with pytest.raises(ServetuneError, match="row 3: t: .*got .2263-01-01 00:00:00."):
        load_trace(path, columns="arrival=t,prompt=in,output=out")
    trace = load_trace(path, columns="arrival=t,prompt=in,output=out", on_bad_row="skip")
    # the zone is applied: 2024-01-01T00:00+01:00 is 2023-12-31T23:00 UTC, 3,610.5 s earlier
    assert trace.arrival_s.tolist() == [0.0, 3610.5]
    assert trace.prompt_tokens.tolist() == [20, 10]


def test_generic_needs_mapping_and_valid_columns(tmp_path):
    path = write(tmp_path, "g.csv", "a,b,c\n1,2,3\n")
    with pytest.raises(ServetuneError, match="argument `columns` arrival="):
        load_trace(path)
    with pytest.raises(ServetuneError, match="no column 'zz' for prompt; the header has a, b, c"):
        load_trace(path, columns="arrival=a,prompt=zz,output=c")
    with pytest.raises(ServetuneError, match="missing output"):
        load_trace(path, columns="arrival=a,prompt=b")
    with pytest.raises(ServetuneError, match="unknown role 'foo'"):
        load_trace(path, columns="arrival=a,prompt=b,output=c,foo=a")
    with pytest.raises(ServetuneError, match="not ROLE=COLUMN"):
        parse_columns("arrival")
    with pytest.raises(ServetuneError, match="unknown trace format"):
        load_trace(path, fmt="parquet")
    with pytest.raises(ServetuneError, match="argument `on_bad_row`"):
        load_trace(path, on_bad_row="ignore")
    with pytest.raises(ServetuneError, match="argument `columns` applies"):
        load_trace(path, fmt="azure", columns="arrival=a,prompt=b,output=c")


# ----------------------------------------------------------------------------- detection


def test_detection_from_header_or_first_record():
    assert detect_format(AZURE.encode()) == "azure"
    assert detect_format(b"\xef\xbb\xbf" + AZURE.encode()) == "azure"
    assert detect_format(BURSTGPT.encode()) == "burstgpt"
    assert detect_format(MOONCAKE.encode()) == "mooncake"
    assert detect_format(b'{"input_lens": [1], "output_lens": [2]}') == "vllm-bench"
    assert detect_format(b'{\n  "input_lens": [1],\n  "output_lens": [2]\n}') == "vllm-bench"
    assert detect_format(b'{"a": 1}\n') == "jsonl"
    assert detect_format(b"a,b,c\n1,2,3\n") == "csv"


def test_a_mooncake_line_longer_than_the_detection_head_loads(tmp_path):
    """A request with 12,000 hash_ids makes a first line of over 64 KB: it was detected as
    a vllm bench result ("not valid JSON"); it is Mooncake (issue 33)."""
    import json

    ids = list(range(12_000))
    lines = [json.dumps({"timestamp": 0, "input_length": 512 * len(ids),
                         "output_length": 7, "hash_ids": ids}),
             json.dumps({"timestamp": 1000, "input_length": 1024, "output_length": 3,
                         "hash_ids": [0, 1]})]
    assert len(lines[0]) > 1 << 16
    path = write(tmp_path, "long.jsonl", "\n".join(lines) + "\n")
    assert detect_format(path.read_bytes()[: 1 << 16]) == "mooncake"
    trace = load_trace(path)
    assert trace.prompt_tokens.tolist() == [512 * 12_000, 1024]
    assert trace.prefix_block_ids[:3].tolist() == [0, 1, 2]
    # a one-line vllm bench result as long is still that, any other long object JSON Lines
    long_bench = b'{"input_lens": [' + b"1, " * 40_000
    assert detect_format(long_bench[: 1 << 16]) == "vllm-bench"
    assert detect_format((b'{"ts": 1, "blob": "' + b"x" * 70_000)[: 1 << 16]) == "jsonl"


def test_trace_format_override(tmp_path):
    # an Azure-shaped file forced through the generic path with the same columns
    path = write(tmp_path, "x.txt", AZURE)
    forced = load_trace(path, fmt="csv",
                        columns="arrival=TIMESTAMP,prompt=ContextTokens,output=GeneratedTokens")
    assert forced.prompt_tokens.tolist() == load_trace(path).prompt_tokens.tolist()
    with pytest.raises(ServetuneError):
        load_trace(path, fmt="mooncake")


# ----------------------------------------------------------------------------- properties

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

rows_strategy = st.lists(
    st.tuples(st.integers(0, 10**6), st.integers(1, 10**6), st.integers(1, 10**5),
              st.sampled_from(["a", "b c", '"q, r"', ""]), st.booleans()),
    min_size=1, max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(rows_strategy, st.integers(8, 200))
def test_any_chunking_gives_the_same_trace(rows, chunk_bytes):
    """Chunk size is invisible: tiny chunks load exactly what one big chunk loads, and
    nothing is lost or invented (a file-order oracle built here)."""
    import tempfile

    import servetune.workloads.formats as tf

    lines = ["ms,in,out,cls"]
    for ms, p, o, cls, blank in rows:
        lines.append(f"{ms},{p},{o},{cls}")
        if blank:
            lines.append("")
    text = "\n".join(lines) + "\n"
    cols = "arrival=ms,prompt=in,output=out,class=cls"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.csv"
        path.write_text(text)
        whole = load_trace(path, columns=cols, arrival_unit="ms")
        saved = tf.CHUNK_BYTES, tf.HEAD_BYTES
        try:
            tf.CHUNK_BYTES, tf.HEAD_BYTES = chunk_bytes, chunk_bytes
            pieces = load_trace(path, columns=cols, arrival_unit="ms")
        finally:
            tf.CHUNK_BYTES, tf.HEAD_BYTES = saved
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])  # stable, as the loader
    t0 = min(r[0] for r in rows)
    assert whole.arrival_s.tolist() == pytest.approx([(rows[i][0] - t0) / 1000 for i in order])
    assert whole.prompt_tokens.tolist() == [rows[i][1] for i in order]
    assert whole.output_tokens.tolist() == [rows[i][2] for i in order]
    labels = [rows[i][3].strip('"') or "(empty)" for i in order]
    assert [whole.class_names[k] for k in whole.class_id] == labels
    for t in (whole, pieces):
        assert [t.class_names[k] for k in t.class_id] == labels
        assert t.prompt_tokens.tolist() == whole.prompt_tokens.tolist()
        assert t.arrival_s.tolist() == whole.arrival_s.tolist()


def test_a_line_longer_than_the_limit_is_an_error(tmp_path, monkeypatch):
    import servetune.workloads.formats as tf

    monkeypatch.setattr(tf, "MAX_LINE_BYTES", 100)
    monkeypatch.setattr(tf, "HEAD_BYTES", 16)
    monkeypatch.setattr(tf, "CHUNK_BYTES", 16)
    path = write(tmp_path, "long.csv", "a,b,c\n" + "1" * 500 + "\n")
    with pytest.raises(ServetuneError, match="longer than"):
        load_trace(path, columns="arrival=a,prompt=b,output=c")


def test_forced_generic_format_without_columns_says_what_is_missing(tmp_path):
    path = write(tmp_path, "azure.csv", AZURE)
    for fmt in ("csv", "jsonl"):
        with pytest.raises(ServetuneError, match=f"argument `fmt` {fmt} needs a column mapping"):
            load_trace(path, fmt=fmt)


def test_interarrival_cv_survives_extreme_spans():
    # Gaps of 1e200 s square to inf: the CV must still be the scale-free 0.5, so
    # `trace stats --json` never prints Infinity.
    from servetune.workloads.stats import trace_stats
    from servetune.workloads.trace import from_arrays

    for scale in (1e200, 1e-200):
        arrival = np.array([0.0, 1.0, 4.0, 5.0, 8.0]) * scale
        stats = trace_stats(from_arrays(arrival, np.ones(5, int), np.ones(5, int)))
        assert stats["interarrival_cv"] == pytest.approx(0.5)
        json.dumps(stats, allow_nan=False)


def test_arrivals_over_decades_are_a_unit_error_not_a_trace(tmp_path):
    # ns epoch timestamps read as seconds: a 1-hour trace would span 3.6e12 "seconds",
    # where float64 arrival times cannot resolve one engine step.
    path = write(tmp_path, "ns.csv", "ts,p,o\n1700000000000000000,5,2\n1700003600000000000,5,2\n")
    with pytest.raises(ServetuneError,
                       match=r"ns.csv: arrivals span .* years.*argument `arrival_unit`"):
        load_trace(path, columns="arrival=ts,prompt=p,output=o")
    trace = load_trace(path, columns="arrival=ts,prompt=p,output=o", arrival_unit="ns")
    assert trace.duration_s == pytest.approx(3600.0)


def test_semicolon_separated_file_gets_a_separator_hint(tmp_path):
    path = write(tmp_path, "semi.csv", "ts;p;o\n0;1;1\n")
    with pytest.raises(ServetuneError, match="no column 'ts'.*comma-separated"):
        load_trace(path, columns="arrival=ts,prompt=p,output=o")


@pytest.mark.parametrize("word", ["now", "Today"])
def test_clock_words_are_not_date_times(tmp_path, word):
    # numpy would read them as the clock's date: the trace would change from day to day
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    f"2023-11-16 18:15:46.6805900,374,44\n{word},396,109\n")
    with pytest.raises(ServetuneError, match=rf"row 2 \(line 3\): TIMESTAMP: expected a "
                                             rf"date-time .*got '{word}'"):
        load_trace(path)


def test_clock_words_are_not_date_times_in_json_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"t": "2023-11-16 18:15:46", "in": 5, "out": 2}\n'
                    '{"t": "now", "in": 6, "out": 1}\n')
    with pytest.raises(ServetuneError, match="row 2"):
        load_trace(path, columns="arrival=t,prompt=in,output=out", arrival_unit="datetime")


def test_a_bad_date_time_in_a_long_column_is_a_bad_row_not_a_crash(tmp_path):
    # numpy (1.26-2.4) crashes the process when a cast of more than 500 texts to datetime64
    # meets one it cannot parse (found by the fuzz harness): the loader casts 500 rows at a
    # time. Run in a child process so that a crash fails this test instead of the suite.
    import subprocess
    import sys

    rows = [f"2023-11-16 18:{i // 600:02d}:{i % 600 / 10:04.1f}0000,{100 + i},{1 + i % 7}"
            for i in range(1_200)]
    rows[900] = "sweep,1320,407"
    rows[1_100] = "99999-11-16 18:00:00.0000000,10,1"  # past datetime64[ns]'s range
    path = tmp_path / "long.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    code = (
        "import sys\n"
        "from servetune.errors import ServetuneError\n"
        "from servetune.workloads.formats import load_trace\n"
        "try:\n"
        "    load_trace(sys.argv[1])\n"
        "except ServetuneError as err:\n"
        "    print(err.message)\n"
        "trace = load_trace(sys.argv[1], on_bad_row='skip')\n"
        "print(len(trace), int(trace.prompt_tokens.sum()), float(trace.arrival_s.max()))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    error, counts = proc.stdout.strip().splitlines()
    assert "row 901 (line 902): TIMESTAMP" in error  # rows count from 1 and "'sweep'" in error
    kept = [i for i in range(1_200) if i not in (900, 1_100)]
    n, prompt_sum, last = counts.split()
    assert int(n) == 1_198
    assert int(prompt_sum) == sum(100 + i for i in kept)
    assert float(last) == pytest.approx(1_199 / 10)  # row 1,199 at 18:01:59.9, row 0 at 18:00


@pytest.mark.parametrize("bad", [0, 499, 500, 501, 1_199])
def test_a_bad_date_time_is_named_by_its_row_on_either_side_of_a_cast_boundary(tmp_path, bad):
    rows = [f"2023-11-16 18:00:{i / 100:05.2f},{1 + i},1" for i in range(1_200)]
    rows[bad] = "2023-11-16 25:00:00,99999,1"  # hour 25
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    with pytest.raises(ServetuneError, match=rf"row {bad + 1} \(line {bad + 2}\): TIMESTAMP"):
        load_trace(path)
    trace = load_trace(path, on_bad_row="skip")
    assert trace.prompt_tokens.tolist() == [1 + i for i in range(1_200) if i != bad]
