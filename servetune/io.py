"""File and JSON helpers every layer shares.

- **Hashing**: SHA-256 of a file, of bytes, of a document (its JSON) or of plain data (its
  sorted JSON), as the hex strings provenance records and cache keys carry.
- **JSON cleaning**: :func:`plain_data` turns numpy scalars and arrays, tuples and
  non-string keys into plain JSON/YAML values (non-finite floats to ``None`` unless asked
  to keep them); :func:`round_floats` rounds to significant digits for provenance;
  :func:`drop_timings` removes wall-clock figures so the same inputs give the same bytes.
- **Atomic writes**: :func:`write_bytes_atomic` (temporary file beside the target, then a
  rename) for one file, :func:`commit_files` for a folder's set of files that must appear
  together (below), :func:`write_all_or_none` for a set of writers that each stream their
  own file.
- **Reading**: :func:`open_binary`, :func:`read_bytes` and :func:`decode_text` turn a
  missing, unreadable or non-UTF-8 input into one error line naming the file.
- **Path checks**: :func:`require_file` for an input that must be a readable file;
  :func:`check_outputs` (the one check every command that writes files calls before any
  long work): no output is a folder, a special file (a device, a FIFO) or one of the run's
  own inputs, and no two outputs are the same file; :func:`check_out_file`,
  :func:`check_out_files`, :func:`check_out_dir` and :func:`check_output_set_folder` (what
  a commit into an output folder would refuse) are its parts.
- **Symlinks**: an output *file* that is a symbolic link is written *through* to the
  link's target (the target is replaced atomically; the link stays a link).

**Output sets** (:func:`commit_files`: ``nightly``, ``report``, ``validate --report``,
``plan``/``place --report``). A folder ``OUT`` holds each run's files as one unit::

    OUT/.generations/000007/      one complete set (policy.yaml, report.md, ...)
    OUT/current -> .generations/000007
    OUT/report.md -> current/report.md      (a relative link per name; readers use these)
    OUT/.lock                     while a run holds the folder (or a killed one's, unlocked)

A commit writes a new generation folder in full (each file and the folder fsynced), adds
the links of names new to the folder (they dangle until the next step), then replaces
``current`` with one rename: the commit point. A reader of ``OUT/NAME`` sees the previous
set or the new one, never a mix, whenever the process dies (a reader of several files
that must agree resolves ``OUT/current`` once and reads them there). Names the command owns that
the new set lacks then leave the folder (their links are removed); files of another
command's set in the same folder are carried into the new generation (hard links). The
last :data:`KEEP_GENERATIONS` generations are kept. A killed run's leftovers (temporary
``.NAME.xxxxxxxx.tmp`` files and links, a generation never made current) are removed by
the next commit, under the lock.

- **Lock**: ``fcntl.flock`` on ``OUT/.lock`` (:func:`output_folder_lock`), non-blocking; the
  holder writes its pid there and removes the file as it lets go. A second run exits 2
  with ``OUT: another servetune run (pid N) is writing this folder; ...``. ``nightly``
  takes it before its long optimization; every commit takes it (or uses the one held).
- **Old layout**: regular files from servetune before output sets, at names the command
  owns, first become a generation of their own (hard links) that is made current, then
  are replaced by links; every step shows a reader the same bytes, and the files stay in
  the history.
- **Refused** (exit 2, one line, nothing changed) where going on could lose data or break
  a reader: ``OUT/current`` or ``OUT/.generations`` that servetune did not make (a user's
  folder named ``current``), an output name that is a folder, a special file or a link
  servetune did not make (a link to a deploy location would silently stop being updated);
  ``OUT`` a file or a dangling link. ``OUT`` may itself be a link to a folder: everything
  happens in the folder it points to.
- **Test hook**: :data:`PAUSE_ENV` makes each step that changes what a reader sees sleep
  (tests kill the process there); unset in production.

Every failure is one :class:`~servetune.errors.ServetuneError` line naming the path.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import secrets
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, BinaryIO

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
    import numpy as np  # lazy: the CLI imports this module at start-up (numpy: 70 ms)

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
    import numpy as np  # lazy: as in plain_data

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
    file, a file stands where one of its parent folders would go, or it (or the nearest
    folder above it that exists) cannot be written."""
    p = Path(path)
    blocker = _file_in_the_way(p)
    if blocker is not None:
        where = "" if blocker == p else f" ({blocker} is a file)"
        raise ServetuneError(
            f"{option} {p}: not a folder{where}; give a folder path (it is created when missing)"
        )
    _refuse_unwritable(p, f"{option} {p}")


