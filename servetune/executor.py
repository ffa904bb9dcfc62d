"""One interface for independent work: in this process, on local processes, or on Ray.

The simulations that do not depend on each other (a plan's capacity measurements, the
candidates of one round of the search loop, a baseline's grid points, the stress runs of
``nightly``, the jobs of a sweep) go through :meth:`Executor.map`::

    results = executor.map(fn, items, shared=inputs)   # [fn(inputs, item) for item in items]

``each(i, result)``, when given, is called in the caller for every result in the order of
``items`` as soon as it and all before it are done (progress lines stay in order).

Three backends, one contract:

- ``serial`` (:class:`SerialExecutor`): in this process, in order. The default of the
  library functions, and what any backend does with fewer than two items.
- ``processes`` (:class:`ProcessExecutor`, ``--workers N``): a pool of N local worker
  processes, started once per executor by a fork server that has already imported the
  simulator, so a worker starts in milliseconds, not the second a fresh interpreter takes.
- ``ray`` (:class:`RayExecutor`, ``--ray [ADDRESS]``, optional extra ``ray``): one Ray
  task per item; ``shared`` is put in the object store once per map and each task reads it
  from there.

The contract that makes the backends interchangeable: ``fn`` is a module-level function
(or a :func:`functools.partial` of one) whose result depends on its arguments only, and
``map`` returns the results in the order of ``items``. Every reduction then happens in
the caller, in that order, so the output is the same, byte for byte, whatever the
backend and the number of workers. Nothing here reads the clock.

Each worker keeps the numba compile cache of its machine: the kernel is compiled once per
machine (the first run says so) and loaded from disk by every worker after that.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Self, TypeVar

from servetune.errors import ServetuneError

if TYPE_CHECKING:  # imported where a pool starts: the simulator imports this module
    from concurrent.futures import ProcessPoolExecutor

R = TypeVar("R")

SERIAL = "serial"
PROCESSES = "processes"
RAY = "ray"

_NO_SHARED = object()
Each = Callable[[int, Any], Any]


class Executor(Protocol):
    """Runs ``fn(shared, item)`` (or ``fn(item)`` without ``shared``) for every item and
    returns the results in the order of ``items``."""

    name: str
    workers: int

    def map(self, fn: Callable[..., R], items: Sequence[Any], *,
            shared: Any = _NO_SHARED, each: Each | None = None) -> list[R]: ...

    def close(self, abort: bool = False) -> None: ...

    def __enter__(self) -> Self: ...

    def __exit__(self, exc_type: object, *exc: object) -> None: ...


def _call(fn: Callable[..., R], shared: Any, item: Any) -> R:
    return fn(item) if shared is _NO_SHARED else fn(shared, item)


def _in_order(results: Iterable[R], each: Each | None) -> list[R]:
    out = []
    for i, result in enumerate(results):
        out.append(result)
        if each is not None:
            each(i, result)
    return out


class _Closing:
    """``with executor:`` closes it at the end; on an error or Ctrl-C, at once (work in
    flight is dropped)."""

    def close(self, abort: bool = False) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close(abort=exc_type is not None)


@dataclass
class SerialExecutor(_Closing):
    """In this process, one item after another."""

    name: str = SERIAL
    workers: int = 1

    def map(self, fn: Callable[..., R], items: Sequence[Any], *,
            shared: Any = _NO_SHARED, each: Each | None = None) -> list[R]:
        return _in_order((_call(fn, shared, item) for item in items), each)


# A process worker's copy of the last ``shared`` it was sent, by the parent's token: a
# map's items then cost the worker one unpickling of the shared inputs, not one per item.
_worker_shared: dict[int, Any] = {}


def _process_task(fn: Callable[..., R], token: int, shared_bytes: bytes | None,
                  item: Any) -> R:
    if shared_bytes is None:
        return fn(item)
    shared = _worker_shared.get(token, _NO_SHARED)
    if shared is _NO_SHARED:
        _worker_shared.clear()
        shared = pickle.loads(shared_bytes)
        _worker_shared[token] = shared
    return fn(shared, item)


class ProcessExecutor(_Closing):
    """A pool of ``workers`` local processes (started at the first map that needs them)."""

    name = PROCESSES

    def __init__(self, workers: int, preload: Sequence[str] = ()) -> None:
        """``preload``: modules the fork server imports once, before the first task (the
        caller's: the apps its tasks run live above this module)."""
        if workers < 1:
            raise ServetuneError(f"--workers: give a number of processes >= 1 (got {workers})")
        self.workers = workers
        self.preload = list(preload)
        self._pool: ProcessPoolExecutor | None = None
        self._maps = 0

    def _started(self) -> ProcessPoolExecutor:
        if self._pool is None:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            # A fork server (where the platform has one): workers are forked from a clean
            # process that imported the simulator once, never from this one (which may
            # hold solver threads or a progress display's thread).
            methods = multiprocessing.get_all_start_methods()
            method = "forkserver" if "forkserver" in methods else "spawn"
            ctx = multiprocessing.get_context(method)
            if method == "forkserver" and self.preload:
                ctx.set_forkserver_preload(self.preload)
            self._pool = ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx)
        return self._pool

    def map(self, fn: Callable[..., R], items: Sequence[Any], *,
            shared: Any = _NO_SHARED, each: Each | None = None) -> list[R]:
        items = list(items)
        if len(items) < 2 or self.workers < 2:
            return _in_order((_call(fn, shared, item) for item in items), each)
        # The first map of a pool also runs its first item here, while the workers start
        # on the rest: on a cold numba cache this process compiles the simulator under
        # the compile notice (the workers compile their own copy meanwhile, silently;
        # the disk cache serves every later run), and on a warm one it is one more core.
        here = 1 if self._pool is None else 0
        self._maps += 1
        blob = None if shared is _NO_SHARED else pickle.dumps(shared, pickle.HIGHEST_PROTOCOL)
        pool = self._started()
        futures = [pool.submit(_process_task, fn, self._maps, blob, item)
                   for item in items[here:]]
        first = [_call(fn, shared, items[0])] if here else []
        results = (r for part in (first, (f.result() for f in futures)) for r in part)
        return _in_order(results, each)

    def close(self, abort: bool = False) -> None:
        if self._pool is None:
            return
        if abort:
            # The pool has no public way to stop a task that runs: end its processes
            # (a Ctrl-C must not wait for a long capacity measurement to finish).
            for process in list(getattr(self._pool, "_processes", {}).values()):
                process.terminate()
        self._pool.shutdown(wait=not abort, cancel_futures=True)
        self._pool = None


