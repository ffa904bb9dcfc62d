"""The shipped example trace: generated deterministically from the fitted Azure
conversation workload, in the Azure CSV format, and loadable as such."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "configs" / "examples" / "make_example_trace.py"
SHIPPED = ROOT / "configs" / "examples" / "azure-conv-synthetic.csv"


def load_script():
    spec = importlib.util.spec_from_file_location("make_example_trace", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_timestamp_layout():
    mod = load_script()
    assert mod.azure_timestamp(0.0) == "2023-11-16 18:00:00.0000000"
    assert mod.azure_timestamp(61.5) == "2023-11-16 18:01:01.5000000"
    assert mod.azure_timestamp(0.0000014) == "2023-11-16 18:00:00.0000010"


def test_generation_is_deterministic_and_azure_formatted(tmp_path):
    mod = load_script()
    if not mod.WORKLOAD.exists():
        pytest.skip("fitted Azure workload not shipped")
    a = mod.example_csv(duration_s=30.0)
    b = mod.example_csv(duration_s=30.0)
    assert a == b
    assert a.splitlines()[0] == "TIMESTAMP,ContextTokens,GeneratedTokens"
    out = tmp_path / "t.csv"
    assert mod.main(["-o", str(out)]) == 0
    assert mod.main(["-o", str(out), "--check"]) == 0
    out.write_text(a)
    assert mod.main(["-o", str(out), "--check"]) == 1


def test_shipped_trace_loads_with_the_workloads_figures():
    from servetune.workloads.fitting import class_stats, load_workload
    from servetune.workloads.formats import load_trace

    trace = load_trace(SHIPPED)
    assert 550 <= trace.duration_s <= 600
    rate = (len(trace) - 1) / trace.duration_s
    stats = class_stats(load_workload(load_script().WORKLOAD))[0]
    # ten minutes of a bursty process: the sample's rate and means within 10% of the fit
    assert abs(rate / stats.rate_per_s - 1) < 0.10
    assert abs(trace.prompt_tokens.mean() / stats.prompt_mean - 1) < 0.10
    assert abs(trace.output_tokens.mean() / stats.output_mean - 1) < 0.10
    assert SHIPPED.stat().st_size < 200_000  # small enough to ship
