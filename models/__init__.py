"""servetune.models: the optimization formulations (Pyomo MILP, CP-SAT)."""
