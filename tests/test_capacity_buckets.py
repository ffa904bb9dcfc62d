"""Buckets, bucket rates from a forecast, and the cache location (no simulation needed)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from servetune.apps import plan as C
from servetune.errors import ServetuneError
from servetune.profiles.schema import Profile
from servetune.schemas.base import document_from_data
from servetune.schemas.fleet import Forecast
from servetune.schemas.slo import SLOSet
from servetune.schemas.workload import Workload


def _workload(classes: dict[str, float]) -> Workload:
    data = {
        "apiVersion": "servetune/v1",
        "kind": "Workload",
        "classes": {
            name: {
                "arrival": {"rate_per_s": rate},
                "prompt_tokens": {"quantiles": [0, 0.5, 1], "values": [10, 600, 3000]},
                "output_tokens": {"quantiles": [0, 0.5, 1], "values": [5, 100, 400]},
            }
            for name, rate in classes.items()
        },
    }
    return document_from_data(data, Workload, "w.yaml")


def _forecast(classes: dict[str, list[float]]) -> Forecast:
    data = {"apiVersion": "servetune/v1", "kind": "Forecast",
            "classes": {c: {"rate_per_s": r} for c, r in classes.items()}}
    return document_from_data(data, Forecast, "f.yaml")


def test_buckets_partition_every_request() -> None:
    buckets = C.make_buckets((512, 2048), (128,))
    assert len(buckets) == 6
    assert buckets[0].name == "p0-512/o0-128" and buckets[-1].name == "p2048-inf/o128-inf"
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 10000, size=5000)
    output = rng.integers(1, 1000, size=5000)
    hits = np.stack([b.contains(prompt, output) for b in buckets])
    assert (hits.sum(axis=0) == 1).all()  # each request in exactly one bucket
    # edges are [low, high)
    assert buckets[1].contains(np.array([511]), np.array([128]))[0]
    assert buckets[2].contains(np.array([512]), np.array([127]))[0]


def test_bad_edges() -> None:
    with pytest.raises(ServetuneError, match="argument `prompt_edges`"):
        C.make_buckets((2048, 512), (128,))
    with pytest.raises(ServetuneError, match="argument `output_edges`"):
        C.make_buckets((512,), (1,))


def test_bucket_rates_conserve_the_forecast() -> None:
    w = _workload({"chat": 3.0, "code": 1.0})
    slices = C.slice_workload(w, C.make_buckets((512,), (128,)), n_requests=4000, seed=1)
    assert abs(sum(slices.share.values()) - 1.0) < 1e-9
    day = [float(h + 1) for h in range(24)]
    # one 'default' class spreads over the workload's classes by their rates
    lam = slices.bucket_rates(_forecast({"default": day}), growth=2.0)
    for s in range(24):
        assert sum(lam[b, s] for b in slices.names) == pytest.approx(2.0 * day[s])
    # per-class forecasts use each class's own bucket shares
    lam2 = slices.bucket_rates(_forecast({"chat": [1.0] * 24, "code": [0.0] * 24}))
    for b in slices.names:
        assert lam2[b, 0] == pytest.approx(slices.class_share["chat"].get(b, 0.0))


def test_forecast_class_must_exist() -> None:
    w = _workload({"chat": 1.0})
    slices = C.slice_workload(w, C.make_buckets(), n_requests=500)
    with pytest.raises(ServetuneError, match="classes.batch: the workload has no such class"):
        slices.bucket_rates(_forecast({"batch": [1.0] * 24}))


def test_mixed_trace_rates_and_determinism() -> None:
    w = _workload({"default": 1.0})
    slices = C.slice_workload(w, C.make_buckets((512,), (128,)), n_requests=3000)
    names = slices.names
    rates = {names[0]: 3.0, names[-1]: 1.0}
    a = slices.mixed_trace(rates, 4000, seed=5)
    b = slices.mixed_trace(rates, 4000, seed=5)
    assert len(a) == 4000
    assert np.array_equal(a.arrival_s, b.arrival_s) and np.array_equal(a.prompt_tokens,
                                                                       b.prompt_tokens)
    rate = (len(a) - 1) / a.duration_s
    assert rate == pytest.approx(4.0, rel=0.08)
    # shapes come from the two buckets' pools only
    big = C.make_buckets((512,), (128,))[-1]
    first = C.make_buckets((512,), (128,))[0]
    inside = big.contains(a.prompt_tokens, a.output_tokens) | first.contains(
        a.prompt_tokens, a.output_tokens
    )
    assert inside.all()


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(C.CACHE_ENV, str(tmp_path / "c"))
    assert C.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv(C.CACHE_ENV)
    assert C.default_cache_dir() == Path.home() / ".cache" / "servetune" / "capacity"


def _tiny_replica_inputs() -> tuple[Profile, SLOSet, C.WorkloadSlices]:
    """A 500-block synthetic profile, a loose SLO and a two-bucket slicing of one class."""
    profile = document_from_data({
        "apiVersion": "servetune/v1", "kind": "Profile", "name": "tiny",
        "memory": {"kv_blocks_override": 500},
        "step_time": {"fixed_s": 0.01, "gemm_pieces": [[0.0, 5.0e-5]]},
    }, Profile, "p.yaml")
    slo = document_from_data({
        "apiVersion": "servetune/v1", "kind": "SLOSet",
        "classes": {"default": {"ttft_s": 2.0, "tpot_s": 0.2, "percentile": 90}},
    }, SLOSet, "s.yaml")
    slices = C.slice_workload(_workload({"default": 1.0}), C.make_buckets((512,), (128,)),
                              n_requests=2000)
    return profile, slo, slices


def test_capacity_cache_hit_and_damaged_entry(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(C, "CANDIDATE_BATCHING", ((64, 2048),))
    profile, slo, slices = _tiny_replica_inputs()
    b = slices.names[0]
    first = C.replica_capacity(profile, slices, b, slo, method="candidates", n_requests=200,
                               cache_dir=tmp_path)
    assert not first.cached and first.simulations > 0 and first.rate_per_s > 0
    second = C.replica_capacity(profile, slices, b, slo, method="candidates", n_requests=200,
                                cache_dir=tmp_path)
    assert second.cached and second.rate_per_s == first.rate_per_s
    assert second.policy == first.policy
    # a damaged entry is recomputed, not trusted
    (entry,) = tmp_path.glob("*.json")
    entry.write_text("{not json")
    third = C.replica_capacity(profile, slices, b, slo, method="candidates", n_requests=200,
                               cache_dir=tmp_path)
    assert not third.cached and third.rate_per_s == first.rate_per_s
    # a new engine-model version measures again rather than trust an old simulator's answer
    monkeypatch.setattr(C, "ENGINE_MODEL_VERSION", C.ENGINE_MODEL_VERSION + 1)
    fourth = C.replica_capacity(profile, slices, b, slo, method="candidates", n_requests=200,
                                cache_dir=tmp_path)
    assert not fourth.cached and fourth.rate_per_s == first.rate_per_s
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_auto_keeps_the_better_of_optimizer_and_candidates(tmp_path: Path, monkeypatch) -> None:
    from types import SimpleNamespace

    from servetune.schemas.policy import Policy

    monkeypatch.setattr(C, "CANDIDATE_BATCHING", ((64, 2048),))
    profile, slo, slices = _tiny_replica_inputs()
    b = slices.names[0]
    calls = []

    def fake_optimize(rate):
        def optimize(trace, prof, s, **kw):
            calls.append(kw)
            return SimpleNamespace(policy=Policy(name="from-optimizer"),
                                   summary={"goodput_rate_per_s": rate, "simulations": 7})
        return optimize

    monkeypatch.setattr(C, "_optimizer", lambda: fake_optimize(1e-3))
    low = C.replica_capacity(profile, slices, b, slo, n_requests=200, cache_dir=tmp_path / "a")
    assert low.method == "optimizer+candidates" and low.policy.name.startswith("candidate")
    assert low.rate_per_s > 1e-3 and calls and calls[0]["n_requests"] == 200
    monkeypatch.setattr(C, "_optimizer", lambda: fake_optimize(1e6))
    high = C.replica_capacity(profile, slices, b, slo, n_requests=200, cache_dir=tmp_path / "b")
    # the optimizer's policy wins, but 200 requests at its claimed 1e6 req/s span far less
    # than MIN_WINDOW_S: its capacity is measured again on a longer trace
    assert high.policy.name == "from-optimizer" and 0 < high.rate_per_s < 1e6
    only = C.replica_capacity(profile, slices, b, slo, method="optimizer", n_requests=200,
                              cache_dir=tmp_path / "c")
    assert only.method == "optimizer" and only.simulations > 7
    assert only.rate_per_s == pytest.approx(high.rate_per_s, rel=0.05)


def test_candidates_that_cannot_beat_the_leader_cost_one_simulation_each() -> None:
    from servetune.schemas.policy import Policy

    profile, slo, slices = _tiny_replica_inputs()
    trace = slices.mixed_trace({slices.names[0]: 1.0}, 200, 0)
    policies = [Policy(name=f"p{s}", batching={"max_num_seqs": s, "max_num_batched_tokens": 2048})
                for s in (64, 32, 16)]
    rate, policy, sims = C._best_candidate(trace, profile, slo, "vllm", policies)
    assert rate > 0 and sims > len(policies)
    # a leader far above what any of them sustains: each is simulated once, at the bar,
    # fails there, and none is chosen
    rate_vs_high, _, sims_vs_high = C._best_candidate(trace, profile, slo, "vllm", policies,
                                                      leader=1e3 * rate)
    assert (rate_vs_high, sims_vs_high) == (0.0, len(policies))
    # a leader below them: the first is searched up from the bar and wins
    rate_vs_low, policy_vs_low, _ = C._best_candidate(trace, profile, slo, "vllm", policies,
                                                      leader=rate / 4)
    assert rate_vs_low == pytest.approx(rate, rel=2 * C.CAPACITY_REL_TOL)
    assert policy_vs_low.name == policies[0].name == policy.name


def test_capacity_is_measured_at_steady_state(tmp_path: Path, monkeypatch) -> None:
    """500 Azure-conversation requests with long outputs arrive in a few seconds, too
    fast for one H100's KV cache to fill, so that short burst "met" the SLOs at 2.4x the
    rate a replica sustains (8.9 req/s with vLLM's host time per sequence charged; 26-29
    req/s on GPU time alone, before the host term). The measurement lengthens the trace until
    its arrivals span MIN_WINDOW_S."""
    from servetune.profiles.shipped import load_profile
    from servetune.workloads.fitting import load_workload

    root = Path(__file__).resolve().parents[1]
    monkeypatch.setattr(C, "CANDIDATE_BATCHING", ((1024, 8192),))  # vLLM serve's defaults
    monkeypatch.setattr(C, "MAX_WINDOW_REQUESTS", 8000)  # still > 240 s at ~27 req/s
    workload = load_workload(root / "configs/workloads/azure-conv-2023.yaml")
    slices = C.slice_workload(workload, C.make_buckets(), n_requests=10000, seed=0)
    profile = load_profile(root / "gpu_profiles/h100-80gb-llama-3.1-8b.yaml")
    slo = document_from_data({
        "apiVersion": "servetune/v1", "kind": "SLOSet",
        "classes": {"default": {"ttft_s": 2.0, "tpot_s": 0.1, "percentile": 99}},
    }, SLOSet, "s.yaml")
    kw = dict(method="candidates", n_requests=500)
    steady = C.replica_capacity(profile, slices, "p0-1024/o256-inf", slo,
                                cache_dir=tmp_path / "a", **kw)
    assert 6.0 < steady.rate_per_s < 12.0
    monkeypatch.setattr(C, "MIN_WINDOW_S", 0.0)  # the burst measurement of before
    burst = C.replica_capacity(profile, slices, "p0-1024/o256-inf", slo,
                               cache_dir=tmp_path / "b", **kw)
    assert burst.rate_per_s > 2.0 * steady.rate_per_s
