"""Prefix caching in the engine model: hits, evictions, shared blocks, and both modes alike.

Hand-worked cases use 16-token blocks and 16-token prefix ids, so that block ``j`` of a
request is exactly its id ``j``.
"""

from __future__ import annotations

import gzip
import json
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from servetune.profiles.shipped import load_profile
from servetune.schemas.policy import Policy
from servetune.sim import _kernel as K
from servetune.sim import api
from servetune.sim import engine as E
from servetune.workloads.trace import Trace

MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "traces" / \
    "mooncake_synthetic_trace.jsonl.gz"
PROFILE = load_profile("h200-llama-3.1-8b")


def _trace(arrivals, prompts, outputs, ids, width=16) -> Trace:
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(x) for x in ids])
    return Trace(arrival_s=np.asarray(arrivals, float), prompt_tokens=np.asarray(prompts),
                 output_tokens=np.asarray(outputs), prefix_offsets=offsets,
                 prefix_block_ids=np.concatenate([np.asarray(x, np.int64) for x in ids]),
                 prefix_block_tokens=width)


def _run(trace: Trace, blocks: int, *, reference: bool = False, step_log: bool = False,
         caching: bool = True) -> E.EngineOutput:
    return E.run_engine(trace, Policy(), blocks, 16, PROFILE.step_time, reference=reference,
                        step_log=step_log, prefix_caching=caching)


def test_a_repeated_prompt_is_served_from_the_cache_but_its_last_token():
    # 2000 tokens = 125 blocks; the second request hits 124 blocks (1984 tokens: the last
    # token is always computed); the third shares the first two 512-token ids: 1024 tokens.
    ids = [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 9]]
    trace = _trace([0.0, 10.0, 20.0], [2000, 2000, 1500], [5, 5, 5], ids, width=512)
    out = _run(trace, 10_000, step_log=True)
    assert out.hit_tokens.tolist() == [0, 1984, 1024]
    admit = [rec for rec in out.step_log if 1 in rec["admitted"]][0]
    assert admit["cached_tokens"] == [[1, 1984]]
    assert admit["scheduled"] == [[1, 16]]  # only the rest of the prompt is computed
    off = _run(trace, 10_000, caching=False, step_log=True)
    assert off.hit_tokens is None
    assert [rec for rec in off.step_log if 1 in rec["admitted"]][0]["scheduled"] == [[1, 2000]]


def test_lru_evicts_the_tail_of_the_oldest_freed_request_first():
    # Pool of 10 blocks. A (4 prompt blocks) finishes: its 4 full blocks stay cached.
    # B (6 prompt blocks) needs a 7th block for its second token: 6 used + 4 cached = 10,
    # so one cached block goes, A's last (freed tail first). C asks for A's 4 blocks plus
    # one more: it finds only 3 of them (48 tokens). With a large pool it finds all 4.
    trace = _trace([0.0, 10.0, 20.0], [64, 96, 65], [2, 2, 2],
                   [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 11]])
    small = _run(trace, 10)
    assert small.hit_tokens.tolist() == [0, 0, 48]
    assert small.cache_evictions == 2  # A's block 4 for B, then B's tail for C's decode
    assert _run(trace, 100).hit_tokens.tolist() == [0, 0, 64]
    for out in (small, _run(trace, 10, reference=True)):
        assert (out.status == 0).all()
        assert out.kv_blocks_in_use_end == 0


