"""SLO tiers: a class's value served per second (worked by hand), classes by prompt length
bands, whether an SLO set can judge a trace, class columns, and the shipped tiered
examples (generator, trace files, SLO sets, job)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from typer.testing import CliRunner

from servetune.cli import app
from servetune.errors import ServetuneError
from servetune.schemas.base import document_from_data, load_document
from servetune.schemas.job import OptimizeJob
from servetune.schemas.slo import ClassSLO, SLOSet
from servetune.sim import SimResult
from servetune.sim import metrics as M
from servetune.workloads.formats import load_trace
from servetune.workloads.tiers import check_fits, classify, unjudged_classes
from servetune.workloads.trace import from_arrays

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "configs" / "examples"
SCRIPT = EXAMPLES / "make_tiered_trace.py"
MIXED = EXAMPLES / "tiered-mixed.csv"
TWO_CLASS = EXAMPLES / "tiered-2class.csv"
SLOS = REPO / "configs" / "slos"
NAN = float("nan")


def slo_set(classes: dict, bands: list | None = None) -> SLOSet:
    data = {"apiVersion": "servetune/v1", "kind": "SLOSet", "name": "t", "classes": classes}
    if bands is not None:
        data["length_bands"] = bands
    return document_from_data(data, SLOSet, "t.yaml")


TIERS = {
    "chat": {"ttft_s": 0.5, "tpot_s": 0.15, "attainment": 0.9, "value": 1.0},
    "longctx": {"ttft_s": 8.0, "tpot_s": 0.1, "attainment": 0.9, "value": 4.0},
}


# ------------------------------------------------------------------ value served


def four_requests() -> SimResult:
    """r0 chat: TTFT 0.2 s, TPOT (1.2-0.2)/10 = 0.1 s: meets chat. r1 chat: TTFT 1.0 s:
    misses. r2 longctx: TTFT 2 s, TPOT (4-2)/20 = 0.1 s: meets longctx. r3 longctx: shed.
    The run spans 0 s (first arrival) to 6 s (last finish)."""
    trace = from_arrays(
        np.array([0.0, 1.0, 2.0, 3.0]), np.array([100, 200, 20_000, 30_000]),
        np.array([11, 6, 21, 300]),
        class_id=np.array([0, 0, 1, 1], dtype=np.int32), class_names=("chat", "longctx"),
    )
    output = SimpleNamespace(
        admitted_s=np.array([0.0, 1.0, 2.0, NAN]),
        first_token_s=np.array([0.2, 2.0, 4.0, NAN]),
        finish_s=np.array([1.2, 2.5, 6.0, NAN]),
        preemptions=np.zeros(4, dtype=np.int32),
        status=np.array([0, 0, 0, 1], dtype=np.int8),
        reason=np.array([0, 0, 0, 1], dtype=np.int8),
        steps=10, kv_blocks_total=100, kv_util_mean=0.1, kv_util_peak=0.2, sim_end_s=6.0,
        series={}, step_log=None,
    )
    return SimResult(trace=trace, output=output, sim_wall_s=0.0)


def test_value_served_per_second_by_hand():
    r = four_requests()
    s = r.summary(slo_set(TIERS))
    assert r.slo_met(slo_set(TIERS)).tolist() == [True, False, True, False]
    # (1 chat request x value 1 + 1 longctx request x value 4) over the 6 s run
    assert s["overall"]["value_served_per_s"] == pytest.approx(5 / 6)
    assert s["overall"]["attainment"] == pytest.approx(0.5)
    chat, longctx = s["per_class"]["chat"], s["per_class"]["longctx"]
    assert chat["value_served_per_s"] == pytest.approx(1 / 6)
    assert longctx["value_served_per_s"] == pytest.approx(4 / 6)
    # the existing keys stay, value beside attainment
    assert list(s["overall"])[-2:] == ["attainment", "value_served_per_s"]
    for key in ("requests", "completed", "shed", "rejected", "ttft_s", "tpot_s", "e2e_s",
                "throughput_tok_s", "throughput_req_s", "attainment", "preemptions",
                "meets_slo"):
        assert key in chat
    # without an SLO set there is nothing to value
    assert r.summary()["overall"]["value_served_per_s"] is None
    assert r.summary()["per_class"]["chat"]["value_served_per_s"] is None


def test_value_defaults_to_one_per_request():
    assert ClassSLO(ttft_s=1.0, attainment=0.9).value == 1.0
    r = four_requests()
    flat = slo_set({"default": {"ttft_s": 0.5, "tpot_s": 0.15, "attainment": 0.9}})
    m = r.metrics
    met = M.slo_met_mask(m, flat, r.trace.class_names)
    assert met.tolist() == [True, False, False, False]  # r2's TTFT 2 s > 0.5 s
    assert M.group_summary(m, 6.0, None, met)["value_served_per_s"] == pytest.approx(1 / 6)
    values = M.request_values(slo_set(TIERS), r.trace.class_names, m.class_id)
    assert values.tolist() == [1.0, 1.0, 4.0, 4.0]
    assert M.value_served_per_s(met, values, 0.0) is None


@pytest.mark.parametrize("value", [0, -1, float("inf"), True])
def test_value_must_be_a_positive_number(value):
    with pytest.raises(ServetuneError, match=r"classes\.chat\.value"):
        slo_set({"chat": {"ttft_s": 1.0, "attainment": 0.9, "value": value}})


# ------------------------------------------------------------------ length bands

BANDS = [
    {"class": "short", "max_prompt_tokens": 2048},
    {"class": "medium", "max_prompt_tokens": 8192},
    {"class": "long", "max_prompt_tokens": None},
]
BANDED = {name: {"ttft_s": 1.0, "attainment": 0.9} for name in ("long", "medium", "short")}


def test_length_bands_classify_exactly_at_the_edges():
    trace = from_arrays(
        np.arange(7, dtype=np.float64), np.array([100, 2048, 2049, 8192, 8193, 1, 60_000]),
        np.ones(7, dtype=np.int64),
        class_id=np.array([1, 1, 0, 0, 1, 0, 1], dtype=np.int32), class_names=("x", "y"),
        priority=np.arange(7, dtype=np.int32),
    )
    out = classify(trace, slo_set(BANDED, BANDS))
    # the bands' order, not the classes' (long, medium, short) order, names the classes
    assert out.class_names == ("short", "medium", "long")
    assert [out.class_names[i] for i in out.class_ids()] == [
        "short", "short", "medium", "medium", "long", "short", "long"]
    # the rest of the trace is the same
    assert out.arrival_s is trace.arrival_s and out.prompt_tokens is trace.prompt_tokens
    assert out.priority.tolist() == list(range(7))
    # no bands: the trace itself, its labels kept
    assert classify(trace, slo_set({"x": {"ttft_s": 1.0, "attainment": 0.9}})) is trace


def test_a_class_may_take_several_bands():
    bands = [{"class": "a", "max_prompt_tokens": 10}, {"class": "b", "max_prompt_tokens": 20},
             {"class": "a", "max_prompt_tokens": None}]
    s = slo_set({"a": {"ttft_s": 1.0, "attainment": 0.9},
                 "b": {"ttft_s": 1.0, "attainment": 0.9}}, bands)
    trace = from_arrays(np.zeros(3), np.array([5, 15, 25]), np.ones(3, dtype=np.int64))
    out = classify(trace, s)
    assert out.class_names == ("a", "b")
    assert out.class_ids().tolist() == [0, 1, 0]


@pytest.mark.parametrize("bands,message", [
    ([{"class": "short", "max_prompt_tokens": 2048}, {"class": "huge", "max_prompt_tokens": None}],
     r"length_bands: class 'huge' is not in classes \(long, medium, short\)"),
    ([{"class": "short", "max_prompt_tokens": 8192}, {"class": "medium", "max_prompt_tokens": 8192},
      {"class": "long", "max_prompt_tokens": None}],
     r"must increase band by band \(band 2 has 8192 after 8192\)"),
    ([{"class": "short", "max_prompt_tokens": 2048}, {"class": "long", "max_prompt_tokens": 9000}],
     "the last band must be unbounded"),
    ([{"class": "short", "max_prompt_tokens": None}, {"class": "long", "max_prompt_tokens": None}],
     "band 1 of 2 is unbounded"),
    ([{"class": "short", "max_prompt_tokens": 0}, {"class": "long", "max_prompt_tokens": None}],
     r"length_bands\.0\.max_prompt_tokens"),
    ([], "length_bands"),
    ([{"class_name": "short", "max_prompt_tokens": None}], r"length_bands\.0\.class"),
])
def test_bad_length_bands_are_one_clear_error(bands, message):
    with pytest.raises(ServetuneError, match=message) as err:
        slo_set(BANDED, bands)
    assert str(err.value).startswith("t.yaml: ")


# ------------------------------------------------------------------ fit of trace and set


def test_check_fits_names_every_class_the_set_cannot_judge():
    trace = from_arrays(
        np.arange(5, dtype=np.float64), np.full(5, 10), np.ones(5, dtype=np.int64),
        class_id=np.array([0, 1, 2, 2, 1], dtype=np.int32),
        class_names=("chat", "batch", "eval"), source="day.csv",
    )
    s = slo_set({"chat": {"ttft_s": 1.0, "attainment": 0.9},
                 "longctx": {"ttft_s": 8.0, "attainment": 0.9}})
    assert unjudged_classes(trace, s) == {"batch": 2, "eval": 2}
    with pytest.raises(ServetuneError) as err:
        check_fits(trace, s, "slos/two.yaml")
    assert str(err.value) == (
        "day.csv: request classes 'batch' (2 requests), 'eval' (2 requests) not in SLO set "
        "slos/two.yaml ('t'), which has chat, longctx; add them or a 'default' class to the "
        "set, or give the set length_bands")
    # a default judges the rest; a one-class set judges everything; bands relabel
    check_fits(trace, slo_set({"chat": {"ttft_s": 1.0, "attainment": 0.9},
                               "default": {"ttft_s": 9.0, "attainment": 0.5}}))
    check_fits(trace, slo_set({"any": {"ttft_s": 1.0, "attainment": 0.9}}))
    banded = slo_set(BANDED, BANDS)
    with pytest.raises(ServetuneError, match="request classes 'chat'"):
        check_fits(trace, banded)
    check_fits(classify(trace, banded), banded)


def test_simulate_cli_says_which_classes_the_set_lacks(tmp_path):
    res = CliRunner().invoke(app, [
        "simulate", "--trace", str(MIXED), "--profile", "h200-llama-3.1-8b",
        "--policy", str(REPO / "configs/policies/vllm-serve-defaults.yaml"),
        "--slo", str(SLOS / "tiers-chat-longctx.yaml"), "--requests", "50",
    ])
    assert res.exit_code == 2
    assert "request class 'batch' (731 requests)" in res.output and "tiered-mixed.csv" in res.output
    assert "Traceback" not in res.output


# ------------------------------------------------------------------ class columns


def test_tenant_endpoint_and_priority_columns_map_to_the_class(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text("ts,in,out,tenant\n0.5,10,2,acme\n0.0,20,3,globex\n1.0,30,4,acme\n")
    trace = load_trace(csv, columns="arrival=ts,prompt=in,output=out,class=tenant")
    assert [trace.class_names[i] for i in trace.class_ids()] == ["globex", "acme", "acme"]
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text('{"t": 0, "in": 5, "out": 1, "endpoint": "/v1/chat"}\n'
                     '{"t": 1, "in": 6, "out": 1, "endpoint": "/v1/completions"}\n')
    trace = load_trace(jsonl, columns="arrival=t,prompt=in,output=out,class=endpoint")
    assert trace.class_names == ("/v1/chat", "/v1/completions")
    # a text priority column is a class (the priority role wants integers)
    csv.write_text("ts,in,out,priority\n0,10,2,interactive\n1,20,3,batch\n")
    trace = load_trace(csv, columns="arrival=ts,prompt=in,output=out,class=priority")
    assert [trace.class_names[i] for i in trace.class_ids()] == ["interactive", "batch"]
    assert trace.priority is None


def test_azure_csv_with_a_class_column_keeps_it(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,Class\n"
                    "2023-11-16 18:00:01.0000000,10,2,chat\n"
                    "2023-11-16 18:00:00.0000000,9000,3,longctx\n")
    trace = load_trace(path)
    assert trace.arrival_s.tolist() == [0.0, 1.0]
    assert [trace.class_names[i] for i in trace.class_ids()] == ["longctx", "chat"]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:00:01.0000000,10,2\n")
    assert load_trace(path).class_id is None


# ------------------------------------------------------------------ the shipped examples


def load_script():
    spec = importlib.util.spec_from_file_location("make_tiered_trace", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generator_is_deterministic_on_a_short_run(tmp_path):
    mod = load_script()
    mixed, two = mod.tiered_csvs(seed=7, duration_s=130.0)
    assert (mixed, two) == mod.tiered_csvs(seed=7, duration_s=130.0)
    assert mod.tiered_csvs(seed=8, duration_s=130.0)[0] != mixed
    lines = mixed.splitlines()
    assert lines[0] == two.splitlines()[0] == "TIMESTAMP,ContextTokens,GeneratedTokens,class"
    # the two-class file is the mixed one less its batch rows, in the same order
    assert two.splitlines()[1:] == [x for x in lines[1:] if not x.endswith(",batch")]
    path = tmp_path / "m.csv"
    path.write_text(mixed)
    trace = load_trace(path)
    assert set(trace.class_names) == {"chat", "longctx", "batch"}
    cls = np.array(trace.class_names)[trace.class_ids()]
    long_prompts = trace.prompt_tokens[cls == "longctx"]
    assert long_prompts.min() >= 8192 and long_prompts.max() <= 65536
    out = trace.output_tokens[cls == "longctx"]
    assert out.min() >= 200 and out.max() <= 1000
    # batch arrives in bursts: only in the last BURST_S of each PERIOD_S (up to the shift
    # of every time by the first arrival, under a second)
    batch_t = trace.arrival_s[cls == "batch"]
    assert len(batch_t) > 0
    phase = np.mod(batch_t, mod.PERIOD_S)
    assert (phase >= mod.PERIOD_S - mod.BURST_S - 1.0).all()
    # --check against what main() wrote
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    argv = ["-o", str(a), "--output-2class", str(b), "--seed", "7", "--duration", "130"]
    assert mod.main(argv) == 0 and a.read_text() == mixed and b.read_text() == two
    assert mod.main([*argv, "--check"]) == 0
    b.write_text(mixed)
    assert mod.main([*argv, "--check"]) == 1


def test_truncated_distribution_keeps_the_shape_between_bounds():
    from servetune.schemas.workload import LengthDistribution

    mod = load_script()
    d = LengthDistribution(quantiles=[0.0, 0.5, 1.0], values=[0.0 + 1, 101.0, 201.0])
    t = mod.truncated(d, 51.0, 151.0)  # uniform on [1, 201] -> uniform on [51, 151]
    assert t.values[0] == 51.0 and t.values[-1] == 151.0
    assert np.interp(0.5, t.quantiles, t.values) == pytest.approx(101.0, abs=0.01)


def test_shipped_tiered_traces_are_up_to_date():
    mod = load_script()
    mixed, two = mod.tiered_csvs()
    assert MIXED.read_text() == mixed
    assert TWO_CLASS.read_text() == two


def test_shipped_slo_sets_and_traces_fit():
    mixed = load_trace(MIXED)
    two = load_trace(TWO_CLASS)
    assert 5_500 <= len(mixed) <= 6_500 and 1_190 <= mixed.duration_s <= 1_200
    counts = dict(zip(mixed.class_names, np.bincount(mixed.class_ids()).tolist(), strict=True))
    assert counts["chat"] > 0.75 * len(mixed)  # most of the traffic
    two_tier = load_document(SLOS / "tiers-chat-longctx.yaml", SLOSet)
    three_tier = load_document(SLOS / "tiers-chat-longctx-batch.yaml", SLOSet)
    assert set(two.class_names) == set(two_tier.classes) == {"chat", "longctx"}
    assert set(mixed.class_names) == set(three_tier.classes) == {"chat", "longctx", "batch"}
    check_fits(two, two_tier)
    check_fits(mixed, three_tier)
    assert three_tier.classes["batch"].max_rejected_share == 0.05
    assert three_tier.classes["batch"].limits() == {"e2e_s": 600.0}
    assert (two_tier.classes["chat"].value, two_tier.classes["longctx"].value) == (1.0, 4.0)
    by_length = load_document(SLOS / "tiers-by-length.yaml", SLOSet)
    banded = classify(mixed, by_length)
    assert banded.class_names == ("short", "medium", "long")
    check_fits(banded, by_length)
    cls = np.array(banded.class_names)[banded.class_ids()]
    assert (banded.prompt_tokens[cls == "long"] > 8192).all()


def test_shipped_job_names_the_two_class_example():
    job_path = REPO / "configs" / "jobs" / "tiers-2class.yaml"
    job = load_document(job_path, OptimizeJob)
    assert (job_path.parent / job.trace).resolve() == TWO_CLASS
    assert (job_path.parent / job.slo).resolve() == SLOS / "tiers-chat-longctx.yaml"
