"""File and JSON helpers every layer shares.

- **Hashing**: SHA-256 of a file, of bytes, of a document (its JSON) or of plain data (its
  sorted JSON), as the hex strings provenance records and cache keys carry.
- **JSON cleaning**: :func:`plain_data` turns numpy scalars and arrays, tuples and
  non-string keys into plain JSON/YAML values (non-finite floats to ``None`` unless asked
  to keep them); :func:`round_floats` rounds to significant digits for provenance;
  :func:`drop_timings` removes wall-clock figures so the same inputs give the same bytes.
- **Atomic writes**: :func:`write_bytes_atomic` (temporary file beside the target, then a
  rename) for one file, :func:`commit_files` for a set of files that must appear together,
  :func:`write_all_or_none` for a set of writers that each stream their own file.
- **Reading**: :func:`open_binary`, :func:`read_bytes` and :func:`decode_text` turn a
  missing, unreadable or non-UTF-8 input into one error line naming the file.
- **Path checks**: :func:`require_file` for an input that must be a readable file,
  :func:`check_out_file`, :func:`check_out_files` and :func:`check_out_dir` for outputs,
  before any long work.

Every failure is one :class:`~servetune.errors.ServetuneError` line naming the path.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from servetune.errors import ServetuneError

_UMASK = os.umask(0)
os.umask(_UMASK)
FILE_MODE = 0o666 & ~_UMASK  # the mode a plain open() would give a new file

# Wall-clock figures in summaries; drop_timings() removes them.
TIMING_KEYS = frozenset({"wall_s", "solver_s", "simulation_s", "sim_wall_s", "solve_s"})


# --------------------------------------------------------------------------- hashing


def sha256_bytes(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB chunks (traces can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_doc(doc: Any) -> str:
    """Hex SHA-256 of a pydantic document's JSON (for a document that has no file)."""
    return sha256_bytes(doc.model_dump_json().encode())


def sha256_json(data: Any) -> str:
    """Hex SHA-256 of plain data as JSON with sorted keys (a cache key)."""
    return sha256_bytes(json.dumps(data, sort_keys=True, default=str).encode())


# ----------------------------------------------------------------------- JSON cleaning


def plain_data(value: Any, *, finite: bool = True) -> Any:
    """A JSON/YAML-safe copy of ``value``: mapping keys as strings, tuples as lists, numpy
    scalars and arrays as Python values, and (with ``finite``) NaN and infinities as
    ``None``. Key order is kept, so the same data always gives the same bytes."""
    if isinstance(value, dict):
        return {str(k): plain_data(v, finite=finite) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain_data(v, finite=finite) for v in value]
    if isinstance(value, np.ndarray):
        return plain_data(value.tolist(), finite=finite)
    if hasattr(value, "item") and callable(value.item):  # numpy (or array-API) scalar
        return plain_data(value.item(), finite=finite)
    if finite and isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def finite_or_none(x: Any) -> float | None:
    """``x`` as a float, or ``None`` when it is ``None``, NaN or infinite."""
    if x is None:
        return None
    value = float(x)
    return value if math.isfinite(value) else None


