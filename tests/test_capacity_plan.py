"""`servetune plan` / `servetune place` end to end on small synthetic inputs.

Two synthetic GPU types: `big` (2,000 KV blocks, $3/h) and `small` (120 KV blocks =
1,920 tokens, $0.10/h). `small` cannot hold a 2,048-token prompt, so the long-prompt buckets
can only go to `big`: the mixed plan must route short requests to `small` and long ones
to `big`, and `small` alone cannot serve the forecast at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import output_names
from typer.testing import CliRunner

from servetune.apps import plan as C
from servetune.cli import app

runner = CliRunner()


def _profile(name: str, blocks: int) -> dict:
    return {
        "apiVersion": "servetune/v1", "kind": "Profile", "name": name,
        "memory": {"kv_blocks_override": blocks},
        "step_time": {"fixed_s": 0.01, "gemm_pieces": [[0.005, 5.0e-5]],
                      "decode_attn_s_per_context_token": 2.0e-8},
        "calibration": {"kind": "synthetic", "source": "test"},
    }


@pytest.fixture()
def inputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    # one candidate policy keeps the capacity search to a few dozen short simulations
    monkeypatch.setattr(C, "CANDIDATE_BATCHING", ((128, 4096),))
    return write_inputs(tmp_path)


def write_inputs(tmp_path: Path) -> dict[str, Path]:
    """The synthetic fleet's files under ``tmp_path / "in"`` (module docstring)."""
    d = tmp_path / "in"
    d.mkdir()
    files = {
        "big.yaml": _profile("big", 2000),
        # 139 usable blocks of 16: 2,224 tokens hold any request of the short bucket
        # (prompt <= 2048, output <= 128) and few of the long one
        "small.yaml": _profile("small", 140),
        "workload.yaml": {
            "apiVersion": "servetune/v1", "kind": "Workload", "name": "synthetic",
            "classes": {"default": {
                "arrival": {"rate_per_s": 1.0},
                "prompt_tokens": {"quantiles": [0, 0.5, 0.85, 1],
                                  "values": [20, 300, 1500, 4000]},
                "output_tokens": {"quantiles": [0, 0.5, 0.9, 1], "values": [2, 40, 150, 300]},
            }},
        },
        "slo.yaml": {
            "apiVersion": "servetune/v1", "kind": "SLOSet", "name": "test",
            "classes": {"default": {"ttft_s": 3.0, "tpot_s": 0.2, "percentile": 90}},
        },
        "forecast.yaml": {
            "apiVersion": "servetune/v1", "kind": "Forecast", "name": "peak",
            "classes": {"default": {"peak_rate_per_s": 30.0}},
        },
        "day.yaml": {
            "apiVersion": "servetune/v1", "kind": "Forecast", "name": "day",
            "classes": {"default": {"rate_per_s": [8.0] * 6 + [30.0] * 18}},
        },
        "fleet.yaml": {
            "apiVersion": "servetune/v1", "kind": "Fleet", "name": "test",
            "utilization_headroom": 0.8,
            "gpu_types": [
                {"name": "big", "profile": "big.yaml", "price_per_gpu_hour": 3.0},
                {"name": "small", "profile": "small.yaml", "price_per_gpu_hour": 0.1},
            ],
        },
        "jobs.yaml": {
            "apiVersion": "servetune/v1", "kind": "Jobs", "name": "night",
            "jobs": [
                {"id": "eval", "requests": 3000, "prompt_tokens": {"mean": 300, "max": 1000},
                 "output_tokens": {"mean": 60, "max": 200}, "release_s": 0,
                 "deadline_s": 21600, "value": 5},
                {"id": "huge", "tokens": 1.0e12, "prompt_tokens": {"mean": 300},
                 "output_tokens": {"mean": 60}, "release_s": 0, "deadline_s": 7200,
                 "value": 1},
            ],
        },
    }
    out = {}
    for name, data in files.items():
        (d / name).write_text(yaml.safe_dump(data, sort_keys=False))
        out[name.split(".")[0]] = d / name
    out["cache"] = tmp_path / "cache"
    out["dir"] = d
    return out


def _plan_args(inp: dict[str, Path], out: Path, *extra: str, forecast: str = "forecast"):
    return [
        "plan", "--workload", str(inp["workload"]), "--forecast", str(inp[forecast]),
        "--fleet", str(inp["fleet"]), "--slo", str(inp["slo"]), "-o", str(out),
        "--cache-dir", str(inp["cache"]), "--capacity-method", "candidates",
        "--prompt-edges", "2048", "--output-edges", "128", "-q", *extra,
    ]


