"""The LRU hit-rate curve of a trace's prefix blocks (workloads/reuse.py): Mattson's stack
distances, checked by hand and against a brute-force LRU cache."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servetune.errors import ServetuneError
from servetune.workloads.reuse import hit_rate_curve, reuse_stats, stack_distances
from servetune.workloads.trace import Trace


def trace_of(requests: list[list[int]], block_tokens: int = 16) -> Trace:
    n = len(requests)
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in requests])]).astype(np.int64)
    flat = np.array([b for r in requests for b in r], dtype=np.int64)
    prompt = np.array([max(1, len(r)) * block_tokens for r in requests], dtype=np.int64)
    return Trace(arrival_s=np.arange(n, dtype=float), prompt_tokens=prompt,
                 output_tokens=np.ones(n, dtype=np.int64), prefix_offsets=offsets,
                 prefix_block_ids=flat, prefix_block_tokens=block_tokens)


def test_distances_worked_by_hand():
    """Requests [1, 2], [1, 3], [1, 2], each referenced last id first: 2 1 | 3 1 | 2 1.
    Block 1 at t3 saw {3} since t1 (1); block 2 at t4 saw {1, 3} since t0 (2); block 1
    at t5 saw {2} since t3 (1)."""
    trace = trace_of([[1, 2], [1, 3], [1, 2]])
    assert stack_distances(trace).tolist() == [-1, -1, -1, 1, 2, 1]
    curve = hit_rate_curve(trace, fractions=(1 / 3, 2 / 3, 1.0))
    assert curve["distinct_blocks"] == 3 and curve["references"] == 6
    assert [p["blocks"] for p in curve["points"]] == [1, 2, 3]
    assert [p["hit_rate"] for p in curve["points"]] == pytest.approx([0.0, 2 / 6, 3 / 6])
    assert curve["bound"] == pytest.approx(0.5)
    # in a cache of 2 the third request finds its first block (1) but not its second (2):
    # the hits of a request are a prefix of its ids, as a prefix cache's are


def lru_hits(requests: list[list[int]], capacity: int) -> int:
    """A plain LRU cache of ``capacity`` blocks, each request's ids touched last first."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for ids in requests:
        for block in reversed(ids):
            if block in cache:
                hits += 1
                cache.move_to_end(block)
            else:
                cache[block] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits


chains = st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=6), min_size=1,
                  max_size=30)


@given(requests=chains, capacity=st.integers(1, 20))
@settings(max_examples=200, deadline=None)
def test_stack_distances_give_what_an_lru_cache_hits(requests, capacity):
    distances = stack_distances(trace_of(requests))
    assert int(((distances >= 0) & (distances < capacity)).sum()) == lru_hits(
        requests, capacity)


@given(requests=chains)
@settings(max_examples=100, deadline=None)
def test_the_curve_rises_to_the_reuse_ratio(requests):
    """The hit rate never falls as the cache grows, and a cache holding every distinct
    block hits every repeat: the block reuse ratio, the infinite-cache bound."""
    trace = trace_of(requests)
    curve = hit_rate_curve(trace)
    rates = [p["hit_rate"] for p in curve["points"]]
    assert rates == sorted(rates)
    assert rates[-1] == pytest.approx(curve["bound"])
    # reuse_stats counts an id repeated inside one request from its second occurrence,
    # as the LRU does
    assert curve["bound"] == pytest.approx(reuse_stats(trace).reuse_ratio)


def test_a_trace_without_ids_is_refused():
    trace = Trace(arrival_s=np.zeros(1), prompt_tokens=np.ones(1, dtype=np.int64),
                  output_tokens=np.ones(1, dtype=np.int64), source="t.csv")
    with pytest.raises(ServetuneError, match="t.csv: has no prefix block ids"):
        stack_distances(trace)


ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl.gz"


def test_the_simulators_prefix_cache_hits_what_lru_at_its_pool_size_predicts():
    """An outside check of the simulator's prefix cache: at a low load (few blocks pinned
    by running requests) on the real Mooncake trace, the share of blocks it serves from
    the cache is the LRU hit rate of a cache of its KV pool's size (1,775 blocks of 512
    tokens: 4% of the trace's distinct blocks), within a point; `simulate` prints both."""
    if not MOONCAKE.exists():
        pytest.skip(f"the shared Mooncake trace is not at {MOONCAKE}")
    import json

    from typer.testing import CliRunner

    from servetune.cli import app

    res = CliRunner().invoke(app, [
        "simulate", "--trace", str(MOONCAKE), "--profile", "h200-llama-3.1-8b",
        "--policy", str(ROOT / "configs" / "policies" / "vllm-serve-defaults.yaml"),
        "--rate-scale", "0.05", "--json"])
    assert res.exit_code == 0, res.output
    cache = json.loads(res.stdout)["prefix_cache"]
    assert cache["trace_bound"] == pytest.approx(0.6396, abs=1e-4)  # 64.0% of references
    assert cache["lru_hit_rate_at_pool"] == pytest.approx(0.1315, abs=1e-4)
    assert abs(cache["hit_rate_blocks"] - cache["lru_hit_rate_at_pool"]) < 0.01