def check_out_file(path: str | os.PathLike[str], option: str) -> None:
    """Fail early when ``path`` cannot be written as a file: it is a folder, a file
    stands where one of its parent folders would go, or the folder it goes in (or the
    nearest one above that exists) cannot be written."""
    p = Path(path)
    if p.is_dir():
        raise ServetuneError(f"{option} {p}: is a folder; give a file path")
    blocker = _file_in_the_way(p.parent)
    if blocker is not None:
        raise ServetuneError(
            f"{option} {p}: {blocker} is a file, not a folder; choose another path"
        )
    _refuse_unwritable(p.parent, f"{option} {p}")


def _refuse_unwritable(folder: Path, what: str) -> None:
    """Refuse, before any work, an output whose nearest existing folder cannot be written
    (a read-only file system, no permission): the file is staged there."""
    for existing in (folder, *folder.parents):
        if existing.exists():
            if not os.access(existing, os.W_OK | os.X_OK):
                raise ServetuneError(f"{what}: {existing} cannot be written (read-only or no "
                                     "permission); choose another path")
            return


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
      ``fnmatch`` patterns) is not a folder, one of the inputs is a file it would write,
      or its commit would be refused (:func:`check_output_set_folder`).

    An output file that is a symlink is written through to its target, so the target is
    what is compared; an input that is one of an output folder's links (last night's
    ``OUT/policy.yaml``) lives in a generation no commit writes, so it is allowed."""
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
        check_output_set_folder(d, patterns, option)


# ----------------------------------------------------------------------- atomic writes


def _write_target(p: Path) -> Path:
    """Where writing ``p`` goes: through a symlink to its target (so the link stays a link
    and the rename replaces the target); an existing special file is refused, since the
    rename would replace a device node with a regular file."""
    if p.is_symlink():
        p = Path(os.path.realpath(p))
    _refuse_special(p, "output")
    return p


def _stage(folder: Path, name: str, data: bytes | Iterable[bytes]) -> Path:
    """Write ``data`` (or its chunks, as they come) to a new temporary file in ``folder``
    (the target's own folder, so that the later rename is atomic)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            for chunk in (data,) if isinstance(data, bytes) else data:
                fh.write(chunk)
        os.chmod(tmp, FILE_MODE)  # mkstemp makes 0600; give the usual file mode
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes | Iterable[bytes]) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same folder and a rename,
    so a reader never sees a half-written file and an interrupted run leaves the old one.
    ``data`` may be an iterable of chunks, written as they are made (a large file need not
    be held in memory)."""
    p = _write_target(Path(path))
    parent = p.parent if str(p.parent) else Path(".")
    made = [d for d in (*reversed(parent.parents), parent) if not d.exists()]  # outermost first
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = _stage(parent, p.name, data)
    except OSError as exc:
        _remove_empty(made)
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
        _remove_empty(made)
        raise ServetuneError(f"{p}: cannot write ({exc.strerror})") from None


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """UTF-8 text twin of :func:`write_bytes_atomic`."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_all_or_none(writers: Sequence[tuple[Path, Callable[[], None]]]) -> None:
    """Run each (path, write) in turn, each writing its file atomically; if one fails or
    the run is interrupted, every file written before it is put back as it was (the
    previous file restored from a hard-linked backup, a new file removed), so an error
    leaves the previous outputs (for writers that stream their own file, where
    :func:`commit_files` would need the bytes in memory). A writer of a folder (a report
    through :func:`commit_files`) cannot be undone: give it last.

    Files at separately named paths cannot change in one rename, so this is not one
    atomic unit: while it runs, and after a SIGKILL (which no handler sees), a reader
    can find the first files new and the later ones old, and a killed run leaves its
    ``.NAME.<pid>.bak`` backups. Each file on its own is always whole."""
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
            # best effort: the error that stopped the writes is the one to report (on a
            # read-only file system even removing a file never made fails, with EROFS)
            try:
                if backup is not None:
                    os.replace(backup, target)
                    # a rename between two links to one inode does nothing: drop the backup
                    backup.unlink(missing_ok=True)
                elif target.exists() and not target.is_dir():
                    target.unlink()
            except OSError:
                pass
        raise
    for _, backup in backups:
        if backup is not None:
            backup.unlink(missing_ok=True)


