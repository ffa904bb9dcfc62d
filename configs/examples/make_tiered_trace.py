"""Sample the shipped tiered example traces (SLO tiers: chat, long context, batch).

    python configs/examples/make_tiered_trace.py            # rewrites the shipped files
    python configs/examples/make_tiered_trace.py --check    # exit 1 if either would differ

Writes ``configs/examples/tiered-mixed.csv`` (three classes) and
``configs/examples/tiered-2class.csv`` (the same requests less the batch class): twenty minutes
of synthetic traffic in the Azure LLM inference trace 2023 CSV format (``TIMESTAMP,
ContextTokens,GeneratedTokens``) plus a ``class`` column, which servetune reads as each
request's class with no column mapping. Drawn with a fixed seed from one three-class
workload built here from the shipped workloads, which hold only numbers fitted from the
public traces in ``../shared/traces`` (no row of a trace is used):

- ``chat`` (most of the traffic): prompt and output lengths from the empirical quantiles of
  ``configs/workloads/azure-conv-2023.yaml`` (fitted from the Azure 2023 conversation
  trace, CC-BY 4.0; Patel et al., Splitwise, ISCA 2024), its gamma arrivals (CV 1.09) at
  ``CHAT_RATE_PER_S``;
- ``longctx`` (long-document summarization): prompts from the log-normal shape of
  ``configs/workloads/long-context-synthetic.yaml`` truncated to ``LONGCTX_PROMPT_TOKENS``
  (8k-64k), outputs from the conversation outputs truncated to ``LONGCTX_OUTPUT_TOKENS``
  (a few hundred tokens); Poisson arrivals at ``LONGCTX_RATE_PER_S``;
- ``batch`` (offline evaluation): prompt and output lengths from
  ``configs/workloads/azure-code-2023.yaml`` (the Azure 2023 code trace's quantiles), in
  bursts: Poisson arrivals only in the last ``BURST_S`` seconds of every ``PERIOD_S``,
  ``BATCH_RATE_PER_S`` on average.

A truncated distribution keeps the shape of the original between its bounds: its quantile
function is the original's on ``[F(lo), F(hi)]``, stretched to ``[0, 1]``. Same inputs, same
bytes. The rates are chosen so that one H200 running Llama-3.1-8B under the vLLM defaults
policy is loaded but not overloaded (see the README's "SLO tiers").
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the package is imported where used, after argument parsing
    from servetune.schemas.workload import LengthDistribution, Workload

HERE = Path(__file__).resolve().parent
WORKLOADS = HERE.parent / "workloads"
CONV = WORKLOADS / "azure-conv-2023.yaml"
CODE = WORKLOADS / "azure-code-2023.yaml"
LONG = WORKLOADS / "long-context-synthetic.yaml"
MIXED = HERE / "tiered-mixed.csv"
TWO_CLASS = HERE / "tiered-2class.csv"
TWO_CLASSES = ("chat", "longctx")

SEED = 20231116
DURATION_S = 1200.0
CHAT_RATE_PER_S = 4.35
LONGCTX_RATE_PER_S = 0.15
LONGCTX_PROMPT_TOKENS = (8192.0, 65536.0)
LONGCTX_OUTPUT_TOKENS = (200.0, 1000.0)
BATCH_RATE_PER_S = 0.6
PERIOD_S = 120.0
BURST_S = 15.0
# The Azure 2023 trace's first day; only the offsets from it matter.
START = datetime(2023, 11, 16, 18, 0, 0)
HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens,class"


def azure_timestamp(offset_s: float) -> str:
    """``2023-11-16 18:15:46.6805900``: the Azure file's layout (7 fractional digits)."""
    micros = int(round(offset_s * 1e6))
    t = START + timedelta(microseconds=micros)
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond:06d}0"


def truncated(dist: LengthDistribution, lo: float, hi: float) -> LengthDistribution:
    """``dist`` (quantile knots) conditioned on ``lo <= x <= hi``: the quantile function
    on ``[F(lo), F(hi)]`` evaluated at the original grid stretched onto it."""
    import numpy as np

    from servetune.schemas.workload import LengthDistribution

    q = np.asarray(dist.quantiles, dtype=np.float64)
    v = np.asarray(dist.values, dtype=np.float64)
    if not v[0] <= lo < hi <= v[-1]:
        raise ValueError(f"bounds [{lo:g}, {hi:g}] outside the knots [{v[0]:g}, {v[-1]:g}]")

    def level(x: float) -> float:  # F(x) by bisection of the piecewise-linear quantile
        a, b = 0.0, 1.0
        for _ in range(60):
            mid = (a + b) / 2.0
            a, b = (mid, b) if np.interp(mid, q, v) < x else (a, mid)
        return (a + b) / 2.0

    u_lo, u_hi = level(lo), level(hi)
    values = np.clip(np.interp(u_lo + q * (u_hi - u_lo), q, v), lo, hi)
    values = np.maximum.accumulate(np.round(values, 2))
    return LengthDistribution(quantiles=q.tolist(), values=values.tolist())


