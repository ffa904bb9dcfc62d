"""The optimizer's method names and default budgets, in one place that imports nothing.

The OptimizeJob schema (:mod:`servetune.schemas.job`) validates against them and the
``optimize`` command's ``--help`` lists them; the help must not pay for pydantic, so they
live here rather than in the schema module.
"""

from __future__ import annotations

# The optimization methods, by name: the names of the methods table of
# servetune.apps.optimize (which the tests check against this tuple).
METHODS: tuple[str, ...] = ("milp", "grid", "random", "optuna")
METHODS_IN_WORDS = f"{', '.join(METHODS[:-1])} or {METHODS[-1]}"  # for error messages

# The optimizer's work budget: no new candidate starts once this many simulations are
# spent. Work, not seconds, so that the answer does not depend on the machine (or on a
# cold numba cache). Generous: the milp loop converges in tens of simulations on the
# shipped examples (at most about 300 by its own iteration limit), and the grid oracle
# simulates the 1,332 points of the default space in about 13,000.
DEFAULT_MAX_SIMULATIONS = 20_000
# The wall-clock safety stop, seconds: only against a run that would never end. When it
# fires, the policy's metadata.stopped_by says "time_limit" (and nightly keeps the
# current policy), because the answer then depends on the machine's speed. The shipped
# examples take seconds, so it never fires on them even on a slow machine.
DEFAULT_TIME_LIMIT_S = 600.0
# Requests per simulation when neither the flags nor the job file say.
DEFAULT_REQUESTS = 3000