def _mooncake_file(path: Path, requests: list[list[int]]) -> Path:
    import json

    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 512 * len(r),
                                        "output_length": 10, "hash_ids": r}) + "\n"
                            for i, r in enumerate(requests)))
    return path


def test_trace_stats_prints_and_plots_the_curve(tmp_path):
    import json

    from typer.testing import CliRunner

    from servetune.cli import app

    trace = _mooncake_file(tmp_path / "t.jsonl", [[1, 2], [1, 3], [1, 2]] * 20)
    runner = CliRunner()
    res = runner.invoke(app, ["trace", "stats", str(trace), "--json"])
    assert res.exit_code == 0, res.output
    curve = json.loads(res.stdout)["prefix_reuse"]["hit_rate_curve"]
    assert curve["distinct_blocks"] == 3 and curve["references"] == 120
    assert curve["bound"] == pytest.approx(117 / 120)
    res = runner.invoke(app, ["trace", "stats", str(trace), "--plot", str(tmp_path / "c.png")])
    assert res.exit_code == 0, res.output
    assert "LRU prefix-cache hit rate by cache size" in res.output
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    plain = tmp_path / "plain.csv"
    plain.write_text("arrival,prompt,output\n0,10,5\n1,20,5\n")
    res = runner.invoke(app, ["trace", "stats", str(plain), "--columns",
                              "arrival=arrival,prompt=prompt,output=output", "--plot",
                              str(tmp_path / "p.png")])
    assert res.exit_code == 2 and "has no prefix block ids" in res.output
    assert not (tmp_path / "p.png").exists()


def test_workload_show_samples_the_curve_of_a_workload_with_reuse(tmp_path):
    import json

    from typer.testing import CliRunner

    from servetune.cli import app

    trace = _mooncake_file(tmp_path / "t.jsonl", [[1, 2, 3 + i % 7] for i in range(300)])
    runner = CliRunner()
    fitted = tmp_path / "w.yaml"
    res = runner.invoke(app, ["workload", "fit", str(trace), "-o", str(fitted), "-q"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["workload", "show", str(fitted), "--json"])
    assert res.exit_code == 0, res.output
    sample = json.loads(res.stdout)["prefix_reuse_sample"]
    assert sample["seed"] == 0 and sample["hit_rate_curve"]["references"] > 0
    # the curve of the sample `goodput` would judge on: the evaluator's default size
    from servetune.sim.evaluator import default_requests
    from servetune.workloads.fitting import load_workload, sample_trace

    workload = load_workload(fitted)
    drawn = sample_trace(workload, n_requests=default_requests(workload), seed=0)
    assert sample["requests"] == len(drawn)
    assert sample["hit_rate_curve"] == json.loads(json.dumps(hit_rate_curve(drawn)))
    res = runner.invoke(app, ["workload", "show", str(fitted), "--sample", "200",
                              "--plot", str(tmp_path / "w.png")])
    assert res.exit_code == 0, res.output
    assert "LRU prefix-cache hit rate" in res.output
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"


def test_the_reports_prefix_cache_section_places_the_pool_on_the_curve():
    """Worked by hand as above: three blocks, half the references repeats. The H200's pool
    holds far more than three 16-token blocks, so an LRU cache that size hits every
    repeat: the bound."""
    from servetune.apps.nightly import PREFIX_CACHE_HEADING, prefix_cache_section
    from servetune.profiles.shipped import load_profile

    profile = load_profile("h200-llama-3.1-8b")
    kv_tokens = profile.kv_blocks() * profile.block_size
    ((heading, text),) = prefix_cache_section(trace_of([[1, 2], [1, 3], [1, 2]]), kv_tokens)
    assert heading == PREFIX_CACHE_HEADING
    blocks = profile.kv_blocks() * profile.block_size // 16
    assert f"This KV pool holds {blocks:,} blocks of 16 tokens" in text
    assert "an LRU cache that size hits 50.0% of the block references, an unbounded one " \
        "50.0%" in text
    plain = Trace(arrival_s=np.zeros(1), prompt_tokens=np.ones(1, dtype=np.int64),
                  output_tokens=np.ones(1, dtype=np.int64))
    assert prefix_cache_section(plain, kv_tokens) == []