def ray_available() -> bool:
    try:
        import ray  # noqa: F401
    except ImportError:
        return False
    return True


RAY_MISSING = ("--ray needs Ray, the optional extra: pip install 'servetune[ray]' "
               "(or pip install 'ray[default]>=2.9')")


RAY_CONNECT_TIMEOUT_S = 5.0


def _check_reachable(address: str) -> None:
    """A HOST:PORT address (or ray://HOST:PORT) must answer a TCP connection within a few
    seconds: Ray itself retries an unreachable one for minutes, printing its own logs."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return  # "auto" and other forms: Ray's own answer is quick and clear
    import socket  # lazy: only a host:port address is checked

    try:
        socket.create_connection((host or "127.0.0.1", int(port)),
                                 timeout=RAY_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ServetuneError(
            f"--ray {address}: nothing answers at {host}:{port} ({exc.strerror or exc}); "
            "start the cluster there with `ray start --head` or give the address that "
            "`ray status` prints") from None


def _ray_task(fn: Callable[..., R], has_shared: bool, shared: Any, item: Any) -> R:
    # (the sentinel does not survive pickling, hence the flag)
    return fn(shared, item) if has_shared else fn(item)


class RayExecutor(_Closing):
    """One Ray task per item, on the cluster at ``address`` (``None``/"local": a local Ray
    started here with ``workers`` CPUs; "auto": the cluster this machine belongs to)."""

    name = RAY

    def __init__(self, address: str | None = None, workers: int | None = None) -> None:
        if not ray_available():
            raise ServetuneError(RAY_MISSING)
        import ray  # lazy: Ray is an optional extra

        self._ray = ray
        self._owns = False
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                      "configure_logging": False}
            if address in (None, "", "local"):
                kwargs["num_cpus"] = workers or os.cpu_count() or 1
            else:
                _check_reachable(address)
                kwargs["address"] = address
            try:
                ray.init(**kwargs)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ServetuneError(f"--ray {address or 'local'}: could not start or reach "
                                     f"the Ray cluster: {exc}") from None
            self._owns = True
        self.workers = int(ray.cluster_resources().get("CPU", 1))
        self._remote = ray.remote(num_cpus=1)(_ray_task)

    def map(self, fn: Callable[..., R], items: Sequence[Any], *,
            shared: Any = _NO_SHARED, each: Each | None = None) -> list[R]:
        items = list(items)
        if not items:
            return []
        has_shared = shared is not _NO_SHARED
        ref = self._ray.put(shared) if has_shared else None
        refs = [self._remote.remote(fn, has_shared, ref, item) for item in items]
        return _in_order((self._ray.get(r) for r in refs), each)

    def close(self, abort: bool = False) -> None:
        if self._owns and self._ray.is_initialized():
            self._ray.shutdown()
            self._owns = False


def default_workers() -> int:
    """The number of cores this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def make_executor(workers: int | None = None, ray_address: str | None = None,
                  preload: Sequence[str] = ()
                  ) -> SerialExecutor | ProcessExecutor | RayExecutor:
    """The executor a command's ``--workers`` / ``--ray`` ask for: Ray when
    ``ray_address`` is given ("local", "auto" or an address), else processes when
    ``workers`` (None: the number of cores) is above 1 (``preload``: see
    :class:`ProcessExecutor`), else serial."""
    if ray_address is not None:
        return RayExecutor(ray_address, workers)
    n = default_workers() if workers is None or workers == 0 else workers
    if n < 0:
        raise ServetuneError(f"--workers: give a number of processes >= 1 (got {workers})")
    return ProcessExecutor(n, preload) if n > 1 else SerialExecutor()
