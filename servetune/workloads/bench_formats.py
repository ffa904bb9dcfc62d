"""The benchmark-result formats :mod:`servetune.workloads.bench` reads, by name.

Apart from the reader (which imports numpy) so that ``servetune validate --help`` lists
them without it.
"""

from __future__ import annotations

BENCH_FORMATS: tuple[str, ...] = ("vllm-bench", "sglang-bench", "aiperf")