# ------------------------------------------------------------------------ output sets

CURRENT = "current"  # OUT/current -> .generations/<id>: the live set
GENERATIONS = ".generations"
LOCK = ".lock"
KEEP_GENERATIONS = 3  # the live set and the two before it
# Test hook only (never set in production): "<seconds>" sleeps at every step of a commit
# that changes what a reader sees, "<seconds>@<n>" only at the n-th; each step is first
# announced on stderr, so a test can SIGKILL the process exactly there.
PAUSE_ENV = "SERVETUNE_TEST_PAUSE_COMMIT"

_GENERATION_ID = re.compile(r"\d{6,}")
# a temporary name of ours (or of servetune before output sets): .NAME.<8 random>.tmp
_STALE_TMP = re.compile(r"\.(.+)\.[a-z0-9_]{8}\.tmp")


@dataclass
class _Hold:
    """This process's lock on an output folder."""

    fd: int
    lock: Path
    created: list[Path]  # folders the lock's taking created, outermost first
    depth: int = 1


_held: dict[str, _Hold] = {}  # os.path.realpath(folder) -> lock held by this process
_pauses = 0  # commit steps announced so far (the test hook's counter)


def _pause(step: str) -> None:
    """The test hook (:data:`PAUSE_ENV`): announce ``step`` on stderr, then sleep."""
    spec = os.environ.get(PAUSE_ENV)
    if not spec:
        return
    global _pauses
    _pauses += 1
    seconds, _, only = spec.partition("@")
    os.write(2, f"servetune: test pause {_pauses}: {step}\n".encode())
    if not only or int(only) == _pauses:
        time.sleep(float(seconds))


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _holder_pid(fd: int) -> str:
    """The pid the lock's holder wrote (it writes it just after taking the lock)."""
    for _ in range(50):
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        if text.isdigit():
            return text
        time.sleep(0.01)
    return "unknown"


def _take_lock(out: Path) -> _Hold:
    """Create the folder when missing, then take ``OUT/.lock`` (non-blocking flock)."""
    if out.is_symlink() and not out.exists():
        raise ServetuneError(
            f"{out}: is a link to {os.readlink(out)}, which does not exist; create that "
            "folder or give another output folder")
    check_out_dir(out, "output folder")
    created = [p for p in (out, *out.parents) if not p.exists()][::-1]
    lock = out / LOCK
    try:
        while True:
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ServetuneError(
                    f"{out}: cannot create the output folder ({exc.strerror})") from None
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            except OSError as exc:
                raise ServetuneError(
                    f"{out}: cannot create the lock file {LOCK} ({exc.strerror}); give a "
                    "folder this user can write") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _holder_pid(fd)
                os.close(fd)
                raise ServetuneError(
                    f"{out}: another servetune run (pid {pid}) is writing this folder; wait "
                    "for it or choose another folder") from None
            # The holder before us unlinks the file as it lets go: a lock on that unlinked
            # file locks nothing, so take the one now at the path.
            try:
                if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as exc:  # a full disk (ENOSPC) makes the file but not its line
            os.close(fd)
            lock.unlink(missing_ok=True)
            raise ServetuneError(
                f"{out}: cannot write the lock file {LOCK} ({exc.strerror}); free some space "
                "or choose another folder") from None
    except BaseException:
        _remove_empty(created)
        raise
    return _Hold(fd, lock, created)


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders (outermost first) that are still empty, innermost first."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return


