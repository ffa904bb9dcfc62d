"""servetune.models: the optimization formulations (Pyomo MILP, CP-SAT).

- :mod:`~servetune.models.fluid`: the steady-state model of a policy under a workload
  (step time, running set, KV occupancy, TTFT, TPOT, stability) that the others build on;
- :mod:`~servetune.models.policy_milp`: the MILP that chooses batching and admission knobs
  for the largest goodput (Pyomo, solved by HiGHS);
- :mod:`~servetune.models.lanes_cpsat`: the CP-SAT model that sizes long-request lanes;
- :mod:`~servetune.models.capacity_milp`, :mod:`~servetune.models.placement_cpsat`:
  capacity planning over a GPU fleet and background-job placement.
"""
