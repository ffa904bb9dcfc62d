"""Load public LLM request traces into a columnar :class:`~servetune.workloads.trace.Trace`.

Formats (the columns as each trace's publisher ships them: Azure/AzurePublicDataset,
HPMLL/BurstGPT, kvcache-ai/Mooncake and vLLM's benchmark client):

- ``azure``: Azure LLM inference 2023 CSV and the 2024 week-long CSV (same columns):
  ``TIMESTAMP`` (date-time text), ``ContextTokens``, ``GeneratedTokens``, and an optional
  ``class`` column of our own (kept as the class label: servetune's tiered examples);
- ``burstgpt``: BurstGPT CSV: ``Timestamp`` (seconds), ``Request tokens``,
  ``Response tokens``, ``Model`` (kept as the class label). Rows with 0 response tokens
  are failed requests: dropped and counted in a notice;
- ``mooncake``: Mooncake JSON Lines: ``timestamp`` (ms), ``input_length``,
  ``output_length``, ``hash_ids`` (kept as prefix block ids, CSR);
- ``vllm-bench``: a ``vllm bench serve --save-result`` JSON: ``input_lens``,
  ``output_lens``, ``errors``; arrivals from ``start_times`` when saved, else evenly
  spaced at the run's rate (with a notice). Failed requests are dropped and counted;
- ``csv`` / ``jsonl``: any CSV with a header or JSON Lines file, with a column mapping
  ``arrival=..,prompt=..,output=..[,class=..,priority=..,max_tokens=..,session=..]`` and an
  arrival unit (``s``, ``ms``, ``us``, ``ns`` or ``datetime``; by default seconds when the
  first value is a number, else date-time text). A ``session`` column (any non-empty text
  or integer naming a conversation) makes prefix block ids: a session's rows in arrival
  order are turns, each prompt extending the previous turn's prompt and output (the rule
  and its 16-token blocks: :mod:`servetune.workloads.sessions`).

Any file may be gzip-compressed (detected from its magic bytes). The format is detected
from the header or first record unless given. CSV is parsed in fixed-size byte chunks with
numpy (field boundaries from the positions of commas and newlines, numbers and date-times
converted as fixed-width byte arrays), so memory is the output columns plus one chunk and
no Python object is made per row. Bad rows raise a ServetuneError naming the file and the
1-based data row (and line); with ``on_bad_row="skip"`` they are skipped and counted in
``Trace.notices``.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
import warnings
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np
import numpy.typing as npt

from servetune.errors import ServetuneError
from servetune.io import open_binary
from servetune.workloads.sessions import SESSION_BLOCK_TOKENS, session_prefix_ids
from servetune.workloads.trace import Trace, from_arrays

FORMATS = ("azure", "burstgpt", "mooncake", "vllm-bench", "csv", "jsonl")
ROLES = ("arrival", "prompt", "output", "class", "priority", "max_tokens", "session")
REQUIRED_ROLES = ("arrival", "prompt", "output")
ARRIVAL_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
CHUNK_BYTES = 4 << 20
MAX_FIELD_BYTES = 64
MAX_TOKENS = 1e9  # a token count above this is a corrupt value, not a request
# Arrivals spread over more than ~30 years are a wrong unit or a corrupt value; beyond,
# float64 seconds also lose the sub-millisecond resolution step times need.
MAX_SPAN_S = 1e9
HEAD_BYTES = 1 << 16
MAX_HEADER_BYTES = 1 << 20
MAX_LINE_BYTES = 64 << 20

AZURE_COLUMNS = {"arrival": "TIMESTAMP", "prompt": "ContextTokens", "output": "GeneratedTokens"}
BURSTGPT_COLUMNS = {
    "arrival": "Timestamp",
    "prompt": "Request tokens",
    "output": "Response tokens",
    "class": "Model",
}
MOONCAKE_KEYS = {"arrival": "timestamp", "prompt": "input_length", "output": "output_length"}
# An Azure-format CSV may add a column of this name: the request's class (SLO tiers).
AZURE_CLASS_COLUMN = "class"

ProgressFn = Callable[[int, int], None]


# ----------------------------------------------------------------------------- options


def parse_columns(spec: str | Mapping[str, str] | None) -> dict[str, str] | None:
    """``"arrival=ts,prompt=in,output=out"`` (or a mapping) -> {role: column}."""
    if spec is None:
        return None
    if isinstance(spec, Mapping):
        pairs = [(str(k).strip(), str(v).strip()) for k, v in spec.items()]
    else:
        pairs = []
        for part in str(spec).split(","):
            if not part.strip():
                continue
            if "=" not in part:
                raise ServetuneError(
                    f"argument `columns`: {part.strip()!r} is not ROLE=COLUMN; example: "
                    "argument `columns` arrival=ts,prompt=in,output=out"
                )
            role, _, col = part.partition("=")
            pairs.append((role.strip(), col.strip()))
    mapping: dict[str, str] = {}
    for role, col in pairs:
        if role not in ROLES:
            raise ServetuneError(
                f"argument `columns`: unknown role {role!r}; roles are {', '.join(ROLES)}"
            )
        if not col:
            raise ServetuneError(f"argument `columns`: role {role!r} has no column name")
        if role in mapping:
            raise ServetuneError(
                f"argument `columns`: role {role!r} is given twice ({mapping[role]!r} and "
                f"{col!r}); give each role once"
            )
        taken = [r for r, c in mapping.items() if c == col]
        if taken:
            raise ServetuneError(
                f"argument `columns`: column {col!r} is mapped to both {taken[0]!r} and "
                f"{role!r}; map each column to one role"
            )
        mapping[role] = col
    missing = [r for r in REQUIRED_ROLES if r not in mapping]
    if missing:
        raise ServetuneError(
            f"argument `columns`: missing {', '.join(missing)}; the mapping needs arrival, "
            "prompt and output (e.g. argument `columns` arrival=ts,prompt=in,output=out)"
        )
    return mapping


# ----------------------------------------------------------------------------- opening


class _Source:
    """A trace file opened for binary reading, transparently gunzipped."""

    def __init__(self, path: str):
        self.path = path
        self.raw: BinaryIO = open_binary(path, "trace")  # closed in close()
        try:
            self.total_bytes = os.fstat(self.raw.fileno()).st_size
        except OSError:
            self.total_bytes = 0
        magic = self.raw.read(2)
        self.raw.seek(0)
        self.gzipped = magic == b"\x1f\x8b"
        # uncompressed size: the file's, or the gzip trailer's ISIZE (size mod 2**32; only
        # a sizing hint, trusted at compression ratios 1 to 50)
        self.text_bytes = self.total_bytes
        if self.gzipped:
            self.text_bytes = 0
            try:
                if self.total_bytes >= 18:
                    self.raw.seek(-4, os.SEEK_END)
                    isize = int.from_bytes(self.raw.read(4), "little")
                    plausible = self.total_bytes <= isize <= 50 * self.total_bytes
                    self.text_bytes = isize if plausible else 0
            except OSError:
                pass
            self.raw.seek(0)
        self.stream: BinaryIO = (
            gzip.GzipFile(fileobj=self.raw, mode="rb") if self.gzipped else self.raw
        )

    def read(self, n: int) -> bytes:
        try:
            return self.stream.read(n)
        except (OSError, EOFError, zlib.error) as exc:
            raise ServetuneError(
                f"{self.path}: corrupt or truncated gzip data ({exc}); re-download the file"
            ) from None

    def position(self) -> int:
        try:
            return self.raw.tell()
        except (OSError, ValueError):
            return 0

    def close(self) -> None:
        try:
            if self.stream is not self.raw:
                self.stream.close()
        finally:
            self.raw.close()


# ----------------------------------------------------------------------------- collecting


class _Column:
    """A growable numpy column. Chunks are copied into one buffer that grows by half its
    size when full (or is sized from a row-count hint), so a large file makes a few large
    allocations instead of thousands of chunk arrays that fragment the heap."""

    def __init__(self, dtype: npt.DTypeLike):
        self.dtype = np.dtype(dtype)
        self.buffer = np.empty(0, dtype=self.dtype)
        self.size = 0
        self.hint = 0

    def __bool__(self) -> bool:
        return self.size > 0

    def append(self, chunk: np.ndarray) -> None:
        need = self.size + len(chunk)
        if need > len(self.buffer):
            capacity = max(need, int(len(self.buffer) * 1.5), self.hint, 1024)
            grown = np.empty(capacity, dtype=self.dtype)
            grown[: self.size] = self.buffer[: self.size]
            self.buffer = grown
        self.buffer[self.size : need] = chunk
        self.size = need

    def result(self) -> np.ndarray:
        """The filled part (trimmed by a copy only when much of the buffer is unused)."""
        out = self.buffer[: self.size]
        if len(self.buffer) > 1.1 * self.size + 1024:
            out = out.copy()
        self.buffer = np.empty(0, dtype=self.dtype)
        return out


def _column(dtype: npt.DTypeLike) -> _Column:
    return field(default_factory=lambda: _Column(dtype))


@dataclass
class _Rows:
    """Accumulates column chunks and the bad-row policy for one file."""

    path: str
    on_bad_row: str
    unit: str = "row"  # "row" for data rows, "request" for vllm-bench entries
    arrival: _Column = _column(np.float64)
    prompt: _Column = _column(np.int64)
    output: _Column = _column(np.int64)
    class_id: _Column = _column(np.int32)
    priority: _Column = _column(np.int32)
    max_tokens: _Column = _column(np.int64)
    prefix_lengths: _Column = _column(np.int64)
    prefix_ids: _Column = _column(np.int64)
    session: _Column = _column(np.int64)
    class_index: dict[str, int] = field(default_factory=dict)
    session_index: dict[str, int] = field(default_factory=dict)
    skipped: int = 0
    first_skipped: str = ""
    blank: int = 0
    dropped_failed: int = 0
    notices: list[str] = field(default_factory=list)
    in_order: bool = True  # arrivals so far are non-decreasing (real files usually are)
    last_arrival: float = -math.inf

    def add_arrivals(self, arrival: np.ndarray) -> None:
        """Append a chunk of arrival times, tracking whether the file is sorted."""
        if len(arrival):
            if self.in_order:
                self.in_order = bool(arrival[0] >= self.last_arrival) and bool(
                    np.all(arrival[1:] >= arrival[:-1])
                )
            self.last_arrival = float(arrival[-1])
            self.arrival.append(arrival)

    def expect_rows(self, n: int) -> None:
        """Size the columns for about ``n`` rows (a hint from the file size)."""
        for col in (self.arrival, self.prompt, self.output, self.class_id, self.priority,
                    self.max_tokens):
            col.hint = n

    def bad(self, row: int, reason: str, line: int | None = None) -> None:
        where = f"{self.unit} {row}" + (f" (line {line})" if line is not None else "")
        if self.on_bad_row == "error":
            raise ServetuneError(
                f"{self.path}: {where}: {reason}; fix the row or pass argument `on_bad_row` skip"
            )
        self.skipped += 1
        if not self.first_skipped:
            self.first_skipped = f"{where}: {reason}"

    def class_ids_for(self, labels: list[str]) -> np.ndarray:
        return np.array(
            [self.class_index.setdefault(lbl, len(self.class_index)) for lbl in labels],
            dtype=np.int32,
        )

    def session_codes_for(self, labels: list[str]) -> np.ndarray:
        return np.array(
            [self.session_index.setdefault(lbl, len(self.session_index)) for lbl in labels],
            dtype=np.int64,
        )

    def build(self, source_name: str) -> Trace:
        notices = list(self.notices)
        if self.blank:
            notices.append(f"skipped {self.blank} blank line(s)")
        if self.dropped_failed:
            notices.append(
                f"dropped {self.dropped_failed} failed request(s) with 0 output tokens"
            )
        if self.skipped:
            notices.append(
                f"skipped {self.skipped} bad {self.unit}(s) (first: {self.first_skipped})"
            )
        if not self.arrival:
            extra = f"; {notices[-1]}" if notices else ""
            raise ServetuneError(f"{self.path}: no requests in the file{extra}")
        arrival = self.arrival.result()
        span = float(arrival.max() - arrival.min())
        if span > MAX_SPAN_S:
            raise ServetuneError(
                f"{self.path}: arrivals span {span:.3g} s (over {MAX_SPAN_S / 3.156e7:.0f} "
                "years); check the arrival column and its unit "
                "(argument `arrival_unit` ms, us or ns)"
            )
        prompt = self.prompt.result()
        output = self.output.result()
        optional: dict[str, Any] = {"source": source_name, "notices": tuple(notices)}
        if self.class_id:
            optional["class_id"] = self.class_id.result()
            optional["class_names"] = tuple(self.class_index)
        if self.priority:
            optional["priority"] = self.priority.result()
        if self.max_tokens:
            optional["max_tokens"] = self.max_tokens.result()
        if self.session:
            offsets, ids = session_prefix_ids(self.session.result(), arrival, prompt, output)
            optional.update(prefix_offsets=offsets, prefix_block_ids=ids,
                            prefix_block_tokens=SESSION_BLOCK_TOKENS)
        elif self.prefix_lengths:
            lengths = self.prefix_lengths.result()
            offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
            np.cumsum(lengths, out=offsets[1:])
            optional["prefix_offsets"] = offsets
            optional["prefix_block_ids"] = (
                self.prefix_ids.result() if self.prefix_ids else np.zeros(0, dtype=np.int64)
            )
        if self.in_order:
            # Already sorted and validated row by row: re-base in place instead of letting
            # from_arrays copy and argsort (which would double peak memory on large files).
            arrival -= arrival[0]
            return Trace(arrival_s=arrival, prompt_tokens=prompt, output_tokens=output,
                         **optional)
        try:
            return from_arrays(arrival, prompt, output, **optional)
        except ServetuneError as err:
            raise ServetuneError(f"{self.path}: {err.message}") from None


# ----------------------------------------------------------------------------- conversions


def _shown(value: Any) -> str:
    if isinstance(value, bytes | np.bytes_):
        value = bytes(value).decode("utf-8", errors="replace")
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _floats(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Fixed-width bytes -> float64 and a mask of values that parsed and are finite."""
    try:
        values = raw.astype(np.float64)
    except (ValueError, OverflowError):
        values = np.empty(len(raw), dtype=np.float64)
        for i, item in enumerate(raw):
            try:
                values[i] = float(item)
            except (ValueError, OverflowError):
                values[i] = np.nan
    return values, np.isfinite(values)


