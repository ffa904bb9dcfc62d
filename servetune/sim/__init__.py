"""The continuous-batching simulator.

Public API:

- :func:`simulate` (one run of a Trace or a sampled Workload) -> :class:`SimResult`
  (``.summary(slo)``, ``.meets_slo(slo)``, ``.write_records(path)``, ``.write_steps(path)``,
  ``.write_timeline(path, window)``);
- :func:`goodput` (highest rate scale meeting an SLO set) -> :class:`GoodputResult`;
- :func:`run_engine`, the engine core (re-exported from :mod:`servetune.sim.engine`,
  imported on first use so that importing this package stays cheap); the engines it
  simulates are :data:`servetune.engines.ENGINE_NAMES`.
"""

from __future__ import annotations

from typing import Any

from servetune.sim.api import SimResult, goodput, prepare_trace, simulate
from servetune.sim.goodput import GoodputResult

__all__ = [
    "EngineOutput",
    "GoodputResult",
    "SimResult",
    "goodput",
    "prepare_trace",
    "run_engine",
    "simulate",
]

_FROM_ENGINE = ("run_engine", "EngineOutput", "REASONS")


def __getattr__(name: str) -> Any:
    if name in _FROM_ENGINE:
        # lazy: the engine imports numba (0.5 s), which `import servetune.sim` should not pay
        from servetune.sim import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'servetune.sim' has no attribute {name!r}")