def test_plan_mixed_fleet_validated_and_deterministic(inputs, tmp_path: Path) -> None:
    out1 = tmp_path / "plan1.yaml"
    r = runner.invoke(app, _plan_args(inputs, out1))
    assert r.exit_code == 0, r.output
    plan = yaml.safe_load(out1.read_text())
    assert plan["kind"] == "CapacityPlan"
    # long prompts only fit on `big`; short ones go to the cheaper `small`
    for b, row in plan["routing"].items():
        if b.startswith("p2048-"):
            assert set(row) == {"big"}
    assert plan["gpu_types"][1]["capacity_rate_per_s"]["p2048-inf/o0-128"] == pytest.approx(
        0, abs=1e-9)
    assert plan["replicas"]["small"][0] >= 1 and plan["replicas"]["big"][0] >= 1
    single = plan["single_type"]
    assert single["small"]["feasible"] is False
    assert "no GPU type can serve bucket" in single["small"]["reason"]
    assert single["best"] == "big"
    assert plan["cost"]["daily_usd"] <= single["big"]["daily_usd"] + 1e-9
    assert single["saving_pct"] >= 0
    # every planned type meets the SLOs in simulation at its busiest slot
    assert plan["validation"]["validated"] is True
    assert all(v["meets_slo"] for v in plan["validation"]["per_type"].values())
    # same inputs, warm cache -> the same bytes; and a cold cache gives them too
    out2 = tmp_path / "plan2.yaml"
    assert runner.invoke(app, _plan_args(inputs, out2)).exit_code == 0
    assert out1.read_bytes() == out2.read_bytes()
    cold = dict(inputs, cache=tmp_path / "cache2")
    out3 = tmp_path / "plan3.yaml"
    assert runner.invoke(app, _plan_args(cold, out3)).exit_code == 0
    assert out3.read_bytes() == out1.read_bytes()
    assert any((tmp_path / "cache2").glob("*.json"))


def test_plan_json_report_and_growth(inputs, tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    r = runner.invoke(app, _plan_args(inputs, out, "--growth", "1,2", "--report",
                                      str(tmp_path / "rep")))
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("growth x")]
    assert len(lines) == 2
    plan = yaml.safe_load(out.read_text())
    sweep = plan["growth_sweep"]
    assert [s["growth"] for s in sweep] == [1.0, 2.0]
    assert sweep[1]["daily_usd"] >= sweep[0]["daily_usd"]
    assert sweep[0]["daily_usd"] == plan["cost"]["daily_usd"]  # x1 is the plan itself
    for png in ("cost_by_type.png", "replicas_over_day.png", "cost_vs_growth.png"):
        assert (tmp_path / "rep" / png).stat().st_size > 1000
    r = runner.invoke(app, _plan_args(inputs, tmp_path / "p.yaml", "--json"))
    assert r.exit_code == 0
    assert json.loads(r.stdout)["kind"] == "CapacityPlan"


def test_count_limit_too_low_exits_3(inputs, tmp_path: Path) -> None:
    fleet = yaml.safe_load(inputs["fleet"].read_text())
    fleet["gpu_types"][0]["max_gpus"] = 1  # `big` must carry the long buckets alone
    inputs["fleet"].write_text(yaml.safe_dump(fleet))
    forecast = yaml.safe_load(inputs["forecast"].read_text())
    forecast["classes"]["default"]["peak_rate_per_s"] = 400.0
    inputs["forecast"].write_text(yaml.safe_dump(forecast))
    out = tmp_path / "plan.yaml"
    r = runner.invoke(app, _plan_args(inputs, out))
    assert r.exit_code == 3, r.output
    assert "count limit too low" in r.output and "big: max 1 replicas" in r.output
    assert not out.exists()


