"""servetune.solvers: solver drivers, formulation solves, the search loop, baselines.

- :mod:`~servetune.solvers.drivers`: HiGHS and CP-SAT with time limits, explicit statuses
  and top-k solutions by no-good cuts;
- :mod:`~servetune.solvers.formulations`: the policy MILP and lane CP-SAT models solved
  by those drivers;
- :mod:`~servetune.solvers.capacity`, :mod:`~servetune.solvers.placement`: the capacity
  MILP and the placement CP-SAT solved by those drivers;
- :mod:`~servetune.solvers.loop`: solve, simulate the best candidates, recalibrate, repeat;
- :mod:`~servetune.solvers.baselines`: engine defaults, exhaustive grid, random, Optuna.

The pipelines that call them (optimize, plan, place) live in :mod:`servetune.apps`.
"""