# numpy releases the GIL in a cast of more than 500 items, and its bytes-to-datetime cast
# then crashes the process (segfault; numpy 1.26.4, 2.2.6, 2.3.5 and 2.4.6 alike) on text
# it cannot parse instead of raising ValueError; casts of at most this many rows raise.
_DATETIME_CAST_ROWS = 500
_NAT = np.datetime64("NaT", "ns")


def _in_ns_range(ns: np.ndarray, days: np.ndarray) -> np.ndarray:
    """Where date-times parsed as ns are the ones parsed as days: numpy wraps a date-time
    outside datetime64[ns]'s years (1678-2262) around silently (numpy issue 9956)."""
    return ns.astype("datetime64[D]") == days


def _datetime_ns(text: str) -> np.datetime64:
    """One date-time text as datetime64[ns]; NaT when it does not parse or lies outside
    the years datetime64[ns] holds."""
    try:
        ns, day = np.datetime64(text, "ns"), np.datetime64(text, "D")
    except (ValueError, OverflowError, TypeError):
        return _NAT
    return ns if _in_ns_range(ns, day) else _NAT


def _datetimes_ns(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Date-time text (``YYYY-MM-DD HH:MM:SS.fffffff``, optional zone) -> int64 ns, cast
    500 rows at a time; a part with a row that does not parse is parsed row by row."""
    values = np.empty(len(raw), dtype="datetime64[ns]")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for start in range(0, len(raw), _DATETIME_CAST_ROWS):
            part = raw[start:start + _DATETIME_CAST_ROWS]
            try:
                ns, days = part.astype("datetime64[ns]"), part.astype("datetime64[D]")
                values[start:start + len(part)] = np.where(_in_ns_range(ns, days), ns, _NAT)
            except (ValueError, OverflowError, TypeError):
                for i, item in enumerate(part, start):
                    try:
                        values[i] = _datetime_ns(bytes(item).decode("ascii").strip())
                    except UnicodeDecodeError:
                        values[i] = _NAT
    ok = ~np.isnat(values)
    # numpy reads "today" and "now" (any case) as the clock's date and time: a trace would
    # load differently each day. A date-time never starts with a letter otherwise.
    if len(raw):
        first = raw.view(np.uint8).reshape(len(raw), -1)[:, 0] | 0x20
        ok &= ~((first >= ord("a")) & (first <= ord("z")))
    return values.view(np.int64), ok


def _whole(values: np.ndarray, ok: np.ndarray, low: float) -> np.ndarray:
    """Mask of finite, integral values in [low, MAX_TOKENS]."""
    with np.errstate(invalid="ignore"):
        return ok & (values == np.floor(values)) & (values >= low) & (values <= MAX_TOKENS)


# ----------------------------------------------------------------------------- CSV


def _split_header(line: bytes, path: str) -> list[str]:
    try:
        text = line.decode("utf-8-sig").rstrip("\r\n")
    except UnicodeDecodeError:
        raise ServetuneError(f"{path}: the header is not UTF-8 text; is this a trace?") from None
    if not text.strip():
        return []
    try:
        return [c.strip() for c in next(csv.reader([text.replace("\r", "")]))]
    except (csv.Error, StopIteration):
        raise ServetuneError(f"{path}: the header line is not valid CSV") from None


def _find_column(header: list[str], name: str, role: str, path: str) -> int:
    if name in header:
        return header.index(name)
    lowered = [h.lower() for h in header]
    if name.lower() in lowered:
        return lowered.index(name.lower())
    hint = ""
    if len(header) == 1 and any(sep in header[0] for sep in (";", "\t", "|")):
        hint = " (servetune reads comma-separated CSV; convert the separators to commas)"
    raise ServetuneError(
        f"{path}: no column {name!r} for {role}; the header has {', '.join(header)}{hint}"
    )


@dataclass
class _CsvChunk:
    """Rows of one chunk that split into the right number of fields."""

    lines: np.ndarray  # 0-based line index within the chunk of each good row
    fields: dict[int, np.ndarray]  # column index -> fixed-width bytes per good row
    bad_lines: np.ndarray  # lines with a wrong field count or an over-long field
    blank: int


def _fixed_width(buf: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, ...]:
    """Fields [start, end) of ``buf`` as a NUL-padded ``S<w>`` array, and a mask of the
    fields that fit ``MAX_FIELD_BYTES``. ``buf`` must have MAX_FIELD_BYTES bytes of padding
    after its last field."""
    length = end - start
    fits = length <= MAX_FIELD_BYTES
    length = np.minimum(length, MAX_FIELD_BYTES)
    width = max(int(length.max()) if len(length) else 1, 1)
    # one contiguous copy of `width` bytes per field, then zero what lies past its end
    mat = np.lib.stride_tricks.sliding_window_view(buf, width)[start]
    mat *= np.arange(width, dtype=np.int64)[None, :] < length[:, None]
    return mat.view(f"S{width}").ravel(), fits


def _csv_chunk_vectorised(chunk: bytes, ncols: int, wanted: list[int]) -> _CsvChunk:
    buf = np.frombuffer(chunk + bytes(MAX_FIELD_BYTES), dtype=np.uint8)
    newlines = np.flatnonzero(buf == 10)
    starts = np.concatenate([[0], newlines[:-1] + 1]).astype(np.int64)
    ends = newlines.astype(np.int64)
    has_cr = (ends > starts) & (buf[np.maximum(ends - 1, 0)] == 13)
    ends = ends - has_cr
    blank = ends == starts
    commas = np.flatnonzero(buf == 44)
    comma_line = np.searchsorted(newlines, commas)
    counts = np.bincount(comma_line, minlength=len(newlines))
    good = ~blank & (counts == ncols - 1)
    bad = ~blank & ~good
    good_commas = commas[good[comma_line]].reshape(-1, ncols - 1) if ncols > 1 else None
    lines = np.flatnonzero(good)
    field_start = starts[lines]
    fields: dict[int, np.ndarray] = {}
    fits_all = np.ones(len(lines), dtype=bool)
    for col in wanted:
        s = field_start if col == 0 else good_commas[:, col - 1] + 1
        e = ends[lines] if col == ncols - 1 else good_commas[:, col]
        fields[col], fits = _fixed_width(buf, s, e)
        fits_all &= fits
    if not fits_all.all():
        bad[lines[~fits_all]] = True
        keep = fits_all
        lines = lines[keep]
        fields = {c: v[keep] for c, v in fields.items()}
    return _CsvChunk(lines, fields, np.flatnonzero(bad), int(blank.sum()))


def _csv_chunk_quoted(chunk: bytes, ncols: int, wanted: list[int]) -> _CsvChunk:
    """Slow path for chunks with quotes: Python's csv module, one chunk at a time."""
    text_lines = chunk.split(b"\n")[:-1]
    good_lines: list[int] = []
    values: dict[int, list[bytes]] = {c: [] for c in wanted}
    bad: list[int] = []
    blank = 0
    for i, line in enumerate(text_lines):
        stripped = line.rstrip(b"\r")
        if not stripped:
            blank += 1
            continue
        try:
            row = next(csv.reader([stripped.decode("utf-8")]))
        except (UnicodeDecodeError, csv.Error, StopIteration):
            bad.append(i)
            continue
        if len(row) != ncols or any(len(row[c].encode()) > MAX_FIELD_BYTES for c in wanted):
            bad.append(i)
            continue
        good_lines.append(i)
        for c in wanted:
            values[c].append(row[c].strip().encode("utf-8"))
    fields = {
        c: np.array(v, dtype=f"S{max([len(x) for x in v] + [1])}") for c, v in values.items()
    }
    return _CsvChunk(
        np.array(good_lines, dtype=np.int64), fields, np.array(bad, dtype=np.int64), blank
    )


def _chunks(source: _Source, first: bytes, progress: ProgressFn | None) -> Iterator[bytes]:
    """Byte chunks that each end with a newline (one added at the end if missing)."""
    pending = first
    while True:
        block = source.read(CHUNK_BYTES)
        if not block:
            if pending:
                yield pending if pending.endswith(b"\n") else pending + b"\n"
            return
        pending += block
        cut = pending.rfind(b"\n")
        if cut >= 0:
            yield pending[: cut + 1]
            pending = pending[cut + 1 :]
        elif len(pending) > MAX_LINE_BYTES:
            raise ServetuneError(
                f"{source.path}: a line is longer than {MAX_LINE_BYTES:,} bytes; this is not "
                "a line-per-request trace (CSV or JSON Lines)"
            )
        if progress is not None:
            progress(source.position(), source.total_bytes)


@dataclass
class _CsvSpec:
    columns: dict[str, str]  # role -> header name
    arrival_unit: str | None  # s/ms/us/ns/datetime, None = decide from the first value
    drop_zero_output: bool = False  # BurstGPT: 0 response tokens = failed request


class _Checker:
    """Collects rows of one chunk that fail a check: drops them from ``keep`` and records
    (bad lines, first bad line, its reason) in ``problems``."""

    def __init__(self, problems: list, keep: np.ndarray, lines: np.ndarray,
                 columns: dict[str, str]):
        self.problems, self.keep, self.lines, self.columns = problems, keep, lines, columns

    def __call__(self, ok: np.ndarray, role: str, raw: np.ndarray, expected: str) -> None:
        bad_pos = np.flatnonzero(~ok)
        if len(bad_pos):
            j = int(bad_pos[0])  # good rows are in line order: the first is the earliest
            self.problems.append((self.lines[bad_pos], int(self.lines[j]),
                                  f"{self.columns[role]}: expected {expected}, got "
                                  f"{_shown(raw[j])}"))
        self.keep[bad_pos] = False


# From this many bytes of text on, a CSV trace is read with pyarrow when it is installed
# (the optional extra `arrow`). In a fresh process pyarrow costs 0.3-0.4 s before its
# first row (its import, and its compute functions' first use), so on an Azure-format
# file it was about even at 1M rows (34 MiB) and 2x faster at 4M and 10M rows (138 and
# 344 MiB), holding 2.5-3x the memory (benchmarks/RESULTS.md, "pyarrow for large CSV
# traces").
ARROW_MIN_BYTES = 64 << 20
# pyarrow's reader handles these roles; class labels and sessions get their ids in the
# order this module's reader meets them chunk by chunk, so files with them use that reader.
_ARROW_ROLES = frozenset({"arrival", "prompt", "output", "max_tokens", "priority"})


def _length_lows(spec: _CsvSpec) -> tuple[tuple[str, int], ...]:
    """The token-count roles and the least whole number each takes (BurstGPT's failed
    requests have 0 output tokens: read, then dropped)."""
    return (("prompt", 1), ("output", 0 if spec.drop_zero_output else 1), ("max_tokens", 1))


def _priority_ok(prio: np.ndarray, ok: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return ok & (prio == np.floor(prio)) & (np.abs(prio) <= 2**31 - 1)


def _append_rows(rows: _Rows, spec: _CsvSpec, keep: np.ndarray, arrival: np.ndarray,
                 lengths: dict[str, np.ndarray], prio: np.ndarray | None) -> np.ndarray:
    """Append the kept rows' numeric columns to ``rows`` (without BurstGPT's failed
    requests, counted); returns the rows appended (the label columns follow them)."""
    if spec.drop_zero_output:
        failed = keep & (lengths["output"] == 0)
        rows.dropped_failed += int(failed.sum())
        keep = keep & ~failed
    if keep.any():
        rows.add_arrivals(arrival[keep])
        rows.prompt.append(lengths["prompt"][keep].astype(np.int64))
        rows.output.append(lengths["output"][keep].astype(np.int64))
        if "max_tokens" in lengths:
            rows.max_tokens.append(lengths["max_tokens"][keep].astype(np.int64))
        if prio is not None:
            rows.priority.append(prio[keep].astype(np.int32))
    return keep


def _load_csv_arrow(source: _Source, ncols: int, index: dict[str, int], spec: _CsvSpec,
                    rows: _Rows) -> bool:
    """Read a clean CSV trace with pyarrow into ``rows``; False, with ``rows`` untouched,
    whenever the file is not one pyarrow reads exactly as :func:`_load_csv` would (a
    value it cannot convert, an empty field or line, a wrong field count, a field longer
    than MAX_FIELD_BYTES, a value the checks reject): that reader then reads it, and
    reports or skips the bad rows as it always does. Fields are read as text and
    converted by pyarrow's casts, so the lengths are checked first."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.csv as pacsv
    except ImportError:
        return False
    names = [f"c{i}" for i in range(ncols)]
    wanted = sorted(set(index.values()))
    numeric = [role for role in ("prompt", "output", "max_tokens", "priority") if role in index]
    unit = spec.arrival_unit
    origin_ns = 0
    parts: list[tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]] = []
    try:
        # batch by batch, as this module's reader goes chunk by chunk: the text of one
        # batch and the numbers of all are held, not the whole file's text
        batches = pacsv.open_csv(
            pa.input_stream(source.path, compression="gzip" if source.gzipped else None),
            read_options=pacsv.ReadOptions(column_names=names, skip_rows=1,
                                           block_size=CHUNK_BYTES),
            parse_options=pacsv.ParseOptions(newlines_in_values=False,
                                              ignore_empty_lines=False),
            convert_options=pacsv.ConvertOptions(
                include_columns=[names[i] for i in wanted],
                column_types={names[i]: pa.string() for i in wanted}))
        for batch in batches:
            text = {i: batch.column(batch.schema.get_field_index(names[i])) for i in wanted}
            if any(col.null_count or pc.max(pc.binary_length(col)).as_py() > MAX_FIELD_BYTES
                   for col in text.values() if len(col)):
                return False
            raw_arrival = text[index["arrival"]]
            if unit is None and len(raw_arrival):
                # as _load_csv decides: by the first rows, numbers mean seconds
                first = np.array(raw_arrival.slice(0, 100).to_pylist(), dtype=object)
                _, first_ok = _floats(first.astype(f"S{MAX_FIELD_BYTES}"))
                unit = "s" if first_ok.mean() >= 0.5 else "datetime"
            if unit == "datetime":
                # as int64 before numpy: a timestamp column's to_numpy took 0.25 s a million
                ns = pc.cast(pc.cast(raw_arrival, pa.timestamp("ns")), pa.int64()).to_numpy(
                    zero_copy_only=False)
                if not parts and len(ns):
                    origin_ns = int(ns[0])
                arrival = (ns - origin_ns).astype(np.float64) / 1e9
            else:
                arrival = pc.cast(raw_arrival, pa.float64()).to_numpy(
                    zero_copy_only=False) * ARRIVAL_UNITS[unit or "s"]
            numbers = {role: pc.cast(text[index[role]], pa.float64()).to_numpy(
                zero_copy_only=False) for role in numeric}
            ok = np.isfinite(arrival)
            for role, low in _length_lows(spec):
                if role in numbers:
                    ok &= _whole(numbers[role], np.isfinite(numbers[role]), low)
            prio = numbers.pop("priority", None)
            if prio is not None:
                ok = _priority_ok(prio, ok)
            if not ok.all():
                return False
            parts.append((arrival, numbers, prio))
    except (pa.ArrowException, ValueError, OverflowError):
        return False
    rows.expect_rows(sum(len(arrival) for arrival, _, _ in parts))
    for arrival, numbers, prio in parts:
        _append_rows(rows, spec, np.ones(len(arrival), dtype=bool), arrival, numbers, prio)
    return True


def _load_csv(
    source: _Source, head: bytes, spec: _CsvSpec, rows: _Rows, progress: ProgressFn | None
) -> None:
    cut = head.find(b"\n")
    while cut < 0 and len(head) < MAX_HEADER_BYTES:  # the header may be longer than the head
        more = source.read(HEAD_BYTES)
        if not more:
            break
        head += more
        cut = head.find(b"\n")
    header_line, rest = (head, b"") if cut < 0 else (head[: cut + 1], head[cut + 1 :])
    header = _split_header(header_line, source.path)
    if not header:
        raise ServetuneError(f"{source.path}: empty header line; expected CSV column names")
    ncols = len(header)
    index = {
        role: _find_column(header, name, role, source.path) for role, name in spec.columns.items()
    }
    if (source.text_bytes >= ARROW_MIN_BYTES and set(index) <= _ARROW_ROLES
            and _load_csv_arrow(source, ncols, index, spec, rows)):
        return
    wanted = sorted(set(index.values()))
    unit = spec.arrival_unit
    origin_ns: int | None = None
    rows_before = 0  # data lines in earlier chunks (the header is line 1)
    for chunk in _chunks(source, rest, progress):
        if b'"' in chunk:
            parsed = _csv_chunk_quoted(chunk, ncols, wanted)
        else:
            parsed = _csv_chunk_vectorised(chunk, ncols, wanted)
        rows.blank += parsed.blank
        n_lines = chunk.count(b"\n")
        # (bad lines, first bad line, its reason) per check
        problems: list[tuple[np.ndarray, int, str]] = []
        if len(parsed.bad_lines):
            problems.append((parsed.bad_lines, int(parsed.bad_lines[0]),
                             f"expected {ncols} comma-separated fields of at most "
                             f"{MAX_FIELD_BYTES} bytes, as in the header"))
        keep = np.ones(len(parsed.lines), dtype=bool)
        check = _Checker(problems, keep, parsed.lines, spec.columns)

        # arrival
        raw_arrival = parsed.fields[index["arrival"]]
        if unit is None and len(raw_arrival):
            # numbers mean seconds, text means date-times; judge by the first rows
            _, first_ok = _floats(raw_arrival[:100])
            unit = "s" if first_ok.mean() >= 0.5 else "datetime"
        if unit == "datetime":
            ns, ok = _datetimes_ns(raw_arrival)
            if origin_ns is None and ok.any():
                origin_ns = int(ns[np.argmax(ok)])
            arrival = (ns - (origin_ns or 0)).astype(np.float64) / 1e9
            check(ok, "arrival", raw_arrival, "a date-time like 2023-11-16 18:15:46.6805900")
        else:
            values, ok = _floats(raw_arrival)
            arrival = values * ARRIVAL_UNITS[unit or "s"]
            check(ok, "arrival", raw_arrival, f"a finite number of {unit or 's'}")
        # lengths
        lengths = {}
        for role, low in _length_lows(spec):
            if role in index:
                raw = parsed.fields[index[role]]
                values, ok = _floats(raw)
                lengths[role] = values
                check(_whole(values, ok, low), role, raw, f"a whole number of tokens >= {low}")
        prio = None
        if "priority" in index:
            raw = parsed.fields[index["priority"]]
            prio, ok = _floats(raw)
            check(_priority_ok(prio, ok), "priority", raw, "an integer priority")
        labels = parsed.fields[index["class"]] if "class" in index else None
        sessions = None
        if "session" in index:
            raw = parsed.fields[index["session"]]
            sessions = np.char.strip(raw)
            check(sessions != b"", "session", raw, "a session id (text or a number), not empty")

        if problems:
            # report the first bad row of the chunk in file order
            _, first_line, reason = min(problems, key=lambda pr: pr[1])
            rows.bad(rows_before + first_line + 1, reason, line=rows_before + first_line + 2)
            bad_all = np.unique(np.concatenate([lines for lines, _, _ in problems]))
            rows.skipped += len(bad_all) - 1  # rows.bad counted the first one
        if rows_before == 0 and n_lines and source.text_bytes:
            # size the columns from the file size and this chunk's bytes per row
            rows.expect_rows(int(source.text_bytes / (len(chunk) / n_lines) * 1.05) + 1024)
        rows_before += n_lines

        keep = _append_rows(rows, spec, keep, arrival, lengths, prio)
        if not keep.any():
            continue
        if labels is not None:
            uniq, inverse = np.unique(labels[keep], return_inverse=True)
            ids = rows.class_ids_for(
                [bytes(u).decode("utf-8", errors="replace").strip() or "(empty)" for u in uniq]
            )
            rows.class_id.append(ids[inverse])
        if sessions is not None:
            uniq, inverse = np.unique(sessions[keep], return_inverse=True)
            codes = rows.session_codes_for(
                [bytes(u).decode("utf-8", errors="replace") for u in uniq])
            rows.session.append(codes[inverse])


# ----------------------------------------------------------------------------- JSON Lines


# bytes.strip()'s whitespace, for text lines too (str.strip() would take Unicode spaces)
_ASCII_SPACE = {bytes: b" \t\n\r\x0b\x0c", str: " \t\n\r\x0b\x0c"}
_JSON_DECODER = json.JSONDecoder()


def _json_lines(chunk: bytes) -> list[str] | list[bytes]:
    """A chunk's lines: as text when the chunk is plain UTF-8 (no NUL, no byte-order mark),
    which is how ``json.loads`` would decode each of them, so that each line is parsed
    without its per-call decoding (a third of a Mooncake trace's parse time); else as
    bytes, for ``json.loads`` to decode (or reject) line by line."""
    try:
        text = chunk.decode("utf-8")
    except UnicodeDecodeError:
        return chunk.split(b"\n")[:-1]
    if "\x00" in text or "\ufeff" in text:
        return chunk.split(b"\n")[:-1]
    return text.split("\n")[:-1]


def _json_value(text: str | bytes) -> Any:
    """``json.loads(text)`` for one stripped line."""
    if isinstance(text, bytes):
        return json.loads(text)
    value, end = _JSON_DECODER.raw_decode(text)
    if end != len(text):
        raise ValueError("extra data")
    return value


def _finite(value: Any) -> float | None:
    """A JSON number as a finite float; None for anything else, including ``true`` and an
    integer past float's range (``float()`` of it raises OverflowError)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _json_whole(value: Any, low: int) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if low <= value <= MAX_TOKENS else None
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value) if low <= value <= MAX_TOKENS else None
    return None


def _json_session(value: Any) -> str | None:
    """A session id as text: a non-empty string (stripped) or an integer (7 and "7" are
    one session); None for anything else."""
    if isinstance(value, str):
        return value.strip() or None
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return None


def _json_arrival(value: Any, unit: str | None) -> tuple[float | None, str | None]:
    """A JSON arrival value as seconds, or as ns since epoch for date-times."""
    if isinstance(value, int | float) and unit != "datetime":
        number = _finite(value)  # None for true and false too
        if number is None:
            return None, unit
        return number * ARRIVAL_UNITS[unit or "s"], unit or "s"
    if isinstance(value, str) and unit in (None, "datetime"):
        text = value.strip()
        if text[:1].isalpha():  # "today", "now": the clock's date (_datetimes_ns)
            return None, unit
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ns = _datetime_ns(text)
        if np.isnat(ns):
            return None, unit
        return float(ns.astype(np.int64)), "datetime"
    return None, unit


def _block_ids_ok(raw_ids: Any) -> bool:
    """A JSON list of integers that fit in int64 (``true`` is not an id). Checked with
    C-level builtins: a Mooncake line holds dozens of ids, and a loop over them in Python
    was half of the trace's load time."""
    return isinstance(raw_ids, list) and (not raw_ids or (
        set(map(type, raw_ids)) == {int} and -(2**63) < min(raw_ids) and max(raw_ids) < 2**63))


def _load_jsonl(
    source: _Source,
    head: bytes,
    keys: dict[str, str],
    arrival_unit: str | None,
    rows: _Rows,
    progress: ProgressFn | None,
    *,
    prefix_key: str | None = None,
) -> None:
    line_no = 0
    unit = arrival_unit
    origin: float | None = None
    for chunk in _chunks(source, head, progress):
        arrival: list[float] = []
        prompt: list[int] = []
        output: list[int] = []
        labels: list[str] = []
        prio: list[int] = []
        max_tokens: list[int] = []
        prefix_len: list[int] = []
        prefix_ids: list[int] = []
        sessions: list[str] = []
        for line in _json_lines(chunk):
            line_no += 1
            text = line.strip(_ASCII_SPACE[type(line)])
            if not text:
                rows.blank += 1
                continue
            try:
                record = _json_value(text)
            except (ValueError, RecursionError):
                rows.bad(line_no, "not a JSON object")
                continue
            if not isinstance(record, dict):
                rows.bad(line_no, "not a JSON object")
                continue
            missing = [keys[r] for r in keys if keys[r] not in record]
            if missing:
                rows.bad(line_no, f"missing key {missing[0]!r}")
                continue
            t, unit_now = _json_arrival(record[keys["arrival"]], unit)
            if t is None:
                rows.bad(line_no, f"{keys['arrival']}: expected a number"
                         f"{' or date-time text' if unit in (None, 'datetime') else ''}, got "
                         f"{_shown(record[keys['arrival']])}")
                continue
            unit = unit_now
            p = _json_whole(record[keys["prompt"]], 1)
            o = _json_whole(record[keys["output"]], 1)
            if p is None:
                rows.bad(line_no, f"{keys['prompt']}: expected a whole number of tokens >= 1, "
                         f"got {_shown(record[keys['prompt']])}")
                continue
            if o is None:
                rows.bad(line_no, f"{keys['output']}: expected a whole number of tokens >= 1, "
                         f"got {_shown(record[keys['output']])}")
                continue
            extra_ok = True
            pr = mt = None
            if "priority" in keys:
                v = record[keys["priority"]]
                if isinstance(v, bool) or not isinstance(v, int) or abs(v) > 2**31 - 1:
                    rows.bad(line_no, f"{keys['priority']}: expected an integer, got {_shown(v)}")
                    extra_ok = False
                pr = v
            if extra_ok and "max_tokens" in keys:
                mt = _json_whole(record[keys["max_tokens"]], 1)
                if mt is None:
                    rows.bad(line_no, f"{keys['max_tokens']}: expected a whole number >= 1, "
                             f"got {_shown(record[keys['max_tokens']])}")
                    extra_ok = False
            session = None
            if extra_ok and "session" in keys:
                session = _json_session(record[keys["session"]])
                if session is None:
                    rows.bad(line_no, f"{keys['session']}: expected a session id (text or an "
                             f"integer), not empty, got {_shown(record[keys['session']])}")
                    extra_ok = False
            ids: list[int] = []
            if extra_ok and prefix_key is not None and prefix_key in record:
                raw_ids = record[prefix_key]
                if not _block_ids_ok(raw_ids):
                    rows.bad(line_no, f"{prefix_key}: expected a list of integer block ids")
                    extra_ok = False
                else:
                    ids = raw_ids
            if not extra_ok:
                continue
            if unit == "datetime":
                if origin is None:
                    origin = t
                t = (t - origin) / 1e9
            arrival.append(t)
            prompt.append(p)
            output.append(o)
            if "class" in keys:
                lbl = record[keys["class"]]
                label = (lbl if isinstance(lbl, str) else json.dumps(lbl)).strip()
                labels.append(label or "(empty)")
            if pr is not None:
                prio.append(pr)
            if mt is not None:
                max_tokens.append(mt)
            if session is not None:
                sessions.append(session)
            if prefix_key is not None:
                prefix_len.append(len(ids))
                prefix_ids.extend(ids)
        if not arrival:
            continue
        rows.add_arrivals(np.array(arrival, dtype=np.float64))
        rows.prompt.append(np.array(prompt, dtype=np.int64))
        rows.output.append(np.array(output, dtype=np.int64))
        if "class" in keys:
            rows.class_id.append(rows.class_ids_for(labels))
        if "priority" in keys:
            rows.priority.append(np.array(prio, dtype=np.int32))
        if "max_tokens" in keys:
            rows.max_tokens.append(np.array(max_tokens, dtype=np.int64))
        if "session" in keys:
            rows.session.append(rows.session_codes_for(sessions))
        if prefix_key is not None:
            rows.prefix_lengths.append(np.array(prefix_len, dtype=np.int64))
            rows.prefix_ids.append(np.array(prefix_ids, dtype=np.int64))


# ----------------------------------------------------------------------------- vllm bench


def _load_vllm_bench(source: _Source, head: bytes, rows: _Rows) -> None:
    data = head + source.read(-1)
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError):
        raise ServetuneError(
            f"{source.path}: not valid JSON; expected a `vllm bench serve --save-result` file"
        ) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("input_lens"), list) or not (
        isinstance(doc.get("output_lens"), list)
    ):
        raise ServetuneError(
            f"{source.path}: expected a JSON object with input_lens and output_lens lists "
            "(a `vllm bench serve --save-result` file)"
        )
    inputs, outputs = doc["input_lens"], doc["output_lens"]
    n = len(inputs)
    if len(outputs) != n:
        raise ServetuneError(
            f"{source.path}: input_lens has {n} entries but output_lens has {len(outputs)}"
        )
    errors = doc.get("errors")
    errors = errors if isinstance(errors, list) and len(errors) == n else [""] * n
    starts = doc.get("start_times")
    have_starts = isinstance(starts, list) and len(starts) == n
    if not have_starts:
        rate = doc.get("request_rate")
        if isinstance(rate, str):
            try:
                rate = float(rate)
            except ValueError:
                rate = None
        rate = _finite(rate)
        if rate is None or rate <= 0:
            duration, completed = _finite(doc.get("duration")), _finite(doc.get("completed"))
            if duration is None or completed is None or duration <= 0 or completed <= 0:
                raise ServetuneError(
                    f"{source.path}: no start_times and no finite request_rate or duration to "
                    "place arrivals; rerun vllm bench serve with --save-detailed"
                )
            rate = completed / duration
        starts = [i / rate for i in range(n)]
        rows.notices.append(
            f"no per-request start_times in the file; arrivals spaced evenly at {rate:g} req/s"
        )
    arrival, prompt, output = [], [], []
    for i in range(n):
        if errors[i] not in ("", None):
            rows.dropped_failed += 1
            continue
        p, o = _json_whole(inputs[i], 1), _json_whole(outputs[i], 0)
        t = _finite(starts[i])
        if t is None:
            rows.bad(i + 1, f"start_times: expected seconds, got {_shown(starts[i])}")
            continue
        if p is None:
            rows.bad(i + 1, f"input_lens: expected a whole number >= 1, got {_shown(inputs[i])}")
            continue
        if o is None:
            rows.bad(i + 1, f"output_lens: expected a whole number >= 0, got "
                     f"{_shown(outputs[i])}")
            continue
        if o == 0:
            rows.dropped_failed += 1
            continue
        arrival.append(t)
        prompt.append(p)
        output.append(o)
    if arrival:
        rows.add_arrivals(np.array(arrival, dtype=np.float64))
        rows.prompt.append(np.array(prompt, dtype=np.int64))
        rows.output.append(np.array(output, dtype=np.int64))


