"""Workload YAML: round trips, the shipped files, and rejections that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import workload_from_yaml_text

from servetune.errors import ServetuneError
from servetune.schemas.workload import Workload
from servetune.workloads.fitting import (
    class_stats,
    load_workload,
    save_workload,
    workload_to_yaml,
)

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "configs" / "workloads").glob("*.yaml"))

SMALL = {
    "apiVersion": "servetune/v1",
    "kind": "Workload",
    "name": "two-classes",
    "classes": {
        "chat": {
            "priority": 0,
            "arrival": {"process": "poisson", "rate_per_s": 3.0},
            "prompt_tokens": {"quantiles": [0, 0.5, 1], "values": [10, 100, 1000]},
            "output_tokens": {"quantiles": [0, 1], "values": [1, 201]},
        },
        "batch": {
            "priority": 1,
            "arrival": {
                "process": "gamma",
                "rate_per_s": 1.0,
                "interarrival_cv": 4.0,
                "windows": {"window_s": 60, "rate_multipliers": [2, 0, 1]},
            },
            "prompt_tokens": {"quantiles": [0, 1], "values": [5000, 5000]},
            "output_tokens": {"quantiles": [0, 0.9, 1], "values": [50, 60, 70]},
        },
    },
}


def small() -> Workload:
    return workload_from_yaml_text(yaml.safe_dump(SMALL, sort_keys=False), "small.yaml")


def test_round_trip_small(tmp_path):
    w = small()
    path = tmp_path / "w.yaml"
    save_workload(w, path, header="a header line\nand another")
    again = load_workload(path)
    assert again == w
    assert path.read_text().startswith("# a header line\n# and another\n")
    # deterministic bytes
    save_workload(again, tmp_path / "w2.yaml", header="a header line\nand another")
    assert (tmp_path / "w2.yaml").read_bytes() == path.read_bytes()


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_workloads_load_and_round_trip(path, tmp_path):
    w = load_workload(path)
    out = tmp_path / path.name
    save_workload(w, out)
    assert load_workload(out) == w
    assert "Patel" in path.read_text() or "SYNTHETIC" in path.read_text()


def test_shipped_numbers():
    names = {p.stem for p in SHIPPED}
    assert {"azure-conv-2023", "azure-code-2023", "long-context-synthetic"} <= names
    conv = class_stats(load_workload(REPO / "configs/workloads/azure-conv-2023.yaml"))[0]
    assert conv.rate_per_s == pytest.approx(5.530, abs=1e-3)
    assert conv.prompt_mean == pytest.approx(1154.7, rel=0.002)
    assert conv.output_mean == pytest.approx(211.1, rel=0.002)
    assert (conv.prompt_p50, conv.prompt_p99, conv.prompt_max) == (1020, 4142, 14050)
    code = class_stats(load_workload(REPO / "configs/workloads/azure-code-2023.yaml"))[0]
    # empirical gaps: the knots' CV, within 1% of the trace's 13.15
    assert code.interarrival_cv == pytest.approx(13.15, rel=0.01)
    assert (code.output_p50, code.output_p99) == (13, 251.46)
    long = class_stats(load_workload(REPO / "configs/workloads/long-context-synthetic.yaml"))[0]
    assert long.prompt_mean == pytest.approx(12000, rel=0.01)
    assert long.prompt_max == 100000 and long.rate_per_s == 0.5
    assert long.output_mean == pytest.approx(conv.output_mean)


def test_class_stats_by_hand():
    chat, batch = class_stats(small())
    assert chat.name == "chat" and batch.priority == 1
    assert chat.share == pytest.approx(0.75) and batch.share == pytest.approx(0.25)
    # piecewise-linear quantile function: mean = 0.5*(10+100)/2 + 0.5*(100+1000)/2
    assert chat.prompt_mean == pytest.approx(302.5)
    assert chat.prompt_p50 == 100 and chat.prompt_max == 1000
    assert chat.prompt_p90 == pytest.approx(100 + 0.8 * 900)
    assert chat.prompt_quantile(0.25) == pytest.approx(55)
    assert chat.output_mean == pytest.approx(101) and chat.output_quantile(0.5) == 101
    assert chat.interarrival_cv == 1.0 and batch.interarrival_cv == 4.0
    assert batch.output_p99 == pytest.approx(60 + 0.9 * 10)


def _mutated(path: tuple, value) -> dict:
    import copy

    data = copy.deepcopy(SMALL)
    node = data
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


_DELETE = object()


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        (("classes", "chat", "arrival", "rate_per_s"), -1, "classes.chat.arrival.rate_per_s"),
        (("classes", "chat", "arrival", "rate_per_s"), 0, "classes.chat.arrival.rate_per_s"),
        (("classes", "chat", "arrival", "process"), "hawkes", "classes.chat.arrival.process"),
        (("classes", "chat", "arrival", "interarrival_cv"), 2.0, "use process: gamma"),
        (("classes", "chat", "prompt_tokens", "values"), [10, 5, 1000],
         "classes.chat.prompt_tokens.values"),
        (("classes", "chat", "prompt_tokens", "values"), [0, 5, 1000], ">= 1 token"),
        (("classes", "chat", "prompt_tokens", "values"), [10, 1000], "one value per quantile"),
        (("classes", "chat", "prompt_tokens", "quantiles"), [0.1, 0.5, 1],
         "classes.chat.prompt_tokens.quantiles"),
        (("classes", "chat", "prompt_tokens", "quantiles"), [0, 0.5, 0.5, 1],
         "strictly increasing"),
        (("classes", "chat", "output_tokens", "values"), ["a", 2], "output_tokens.values"),
        (("classes", "chat", "colour"), "red", "classes.chat.colour: unknown key"),
        (("classes", "chat", "prompt_tokens"), _DELETE, "classes.chat.prompt_tokens: required"),
        (("classes", "batch", "arrival", "windows", "rate_multipliers"), [0, 0],
         "rate_multipliers"),
        (("classes", "batch", "arrival", "windows", "window_s"), -5, "windows.window_s"),
        (("classes",), {}, "classes"),
        (("duration_s",), -1, "duration_s"),
        (("kind",), "Policy", "kind: expected 'Workload'"),
        (("apiVersion",), "v2", "apiVersion"),
    ],
)
def test_rejections_name_the_field(path, value, needle):
    text = yaml.safe_dump(_mutated(path, value), sort_keys=False)
    with pytest.raises(ServetuneError) as err:
        workload_from_yaml_text(text, "w.yaml")
    assert err.value.message.startswith("w.yaml: ")
    assert needle in err.value.message
    assert "\n" not in err.value.message


def test_load_errors(tmp_path):
    with pytest.raises(ServetuneError, match="file not found"):
        load_workload(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("classes: [unclosed\n")
    with pytest.raises(ServetuneError, match="invalid YAML"):
        load_workload(bad)
    bad.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ServetuneError, match="UTF-8"):
        load_workload(bad)


def test_flow_lists_in_yaml():
    text = workload_to_yaml(small())
    assert "values: [10.0, 100.0, 1000.0]" in text


# ----------------------------------------------------------------------------- property

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

positive = st.floats(min_value=1e-9, max_value=1e9, allow_nan=False, allow_infinity=False)
rates = st.floats(min_value=1e-9, max_value=1e6, allow_nan=False, allow_infinity=False)


@st.composite
def distributions(draw, low: float = 1.0, high: float = 1e7) -> dict:
    inner = sorted(set(draw(st.lists(st.floats(0.001, 0.999), max_size=6))))
    values = sorted(draw(st.lists(st.floats(low, high), min_size=len(inner) + 2,
                                  max_size=len(inner) + 2)))
    return {"quantiles": [0.0, *inner, 1.0], "values": values}


@st.composite
def workloads(draw) -> Workload:
    classes = {}
    for name in draw(st.lists(st.text(min_size=1, max_size=6).filter(str.strip), min_size=1,
                              max_size=3, unique=True)):
        cv = draw(st.one_of(st.just(1.0), st.floats(0.01, 100), st.just(None)))
        if cv is None:  # empirical: gap knots (zero gaps allowed), CV computed from them
            gaps = draw(distributions(low=0.0, high=1e4))
            if gaps["values"][-1] <= 0:
                gaps["values"][-1] = 1.0
            arrival = {"process": "empirical", "rate_per_s": draw(rates),
                       "interarrival_gaps": gaps}
        else:
            arrival = {"process": "poisson" if cv == 1.0 else "gamma",
                       "rate_per_s": draw(rates), "interarrival_cv": cv}
        if draw(st.booleans()):
            arrival["windows"] = {"window_s": draw(positive), "rate_multipliers": draw(
                st.lists(st.floats(0, 100), min_size=1, max_size=5).filter(
                    lambda m: any(x > 0 for x in m)))}
        classes[name] = {"priority": draw(st.integers(-5, 5)), "arrival": arrival,
                         "prompt_tokens": draw(distributions()),
                         "output_tokens": draw(distributions())}
    data = {"apiVersion": "servetune/v1", "kind": "Workload", "name": draw(st.text(max_size=10)),
            "duration_s": draw(st.one_of(st.none(), positive)), "classes": classes}
    return Workload.model_validate(data)


@settings(max_examples=80, deadline=None)
@given(workloads())
def test_any_valid_workload_round_trips(w):
    text = workload_to_yaml(w)
    assert workload_from_yaml_text(text, "w.yaml") == w
    assert workload_to_yaml(workload_from_yaml_text(text, "w.yaml")) == text
