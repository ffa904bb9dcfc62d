"""Replicas behind a router and disaggregated prefill/decode (servetune.sim.cluster)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from servetune.cli import app
from servetune.errors import ServetuneError
from servetune.profiles.shipped import load_profile
from servetune.profiles.steptime import step_seconds
from servetune.routers import ROUTER_NAMES
from servetune.schemas.policy import Policy
from servetune.sim import cluster as C
from servetune.sim import engine as E
from servetune.workloads.trace import Trace

PROFILE = load_profile("h200-llama-3.1-8b")
MOONCAKE = Path(__file__).resolve().parents[2] / "shared" / "traces" / \
    "mooncake_synthetic_trace.jsonl.gz"


def _trace(arrivals, prompts, outputs, ids=None, width=16) -> Trace:
    extra = {}
    if ids is not None:
        offsets = np.zeros(len(ids) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(x) for x in ids])
        extra = dict(prefix_offsets=offsets, prefix_block_tokens=width,
                     prefix_block_ids=np.concatenate([np.asarray(x, np.int64) for x in ids]))
    return Trace(arrival_s=np.asarray(arrivals, float), prompt_tokens=np.asarray(prompts),
                 output_tokens=np.asarray(outputs), **extra)


def _specs(n, role="both"):
    return [C.ReplicaSpec(PROFILE, Policy(), role=role)] * n


def _random_trace(n=300, seed=3) -> Trace:
    rng = np.random.default_rng(seed)
    prompts = rng.integers(50, 4000, n)
    ids = [[int(rng.integers(0, 5))] + [1000 * (r + 1) + j for j in range(p // 512 + 1)]
           for r, p in enumerate(prompts)]
    return _trace(np.sort(rng.uniform(0, 30, n)), prompts, rng.integers(1, 400, n), ids,
                  width=512)


def test_one_replica_is_the_single_engine_run():
    trace = _random_trace()
    single = E.run_engine(trace, Policy(), PROFILE.kv_blocks(), PROFILE.block_size,
                          PROFILE.step_time, prefix_caching=True)
    for router in ("least_kv", "round_robin"):
        out = C.run_cluster(trace, _specs(1), router=router, prefix_caching=True).merged
        for name in ("admitted_s", "first_token_s", "finish_s", "status", "hit_tokens"):
            assert np.array_equal(getattr(single, name), getattr(out, name), equal_nan=True)


def test_routers_decide_by_what_they_read():
    # R0 and R1 arrive together: R0 goes to replica 0 (tie), R1 to replica 1 (replica 0
    # has R0 in flight). Later, both idle: R2 shares R1's prefix, R3 R0's.
    a = [1, 2, 3]
    b = [5, 6, 7, 8]
    trace = _trace([0.0, 0.0, 10.0, 20.0], [2048] * 4, [4] * 4, [a, b, b, a], width=512)
    routed = {router: C.run_cluster(trace, _specs(2), router=router,
                                    prefix_caching=True).replica.tolist()
              for router in ROUTER_NAMES}
    assert routed["prefix_aware"] == [0, 1, 1, 0]  # follows the cached prefix
    assert routed["round_robin"] == [0, 1, 0, 1]
    assert routed["least_loaded"] == [0, 1, 0, 0]  # idle replicas tie: the lowest index
    assert routed["least_kv"] == [0, 1, 0, 0]
    # by first id (renumbered densely: a's is 0, b's 3): the same conversation, the same
    # replica
    assert routed["session"] == [0, 1, 1, 0]


def test_a_kv_transfer_worked_by_hand():
    # 1 prefill + 1 decode replica, one request of 1000 prompt and 3 output tokens.
    trace = _trace([0.0], [1000], [3])
    link = C.Link("test", 10e9, 0.001)
    out = C.run_cluster(trace, [*_specs(1, "prefill"), *_specs(1, "decode")], link=link,
                        prefix_caching=False)
    coef, pieces = PROFILE.step_time.as_arrays("vllm")

    def step(T, S, D, Cx, W):
        return step_seconds(coef, pieces, float(T), float(S), float(D), float(Cx), W)

    prefill_end = 0.0 + step(1000, 1, 0, 0, 1000 * 500.0)
    transfer = 1000 * PROFILE.kv_bytes_per_token() / 10e9 + 0.001
    assert out.transfer_s[0] == pytest.approx(transfer, rel=1e-12)
    # the decode replica admits it at once, waits for the KV, then recomputes the last
    # prompt token (its first token), then decodes two more
    first = prefill_end + transfer + step(1, 1, 0, 0, 1 * (999 + 0.5))
    second = first + step(1, 1, 1, 1001, 0.0)
    third = second + step(1, 1, 1, 1002, 0.0)
    assert out.merged.first_token_s[0] == pytest.approx(first, rel=1e-12)
    assert out.merged.finish_s[0] == pytest.approx(third, rel=1e-12)
    assert out.outputs[0].first_token_s[0] == pytest.approx(prefill_end, rel=1e-12)
    assert out.decode_replica.tolist() == [1]


def test_a_decode_replica_without_room_makes_the_transfer_wait():
    # Decode pool of 70 blocks: two 1000-token prompts (63 blocks each) cannot both be
    # admitted; the second waits for the first to finish before its KV moves.
    trace = _trace([0.0, 0.0], [1000, 1000], [50, 50])
    small = PROFILE.model_copy(deep=True)
    small.memory.kv_blocks_override = 71  # 70 usable
    specs = [C.ReplicaSpec(PROFILE, Policy(), role="prefill"),
             C.ReplicaSpec(small, Policy(), role="decode")]
    out = C.run_cluster(trace, specs, link=C.LINKS["nvlink"])
    dec = out.outputs[1]
    first_done = np.nanmin(dec.finish_s)
    assert np.nanmax(dec.admitted_s) >= first_done
    assert np.nanmax(out.merged.first_token_s) > first_done + out.transfer_s[1]
    assert (out.merged.status == 0).all()


@pytest.mark.parametrize("router", ROUTER_NAMES)
def test_every_request_is_accounted_for_once(router):
    trace = _random_trace(400)
    agg = C.run_cluster(trace, _specs(4), router=router, prefix_caching=True)
    assert sorted(np.concatenate(agg.rows).tolist()) == list(range(len(trace)))
    assert (agg.merged.status >= 0).all()
    assert sum(int((o.status >= 0).sum()) for o in agg.outputs) == len(trace)
    dis = C.run_cluster(trace, [*_specs(2, "prefill"), *_specs(2, "decode")], router=router,
                        prefix_caching=True)
    forwarded = dis.decode_replica >= 0
    prefill_ok = np.concatenate([o.status for o in dis.outputs[:2]]) == 0
    assert forwarded.sum() == prefill_ok.sum()
    assert (dis.merged.status >= 0).all()
    decoded = np.concatenate(dis.rows[2:])
    assert sorted(decoded.tolist()) == np.flatnonzero(forwarded).tolist()
    ttft = dis.merged.first_token_s - trace.arrival_s
    assert (ttft[forwarded] > dis.transfer_s[forwarded]).all()


def test_fast_and_reference_clusters_agree():
    trace = _random_trace(150)
    runs = [C.run_cluster(trace, [*_specs(1, "prefill"), *_specs(2, "decode")],
                          router="least_kv", reference=ref, prefix_caching=True)
            for ref in (False, True)]
    assert np.array_equal(runs[0].decode_replica, runs[1].decode_replica)
    for name in ("first_token_s", "finish_s", "status", "hit_tokens"):
        assert np.array_equal(getattr(runs[0].merged, name), getattr(runs[1].merged, name),
                              equal_nan=True)


def test_bad_topologies_say_what_to_do():
    trace = _trace([0.0], [10], [2])
    with pytest.raises(ServetuneError, match="router 'nearest' is unknown"):
        C.run_cluster(trace, _specs(2), router="nearest")
    with pytest.raises(ServetuneError, match="prefill and decode replicas only"):
        C.run_cluster(trace, [*_specs(1, "prefill"), *_specs(1)])
    with pytest.raises(ServetuneError, match="decode replicas are simulated as vLLM"):
        C.run_cluster(trace, [*_specs(1, "prefill"),
                              C.ReplicaSpec(PROFILE, Policy(), "sglang", "decode")])
    with pytest.raises(ServetuneError, match="expected P:D"):
        C.parse_disagg("2-2")


@pytest.mark.skipif(not MOONCAKE.exists(), reason="../shared/traces (Mooncake) not present")
def test_cli_replays_mooncake_on_four_replicas_and_a_2_2_disaggregated_cluster(tmp_path):
    runner = CliRunner()
    base = ["simulate", "--trace", str(MOONCAKE), "--profile", "h200-llama-3.1-8b",
            "--policy", "configs/policies/vllm-serve-defaults.yaml", "--requests", "600",
            "--prefix-caching", "on", "--json"]
    for extra in (["--replicas", "4", "--router", "prefix_aware"], ["--disagg", "2:2"]):
        res = runner.invoke(app, base + extra)
        assert res.exit_code == 0, res.output
        data = json.loads(res.stdout)
        assert data["requests"] == 600
        assert data["completed"] + data["shed"] + data["rejected"] == 600
        assert data["prefix_cache"]["hit_rate_tokens"] > 0
        assert len(data["cluster"]["replicas"]) == 4
    res = runner.invoke(app, base + ["--replicas", "2", "--disagg", "1:1"])
    assert res.exit_code == 2 and "not both" in res.output


@pytest.mark.skipif(not MOONCAKE.exists(), reason="../shared/traces (Mooncake) not present")
def test_trace_stats_reports_prefix_reuse_only_for_traces_with_ids(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["trace", "stats", str(MOONCAKE), "--json"])
    assert res.exit_code == 0, res.output
    reuse = json.loads(res.stdout)["prefix_reuse"]
    assert (reuse["references"], round(reuse["reuse_ratio"], 3)) == (121_877, 0.640)
    plain = tmp_path / "t.csv"
    plain.write_text("arrival,prompt,output\n0,10,2\n1,20,3\n")
    res = runner.invoke(app, ["trace", "stats", str(plain), "--json", "--columns",
                              "arrival=arrival,prompt=prompt,output=output"])
    assert res.exit_code == 0, res.output
    assert "prefix_reuse" not in json.loads(res.stdout)


def test_a_topology_file_mixes_gpu_types_and_roles(tmp_path):
    trace = _random_trace(200)
    trace_file = tmp_path / "t.jsonl"
    offsets = trace.prefix_offsets
    lines = []
    for r in range(len(trace)):
        ids = trace.prefix_block_ids[offsets[r]:offsets[r + 1]].tolist()
        lines.append(json.dumps({"timestamp": int(trace.arrival_s[r] * 1000),
                                 "input_length": int(trace.prompt_tokens[r]),
                                 "output_length": int(trace.output_tokens[r]),
                                 "hash_ids": ids}))
    trace_file.write_text("\n".join(lines) + "\n")
    runner = CliRunner()
    base = ["simulate", "--trace", str(trace_file), "--profile", "h200-llama-3.1-8b",
            "--policy", "configs/policies/vllm-serve-defaults.yaml", "--json"]
    res = runner.invoke(app, base + ["--topology", "configs/topologies/mixed-h200-h100.yaml"])
    assert res.exit_code == 0, res.output
    cluster = json.loads(res.stdout)["cluster"]
    assert cluster["router"] == "prefix_aware"
    assert [r["profile"] for r in cluster["replicas"]] == [
        "h200-llama-3.1-8b", "h200-llama-3.1-8b", "h100-80gb-llama-3.1-8b",
        "h100-80gb-llama-3.1-8b"]
    assert sum(r["requests"] for r in cluster["replicas"]) == 200
    res = runner.invoke(app, base + ["--topology", "configs/topologies/h200-1p3d.yaml"])
    assert res.exit_code == 0, res.output
    cluster = json.loads(res.stdout)["cluster"]
    assert [r["role"] for r in cluster["replicas"]] == ["prefill"] + ["decode"] * 3
    assert cluster["topology"] == "h200-1p3d: disaggregated 1:3 over infiniband"
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: servetune/v1\nkind: Topology\nreplicas:\n"
                   "  - role: prefill\n  - role: both\n")
    res = runner.invoke(app, base + ["--topology", str(bad)])
    assert res.exit_code == 2
    assert "mix of role both with prefill/decode" in res.output
    assert "Traceback" not in res.output
    res = runner.invoke(app, base + ["--topology", str(bad), "--replicas", "2"])
    assert res.exit_code == 2 and "not both" in res.output


def test_records_name_the_replica_and_the_cached_tokens(tmp_path):
    import csv

    from servetune.sim.api import simulate_cluster

    trace = _random_trace(120)
    result, out = simulate_cluster(trace, [*_specs(1, "prefill"), *_specs(2, "decode")],
                                   router="least_kv", prefix_caching=True)
    path = tmp_path / "r.csv"
    result.write_records(path)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0])[-3:] == ["cached_tokens", "replica", "decode_replica"]
    assert [int(r["replica"]) for r in rows] == out.replica.tolist()
    assert [int(r["decode_replica"]) for r in rows] == out.decode_replica.tolist()
    assert {int(r["decode_replica"]) for r in rows} <= {-1, 1, 2}
    assert [int(r["cached_tokens"]) for r in rows] == out.merged.hit_tokens.tolist()
    assert sum(int(r["cached_tokens"]) for r in rows) > 0


def test_a_cluster_past_the_state_bound_is_refused_before_it_allocates(monkeypatch):
    """Every replica holds arrays over all requests and over its KV pool: the bound is on
    their sum, worked by hand: 3 replicas x 10 requests x 100 B + 3 x 56,821 blocks x 89 B
    = 3,000 + 15,171,207 B."""
    from servetune.engines import CLUSTER_BYTES_PER_KV_BLOCK, CLUSTER_BYTES_PER_REQUEST

    trace = _trace(np.arange(10.0), [100] * 10, [5] * 10)
    need = (3 * 10 * CLUSTER_BYTES_PER_REQUEST
            + 3 * PROFILE.kv_blocks() * CLUSTER_BYTES_PER_KV_BLOCK)
    assert need == 3_000 + 15_171_207
    monkeypatch.setattr(C, "MAX_CLUSTER_STATE_BYTES", need - 1)
    with pytest.raises(ServetuneError, match=r"3 replicas x 10 requests: .* at most 2 replicas"):
        C.run_cluster(trace, _specs(3))
    monkeypatch.setattr(C, "MAX_CLUSTER_STATE_BYTES", need)
    assert C.run_cluster(trace, _specs(3)).merged.finish_s.size == 10
    # one replica is the single engine: nothing to bound here (the sample cap holds)
    monkeypatch.setattr(C, "MAX_CLUSTER_STATE_BYTES", 0)
    assert C.run_cluster(trace, _specs(1)).merged.finish_s.size == 10


def test_a_reading_router_takes_at_most_its_replica_count():
    from servetune.routers import MAX_ROUTED_REPLICAS

    trace = _trace([0.0, 1.0], [100, 100], [3, 3])
    many = _specs(MAX_ROUTED_REPLICAS + 1)
    for router in ("least_loaded", "least_kv", "prefix_aware"):
        with pytest.raises(ServetuneError,
                           match=rf"router '{router}' with 17 replicas.*round_robin"):
            C.run_cluster(trace, many, router=router)
    # a static router runs each replica on its own: no such limit
    assert C.run_cluster(trace, many, router="round_robin").merged.finish_s.size == 2
    # disaggregation routes in Python, not in the compiled loop
    split = _specs(MAX_ROUTED_REPLICAS, "prefill") + _specs(2, "decode")
    assert C.run_cluster(trace, split, router="least_kv").merged.finish_s.size == 2
