"""Sample the shipped example trace from the fitted Azure conversation workload.

    python configs/examples/make_example_trace.py            # rewrites the shipped file
    python configs/examples/make_example_trace.py --check    # exit 1 if it would differ

The output, ``configs/examples/azure-conv-synthetic.csv``, is ten minutes of synthetic
traffic in the Azure LLM inference trace 2023 CSV format (``TIMESTAMP,ContextTokens,
GeneratedTokens``), drawn with a fixed seed from ``configs/workloads/azure-conv-2023.yaml``
(fitted from the public Azure conversation trace, CC-BY; only its fitted distributions
are used, no row of the original). It lets ``servetune nightly`` and the notebook run
from a fresh clone with no download. Same inputs, same bytes.
"""

from __future__ import annotations

import argparse
import sys
from datetime import datetime, timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE.parent / "workloads" / "azure-conv-2023.yaml"
OUTPUT = HERE / "azure-conv-synthetic.csv"
SEED = 20231116
DURATION_S = 600.0
# The Azure 2023 trace's first day; only the offsets from it matter.
START = datetime(2023, 11, 16, 18, 0, 0)


def azure_timestamp(offset_s: float) -> str:
    """``2023-11-16 18:15:46.6805900``: the Azure file's layout (7 fractional digits)."""
    micros = int(round(offset_s * 1e6))
    t = START + timedelta(microseconds=micros)
    return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond:06d}0"


def example_csv(workload_path: Path = WORKLOAD, *, seed: int = SEED,
                duration_s: float = DURATION_S) -> str:
    from servetune.workloads.fitting import load_workload, sample_trace

    workload = load_workload(workload_path)
    trace = sample_trace(workload, duration_s=duration_s, seed=seed)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for t, p, o in zip(trace.arrival_s.tolist(), trace.prompt_tokens.tolist(),
                       trace.output_tokens.tolist(), strict=True):
        lines.append(f"{azure_timestamp(t)},{p},{o}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if the shipped file differs")
    parser.add_argument("-o", "--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    text = example_csv()
    if args.check:
        same = args.output.exists() and args.output.read_text() == text
        print(f"{args.output}: {'up to date' if same else 'DIFFERS'}")
        return 0 if same else 1
    from servetune.io import write_text_atomic

    write_text_atomic(args.output, text)
    print(f"wrote {args.output} ({text.count(chr(10)) - 1} requests, {DURATION_S:g} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