def tiered_workload() -> Workload:
    """The three-class workload the example traces are drawn from."""
    from servetune.schemas.workload import Arrival, RateWindows, Workload, WorkloadClass
    from servetune.workloads.fitting import load_workload

    conv = next(iter(load_workload(CONV).classes.values()))
    code = next(iter(load_workload(CODE).classes.values()))
    long = next(iter(load_workload(LONG).classes.values()))
    windows = int(round(PERIOD_S / BURST_S))
    chat = WorkloadClass(
        priority=0,
        arrival=Arrival(process="gamma", rate_per_s=CHAT_RATE_PER_S,
                        interarrival_cv=conv.arrival.interarrival_cv),
        prompt_tokens=conv.prompt_tokens, output_tokens=conv.output_tokens,
        prompt_output_correlation=conv.prompt_output_correlation,
    )
    longctx = WorkloadClass(
        priority=0,
        arrival=Arrival(process="poisson", rate_per_s=LONGCTX_RATE_PER_S),
        prompt_tokens=truncated(long.prompt_tokens, *LONGCTX_PROMPT_TOKENS),
        output_tokens=truncated(conv.output_tokens, *LONGCTX_OUTPUT_TOKENS),
    )
    batch = WorkloadClass(
        priority=0,
        arrival=Arrival(
            process="poisson", rate_per_s=BATCH_RATE_PER_S,
            # rate only in the last window of each period: one burst per period
            windows=RateWindows(window_s=BURST_S,
                                rate_multipliers=[0.0] * (windows - 1) + [1.0]),
        ),
        prompt_tokens=code.prompt_tokens, output_tokens=code.output_tokens,
    )
    return Workload(
        name="tiered-mixed",
        source="synthetic (servetune): Azure 2023 conversation (chat) and code (batch) "
        "fitted lengths, truncated long-context-synthetic prompts (longctx)",
        duration_s=DURATION_S,
        classes={"chat": chat, "longctx": longctx, "batch": batch},
    )


def tiered_csvs(*, seed: int = SEED, duration_s: float = DURATION_S) -> tuple[str, str]:
    """(the three-class CSV, the chat + longctx CSV) of ``duration_s`` seconds."""
    from servetune.workloads.fitting import sample_trace

    trace = sample_trace(tiered_workload(), duration_s=duration_s, seed=seed)
    names = trace.class_names
    mixed, two = [HEADER], [HEADER]
    for t, p, o, c in zip(trace.arrival_s.tolist(), trace.prompt_tokens.tolist(),
                          trace.output_tokens.tolist(), trace.class_ids().tolist(),
                          strict=True):
        line = f"{azure_timestamp(t)},{p},{o},{names[c]}"
        mixed.append(line)
        if names[c] in TWO_CLASSES:
            two.append(line)
    return "\n".join(mixed) + "\n", "\n".join(two) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if a shipped file differs")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--duration", type=float, default=DURATION_S, help="seconds")
    parser.add_argument("-o", "--output", type=Path, default=MIXED, help="three-class CSV")
    parser.add_argument("--output-2class", type=Path, default=TWO_CLASS,
                        help="chat + longctx CSV")
    args = parser.parse_args(argv)
    texts = tiered_csvs(seed=args.seed, duration_s=args.duration)
    paths = (args.output, args.output_2class)
    if args.check:
        same = True
        for path, text in zip(paths, texts, strict=True):
            ok = path.exists() and path.read_text() == text
            same &= ok
            print(f"{path}: {'up to date' if ok else 'DIFFERS'}")
        return 0 if same else 1
    from servetune.io import write_text_atomic

    for path, text in zip(paths, texts, strict=True):
        write_text_atomic(path, text)
        print(f"wrote {path} ({text.count(chr(10)) - 1} requests, {args.duration:g} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