def _let_go(hold: _Hold) -> None:
    """Remove the lock file while still holding it, then release; remove the folders the
    lock created if nothing was written in them (an error before the commit)."""
    hold.lock.unlink(missing_ok=True)
    os.close(hold.fd)
    _remove_empty(hold.created)


@contextmanager
def output_folder_lock(out_dir: str | os.PathLike[str]) -> Iterator[Path]:
    """Hold ``out_dir``'s lock for the block: created when missing, a second run (another
    process) that asks for it meanwhile fails at once with exit 2, naming this pid. Take
    it at the start of a long run (``nightly``) so that a concurrent one fails before its
    work, not after; :func:`commit_files` inside the block uses the lock held. A folder
    this created is removed again on leaving when nothing was committed in it."""
    out = Path(out_dir)
    key = os.path.realpath(out)
    hold = _held.get(key)
    if hold is not None:  # already ours: commit_files inside nightly's block
        hold.depth += 1
    else:
        hold = _held[key] = _take_lock(out)
    try:
        yield out
    finally:
        hold.depth -= 1
        if hold.depth == 0:
            del _held[key]
            _let_go(hold)


def _our_link(path: Path, target: str) -> bool:
    try:
        return os.readlink(path) == target
    except OSError:
        return False


def _current_id(out: Path) -> str | None:
    """The live generation's id, or None before the first commit; anything else at
    ``OUT/current`` is refused, since replacing it could lose a user's files."""
    cur = out / CURRENT
    if not cur.is_symlink():
        if cur.exists():
            raise ServetuneError(
                f"{cur}: exists and is not servetune's link to {GENERATIONS}/; servetune "
                "keeps the live output set there: move it away or choose another folder")
        return None
    target = os.readlink(cur)
    head, _, gen = target.partition("/")
    if head != GENERATIONS or not _GENERATION_ID.fullmatch(gen):
        raise ServetuneError(
            f"{cur}: is a link to {target}, not servetune's link to {GENERATIONS}/; "
            "servetune keeps the live output set there: move it away or choose another folder")
    return gen


def _generation_ids(out: Path) -> list[str]:
    gens = out / GENERATIONS
    if gens.is_symlink() or (gens.exists() and not gens.is_dir()):
        raise ServetuneError(
            f"{gens}: is not a folder; servetune keeps its output sets there: move it away "
            "or choose another folder")
    if not gens.exists():
        return []
    return sorted((p.name for p in gens.iterdir()
                   if _GENERATION_ID.fullmatch(p.name) and p.is_dir() and not p.is_symlink()),
                  key=int)


def _top_level(out: Path, names: Iterable[str]) -> dict[str, str]:
    """What stands at each ``OUT/NAME``: ``"ours"`` (our link into ``current``),
    ``"legacy"`` (a regular file, from servetune before output sets) or ``"missing"``; a
    folder, a special file or a link of the user's is refused."""
    kinds: dict[str, str] = {}
    for name in names:
        p = out / name
        if p.is_symlink():
            if not _our_link(p, f"{CURRENT}/{name}"):
                raise ServetuneError(
                    f"{p}: is a link to {os.readlink(p)} that servetune did not make; each "
                    f"output in this folder is a link into {CURRENT}/ (one set per run): "
                    f"remove the link, or point readers at {p}")
            kinds[name] = "ours"
        elif not p.exists():
            kinds[name] = "missing"
        elif p.is_dir():
            raise ServetuneError(f"{p}: is a folder, where this run writes a file; move it "
                                 "away or choose another folder")
        elif not stat.S_ISREG(p.stat().st_mode):
            raise ServetuneError(f"{p}: is not a regular file (a device, pipe or socket); "
                                 "move it away or choose another folder")
        else:
            kinds[name] = "legacy"
    return kinds


