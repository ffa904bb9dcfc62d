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
- **Path checks**: :func:`require_file` for an input that must be a readable file;
  :func:`check_outputs` (the one check every command that writes files calls before any
  long work): no output is a folder, a special file (a device, a FIFO) or one of the run's
  own inputs, and no two outputs are the same file; :func:`check_out_file`,
  :func:`check_out_files` and :func:`check_out_dir` are its parts.
- **Symlinks**: an output path that is a symbolic link is written *through* to the link's
  target (the target is replaced atomically; the link stays a link).

Every failure is one :class:`~servetune.errors.ServetuneError` line naming the path.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from fnmatch import fnmatch
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
    file, or two outputs name the same file (:func:`check_outputs` without inputs)."""
    for option, path in outputs.items():
        if path is not None and path.is_dir():
            raise ServetuneError(f"{path}: is a directory (given to {option}); give a file path")
    check_outputs(outputs)


PathArg = str | os.PathLike[str] | None
STDOUT = "-"


def _same_file(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one file: the same resolved path, or (hard links, bind
    mounts) the same device and inode."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def _refuse_special(p: Path, option: str) -> None:
    """An existing output that is not a regular file (a device, FIFO, socket) after
    following symlinks: an atomic rename would replace it with a regular file."""
    try:
        mode = os.stat(p).st_mode
    except OSError:
        return  # missing (or a dangling link: written through to its target)
    if stat.S_ISDIR(mode):
        raise ServetuneError(f"{option} {p}: is a folder; give a file path")
    if not stat.S_ISREG(mode):
        raise ServetuneError(
            f"{option} {p}: is not a regular file (a device, pipe or socket); give a file "
            "path, or - for stdout where the option takes it"
        )


def _input_paths(inputs: Mapping[str, PathArg]) -> list[tuple[str, Path]]:
    return [(opt, Path(v)) for opt, v in inputs.items()
            if v is not None and str(v) != STDOUT and Path(v).exists()]


def check_outputs(
    outputs: Mapping[str, PathArg],
    inputs: Mapping[str, PathArg] | None = None,
    *,
    out_dirs: Mapping[str, tuple[PathArg, Iterable[str]]] | None = None,
) -> None:
    """The check every command that writes files runs before any work: refuse (one
    :class:`ServetuneError` line, exit 2) when

    - an output file (``option -> path``; ``None`` and ``-`` = stdout are skipped) is a
      folder, stands below a file, or exists and is not a regular file (``/dev/full``);
    - an output resolves to one of the run's ``inputs`` (``option -> path``; a shipped
      profile's bare name or a missing path is skipped): the same resolved path or the
      same inode, symlinks and hard links included;
    - two outputs are the same file;
    - an output folder (``option -> (folder, names it writes)``, names may be
      ``fnmatch`` patterns) is not a folder, or one of the inputs is a file it would write.

    An output that is a symlink is written through to its target, so the target is what
    is compared."""
    ins = _input_paths(inputs or {})
    seen: dict[Path, str] = {}
    for option, raw in outputs.items():
        if raw is None or str(raw) == STDOUT:
            continue
        p = Path(raw)
        check_out_file(p, option)
        _refuse_special(p, option)
        for in_option, q in ins:
            if _same_file(p, q):
                raise ServetuneError(
                    f"{option} {p}: is the input given to {in_option}; writing it would "
                    "destroy the input; choose another output path"
                )
        key = p.resolve()
        if key in seen:
            raise ServetuneError(
                f"{p}: given to both {seen[key]} and {option}; give each output its own file"
            )
        seen[key] = option
    for option, (folder, names) in (out_dirs or {}).items():
        if folder is None:
            continue
        d = Path(folder)
        check_out_dir(d, option)
        patterns = list(names)
        for in_option, q in ins:
            if q.resolve().parent == d.resolve() and any(fnmatch(q.name, n) for n in patterns):
                raise ServetuneError(
                    f"{option} {d}: the input given to {in_option} ({q}) is a file this run "
                    "writes there; copy the input elsewhere or choose another folder"
                )
        for name in patterns:
            if not any(ch in name for ch in "*?["):
                _refuse_special(d / name, option)


# ----------------------------------------------------------------------- atomic writes


def _write_target(p: Path) -> Path:
    """Where writing ``p`` goes: through a symlink to its target (so the link stays a link
    and the rename replaces the target); an existing special file is refused, since the
    rename would replace a device node with a regular file."""
    if p.is_symlink():
        p = Path(os.path.realpath(p))
    _refuse_special(p, "output")
    return p


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
    p = _write_target(Path(path))
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
            target = _write_target(out / name)
            staged.append((_stage(target.parent, name, data, sync=True), target))
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
    """Run each (path, write) in turn, each writing its file atomically; if one fails or
    the run is interrupted, every file written before it is put back as it was (the
    previous file restored from a hard-linked backup, a new file removed), so an error
    leaves the previous outputs, never a mix (for writers that stream their own file,
    where :func:`commit_files` would need the bytes in memory). A writer of a folder
    (a report through :func:`commit_files`) cannot be undone: give it last."""
    backups: list[tuple[Path, Path | None]] = []
    try:
        for path, write in writers:
            target = Path(os.path.realpath(path)) if Path(path).is_symlink() else Path(path)
            if target.is_dir():  # a folder writer: atomic on its own, not undone
                write()
                continue
            backup = None
            if target.is_file():
                backup = target.with_name(f".{target.name}.{os.getpid()}.bak")
                try:
                    backup.unlink(missing_ok=True)
                    os.link(target, backup)
                except OSError:
                    backup = None
            backups.append((target, backup))
            write()
    except BaseException:
        for target, backup in reversed(backups):
            if backup is not None:
                os.replace(backup, target)
                # a rename between two links to one inode does nothing: drop the backup
                backup.unlink(missing_ok=True)
            elif not target.is_dir():
                target.unlink(missing_ok=True)
        raise
    for _, backup in backups:
        if backup is not None:
            backup.unlink(missing_ok=True)