def test_bad_inputs_exit_2_naming_the_field(inputs, tmp_path: Path) -> None:
    fleet = yaml.safe_load(inputs["fleet"].read_text())
    fleet["gpu_types"][1]["price_per_gpu_hour"] = "cheap"
    inputs["fleet"].write_text(yaml.safe_dump(fleet))
    r = runner.invoke(app, _plan_args(inputs, tmp_path / "p.yaml"))
    assert r.exit_code == 2 and "gpu_types.1.price_per_gpu_hour" in r.output
    fleet["gpu_types"][1]["price_per_gpu_hour"] = 1.0
    fleet["gpu_types"][1]["profile"] = "missing.yaml"
    inputs["fleet"].write_text(yaml.safe_dump(fleet))
    r = runner.invoke(app, _plan_args(inputs, tmp_path / "p.yaml"))
    assert r.exit_code == 2 and "gpu_types.1 (small): profile" in r.output
    fleet["gpu_types"][1]["profile"] = "small.yaml"
    fleet["gpu_types"][1]["gpus_per_replica"] = 2
    inputs["fleet"].write_text(yaml.safe_dump(fleet))
    r = runner.invoke(app, _plan_args(inputs, tmp_path / "p.yaml"))
    assert r.exit_code == 2 and "gpus_per_replica is 2" in r.output
    r = runner.invoke(app, _plan_args(inputs, tmp_path / "p.yaml", "--growth", "1,x"))
    assert r.exit_code == 2 and "--growth" in r.output
    for flag, value in (("--growth", "1,,2"), ("--prompt-edges", "1024,"),
                        ("--output-edges", ",256")):  # empty items were skipped silently
        r = runner.invoke(app, _plan_args(inputs, tmp_path / "p.yaml", flag, value))
        assert r.exit_code == 2 and f"{flag}: an item of {value!r} is empty" in r.output
    del fleet["gpu_types"][1]["gpus_per_replica"]
    inputs["fleet"].write_text(yaml.safe_dump(fleet))
    forecast = {"apiVersion": "servetune/v1", "kind": "Forecast",
                "classes": {"chat": {"peak_rate_per_s": 1.0}}}
    inputs["forecast"].write_text(yaml.safe_dump(forecast))
    r = runner.invoke(app, _plan_args(inputs, tmp_path / "p.yaml"))
    assert r.exit_code == 2 and "forecast.yaml: classes.chat: the workload has no" in r.output
    assert not (tmp_path / "p.yaml").exists()


def test_place_on_a_static_plan(inputs, tmp_path: Path) -> None:
    fleet = yaml.safe_load(inputs["fleet"].read_text())
    fleet["scaling"] = "static"
    inputs["fleet"].write_text(yaml.safe_dump(fleet))
    plan = tmp_path / "plan.yaml"
    r = runner.invoke(app, _plan_args(inputs, plan, forecast="day"))
    assert r.exit_code == 0, r.output
    p = yaml.safe_load(plan.read_text())
    assert len(set(p["replicas"]["big"])) == 1  # static: the same all day
    sched = tmp_path / "sched.yaml"
    args = ["place", "--jobs", str(inputs["jobs"]), "--plan", str(plan), "--forecast",
            str(inputs["day"]), "-o", str(sched), "--cache-dir", str(inputs["cache"]),
            "--levels", "3", "-q", "--report", str(tmp_path / "rep")]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    s = yaml.safe_load(sched.read_text())
    jobs = {j["id"]: j for j in s["jobs"]}
    assert jobs["eval"]["scheduled"] is True
    assert jobs["eval"]["finish_s"] <= 21600
    assert sum(a["tokens"] for a in jobs["eval"]["allocation"]) >= 3000 * 360
    assert jobs["huge"]["scheduled"] is False
    assert "spare in its window" in jobs["huge"]["reason"]
    # the night (slots 0-5, 8 req/s) leaves more room than the day (30 req/s)
    spare = s["spare_tok_s"]
    assert all(spare[t][0] >= spare[t][12] for t in spare)
    assert s["validation"]["validated"] is True
    assert all(v["meets_slo"] for v in s["validation"]["per_type"].values())
    assert (tmp_path / "rep" / "spare_and_work.png").exists()
    # the same inputs give the same schedule bytes
    r = runner.invoke(app, args[:-2] + ["-o", str(tmp_path / "sched2.yaml")])
    assert r.exit_code == 0
    assert (tmp_path / "sched2.yaml").read_bytes() == sched.read_bytes()


def test_place_deadline_before_release_exits_3(inputs, tmp_path: Path) -> None:
    plan = tmp_path / "plan.yaml"
    assert runner.invoke(app, _plan_args(inputs, plan)).exit_code == 0
    jobs = yaml.safe_load(inputs["jobs"].read_text())
    jobs["jobs"][0]["release_s"] = 30000
    inputs["jobs"].write_text(yaml.safe_dump(jobs))
    r = runner.invoke(app, ["place", "--jobs", str(inputs["jobs"]), "--plan", str(plan),
                            "--forecast", str(inputs["forecast"]), "-o",
                            str(tmp_path / "s.yaml"), "--cache-dir", str(inputs["cache"])])
    assert r.exit_code == 3, r.output
    assert "jobs.0 (eval): deadline_s 21600 is not after release_s 30000" in r.output
    assert not (tmp_path / "s.yaml").exists()


