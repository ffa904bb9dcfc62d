"""`plan` choosing the serving topology: aggregated replicas and prefill:decode units.

The MILP with units is checked by hand-worked instances in test_capacity_milp.py; here:
parsing ``--topologies``, the unit capacity cache (its key holds the topology), the plan
document of a unit plan (no simulation: fixed capacities, validation off), and the CLI end
to end on the small synthetic fleet of test_capacity_plan.py (with hardware and model in
the profiles, so that a KV transfer can be sized).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from test_capacity_buckets import _tiny_replica_inputs
from test_capacity_plan import _plan_args, inputs  # noqa: F401  (fixture)
from typer.testing import CliRunner

from servetune.apps import plan as C
from servetune.cli import app
from servetune.errors import ServetuneError
from servetune.schemas.base import document_from_data
from servetune.schemas.fleet import Fleet, Forecast
from servetune.schemas.policy import Policy

runner = CliRunner()

ARCH = {
    "hardware": {"name": "test-gpu", "memory_bytes": 80.0e9, "hbm_bandwidth_Bps": 3.0e12,
                 "peak_flops": 1.0e15},
    "model": {"name": "test-8b", "layers": 32, "hidden": 4096, "intermediate": 14336,
              "heads": 32, "kv_heads": 8, "head_dim": 128, "vocab": 128256,
              "params": 8030261248, "dtype": "bf16"},
}


def test_parse_topologies() -> None:
    assert C.parse_topologies("agg, 1:1,01:2,agg") == ("agg", "1:1", "1:2")
    assert C.parse_topologies(["2:1"]) == ("2:1",)
    for bad in ("1:0", "x", "1-2", "9:1", ",", "1:1:1"):
        with pytest.raises(ServetuneError, match="argument `topologies`"):
            C.parse_topologies(bad)
    units = C.fleet_units(["h200", "l40s"], ("agg", "1:2"))
    assert list(units) == ["h200", "h200@1:2", "l40s", "l40s@1:2"]
    assert units["h200@1:2"].size == 3 and units["h200"].size == 1
    assert units["l40s@1:2"].gpu_type == "l40s" and units["l40s@1:2"].topology == "1:2"


def test_unit_capacity_cache_key_holds_the_topology(tmp_path: Path, monkeypatch) -> None:
    profile, slo, slices = _tiny_replica_inputs()
    b = slices.names[0]
    calls: list[int] = []

    class Verdict:
        def __init__(self, ok: bool) -> None:
            self.ok = ok

        def meets_slo(self, _slo) -> bool:
            return self.ok

    def fake_cluster(trace, specs, *, router, link, rate_scale):
        # a unit of k replicas "meets the SLOs" up to 2k req/s
        calls.append(len(specs))
        return Verdict(rate_scale * C.base_rate_per_s(trace) <= 2.0 * len(specs)), None

    monkeypatch.setattr(C, "simulate_cluster", fake_cluster)
    agg = C.ReplicaCapacity(1.5, Policy(), "candidates", 1)
    kw = dict(cache_dir=tmp_path, n_requests=100, min_window_s=10.0)
    one = C.unit_capacity(C.Unit("t", 1, 1), profile, slices, b, slo, agg, **kw)
    two = C.unit_capacity(C.Unit("t", 1, 2), profile, slices, b, slo, agg, **kw)
    assert not one.cached and not two.cached
    assert one.rate_per_s == pytest.approx(4.0, rel=0.04)
    assert two.rate_per_s == pytest.approx(6.0, rel=0.04)
    assert set(calls) == {2, 3}
    assert len(list(tmp_path.glob("*.json"))) == 2  # one entry per topology
    n_calls = len(calls)
    again = C.unit_capacity(C.Unit("t", 1, 2), profile, slices, b, slo, agg, **kw)
    assert again.cached and again.rate_per_s == two.rate_per_s and len(calls) == n_calls
    # the router is part of the key too
    other = C.unit_capacity(C.Unit("t", 1, 2), profile, slices, b, slo, agg,
                            router="round_robin", **kw)
    assert not other.cached and len(list(tmp_path.glob("*.json"))) == 3
    # an aggregated unit is the replica's own capacity; a bucket it cannot serve is 0
    assert C.unit_capacity(C.Unit("t"), profile, slices, b, slo, agg, **kw) is agg
    zero = C.ReplicaCapacity(0.0, Policy(), "candidates", 1)
    assert C.unit_capacity(C.Unit("t", 2, 1), profile, slices, b, slo, zero, **kw
                           ).rate_per_s == 0.0


def _slices() -> C.WorkloadSlices:
    short, long = C.Bucket("short", 0, 1000, 0, None), C.Bucket("long", 1000, None, 0, None)
    one = np.ones(4, dtype=np.int64)
    return C.WorkloadSlices(
        buckets=[short, long], class_names=("default",),
        prompt={"short": one * 100, "long": one * 3000}, output={"short": one, "long": one},
        class_id={"short": one * 0, "long": one * 0},
        class_share={"default": {"short": 8 / 14, "long": 6 / 14}},
        share={"short": 8 / 14, "long": 6 / 14}, class_weight={"default": 1.0})


def test_plan_document_of_a_unit_plan() -> None:
    # the hand-worked instance of test_capacity_milp.py, through plan_capacity: short on
    # aggregated g, long on a 1:1 unit of g
    fleet = document_from_data({
        "apiVersion": "servetune/v1", "kind": "Fleet", "utilization_headroom": 1.0,
        "gpu_types": [{"name": "g", "profile": "g.yaml", "price_per_gpu_hour": 1.0}],
    }, Fleet, "fleet.yaml")
    forecast = document_from_data({
        "apiVersion": "servetune/v1", "kind": "Forecast",
        "classes": {"default": {"peak_rate_per_s": 14.0}},
    }, Forecast, "f.yaml")
    units = C.fleet_units(["g"], ("agg", "1:1"))
    mu = {("g", "short"): 4.0, ("g", "long"): 1.0, ("g@1:1", "short"): 6.0,
          ("g@1:1", "long"): 6.0}
    capacity = {k: C.ReplicaCapacity(v, Policy(), "candidates", 0) for k, v in mu.items()}
    res = C.plan_capacity(fleet, forecast, None, _slices(), {}, capacity, units=units,
                          validate=False)
    assert res.solution.replicas == {("g", 0): 2, ("g@1:1", 0): 1}
    topo = C.topology_section(res, fleet, {}, topologies=("agg", "1:1"), router="least_kv",
                              link="infiniband")
    assert topo["per_type"] == {"g": "agg+1:1"}
    assert topo["units"]["g@1:1"]["units"] == [1]
    assert topo["units"]["g@1:1"]["routing"] == {"long": [1.0]}
    assert topo["comparison"]["mixed"]["daily_usd"] == pytest.approx(4.0 * 24)
    plan = C.plan_document(res, fleet, _slices(), {}, profile_paths={"g": "g.yaml"},
                           inputs={}, growth=1.0, engine="vllm", sample={}, topology=topo)
    # per GPU type: 2 aggregated replicas + one unit of 2 = 4; routing summed over units
    assert plan.replicas == {"g": [4]} and plan.gpus == {"g": [4]}
    assert plan.routing == {"short": {"g": [1.0]}, "long": {"g": [1.0]}}
    assert plan.cost["by_type_usd"] == {"g": 4.0}
    assert plan.gpu_types[0].capacity_rate_per_s == {"short": 4.0, "long": 1.0}


def _with_arch(inp: dict[str, Path]) -> None:
    for name in ("big", "small"):
        data = yaml.safe_load(inp[name].read_text())
        inp[name].write_text(yaml.safe_dump({**data, **ARCH}, sort_keys=False))


def test_cli_compares_topologies_and_names_each_types(inputs, tmp_path: Path  # noqa: F811
                                                      ) -> None:
    _with_arch(inputs)
    out = tmp_path / "plan.yaml"
    rep = tmp_path / "rep"
    r = runner.invoke(app, _plan_args(inputs, out, "--topologies", "agg,1:1", "--report",
                                      str(rep)))
    assert r.exit_code == 0, r.output
    plan = yaml.safe_load(out.read_text())
    topo = plan["topology"]
    assert topo["options"] == ["agg", "1:1"] and topo["router"] == "least_kv"
    assert set(topo["per_type"]) == {"big", "small"}
    assert all(v in ("agg", "1:1", "agg+1:1", "none") for v in topo["per_type"].values())
    assert set(topo["units"]) == {"big", "big@1:1", "small", "small@1:1"}
    comp = topo["comparison"]
    assert set(comp) == {"aggregated", "disaggregated", "mixed", "cheapest"}
    assert comp["mixed"]["daily_usd"] == plan["cost"]["daily_usd"]
    # the plan written is never dearer than either single-topology plan that validated
    for kind in ("aggregated", "disaggregated"):
        if comp[kind]["feasible"] and comp[kind]["validated"]:
            assert comp["mixed"]["daily_usd"] <= comp[kind]["daily_usd"] + 1e-9
    assert comp["cheapest"] in ("aggregated", "disaggregated", "mixed")
    assert plan["validation"]["validated"] is True
    # replicas per GPU type add up the units' replicas
    for t in ("big", "small"):
        units = [u for u in topo["units"].values() if u["gpu_type"] == t]
        assert plan["replicas"][t] == [sum(u["units"][0] * u["replicas_per_unit"]
                                           for u in units)]
    assert "topologies: aggregated $" in r.output and "topology per GPU type: big" in r.output
    assert (rep / "cost_by_type.png").stat().st_size > 1000
    assert yaml.safe_load((rep / "plan.json").read_text())["topology"] == topo
    # a warm cache gives the same bytes
    out2 = tmp_path / "plan2.yaml"
    assert runner.invoke(app, _plan_args(inputs, out2, "--topologies", "agg,1:1")
                         ).exit_code == 0
    assert out2.read_bytes() == out.read_bytes()


def test_cli_topologies_agg_is_todays_plan(inputs, tmp_path: Path) -> None:  # noqa: F811
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    assert runner.invoke(app, _plan_args(inputs, a)).exit_code == 0
    assert runner.invoke(app, _plan_args(inputs, b, "--topologies", "agg")).exit_code == 0
    assert a.read_bytes() == b.read_bytes()
    assert "topology" not in yaml.safe_load(a.read_text())


def test_cli_topology_errors_exit_2(inputs, tmp_path: Path) -> None:  # noqa: F811
    out = tmp_path / "p.yaml"
    r = runner.invoke(app, _plan_args(inputs, out, "--topologies", "agg,1:0"))
    assert r.exit_code == 2 and "--topologies: '1:0'" in r.output
    # the fixture's profiles have no hardware/model: no KV transfer size for a P:D unit
    r = runner.invoke(app, _plan_args(inputs, out, "--topologies", "agg,1:1"))
    assert r.exit_code == 2 and "big: the profile has no hardware and model" in r.output
    _with_arch(inputs)
    r = runner.invoke(app, _plan_args(inputs, out, "--topologies", "1:1", "--router", "x"))
    assert r.exit_code == 2 and "--router: 'x' is unknown" in r.output
    r = runner.invoke(app, _plan_args(inputs, out, "--topologies", "1:1", "--engine", "sglang"))
    assert r.exit_code == 2 and "--topologies: disaggregated units" in r.output
    assert not out.exists()
