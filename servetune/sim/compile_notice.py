"""One line when numba is about to compile the simulator (a cold cache), never otherwise.

The kernel's entry points (:mod:`servetune.sim._kernel`) are compiled with
``cache=True``: the first run on a machine (or after an upgrade) compiles them, which
takes tens of seconds with nothing on screen; later runs load them from numba's on-disk
cache in well under a second. numba looks in that cache first and broadcasts a
``numba:compile`` event only when it found nothing there and starts compiling; a listener
on that event therefore says exactly "a compile is starting", without guessing the
signature or reading the cache index (numba's event API, ``numba.core.event``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# Wall-clock seconds of the first compile of run_kernel and reject_at_arrival, measured
# on the development machine (2 cores shared with other jobs): a 200-request `servetune
# simulate` with NUMBA_CACHE_DIR an empty folder took 53, 53 and 66 s, the same run with
# that folder filled 4.4-5.2 s; so the compile is 48-61 s, rounded to the typical 50.
COMPILE_SECONDS = 50
NOTICE = f"compiling the simulator once, about {COMPILE_SECONDS} s (cached afterwards)"

# numba functions of these modules are the simulator's (the only numba code servetune has).
SIMULATOR_MODULES = ("servetune.",)


def is_simulator_function(py_func: Any) -> bool:
    """Whether a numba dispatcher's Python function is servetune's (not another package's)."""
    return str(getattr(py_func, "__module__", "")).startswith(SIMULATOR_MODULES)


@contextmanager
def compile_notice(say: Callable[[str], None] | None) -> Iterator[None]:
    """Within this block, call ``say(NOTICE)`` the first time numba starts compiling a
    servetune function (at most once per block); ``say=None`` listens to nothing."""
    if say is None:
        yield
        return
    # lazy: numba costs 0.5 s to import; only commands that simulate come here
    from numba.core import event

    said = False

    class _FirstCompile(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            nonlocal said
            if not said and is_simulator_function(ev.data["dispatcher"].py_func):
                said = True
                say(NOTICE)

        def on_end(self, ev: event.Event) -> None:
            pass

    with event.install_listener("numba:compile", _FirstCompile()):
        yield