def check_output_set_folder(out_dir: str | os.PathLike[str], names: Iterable[str],
                            option: str = "output folder") -> None:
    """Fail before any work when committing ``names`` (``fnmatch`` patterns) into
    ``out_dir`` would be refused (:func:`commit_files`): ``current`` or ``.generations``
    is not servetune's, or an output name is a user's link, a folder or a special file."""
    out = Path(out_dir)
    if not out.is_dir():
        return
    try:
        _current_id(out)
        _generation_ids(out)
        _top_level(out, _owned_present(out, list(names)))
    except ServetuneError as err:
        raise ServetuneError(f"{option} {err.message}") from None


def _owned_present(out: Path, patterns: Sequence[str]) -> list[str]:
    """The names at the top of ``out`` that match ``patterns`` (not hidden, not current),
    with the patterns' plain names."""
    present = sorted(n for n in os.listdir(out) if not n.startswith(".") and n != CURRENT
                     and any(fnmatch(n, p) for p in patterns))
    plain = [p for p in patterns if not any(ch in p for ch in "*?[")]
    return list(dict.fromkeys([*plain, *present]))


def _check_name(name: str) -> None:
    if not name or "/" in name or name.startswith(".") or name == CURRENT:
        raise ValueError(f"output name {name!r}: give a plain file name")


def _link_into(folder: Path, name: str, source: Path) -> None:
    """``folder/name`` as a hard link to ``source`` (a copy where hard links fail)."""
    try:
        os.link(source, folder / name)
    except OSError:
        shutil.copy2(source, folder / name)


