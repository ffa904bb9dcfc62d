"""servetune.solvers: solver drivers, search loops, baselines.

- :mod:`~servetune.solvers.drivers`: HiGHS and CP-SAT with time limits, explicit statuses
  and top-k solutions by no-good cuts;
- :mod:`~servetune.solvers.formulations`: the policy MILP and lane CP-SAT models solved
  by those drivers;
- :mod:`~servetune.solvers.loop`: solve, simulate the best candidates, recalibrate, repeat;
- :mod:`~servetune.solvers.baselines`: engine defaults, exhaustive grid, random, Optuna;
- :mod:`~servetune.solvers.optimize`: ``optimize(...) -> OptimizeResult``, what the CLI and
  the nightly job call;
- :mod:`~servetune.solvers.capacity`, :mod:`~servetune.solvers.placement`: capacity
  planning and background-job placement.
"""