# ----------------------------------------------------------------------------- detection


def detect_format(head: bytes, path: str = "trace") -> str:
    """The format of a file from its first bytes (decompressed)."""
    text = head.lstrip(b"\xef\xbb\xbf").lstrip()
    if not text:
        raise ServetuneError(f"{path}: the file is empty; expected a trace")
    if b"\x00" in head[:4096]:
        raise ServetuneError(
            f"{path}: binary data, not a text trace; expected CSV, JSON Lines or JSON"
        )
    first_line = text.split(b"\n", 1)[0].strip()
    if text[:1] in (b"{", b"["):
        try:
            record = json.loads(first_line)
        except (ValueError, RecursionError):
            if b"\n" in text:
                return "vllm-bench"  # a JSON document spread over several lines
            # one line longer than the head (a Mooncake request with thousands of
            # hash_ids): tell it by the keys it starts with
            if all(f'"{k}"'.encode() in text for k in MOONCAKE_KEYS.values()):
                return "mooncake"
            return "vllm-bench" if b'"input_lens"' in text else "jsonl"
        if isinstance(record, dict):
            if "input_lens" in record and "output_lens" in record:
                return "vllm-bench"
            if all(k in record for k in MOONCAKE_KEYS.values()):
                return "mooncake"
        return "jsonl"
    header = set(_split_header(first_line, path))
    if set(AZURE_COLUMNS.values()) <= header:
        return "azure"
    if {BURSTGPT_COLUMNS[r] for r in ("arrival", "prompt", "output")} <= header:
        return "burstgpt"
    return "csv"


