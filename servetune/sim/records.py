"""Per-request records of a simulated run, as CSV (always) or Parquet (with pyarrow).

One row per request, in trace order: ``request_id`` (the trace row), ``class``,
``arrival_s``, ``admitted_s``, ``first_token_s``, ``finish_s`` (empty/null when not
reached), ``prompt_tokens``, ``output_tokens`` (capped by ``max_tokens`` where the trace
has it: the tokens a served request generates), ``preemptions``, ``status`` (completed,
shed, rejected), ``reason`` (why a request was shed or rejected; empty otherwise) and the
derived ``ttft_s``, ``tpot_s``, ``e2e_s``; then, where the run has them, ``cached_tokens``
(prompt tokens served from the prefix cache at first admission) and, for a cluster,
``replica`` (the replica the router chose; under disaggregation the prefill replica) and
``decode_replica`` (-1: none). Floats are written in Python's shortest
round-trip form, so a CSV reads back to the exact simulated values and the same run gives
the same bytes. Files are written atomically.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from servetune.errors import ServetuneError
from servetune.io import write_bytes_atomic
from servetune.sim.metrics import STATUS_NAMES, request_metrics, served_output_tokens

if TYPE_CHECKING:
    from servetune.sim.engine import EngineOutput
    from servetune.workloads.trace import Trace

COLUMNS = (
    "request_id",
    "class",
    "arrival_s",
    "admitted_s",
    "first_token_s",
    "finish_s",
    "prompt_tokens",
    "output_tokens",
    "preemptions",
    "status",
    "reason",
    "ttft_s",
    "tpot_s",
    "e2e_s",
)


def record_columns(
    trace: Trace, output: EngineOutput, reasons: tuple[str, ...]
) -> dict[str, np.ndarray]:
    """The record table as named columns (numpy arrays; strings as object arrays)."""
    served = served_output_tokens(trace)
    m = request_metrics(
        trace.arrival_s, output.first_token_s, output.finish_s, served,
        output.status, trace.class_ids(),
    )
    names = np.asarray(trace.class_names, dtype=object)
    status_names = np.asarray(STATUS_NAMES, dtype=object)
    reason_text = np.asarray(reasons if reasons else ("",), dtype=object)
    reason_code = np.asarray(output.reason, dtype=np.int64)
    reason_col = np.where(
        (reason_code > 0) & (reason_code < len(reason_text)),
        reason_text[np.clip(reason_code, 0, len(reason_text) - 1)],
        "",
    )
    columns = {
        "request_id": np.arange(len(trace), dtype=np.int64),
        "class": names[trace.class_ids()],
        "arrival_s": np.asarray(trace.arrival_s, dtype=np.float64),
        "admitted_s": np.asarray(output.admitted_s, dtype=np.float64),
        "first_token_s": np.asarray(output.first_token_s, dtype=np.float64),
        "finish_s": np.asarray(output.finish_s, dtype=np.float64),
        "prompt_tokens": np.asarray(trace.prompt_tokens, dtype=np.int64),
        "output_tokens": served,
        "preemptions": np.asarray(output.preemptions, dtype=np.int64),
        "status": status_names[np.asarray(output.status, dtype=np.int64)],
        "reason": reason_col,
        "ttft_s": m.ttft_s,
        "tpot_s": m.tpot_s,
        "e2e_s": m.e2e_s,
    }
    for name, values in (("cached_tokens", getattr(output, "hit_tokens", None)),
                         ("replica", getattr(output, "replica", None)),
                         ("decode_replica", getattr(output, "decode_replica", None))):
        if values is not None:
            columns[name] = np.asarray(values, dtype=np.int64)
    return columns


def _float_text(x: float) -> str:
    return repr(x) if math.isfinite(x) else ""


def _csv_field(text: str) -> str:
    if any(c in text for c in ',"\n\r'):
        return '"' + text.replace('"', '""') + '"'
    return text


def _column_text(col: np.ndarray) -> list[str]:
    if col.dtype.kind == "f":
        return [_float_text(v) for v in col.tolist()]
    if col.dtype.kind in "iu":
        return [str(v) for v in col.tolist()]
    return [_csv_field(str(v)) for v in col.tolist()]


def records_csv_chunks(columns: dict[str, np.ndarray], chunk_rows: int = 65536
                       ) -> Iterator[bytes]:
    """CSV bytes of the record table (header + one line per request), ``chunk_rows`` lines
    at a time, so that a million-request run never holds a Python string per cell, nor the
    whole text, at once."""
    n = len(columns[COLUMNS[0]])
    yield (",".join(columns) + "\n").encode()
    for lo in range(0, n, chunk_rows):
        texts = [_column_text(columns[name][lo : lo + chunk_rows]) for name in columns]
        yield "".join(",".join(row) + "\n" for row in zip(*texts, strict=True)).encode()


def records_csv(columns: dict[str, np.ndarray], chunk_rows: int = 65536) -> bytes:
    """CSV bytes of the record table (:func:`records_csv_chunks`, joined)."""
    return b"".join(records_csv_chunks(columns, chunk_rows))


def records_parquet(columns: dict[str, np.ndarray]) -> bytes:
    """Parquet bytes of the record table; needs pyarrow."""
    try:  # lazy: pyarrow is optional (only Parquet output needs it)
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ServetuneError(
            "writing Parquet records needs pyarrow (pip install pyarrow); "
            "or give a .csv path"
        ) from None
    arrays = {}
    for name, col in columns.items():
        if col.dtype.kind == "f":
            arrays[name] = pa.array(col, mask=~np.isfinite(col))
        elif col.dtype == object:
            arrays[name] = pa.array([str(v) for v in col.tolist()], type=pa.string())
        else:
            arrays[name] = pa.array(col)
    buf = io.BytesIO()
    pq.write_table(pa.table(arrays), buf)
    return buf.getvalue()


def is_parquet_path(path: str | os.PathLike[str]) -> bool:
    return Path(path).suffix.lower() in (".parquet", ".pq")


RECORD_SUFFIXES = (".csv", ".parquet", ".pq")


def check_records_path(path: str | os.PathLike[str]) -> None:
    """Fail early (before a long run) when the path's extension names no records format
    (``out.xlsx``), or Parquet is asked for without pyarrow."""
    if Path(path).suffix.lower() not in RECORD_SUFFIXES:
        raise ServetuneError(
            f"--records {path}: the extension names the format: give a .csv or .parquet path"
        )
    if is_parquet_path(path):
        try:  # lazy: pyarrow is optional (only Parquet output needs it)
            import pyarrow  # noqa: F401
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise ServetuneError(
                f"{path}: writing Parquet records needs pyarrow (pip install pyarrow); "
                "or give a .csv path"
            ) from None


def write_records(
    path: str | os.PathLike[str], trace: Trace, output: EngineOutput,
    reasons: tuple[str, ...] = (),
) -> None:
    """Write the record table to ``path``: Parquet for ``.parquet``/``.pq``, else CSV."""
    p = Path(path)
    columns = record_columns(trace, output, reasons)
    if is_parquet_path(p):
        write_bytes_atomic(p, records_parquet(columns))
    else:  # written as it is formatted: the CSV text is never whole in memory
        write_bytes_atomic(p, records_csv_chunks(columns))
