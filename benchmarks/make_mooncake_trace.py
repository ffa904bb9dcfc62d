"""Write a longer Mooncake-format trace by tiling a Mooncake trace in time.

    python benchmarks/make_mooncake_trace.py OUT.jsonl [--source T.jsonl[.gz]]
        [--copies 10] [--gap-ms G] [--jitter-ms 0 --seed 0]

The source (by default the shared ``mooncake_synthetic_trace.jsonl.gz``: 3,993 requests
over 1,022 s) is laid end to end ``--copies`` times: copy ``c`` starts ``c * (span + gap)``
ms after the first (``span`` = last minus first timestamp; ``gap`` by default the source's
mean inter-arrival time, rounded to a whole ms), so the long trace keeps the source's
arrival rate, lengths and burst shape. Copy ``c`` adds ``c * (max id + 1)`` to every hash id,
so copies share no prefix block with each other and each copy's reuse is exactly the
source's. A row's other fields are kept (a ``session_id`` gets ``-c`` and the copy number,
so sessions stay apart). ``--jitter-ms J`` moves each arrival of copies 1.. by a uniform
whole number of ms in ``[-J, J]`` drawn with ``--seed`` (copy 0 stays the source); with the
default ``J = 0`` the output does not depend on the seed. The rows are written sorted by
timestamp (stable), one JSON object per line in the source's key order; ``.gz`` output is
gzip with no name or time in its header. Same inputs, same bytes.

Dynamo's replay turns each hash id into the token id of its 512 tokens as an unsigned
32-bit integer, so the largest id written must stay below 2**32 (checked).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED_TRACE = REPO.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl.gz"
COPIES = 10
MAX_HASH_ID = 2**32 - 1  # the replay peer's token ids are u32
REQUIRED = ("timestamp", "input_length", "output_length", "hash_ids")


def _error(message: str) -> Exception:
    from servetune.errors import ServetuneError

    return ServetuneError(message)


def _nonnegative_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_row(row: object, where: str) -> dict:
    if not isinstance(row, dict):
        raise _error(f"{where}: expected a JSON object per line")
    for key in REQUIRED:
        if key not in row:
            raise _error(f"{where}: field {key} is missing")
    ts = row["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not ts >= 0:
        raise _error(f"{where}: field timestamp must be a number >= 0 (ms), got {ts!r}")
    for key in ("input_length", "output_length"):
        if not _nonnegative_int(row[key]) or row[key] < 1:
            raise _error(f"{where}: field {key} must be an integer >= 1, got {row[key]!r}")
    ids = row["hash_ids"]
    if not isinstance(ids, list) or not all(_nonnegative_int(i) for i in ids):
        raise _error(f"{where}: field hash_ids must be a list of integers >= 0")
    return row


def read_rows(path: str | Path) -> list[dict]:
    """The source's rows (plain or gzipped JSON Lines), each checked; one error line
    naming the file and line when a row is not a Mooncake request."""
    from servetune.io import decode_text, read_bytes

    data = read_bytes(path, "Mooncake JSON Lines")
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise _error(f"{path}: not a readable gzip file ({exc})") from None
    rows = []
    for n, line in enumerate(decode_text(data, path, "Mooncake JSON Lines").split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise _error(f"{path}: line {n}: not JSON") from None
        rows.append(_check_row(row, f"{path}: line {n}"))
    if not rows:
        raise _error(f"{path}: no request; expected Mooncake JSON Lines")
    return rows


def mean_gap_ms(rows: list[dict]) -> int:
    """The source's mean inter-arrival time in whole ms (0 for a single request)."""
    ts = [r["timestamp"] for r in rows]
    return round((max(ts) - min(ts)) / (len(ts) - 1)) if len(ts) > 1 else 0


def tile(rows: list[dict], copies: int = COPIES, *, gap_ms: int | None = None,
         jitter_ms: int = 0, seed: int = 0) -> list[dict]:
    """``copies`` copies of ``rows`` laid end to end (module docstring), sorted by
    timestamp; the input rows are not changed."""
    if copies < 1:
        raise _error(f"argument `copies` must be >= 1 (got {copies})")
    if jitter_ms < 0:
        raise _error(f"argument `jitter_ms` must be >= 0 (got {jitter_ms})")
    gap = mean_gap_ms(rows) if gap_ms is None else gap_ms
    if gap < 0:
        raise _error(f"argument `gap_ms` must be >= 0 (got {gap})")
    ts = [r["timestamp"] for r in rows]
    period = (max(ts) - min(ts)) + gap
    stride = 1 + max((max(r["hash_ids"]) for r in rows if r["hash_ids"]), default=-1)
    top = copies * stride - 1  # the last copy's largest id
    if top > MAX_HASH_ID:
        raise _error(
            f"{copies} copies need hash ids up to {top}, above the replay peer's u32 token "
            f"ids (max {MAX_HASH_ID}); use fewer copies"
        )
    rng = random.Random(seed)
    out = []
    for c in range(copies):
        for r in rows:
            new = dict(r)
            t = r["timestamp"] + c * period
            if c and jitter_ms:
                t = max(0, t + rng.randint(-jitter_ms, jitter_ms))
            new["timestamp"] = t
            new["hash_ids"] = [i + c * stride for i in r["hash_ids"]]
            if "session_id" in r:
                new["session_id"] = f"{r['session_id']}-c{c}"
            out.append(new)
    out.sort(key=lambda r: r["timestamp"])  # stable: equal times keep copy and file order
    return out


def jsonl_chunks(rows: list[dict], chunk_rows: int = 4096) -> Iterator[bytes]:
    """The rows as JSON Lines bytes, a few thousand rows at a time."""
    for i in range(0, len(rows), chunk_rows):
        text = "".join(json.dumps(r) + "\n" for r in rows[i:i + chunk_rows])
        yield text.encode("utf-8")


def write_rows(path: str | Path, rows: list[dict]) -> None:
    """Write ``rows`` atomically; gzip (no name, mtime 0) when ``path`` ends in .gz."""
    from servetune.io import write_bytes_atomic

    data: bytes | Iterator[bytes] = jsonl_chunks(rows)
    if str(path).endswith(".gz"):
        data = gzip.compress(b"".join(data), compresslevel=6, mtime=0)
    write_bytes_atomic(path, data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output", type=Path, help="where to write (.jsonl or .jsonl.gz)")
    parser.add_argument("--source", type=Path, default=SHARED_TRACE,
                        help="Mooncake trace to tile (default: the shared synthetic trace)")
    parser.add_argument("--copies", type=int, default=COPIES)
    parser.add_argument("--gap-ms", type=int, default=None,
                        help="ms between one copy's last arrival and the next's first "
                             "(default: the source's mean inter-arrival)")
    parser.add_argument("--jitter-ms", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from servetune.errors import ServetuneError

    try:
        if args.output.resolve() == args.source.resolve():
            raise _error(f"{args.output}: is the source; choose another output path")
        rows = tile(read_rows(args.source), args.copies, gap_ms=args.gap_ms,
                    jitter_ms=args.jitter_ms, seed=args.seed)
        write_rows(args.output, rows)
    except ServetuneError as exc:
        print(f"make_mooncake_trace: error: {exc}", file=sys.stderr)
        return exc.exit_code
    span_s = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000.0
    print(f"wrote {args.output} ({len(rows)} requests over {span_s:.1f} s, "
          f"{args.copies} copies of {args.source.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