def load_trace(
    path: str | os.PathLike[str],
    fmt: str | None = None,
    on_bad_row: str = "error",
    columns: str | Mapping[str, str] | None = None,
    *,
    arrival_unit: str | None = None,
    progress: ProgressFn | None = None,
) -> Trace:
    """Load a trace file (any of ``FORMATS``, optionally gzipped) as a Trace."""
    p = os.fspath(path)
    if fmt is not None and fmt not in FORMATS:
        raise ServetuneError(f"unknown trace format {fmt!r}; use one of {', '.join(FORMATS)}")
    if on_bad_row not in ("error", "skip"):
        raise ServetuneError(
            f"argument `on_bad_row` must be error or skip (got {on_bad_row!r})"
        )
    if arrival_unit is not None and arrival_unit not in (*ARRIVAL_UNITS, "datetime"):
        raise ServetuneError(
            f"argument `arrival_unit` must be one of s, ms, us, ns, datetime "
            f"(got {arrival_unit!r})"
        )
    mapping = parse_columns(columns)
    source = _Source(p)
    try:
        head = source.read(HEAD_BYTES)
        detected = detect_format(head, p)
        if fmt in ("csv", "jsonl") and mapping is None:
            raise ServetuneError(
                f"{p}: argument `fmt` {fmt} needs a column mapping, e.g. argument `columns` "
                "arrival=ts,prompt=in,output=out"
            )
        if fmt is None:
            fmt = detected
            if mapping is not None:
                fmt = "jsonl" if detected in ("mooncake", "jsonl", "vllm-bench") else "csv"
        if mapping is not None and fmt not in ("csv", "jsonl"):
            raise ServetuneError(
                f"argument `columns` applies to argument `fmt` csv or jsonl, not {fmt}"
            )
        if fmt in ("csv", "jsonl") and mapping is None:
            raise ServetuneError(
                f"{p}: not a known trace format (detected generic {detected}); give a column "
                "mapping, e.g. argument `columns` arrival=ts,prompt=in,output=out"
            )
        rows = _Rows(p, on_bad_row, unit="request" if fmt == "vllm-bench" else "row")
        head = head.lstrip(b"\xef\xbb\xbf")
        if fmt == "azure":
            columns = dict(AZURE_COLUMNS)
            header = _split_header(head.split(b"\n", 1)[0], p)
            if AZURE_CLASS_COLUMN in (h.lower() for h in header):
                columns["class"] = AZURE_CLASS_COLUMN
            _load_csv(source, head, _CsvSpec(columns, "datetime"), rows, progress)
        elif fmt == "burstgpt":
            spec = _CsvSpec(dict(BURSTGPT_COLUMNS), "s", drop_zero_output=True)
            _load_csv(source, head, spec, rows, progress)
        elif fmt == "csv":
            assert mapping is not None
            _load_csv(source, head, _CsvSpec(mapping, arrival_unit), rows, progress)
        elif fmt == "mooncake":
            keys = dict(MOONCAKE_KEYS)
            _load_jsonl(source, head, keys, "ms", rows, progress, prefix_key="hash_ids")
        elif fmt == "jsonl":
            assert mapping is not None
            _load_jsonl(source, head, mapping, arrival_unit, rows, progress)
        else:
            _load_vllm_bench(source, head, rows)
        if progress is not None:
            progress(source.total_bytes, source.total_bytes)
        return rows.build(p)
    except MemoryError:
        raise ServetuneError(f"{p}: out of memory while loading the trace") from None
    finally:
        source.close()

