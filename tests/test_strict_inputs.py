"""Strict inputs: no boolean is read as a number, no YAML key counts twice, a --columns
role or column is given once, --requests 0 is refused, --records names its format."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from servetune.cli import app
from servetune.errors import ServetuneError
from servetune.schemas.base import document_from_data, load_yaml, parse_yaml_text
from servetune.schemas.policy import Policy
from servetune.schemas.slo import SLOSet
from servetune.workloads.formats import parse_columns

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _policy(batching: dict) -> dict:
    return {"apiVersion": "servetune/v1", "kind": "Policy", "name": "p", "batching": batching}


@pytest.mark.parametrize("value", [True, False])
@pytest.mark.parametrize("field", ["max_num_seqs", "max_num_batched_tokens"])
def test_a_boolean_is_not_an_integer(field, value):
    with pytest.raises(ServetuneError, match=rf"batching\.{field}: a boolean"):
        document_from_data(_policy({field: value}), Policy, "p.yaml")
    document_from_data(_policy({field: 8192}), Policy, "p.yaml")  # a number still is


def test_a_boolean_is_not_a_float():
    data = {"apiVersion": "servetune/v1", "kind": "SLOSet", "name": "s",
            "classes": {"default": {"ttft_s": True, "tpot_s": 0.05, "attainment": 0.9}}}
    with pytest.raises(ServetuneError, match="ttft_s: a boolean"):
        document_from_data(data, SLOSet, "s.yaml")


def test_boolean_fields_still_take_booleans():
    """Every shipped config still loads: fields typed bool keep their booleans."""
    from servetune.schemas.base import load_document

    for path in sorted((REPO / "configs" / "policies").glob("*.yaml")):
        load_document(path, Policy)


keys = st.text(string.ascii_lowercase, min_size=1, max_size=8).map(lambda k: "k" + k)


@given(st.lists(keys, min_size=1, max_size=6, unique=True), st.data())
def test_a_duplicate_yaml_key_is_an_error_naming_key_and_lines(names, data):
    dup = data.draw(st.sampled_from(names))
    lines = [f"{k}: {i}" for i, k in enumerate(names)]
    at = data.draw(st.integers(0, len(lines)))
    lines.insert(at, f"{dup}: 99")
    text = "\n".join(lines) + "\n"
    with pytest.raises(ServetuneError) as err:
        parse_yaml_text(text, "x.yaml")
    msg = err.value.message
    assert msg.startswith("x.yaml: line ") and f"duplicate key {dup!r}" in msg
    first = min(i for i, ln in enumerate(lines) if ln.startswith(f"{dup}:")) + 1
    second = max(i for i, ln in enumerate(lines) if ln.startswith(f"{dup}:")) + 1
    assert f"line {second}," in msg and f"first given on line {first}" in msg


def test_nested_duplicates_and_merge_keys():
    with pytest.raises(ServetuneError, match="line 4.*duplicate key 'a'"):
        parse_yaml_text("top:\n  a: 1\n  b: 2\n  a: 3\n", "n.yaml")
    # a merged key may be overridden, as YAML intends
    assert load_yaml("base: &b {a: 1, b: 2}\nx:\n  <<: *b\n  a: 5\n")["x"] == {"a": 5, "b": 2}
    # keys YAML reads as the same value are named as written
    with pytest.raises(ServetuneError, match="duplicate key 'on'"):
        parse_yaml_text("yes: 1\non: 2\n", "b.yaml")


def test_duplicate_yaml_key_in_a_file_through_the_cli(tmp_path):
    pol = tmp_path / "p.yaml"
    pol.write_text("apiVersion: servetune/v1\nkind: Policy\nname: p\nname: q\n")
    res = runner.invoke(app, ["export", "--policy", str(pol), "--engine", "vllm"])
    assert res.exit_code == 2
    assert res.output.strip() == (f"servetune: error: {pol}: line 4, column 1: invalid YAML: "
                                  "duplicate key 'name' (first given on line 3); give each "
                                  "key once")


def test_duplicate_columns_are_errors():
    with pytest.raises(ServetuneError, match="role 'prompt' is given twice"):
        parse_columns("arrival=t,prompt=a,output=b,prompt=c")
    with pytest.raises(ServetuneError, match="column 'a' is mapped to both 'prompt' and"):
        parse_columns("arrival=t,prompt=a,output=a")
    assert parse_columns("arrival=t,prompt=a,output=b") == {
        "arrival": "t", "prompt": "a", "output": "b"}


def test_base_60_numbers_are_text_not_counts():
    """YAML 1.1 read 50:00 as 3000 and 1:30.5 as 90.5; other numbers read as before."""
    data = load_yaml("a: 50:00\nb: 1:30.5\nc: 12\nd: -1.5\ne: .inf\nf: 0x1f\ng: 1_000\n"
                     "h: 2.5e-3\n")
    assert data == {"a": "50:00", "b": "1:30.5", "c": 12, "d": -1.5, "e": float("inf"),
                    "f": 31, "g": 1000, "h": 0.0025}
    # YAML 1.2's numbers: an exponent without a point is a number too
    assert load_yaml("a: 1e5\nb: -2.5E-3\nc: .5\n") == {"a": 1e5, "b": -0.0025, "c": 0.5}
    with pytest.raises(ServetuneError, match=r"job.yaml: requests: text where a number "
                       r"belongs \(quoted, or not a number\)"):
        from servetune.schemas.job import OptimizeJob

        document_from_data(load_yaml("apiVersion: servetune/v1\nkind: OptimizeJob\n"
                                     "workload: w.yaml\nprofile: p\nslo: s.yaml\n"
                                     'requests: "3000"\n'), OptimizeJob, "job.yaml")
    with pytest.raises(ServetuneError, match=r"job.yaml: requests"):
        from servetune.schemas.job import OptimizeJob

        document_from_data(load_yaml("apiVersion: servetune/v1\nkind: OptimizeJob\n"
                                     "workload: w.yaml\nprofile: p\nslo: s.yaml\n"
                                     "requests: 50:00\n"), OptimizeJob, "job.yaml")


def test_optimize_requests_zero_is_refused(tmp_path):
    res = runner.invoke(app, [
        "optimize", "--workload", str(REPO / "configs/workloads/azure-conv-2023.yaml"),
        "--profile", "h200-llama-3.1-8b", "--slo",
        str(REPO / "configs/slos/mlperf-llama-3.1-8b-server.yaml"), "--requests", "0",
        "-o", str(tmp_path / "p.yaml")])
    assert res.exit_code == 2
    assert res.output.strip() == "servetune: error: --requests must be >= 50 (got 0)"


@pytest.mark.parametrize("name", ["out.xlsx", "out", "out.json"])
def test_records_extension_must_name_the_format(tmp_path, name):
    res = runner.invoke(app, [
        "simulate", "--trace", str(REPO / "configs/examples/azure-conv-synthetic.csv"),
        "--profile", "h200-llama-3.1-8b",
        "--policy", str(REPO / "configs/policies/vllm-serve-defaults.yaml"),
        "--records", str(tmp_path / name)])
    assert res.exit_code == 2
    assert "give a .csv or .parquet path" in res.output
    assert len(res.output.strip().splitlines()) == 1
