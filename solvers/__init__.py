"""servetune.solvers: solver drivers, search loops, baselines."""
