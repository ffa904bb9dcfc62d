"""One line when numba is about to compile the simulator (a cold cache), never otherwise.

The kernel's entry points (:mod:`servetune.sim._kernel`) are compiled once per machine and
kernel version and cached in the user's cache folder (:mod:`servetune.sim.kernel_cache`,
shared by every environment and clone): the first run compiles them, which takes tens of
seconds; later runs load them from that cache in well under a second. numba looks in the
cache first and broadcasts a ``numba:compile`` event only when it found nothing there and
starts compiling; a listener on that event therefore says exactly "a compile is
starting", without guessing the signature or reading the cache index (numba's event API,
``numba.core.event``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

# Wall-clock seconds of the first compile of run_kernel and reject_at_arrival on 2 cores:
# on the development machine (load 1-2; benchmarks/startup.py) a one-request `servetune
# simulate` with an empty cache folder took 35-40 s against 1.2-3 s warm, so the compile
# is 33-37 s; on 2026-12-07 the whole cold quick start took 33 s there (25 s of compile),
# and a tester saw 77 s for it on a busier machine of the same size. So a range.
COMPILE_SECONDS = (25, 75)
NOTICE = (f"compiling the simulator once, {COMPILE_SECONDS[0]}-{COMPILE_SECONDS[1]} s on 2 "
          "cores (cached afterwards)")

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
