"""Fleet, Forecast and Jobs documents: shipped examples load; bad files name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from servetune.errors import ServetuneError
from servetune.schemas.base import (
    document_data,
    document_from_data,
    load_document,
    save_document,
)
from servetune.schemas.fleet import CapacityPlan, Fleet, Forecast, Jobs

REPO = Path(__file__).resolve().parents[1]


def _fleet() -> dict:
    return {
        "apiVersion": "servetune/v1",
        "kind": "Fleet",
        "gpu_types": [
            {"name": "h100", "profile": "gpu_profiles/h100-llama-3.1-8b.yaml",
             "price_per_gpu_hour": 3.0, "max_gpus": 8},
            {"name": "l40s", "profiles": {"llama-3.1-8b": "x.yaml"}, "price_per_gpu_hour": 1.0},
        ],
    }


def _forecast() -> dict:
    return {
        "apiVersion": "servetune/v1",
        "kind": "Forecast",
        "classes": {"default": {"rate_per_s": [1.0] * 24}},
    }


def _jobs() -> dict:
    return {
        "apiVersion": "servetune/v1",
        "kind": "Jobs",
        "jobs": [
            {"id": "eval", "requests": 1000, "prompt_tokens": {"mean": 500},
             "output_tokens": {"mean": 100}, "release_s": 0, "deadline_s": 21600},
        ],
    }


@pytest.mark.parametrize("folder,cls", [
    ("configs/fleets", Fleet), ("configs/forecasts", Forecast), ("configs/batch_jobs", Jobs),
])
def test_shipped_examples_load_and_round_trip(folder: str, cls, tmp_path: Path) -> None:
    files = sorted((REPO / folder).glob("*.yaml"))
    assert files, f"no examples in {folder}"
    for f in files:
        doc = load_document(f, cls)
        save_document(doc, tmp_path / f.name)
        assert load_document(tmp_path / f.name, cls) == doc


def test_good_documents() -> None:
    fleet = document_from_data(_fleet(), Fleet, "f.yaml")
    assert fleet.gpu_types[0].max_replicas() == 8
    assert fleet.gpu_types[1].profile_path(None).name == "x.yaml"
    fc = document_from_data(_forecast(), Forecast, "fc.yaml")
    assert fc.n_slots == 24 and fc.class_rates(2.0)["default"][0] == 2.0
    jobs = document_from_data(_jobs(), Jobs, "j.yaml")
    assert jobs.jobs[0].total_tokens() == 600_000


def _expect(data: dict, cls, *needles: str) -> None:
    with pytest.raises(ServetuneError) as err:
        document_from_data(data, cls, "in.yaml")
    msg = err.value.message
    assert err.value.exit_code == 2 and "\n" not in msg
    assert msg.startswith("in.yaml")
    for n in needles:
        assert n in msg, msg


def test_bad_fleet_names_the_field() -> None:
    d = _fleet()
    d["gpu_types"][0]["price_per_gpu_hour"] = -1
    _expect(d, Fleet, "gpu_types.0.price_per_gpu_hour")
    d = _fleet()
    del d["gpu_types"][0]["profile"]
    _expect(d, Fleet, "gpu_types.0", "exactly one of profile")
    d = _fleet()
    d["gpu_types"][1]["name"] = "h100"
    _expect(d, Fleet, "duplicate GPU type name")
    d = _fleet()
    d["gpu_types"][0]["min_gpus"] = 9
    _expect(d, Fleet, "min_gpus (9) must be <= max_gpus (8)")
    d = _fleet()
    d["gpu_types"][0]["tp"] = 2
    _expect(d, Fleet, "gpu_types.0.tp", "unknown key")
    d = _fleet()
    d["utilization_headroom"] = 1.5
    _expect(d, Fleet, "utilization_headroom")


def test_bad_forecast_names_the_field() -> None:
    d = _forecast()
    d["classes"]["default"]["rate_per_s"] = [1.0] * 23
    _expect(d, Forecast, "classes.default.rate_per_s", "24 hourly rates")
    d = _forecast()
    d["classes"]["default"]["rate_per_s"][5] = -2
    _expect(d, Forecast, "slot 5")
    d = _forecast()
    d["classes"]["other"] = {"peak_rate_per_s": 3.0}
    _expect(d, Forecast, "not a mix")
    d = _forecast()
    d["growth"] = [1.0, 0.0]
    _expect(d, Forecast, "growth")
    d = _forecast()
    d["classes"]["default"] = {}
    _expect(d, Forecast, "classes.default", "exactly one of rate_per_s")


def test_bad_jobs_name_the_field() -> None:
    d = _jobs()
    del d["jobs"][0]["deadline_s"]
    _expect(d, Jobs, "jobs.0.deadline_s", "required")
    d = _jobs()
    d["jobs"][0]["tokens"] = 5
    _expect(d, Jobs, "jobs.0", "exactly one of requests or tokens")
    d = _jobs()
    d["jobs"][0]["prompt_tokens"] = {"mean": -3}
    _expect(d, Jobs, "jobs.0.prompt_tokens.mean")
    d = _jobs()
    d["jobs"].append(dict(d["jobs"][0]))
    _expect(d, Jobs, "duplicate job id 'eval'")


def test_missing_file_and_bad_yaml(tmp_path: Path) -> None:
    with pytest.raises(ServetuneError, match="file not found"):
        load_document(tmp_path / "nope.yaml", Fleet)
    p = tmp_path / "bad.yaml"
    p.write_text("kind: Fleet\n  gpu_types: [\n")
    with pytest.raises(ServetuneError, match="invalid YAML"):
        load_document(p, Fleet)


_values = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.floats(allow_nan=True),
    st.text(max_size=5), st.lists(st.integers(), max_size=3),
)


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(
    ["name", "price_per_gpu_hour", "gpus_per_replica", "max_gpus", "min_gpus", "profile"]
), value=_values)
def test_fleet_fuzz_fails_cleanly(field: str, value) -> None:
    d = _fleet()
    d["gpu_types"][0][field] = value
    try:
        document_from_data(yaml.safe_load(yaml.safe_dump(d)), Fleet, "fuzz.yaml")
    except ServetuneError as err:
        assert err.message.startswith("fuzz.yaml") and "\n" not in err.message


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(
    ["requests", "tokens", "release_s", "deadline_s", "value", "preemptible", "priority"]
), value=_values)
def test_jobs_fuzz_fails_cleanly(field: str, value) -> None:
    d = _jobs()
    d["jobs"][0][field] = value
    try:
        document_from_data(d, Jobs, "fuzz.yaml")
    except ServetuneError as err:
        assert err.message.startswith("fuzz.yaml") and "\n" not in err.message


@settings(max_examples=60, deadline=None)
@given(rates=st.lists(st.one_of(st.floats(allow_nan=True), st.integers(-3, 3), st.text(max_size=3)),
                      max_size=26),
       growth=st.lists(st.floats(allow_nan=True), max_size=3))
def test_forecast_fuzz_fails_cleanly(rates, growth) -> None:
    d = _forecast()
    d["classes"]["default"]["rate_per_s"] = rates
    d["growth"] = growth
    try:
        fc = document_from_data(d, Forecast, "fuzz.yaml")
    except ServetuneError as err:
        assert err.message.startswith("fuzz.yaml") and "\n" not in err.message
    else:  # accepted: then it is a usable day of rates
        assert fc.n_slots == 24 and all(r >= 0 for r in fc.class_rates()["default"])
        assert all(g > 0 for g in fc.growth)


def test_whole_document_checks_read_cleanly() -> None:
    """Checks across a document name their own field: no pydantic "Value error," and no
    "(document):" placeholder in front of them."""
    d = _fleet()
    d["gpu_types"][1]["name"] = d["gpu_types"][0]["name"]
    with pytest.raises(ServetuneError) as err:
        document_from_data(d, Fleet, "in.yaml")
    assert err.value.message == (
        f"in.yaml: gpu_types.1.name: duplicate GPU type name {d['gpu_types'][0]['name']!r}"
    )
    d = _forecast()
    d["classes"]["default"]["rate_per_s"] = [1.0] * 23
    with pytest.raises(ServetuneError) as err:
        document_from_data(d, Forecast, "in.yaml")
    assert err.value.message == (
        "in.yaml: classes.default.rate_per_s: give 24 hourly rates (got 23)"
    )


def _plan(**extra) -> CapacityPlan:
    return CapacityPlan(
        name="p", n_slots=1,
        buckets=[{"name": "all", "prompt_tokens": [0, None], "output_tokens": [0, None],
                  "share": 1.0}],
        gpu_types=[{"name": "h100", "profile": "h100.yaml", "price_per_gpu_hour": 3.0,
                    "gpus_per_replica": 1, "capacity_rate_per_s": {"all": 10.0}}],
        replicas={"h100": [2]}, gpus={"h100": [2]}, routing={"all": {"h100": [1.0]}},
        **extra,
    )


def test_plan_file_leaves_out_empty_optional_sections(tmp_path: Path) -> None:
    plain = document_data(_plan())
    assert "excluded_gpu_types" not in plain and "growth_sweep" not in plain
    assert list(plain)[:3] == ["apiVersion", "kind", "name"]
    full = document_data(_plan(excluded_gpu_types={"l40s": "no profile for model x"},
                               growth_sweep=[{"growth": 2.0, "feasible": False}]))
    assert list(full)[-2:] == ["excluded_gpu_types", "growth_sweep"]
    # what `servetune plan` writes, `servetune place` reads back unchanged
    path = tmp_path / "plan.yaml"
    plan = _plan(excluded_gpu_types={"l40s": "no profile for model x"})
    save_document(plan, path)
    assert load_document(path, CapacityPlan) == plan
    assert "growth_sweep" not in path.read_text()