def _swap_link(out: Path, name: str, target: str) -> None:
    """Point ``OUT/name`` at ``target`` with one rename (a reader sees the old or the new
    link, never none)."""
    tmp = out / f".{name}.{secrets.token_hex(4)}.tmp"
    os.symlink(target, tmp)
    try:
        os.replace(tmp, out / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _clean_leftovers(out: Path, current: str | None, patterns: Sequence[str]) -> None:
    """What a killed run left (only under the lock): temporary files and links at the
    top, of ``current`` or of a name the command owns (``patterns``), and generations
    never made current (newer than the live one)."""
    for entry in os.scandir(out):
        tmp = _STALE_TMP.fullmatch(entry.name)
        if tmp and not entry.is_dir(follow_symlinks=False) and (
                tmp[1] == CURRENT or any(fnmatch(tmp[1], p) for p in patterns)):
            Path(entry.path).unlink(missing_ok=True)
    for gen in _generation_ids(out):
        if current is None or int(gen) > int(current):
            shutil.rmtree(out / GENERATIONS / gen)


def _new_generation(out: Path) -> Path:
    ids = _generation_ids(out)
    gen = out / GENERATIONS / f"{int(ids[-1]) + 1 if ids else 1:06d}"
    gen.mkdir(parents=True)
    return gen


def _commit_generation(out: Path, gen: Path) -> None:
    """The commit point: ``OUT/current`` -> ``gen``, one rename."""
    _pause(f"swap {CURRENT} -> {GENERATIONS}/{gen.name}")
    _swap_link(out, CURRENT, f"{GENERATIONS}/{gen.name}")


def _drop_unfinished(out: Path, gen: Path) -> bool:
    """After an error or interrupt: remove ``gen`` unless it became current (an interrupt
    can land just after the rename), and ``.generations`` if that leaves it empty; whether
    it was removed."""
    if _our_link(out / CURRENT, f"{GENERATIONS}/{gen.name}"):
        return False
    shutil.rmtree(gen, ignore_errors=True)
    with contextlib.suppress(OSError):
        gen.parent.rmdir()
    return True


def _adopt_legacy(out: Path, live: Path | None, legacy: Sequence[str]) -> Path:
    """Make the old layout's regular files (``legacy``) part of a generation that holds
    the live set too, commit it, then put our links in their place: every step shows a
    reader the same bytes, and the files stay in the history."""
    gen = _new_generation(out)
    try:
        if live is not None and live.is_dir():
            for entry in sorted(os.listdir(live)):
                if entry not in legacy:
                    _link_into(gen, entry, live / entry)
        for name in legacy:
            _link_into(gen, name, out / name)
        _fsync_dir(gen)
        _commit_generation(out, gen)
    except BaseException:
        _drop_unfinished(out, gen)
        raise
    _fsync_dir(out)
    for name in legacy:
        _pause(f"replace the file {name} with a link into {CURRENT}/")
        _swap_link(out, name, f"{CURRENT}/{name}")
    return gen


def _write_generation(gen: Path, files: Sequence[tuple[str, bytes]]) -> None:
    for i, (name, data) in enumerate(files):
        if i == 1:
            _pause(f"writing {GENERATIONS}/{gen.name}")
        fd = os.open(gen / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    _fsync_dir(gen)


def _prune(out: Path, current: str) -> None:
    old = [g for g in _generation_ids(out) if int(g) < int(current)]
    for gen in old[:max(0, len(old) - (KEEP_GENERATIONS - 1))]:
        _pause(f"remove {GENERATIONS}/{gen}")
        shutil.rmtree(out / GENERATIONS / gen)


def commit_files(out_dir: str | os.PathLike[str], files: Sequence[tuple[str, bytes]], *,
                 owned: Iterable[str] | None = None, keep: Iterable[str] = ()
                 ) -> list[Path]:
    """Commit ``files`` (name, bytes) as the folder's new output set, under its lock
    (:func:`output_folder_lock`): a reader of ``OUT/NAME`` sees the previous set or this
    one, never a mix, whenever the process dies (module docstring: output sets).

    ``owned`` (``fnmatch`` patterns; default the names in ``files``) are the names this
    command writes: one of them that ``files`` lacks leaves the live set, unless named in
    ``keep`` (the live file is kept, unchanged); a name it does not own (another
    command's output in the same folder) stays as it is. Returns ``OUT/NAME`` for each
    file written."""
    out = Path(out_dir)
    names = [name for name, _ in files]
    for name in [*names, *keep]:
        _check_name(name)
    if len(set(names)) != len(names):
        raise ValueError(f"output names repeat: {names}")
    patterns = list(dict.fromkeys([*names, *(owned or ())]))
    with output_folder_lock(out):
        try:
            return _commit(out, files, patterns, set(keep) - set(names))
        except OSError as exc:
            raise ServetuneError(f"{out}: cannot write ({exc.strerror})") from None


def _commit(out: Path, files: Sequence[tuple[str, bytes]], patterns: list[str],
            keep: set[str]) -> list[Path]:
    current = _current_id(out)
    tops = _top_level(out, _owned_present(out, patterns))
    _clean_leftovers(out, current, patterns)
    live = None if current is None else out / GENERATIONS / current
    legacy = [name for name, kind in tops.items() if kind == "legacy"]
    if legacy:
        live = _adopt_legacy(out, live, legacy)
        tops.update(dict.fromkeys(legacy, "ours"))
    names = {name for name, _ in files}
    carried = [] if live is None or not live.is_dir() else sorted(
        n for n in os.listdir(live)
        if n not in names and (n in keep or not any(fnmatch(n, p) for p in patterns)))
    gen = _new_generation(out)
    made: list[Path] = []
    try:
        for name in carried:
            _link_into(gen, name, live / name)
        _write_generation(gen, files)
        for name in sorted(names):  # a name new to the folder: its link dangles until the swap
            if tops[name] == "missing":
                _pause(f"link {name} -> {CURRENT}/{name}")
                os.symlink(f"{CURRENT}/{name}", out / name)
                made.append(out / name)
        _commit_generation(out, gen)
    except BaseException:
        if _drop_unfinished(out, gen):
            for link in made:
                link.unlink(missing_ok=True)
        raise
    _fsync_dir(out)
    live_names = names | set(carried)
    for name, kind in sorted(tops.items()):
        if kind == "ours" and name not in live_names:
            _pause(f"remove the link {name} (not in the new set)")
            (out / name).unlink(missing_ok=True)
    _prune(out, gen.name)
    return [out / name for name, _ in files]
