"""Reading GPU timing CSVs (the format of ``gpu_measurements/h200/``), strictly.

Per-operation files (one layer's worth of one operation, milliseconds):

- ``linear.csv``: model, op (qkv | o | gate_up | down), tokens, k, n, dtype, ms
- ``attn_decode.csv``: model, batch, context, ms
- ``attn_prefill.csv``: model, batch (``1`` or ``chunk_prefix<P>``), tokens, ms
- ``elementwise.csv``: model, tokens, ms
- ``lm_head.csv``: model, tokens, ms

Whole-step files ``step_graph_<model>.csv``: model, decode_seqs, context, prefill_tokens,
graph_ms (optionally ``prefix``: cached tokens before the prefill chunk).

Every problem is one :class:`ServetuneError` naming the file, the line and the column.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass, field
from pathlib import Path

from servetune.errors import ServetuneError
from servetune.io import decode_text, read_bytes, sha256_bytes

PER_OP_FILES: dict[str, tuple[str, ...]] = {
    "linear.csv": ("model", "op", "tokens", "k", "n", "dtype", "ms"),
    "attn_decode.csv": ("model", "batch", "context", "ms"),
    "attn_prefill.csv": ("model", "batch", "tokens", "ms"),
    "elementwise.csv": ("model", "tokens", "ms"),
    "lm_head.csv": ("model", "tokens", "ms"),
}
STEP_COLUMNS: tuple[str, ...] = ("model", "decode_seqs", "context", "prefill_tokens", "graph_ms")
GEMM_OPS: tuple[str, ...] = ("qkv", "o", "gate_up", "down")


@dataclass
class CsvTable:
    """Rows of one CSV as strings, with their line numbers (the header is line 1)."""

    path: Path
    columns: list[str]
    rows: list[dict[str, str]]
    lines: list[int]
    sha256: str

    def number(self, i: int, column: str, *, integer: bool = False, positive: bool = True,
               allow_zero: bool = False) -> float:
        """Row ``i``'s ``column`` as a number, or a one-line error naming file/line/column."""
        raw = (self.rows[i].get(column) or "").strip()
        what = "an integer" if integer else "a number"
        try:
            value = float(raw)
            if integer:
                if value != int(value):
                    raise ValueError
                value = int(value)
        except (ValueError, OverflowError):  # OverflowError: int() of inf
            raise ServetuneError(
                f"{self.path}: line {self.lines[i]}, column {column!r}: expected {what} "
                f"(got {raw!r})"
            ) from None
        if value != value or value in (float("inf"), float("-inf")):
            raise ServetuneError(
                f"{self.path}: line {self.lines[i]}, column {column!r}: must be finite"
            )
        if positive and (value < 0 or (value == 0 and not allow_zero)):
            bound = ">= 0" if allow_zero else "> 0"
            raise ServetuneError(
                f"{self.path}: line {self.lines[i]}, column {column!r}: must be {bound} "
                f"(got {raw!r})"
            )
        return value

    def for_model(self, model: str) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r.get("model", "").strip() == model]

    def models(self) -> list[str]:
        return sorted({r.get("model", "").strip() for r in self.rows})


def read_csv(path: str | Path, required: tuple[str, ...]) -> CsvTable:
    """Read a CSV with a header that must contain ``required`` columns."""
    p = Path(path)
    data = read_bytes(p, "CSV")
    text = decode_text(data, p, "CSV", encoding="utf-8-sig")
    reader = csv.reader(text.splitlines())
    try:
        header = next(reader)
    except StopIteration:
        raise ServetuneError(f"{p}: empty file; expected a header with columns "
                             f"{', '.join(required)}") from None
    header = [h.strip() for h in header]
    missing = [c for c in required if c not in header]
    if missing:
        raise ServetuneError(
            f"{p}: missing column {missing[0]!r} (has: {', '.join(header) or 'none'}; "
            f"needs: {', '.join(required)})"
        )
    rows: list[dict[str, str]] = []
    lines: list[int] = []
    for line_no, values in enumerate(reader, start=2):
        if not values or all(not v.strip() for v in values):
            continue
        if len(values) != len(header):
            raise ServetuneError(
                f"{p}: line {line_no}: {len(values)} fields, the header has {len(header)}"
            )
        rows.append(dict(zip(header, values, strict=True)))
        lines.append(line_no)
    if not rows:
        raise ServetuneError(f"{p}: no data rows")
    return CsvTable(p, header, rows, lines, sha256_bytes(data))


@dataclass
class Measurements:
    """The per-operation tables of one measurement folder, plus its whole-step files."""

    folder: Path
    tables: dict[str, CsvTable]
    steps: dict[str, CsvTable] = field(default_factory=dict)  # model name -> table

    def files(self) -> list[CsvTable]:
        return [*self.tables.values(), *self.steps.values()]

    def require_model(self, model: str) -> None:
        """Every per-operation table must have rows for ``model``."""
        for table in self.tables.values():
            if not table.for_model(model):
                raise ServetuneError(
                    f"{table.path}: no rows for model {model!r} in column 'model' "
                    f"(models present: {', '.join(table.models())})"
                )


def load_measurements(folder: str | Path) -> Measurements:
    """Load a measurement folder; every per-operation file is required."""
    d = Path(folder)
    if not d.is_dir():
        raise ServetuneError(f"{d}: not a folder; expected a folder of timing CSVs "
                             f"({', '.join(PER_OP_FILES)})")
    tables = {name: read_csv(d / name, cols) for name, cols in PER_OP_FILES.items()}
    steps: dict[str, CsvTable] = {}
    for path in sorted(d.glob("step_graph_*.csv")):
        table = read_csv(path, STEP_COLUMNS)
        for model in table.models():
            if model in steps:
                raise ServetuneError(f"{path}: model {model!r} also has steps in "
                                     f"{steps[model].path}; keep one whole-step file per model")
            steps[model] = table
    return Measurements(d, tables, steps)


@dataclass
class StepRow:
    decode_seqs: int
    context: int
    prefill_tokens: int
    prefix: int
    seconds: float
    line: int


def step_rows(table: CsvTable, model: str | None = None) -> list[StepRow]:
    """Whole-step rows (of one model, or all) with validated numbers."""
    out = []
    has_prefix = "prefix" in table.columns
    for i, row in enumerate(table.rows):
        if model is not None and row.get("model", "").strip() != model:
            continue
        out.append(StepRow(
            decode_seqs=int(table.number(i, "decode_seqs", integer=True, allow_zero=True)),
            context=int(table.number(i, "context", integer=True, allow_zero=True)),
            prefill_tokens=int(table.number(i, "prefill_tokens", integer=True, allow_zero=True)),
            prefix=int(table.number(i, "prefix", integer=True, allow_zero=True))
            if has_prefix else 0,
            seconds=table.number(i, "graph_ms") * 1e-3,
            line=table.lines[i],
        ))
        if out[-1].decode_seqs == 0 and out[-1].prefill_tokens == 0:
            raise ServetuneError(f"{table.path}: line {table.lines[i]}: an empty step "
                                 "(decode_seqs and prefill_tokens both 0)")
    return out