def round_floats(value: Any, digits: int = 6) -> Any:
    """Round every float in nested data to ``digits`` significant digits (non-finite to
    ``None``), so that noise below that never changes the bytes of a written file."""
    if isinstance(value, dict):
        return {k: round_floats(v, digits) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [round_floats(v, digits) for v in value]
    if isinstance(value, float | np.floating):
        v = float(value)
        if not math.isfinite(v):
            return None
        return float(f"{v:.{digits}g}")
    return value


def drop_timings(value: Any) -> Any:
    """Remove wall-clock figures (:data:`TIMING_KEYS`), so that the same inputs give the
    same summary bytes."""
    if isinstance(value, dict):
        return {k: drop_timings(v) for k, v in value.items() if k not in TIMING_KEYS}
    if isinstance(value, list | tuple):
        return [drop_timings(v) for v in value]
    return value


# --------------------------------------------------------------------------- paths


def open_binary(path: str | os.PathLike[str], kind: str) -> BinaryIO:
    """``path`` opened for binary reading; a missing file, a folder or an unreadable file
    is one line naming the path (``kind`` names the file expected, e.g. ``"YAML"``)."""
    try:
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    except FileNotFoundError:
        raise ServetuneError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ServetuneError(f"{path}: is a directory, expected a {kind} file") from None
    except OSError as exc:
        raise ServetuneError(f"{path}: cannot read ({exc.strerror})") from None


def read_bytes(path: str | os.PathLike[str], kind: str) -> bytes:
    """The whole file (errors as in :func:`open_binary`)."""
    with open_binary(path, kind) as fh:
        try:
            return fh.read()
        except OSError as exc:
            raise ServetuneError(f"{path}: cannot read ({exc.strerror})") from None


def decode_text(data: bytes, path: str | os.PathLike[str], kind: str,
                encoding: str = "utf-8") -> str:
    """``data`` (read from ``path``) as text with universal newlines, as a file opened in
    text mode reads; bytes that are not UTF-8 are one line naming the path."""
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError:
        raise ServetuneError(f"{path}: not UTF-8 text; expected a {kind} file") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def require_file(path: Path, given: str) -> Path:
    """``path`` when it is an existing file, else a one-line error; ``given`` says where
    the path came from (e.g. ``"given to --trace"``)."""
    if not path.exists():
        raise ServetuneError(f"{path}: file not found ({given})")
    if path.is_dir():
        raise ServetuneError(f"{path}: is a directory ({given}); give a file")
    return path


def _file_in_the_way(p: Path) -> Path | None:
    """The nearest existing path at or above ``p`` when it is not a folder, else None."""
    for candidate in (p, *p.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


def check_out_dir(path: str | os.PathLike[str], option: str) -> None:
    """Fail early, before any work, when ``path`` cannot become an output folder: it is a
    file, or a file stands where one of its parent folders would go."""
    p = Path(path)
    blocker = _file_in_the_way(p)
    if blocker is not None:
        where = "" if blocker == p else f" ({blocker} is a file)"
        raise ServetuneError(
            f"{option} {p}: not a folder{where}; give a folder path (it is created when missing)"
        )


def check_out_file(path: str | os.PathLike[str], option: str) -> None:
    """Fail early when ``path`` cannot be written as a file: it is a folder, or a file
    stands where one of its parent folders would go."""
    p = Path(path)
    if p.is_dir():
        raise ServetuneError(f"{option} {p}: is a folder; give a file path")
    blocker = _file_in_the_way(p.parent)
    if blocker is not None:
        raise ServetuneError(
            f"{option} {p}: {blocker} is a file, not a folder; choose another path"
        )


def check_out_files(outputs: Mapping[str, Path | None]) -> None:
    """Fail before a run when an output path (where it came from -> path) cannot be a
    file, or two outputs name the same file."""
    seen: dict[Path, str] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        if path.is_dir():
            raise ServetuneError(f"{path}: is a directory (given to {option}); give a file path")
        key = path.resolve()
        if key in seen:
            raise ServetuneError(
                f"{path}: given to both {seen[key]} and {option}; give each output its own file"
            )
        seen[key] = option


# ----------------------------------------------------------------------- atomic writes


def _stage(folder: Path, name: str, data: bytes, *, sync: bool = False) -> Path:
    """Write ``data`` to a new temporary file in ``folder`` (the target's own folder, so
    that the later rename is atomic); with ``sync``, flushed to disk before returning."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            if sync:
                fh.flush()
                os.fsync(fh.fileno())
        os.chmod(tmp, FILE_MODE)  # mkstemp makes 0600; give the usual file mode
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and a rename,
    so a reader never sees a half-written file and an interrupted run leaves the old one."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = _stage(parent, p.name, data)
    except OSError as exc:
        blocker = _file_in_the_way(parent)
        if blocker is not None:
            raise ServetuneError(
                f"{p}: cannot write: {blocker} is a file, not a folder; choose another path"
            ) from None
        raise ServetuneError(f"{p}: cannot write ({exc.strerror})") from None
    try:
        os.replace(tmp, p)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise ServetuneError(f"{p}: cannot write ({exc.strerror})") from None


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """UTF-8 text twin of :func:`write_bytes_atomic`."""
    write_bytes_atomic(path, text.encode("utf-8"))


def commit_files(out_dir: str | os.PathLike[str], files: Sequence[tuple[str, bytes]]
                 ) -> list[Path]:
    """Write a set of files so that an interruption leaves the previous set intact.

    Every file is first written in full to a temporary file beside its target; only when
    all are on disk are they renamed into place, in order (put the file that marks a
    finished run, ``summary.json``, last). An error or interrupt while staging removes the
    temporary files and touches no previous output."""
    out = Path(out_dir)
    check_out_dir(out, "output folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ServetuneError(f"{out}: cannot create the output folder ({exc.strerror})") from None
    staged: list[tuple[Path, Path]] = []
    try:
        for name, data in files:
            staged.append((_stage(out, name, data, sync=True), out / name))
    except BaseException as exc:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise ServetuneError(f"{out}: cannot write ({exc.strerror})") from None
        raise
    written = []
    for tmp, target in staged:
        os.replace(tmp, target)
        written.append(target)
    return written


def write_all_or_none(writers: Sequence[tuple[Path, Callable[[], None]]]) -> None:
    """Run each (path, write) in turn; if one fails, remove the files written before it,
    so that an error leaves no partial set of outputs behind (for writers that stream
    their own file, where :func:`commit_files` would need the bytes in memory)."""
    written: list[Path] = []
    try:
        for path, write in writers:
            write()
            written.append(path)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