def test_budget_mode_serves_what_it_can(inputs, tmp_path: Path) -> None:
    out = tmp_path / "plan.yaml"
    r = runner.invoke(app, _plan_args(inputs, out, "--budget", "3.5", "--growth", "1"))
    assert r.exit_code == 0, r.output
    plan = yaml.safe_load(out.read_text())
    assert plan["cost"]["total_usd"] <= 3.5 + 1e-9
    assert 0 < plan["solver"]["served_share"] < 1
    assert "budget $3.50: serves" in r.output
    # the sweep plans full service, dearer than the budget: the output says so
    assert plan["growth_sweep"][0]["daily_usd"] > plan["cost"]["daily_usd"]
    assert "the budget does not apply" in r.output


def test_growth_beyond_the_limits_is_reported_not_fatal(inputs, tmp_path: Path) -> None:
    fleet = yaml.safe_load(inputs["fleet"].read_text())
    fleet["gpu_types"][0]["max_gpus"] = 4
    inputs["fleet"].write_text(yaml.safe_dump(fleet))
    out = tmp_path / "plan.yaml"
    r = runner.invoke(app, _plan_args(inputs, out, "--growth", "1,50"))
    assert r.exit_code == 0, r.output
    sweep = yaml.safe_load(out.read_text())["growth_sweep"]
    assert sweep[0]["feasible"] is True
    assert sweep[1]["feasible"] is False and "count limit too low" in sweep[1]["reason"]
    assert "growth x50: infeasible: capacity plan: count limit too low" in r.output


def test_unusable_output_paths_exit_2_before_any_work(inputs, tmp_path: Path) -> None:
    """--report or -o where a file or folder is in the way: one line naming the option,
    exit 2, and no plan or schedule half written (this used to raise FileExistsError
    after the plan had already been written)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = tmp_path / "plan.yaml"
    r = runner.invoke(app, _plan_args(inputs, out, "--report", str(afile)))
    assert r.exit_code == 2, r.output
    assert "--report" in r.output and "not a folder" in r.output
    assert not out.exists() and not inputs["cache"].exists()  # nothing measured either
    r = runner.invoke(app, _plan_args(inputs, afile / "plan.yaml"))
    assert r.exit_code == 2 and f"{afile} is a file" in r.output
    r = runner.invoke(app, _plan_args(inputs, tmp_path))
    assert r.exit_code == 2 and "is a folder" in r.output
    sched = tmp_path / "s.yaml"
    r = runner.invoke(app, ["place", "--jobs", str(inputs["jobs"]), "--plan", str(afile),
                            "--forecast", str(inputs["forecast"]), "-o", str(sched),
                            "--report", str(afile / "rep")])
    assert r.exit_code == 2 and "--report" in r.output and not sched.exists()
    # a file as the cache folder is refused before the work, not after (issue 33)
    args = _plan_args(inputs, out)
    args[args.index("--cache-dir") + 1] = str(afile)
    r = runner.invoke(app, args)
    assert r.exit_code == 2 and "--cache-dir" in r.output and "not a folder" in r.output
    assert not out.exists()
    r = runner.invoke(app, ["place", "--jobs", str(inputs["jobs"]), "--plan", str(afile),
                            "--forecast", str(inputs["forecast"]), "-o", str(sched),
                            "--cache-dir", str(afile)])
    assert r.exit_code == 2 and "--cache-dir" in r.output and not sched.exists()


def test_plan_report_bytes_are_deterministic(inputs, tmp_path: Path) -> None:
    for name in ("a", "b"):
        r = runner.invoke(app, _plan_args(inputs, tmp_path / f"{name}.yaml", "--report",
                                          str(tmp_path / name)))
        assert r.exit_code == 0, r.output
    files = output_names(tmp_path / "a")
    assert files == ["cost_by_type.png", "plan.json", "replicas_over_day.png"]
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert not list((tmp_path / "a").glob(".*.tmp"))  # no temporary file left behind


def test_gpu_type_without_the_models_profile_is_named_not_dropped_silently(
    inputs, tmp_path: Path
) -> None:
    fleet = yaml.safe_load(inputs["fleet"].read_text())
    fleet["model"] = "m"
    for g in fleet["gpu_types"]:
        g["profiles"] = {"m": g.pop("profile")}
    fleet["gpu_types"].append({"name": "other", "profiles": {"x": "big.yaml"},
                               "price_per_gpu_hour": 0.01})
    inputs["fleet"].write_text(yaml.safe_dump(fleet))
    out = tmp_path / "plan.yaml"
    r = runner.invoke(app, _plan_args(inputs, out))
    assert r.exit_code == 0, r.output
    assert "not in this plan: other (no profile for model m)" in r.output
    plan = yaml.safe_load(out.read_text())
    assert plan["excluded_gpu_types"] == {"other": "no profile for model m"}
    assert "other" not in plan["gpus"]
