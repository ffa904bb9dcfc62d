"""Application pipelines over the solvers and the simulator: optimize, nightly, plan,
place, report. The CLI parses arguments and prints; the work happens here."""
