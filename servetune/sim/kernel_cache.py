"""Where numba caches the simulator's compiled kernels: one folder per user, keyed by the
hash of the kernels' sources, shared by every environment and clone on the machine.

numba's own cache (``cache=True``) sits beside the source file (``__pycache__``) or under
``NUMBA_CACHE_DIR`` in a folder named after the source file's path, so every clone, every
virtual environment and every wheel install compiles the simulator again (30-50 s); and it
stamps an entry point's own file only, so an edit of a module whose code or constants the
kernel compiles in (the step-time formula, the engine ids) would not invalidate it. Here:

- the folder is :func:`cache_root` / ``kernels-<hash>-numba-<version>``, where ``<hash>``
  is the SHA-256 of :data:`KERNEL_SOURCES` (the files the compiled code comes from): the
  same sources find the same compiled code wherever they are installed; an edit of any of
  them starts a new folder; two numba versions never overwrite each other's entries;
- within it numba's own index and data files (an entry per function, signature, CPU and
  Python version), written atomically by numba, so concurrent processes can share it.

:func:`cached_jit` is ``numba.njit`` with this cache. Where the folder cannot be created or
written, numba's own locators (beside the source, ...) take over.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The files whose code (or constants) the compiled kernels contain, relative to the package.
KERNEL_SOURCES = ("sim/_kernel.py", "sim/_replay.py", "profiles/steptime.py", "engines.py",
                  "routers.py")
CACHE_ENV = "SERVETUNE_CACHE_DIR"  # servetune's cache root (also the capacity cache's)
NUMBA_CACHE_ENV = "NUMBA_CACHE_DIR"


def cache_root() -> Path:
    """The folder that holds the kernel caches: ``$SERVETUNE_CACHE_DIR/numba``, else
    ``$NUMBA_CACHE_DIR``, else ``$XDG_CACHE_HOME/servetune/numba``, else
    ``~/.cache/servetune/numba``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]) / "numba"
    if os.environ.get(NUMBA_CACHE_ENV):
        return Path(os.environ[NUMBA_CACHE_ENV])
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "servetune" / "numba"


@functools.cache
def sources_hash() -> str:
    """Hex SHA-256 of :data:`KERNEL_SOURCES` (each file's name and bytes)."""
    package = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for name in KERNEL_SOURCES:
        h.update(name.encode() + b"\0")
        h.update((package / name).read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def kernel_cache_dir() -> Path:
    """This installation's folder under :func:`cache_root` (see the module doc)."""
    import numba  # lazy: numba is imported only by code that compiles

    return cache_root() / f"kernels-{sources_hash()[:16]}-numba-{numba.__version__}"


@functools.cache
def _cache_class() -> type:
    """numba's function cache with :class:`_SourceHashLocator` tried first (built on first
    use: numba is imported only by code that compiles)."""
    from numba.core.caching import FunctionCache, _CacheLocator  # lazy: as above

    class _SourceHashLocator(_CacheLocator):
        def __init__(self, py_func: Any, py_file: str) -> None:
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = str(kernel_cache_dir())

        def get_cache_path(self) -> str:
            return self._cache_path

        def get_source_stamp(self) -> str:
            return sources_hash()

        def get_disambiguator(self) -> str:
            return str(self._lineno)

        @classmethod
        def from_function(cls, py_func: Any, py_file: str) -> _SourceHashLocator | None:
            try:
                self = cls(py_func, py_file)
                self.ensure_cache_path()  # creates it and checks that it is writable
            except OSError:  # numba's own locators take over
                return None
            return self

    impl = FunctionCache._impl_class

    class _Impl(impl):  # type: ignore[misc, valid-type]
        _locator_classes = [_SourceHashLocator, *impl._locator_classes]

    class _KernelCache(FunctionCache):
        _impl_class = _Impl

    return _KernelCache


def cached_jit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit(**options)`` whose compiled code is cached in :func:`kernel_cache_dir`."""
    import numba  # lazy: as above

    def decorate(fn: Callable[..., Any]) -> Any:
        dispatcher = numba.njit(**options)(fn)
        # what numba's enable_caching() does (cache=True), with this module's cache class
        dispatcher._cache = _cache_class()(dispatcher.py_func)
        return dispatcher

    return decorate