def test_blocks_shared_by_running_requests_are_counted_once():
    # Two requests with the same 8-block prompt, the second admitted while the first is
    # decoding: it takes the first's 7 registered blocks (the last token is recomputed),
    # so the pool holds 8 + 1 blocks for both prompts, not 16.
    ids = [list(range(8)), list(range(8))]
    trace = _trace([0.0, 0.5], [128, 128], [400, 400], ids)
    out = _run(trace, 100)
    assert out.hit_tokens.tolist() == [0, 112]
    # the peak (both decoding) is lower by at least the 7 shared blocks than without
    # the cache, where B holds a copy of its own
    peak = round(out.kv_util_peak * 100)
    assert round(_run(trace, 100, caching=False).kv_util_peak * 100) - peak >= 7
    assert round(_run(trace, 100, reference=True).kv_util_peak * 100) == peak


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm", "tgi"])
def test_fast_and_reference_modes_agree_with_caching_on(engine):
    rng = np.random.default_rng(7)
    n = 120
    arrivals = np.sort(rng.uniform(0, 20, n))
    prompts = rng.integers(20, 900, n)
    outputs = rng.integers(1, 300, n)
    # a few shared system prompts of 1-3 ids, then ids of the request's own
    ids = []
    for r in range(n):
        head = list(range(100 * int(rng.integers(0, 4)), 100 * int(rng.integers(0, 4)) + 3))
        own = [10_000 + 100 * r + j for j in range(int(prompts[r]) // 64 + 1)]
        ids.append(head[: int(rng.integers(0, 4))] + own)
    trace = _trace(arrivals, prompts, outputs, ids, width=64)
    runs = [E.run_engine(trace, Policy(), 60, 16, PROFILE.step_time, engine=engine,
                         reference=ref, step_log=True, prefix_caching=True)
            for ref in (False, True)]
    fast, slow = runs
    for name in ("admitted_s", "first_token_s", "finish_s", "preemptions", "status",
                 "generated", "hit_tokens"):
        assert np.array_equal(getattr(fast, name), getattr(slow, name), equal_nan=True), name
    assert fast.cache_evictions == slow.cache_evictions > 0
    assert E.expand_repeats(fast.step_log) == slow.step_log
    assert np.array_equal(fast.series["kv_cached"], slow.series["kv_cached"])
    assert fast.kv_blocks_in_use_end == 0


def _mooncake_rows():
    with gzip.open(MOONCAKE, "rt") as f:
        return [json.loads(line) for line in f]


@pytest.mark.skipif(not MOONCAKE.exists(), reason="../shared/traces (Mooncake) not present")
def test_mooncake_hit_rate_matches_an_independent_lru_at_low_load():
    """Outside check: replayed at 1/20 of its rate (requests rarely overlap), the engine's
    hit rate matches a plain LRU over the trace's 512-token ids (Python's OrderedDict) of
    the same capacity in tokens, and, with a pool too large to evict, the ideal rate."""
    from servetune.workloads.formats import load_trace

    rows = _mooncake_rows()
    trace = load_trace(str(MOONCAKE)).rate_scaled(0.05)

    def oracle(capacity_ids: int) -> float:
        lru: OrderedDict[int, None] = OrderedDict()
        hit = total = 0
        for row in rows:
            ids = row["hash_ids"]
            k = 0
            while k < len(ids) and ids[k] in lru:
                k += 1
            prompt = row["input_length"]
            hit += min(k * 512, (prompt - 1) // 16 * 16)
            total += prompt
            for x in reversed(ids):  # a request's tail is evicted first
                lru[x] = None
                lru.move_to_end(x)
            while len(lru) > capacity_ids:
                lru.popitem(last=False)
        return hit / total

    blocks = PROFILE.kv_blocks()
    sim = api.simulate(trace, Policy(), PROFILE, prefix_caching=True)
    rate = sim.summary()["prefix_cache"]["hit_rate_tokens"]
    assert rate == pytest.approx(oracle(blocks * 16 // 512), abs=0.015)
    big = E.run_engine(trace, Policy(), 3_000_000, 16, PROFILE.step_time, prefix_caching=True)
    ideal = oracle(10**9)
    assert big.cache_evictions == 0
    assert big.hit_tokens.sum() / trace.prompt_tokens.sum() == pytest.approx(ideal, abs=0.005)
    assert ideal == pytest.approx(0.651, abs=0.001)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_cache_is_whole_after_a_run_under_pressure(engine):
    """After a run with evictions and preemptions: no block is still referenced; the table
    holds exactly the units in use, each under its own key and with a cached block; the
    LRU nodes hold every cached block once (and the finished requests' anonymous blocks),
    as many as ``cached_free``; units and nodes in use plus free ones make the pool."""
    from servetune.sim import cluster as C

    rng = np.random.default_rng(11)
    n = 200
    prompts = rng.integers(16, 700, n)
    ids = [[int(rng.integers(0, 3))] + [5000 + 50 * r + j for j in range(int(p) // 64 + 1)]
           for r, p in enumerate(prompts)]
    trace = _trace(np.sort(rng.uniform(0, 5, n)), prompts, rng.integers(1, 200, n), ids,
                   width=64)
    small = PROFILE.model_copy(deep=True)
    small.memory.kv_blocks_override = 81  # 80 usable blocks of 16 tokens
    rep = C._Replica(0, C.ReplicaSpec(small, Policy(), engine), trace, reference=False,
                     prefix_caching=True, horizon_s=5.0)
    for row in range(n):
        rep.append(row, float(trace.arrival_s[row]))
    rep.advance(np.inf)
    st, sc = rep.state, rep.scalars
    assert (st.status >= 0).all() and st.preemptions.sum() > 0 and sc.evictions > 0
    assert sc.used == 0 and (st.unit_ref == 0).all()
    assert rep.params.unit_blocks == 4  # 64-token ids over 16-token blocks
    live = np.flatnonzero(st.table_key != K.EMPTY_KEY)
    units = st.table_slot[live]
    assert len(set(units.tolist())) == len(units)
    assert (st.units[units, K.U_KEY] == st.table_key[live]).all()
    assert (st.units[units, K.U_MASK] != 0).all()
    assert sc.free_units + len(units) == 80
    assert not set(st.unit_free[:sc.free_units].tolist()) & set(units.tolist())
    order, node = [], sc.lru_head
    while node >= 0:
        order.append(node)
        node = st.nodes[node, K.N_NEXT]
    assert len(order) == len(set(order)) and sc.free_nodes + len(order) == 80
    cached = set()
    sizes = []
    for node in order:
        u, lo, hi = st.nodes[node, [K.N_UNIT, K.N_LO, K.N_HI]].tolist()
        assert lo < hi
        sizes.append((u, hi - lo))
        for o in range(lo, hi):
            if u >= 0:
                assert (st.units[u, K.U_MASK] >> o) & 1 and st.unit_node[u, o] == node
                assert (u, o) not in cached
                cached.add((u, o))
    every = {(u, o) for u in units.tolist() for o in range(4) if (st.units[u, K.U_MASK] >> o) & 1}
    assert cached == every
    assert sum(size for _, size in sizes) == sc.cached_free
    # finished requests' own blocks are anonymous runs; a release's blocks of a unit, one node
    assert any(u < 0 and size > 1 for u, size in sizes)
    assert any(u >= 0 and size > 1 for u, size in sizes)


def _chained_trace(seed: int, n: int, width: int) -> Trace:
    """Requests over a few shared system prompts, each a conversation's next turn or a new
    one, some with an id repeated, ids covering part of their output: every way two
    requests can share blocks, and a request share with itself."""
    rng = np.random.default_rng(seed)
    ids, prompts = [], []
    for r in range(n):
        if r and rng.random() < 0.4:  # a later turn: the earlier prompt, extended
            chain = list(ids[int(rng.integers(0, r))]) + [10_000 + r]
        else:
            chain = [int(rng.integers(0, 3))] + [20_000 + 40 * r + j
                                                 for j in range(int(rng.integers(0, 6)))]
        if rng.random() < 0.1:
            chain.append(chain[-1])  # the same id twice in a row
        ids.append(chain)
        # the prompt ends anywhere in its last id, so its output is partly keyed
        prompts.append(max(1, (len(chain) - 1) * width + int(rng.integers(1, width + 1))))
    return _trace(np.sort(rng.uniform(0, 4, n)), prompts, rng.integers(1, 120, n), ids,
                  width=width)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("width,blocks", [(64, 60), (128, 90), (512, 400)])
def test_units_of_blocks_change_nothing(engine, width, blocks, monkeypatch):
    """The cache keeps blocks in units of up to 32 (one hash entry, one LRU node for a
    release's run of a unit): the same run, to the bit, as one block per unit, under
    pressure (evictions and preemptions), fast and reference."""
    trace = _chained_trace(width, 160, width)

    def run(reference: bool) -> E.EngineOutput:
        return E.run_engine(trace, Policy(), blocks, 16, PROFILE.step_time, engine=engine,
                            reference=reference, prefix_caching=True)

    grouped = run(False)
    assert E.unit_blocks_for(width, 16) == min(width // 16, 32) > 1
    assert grouped.cache_evictions > 0 and grouped.preemptions.sum() > 0
    monkeypatch.setattr(E, "unit_blocks_for", lambda width, block_size: 1)
    for single in (run(False), run(True)):
        assert single.cache_evictions == grouped.cache_evictions
        for name in ("first_token_s", "finish_s", "status", "preemptions", "hit_tokens"):
            np.testing.assert_array_equal(getattr(single, name), getattr(grouped, name))
