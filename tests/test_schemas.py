"""Policy, SLOSet and SearchSpace documents: round trips, rejections, fuzzing."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servetune.errors import ServetuneError
from servetune.schemas import (
    Policy,
    SearchSpace,
    SLOSet,
    apply_knobs,
    load_document,
    save_document,
)
from servetune.schemas.base import document_to_yaml

REPO = Path(__file__).resolve().parents[1]
SHIPPED = {
    "configs/policies/vllm-serve-defaults.yaml": Policy,
    "configs/slos/mlperf-llama-3.1-8b-server.yaml": SLOSet,
    "configs/slos/mlperf-llama-3.1-8b-interactive.yaml": SLOSet,
    "configs/slos/tiers-chat-longctx.yaml": SLOSet,
    "configs/slos/tiers-chat-longctx-batch.yaml": SLOSet,
    "configs/slos/tiers-by-length.yaml": SLOSet,
}


def write(tmp_path: Path, text: str, name: str = "doc.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("rel,cls", sorted(SHIPPED.items()))
def test_shipped_documents_load_and_round_trip(rel, cls, tmp_path):
    doc = load_document(REPO / rel, cls)
    out = tmp_path / "again.yaml"
    save_document(doc, out)
    assert load_document(out, cls) == doc
    # Saving is deterministic: the same object gives the same bytes.
    save_document(doc, tmp_path / "twice.yaml")
    assert out.read_bytes() == (tmp_path / "twice.yaml").read_bytes()


def test_policy_defaults_are_vllm_serve_defaults_on_big_gpus():
    p = Policy()
    assert p.scheduling == "fcfs"
    assert (p.batching.max_num_seqs, p.batching.max_num_batched_tokens) == (1024, 8192)
    assert p.batching.long_prefill_token_threshold == 0
    # unset: each engine's own default, which is on in vLLM (off in trtllm-serve)
    assert p.batching.enable_chunked_prefill is None
    assert p.admission.kv_watermark == 0.0 and p.admission.reserve_full_prompt is True
    assert p.admission.max_queued_requests is None
    assert not p.long_requests.enabled


def test_mlperf_slo_values():
    server = load_document(REPO / "configs/slos/mlperf-llama-3.1-8b-server.yaml", SLOSet)
    inter = load_document(REPO / "configs/slos/mlperf-llama-3.1-8b-interactive.yaml", SLOSet)
    assert server.for_class("anything").limits() == {"ttft_s": 2.0, "tpot_s": 0.1}
    assert inter.for_class("default").limits() == {"ttft_s": 0.5, "tpot_s": 0.03}
    assert server.for_class("x").percentile == 99.0


POLICY_HEAD = "apiVersion: servetune/v1\nkind: Policy\n"


@pytest.mark.parametrize(
    "body,needle",
    [
        ("batching:\n  max_num_seqs: -4\n", "batching.max_num_seqs"),
        ("batching:\n  max_num_seqs: lots\n", "batching.max_num_seqs"),
        ("batching:\n  max_num_seqs: 512\n  max_num_batched_tokens: 256\n",
         "max_num_batched_tokens (256) must be >= batching.max_num_seqs (512)"),
        ("admission:\n  kv_watermark: 1.5\n", "admission.kv_watermark"),
        ("long_requests:\n  reserved_kv_fraction: -0.1\n", "long_requests.reserved_kv_fraction"),
        ("long_requests:\n  reserved_seqs: 5\n  max_seqs: 2\n", "reserved_seqs (5) must be <="),
        ("batching:\n  max_num_sequences: 4\n", "batching.max_num_sequences: unknown key"),
        ("scheduling: lifo\n", "scheduling"),
        ("colour: blue\n", "colour: unknown key"),
    ],
)
def test_policy_rejections_name_file_and_field(tmp_path, body, needle):
    path = write(tmp_path, POLICY_HEAD + body)
    with pytest.raises(ServetuneError) as info:
        load_document(path, Policy)
    message = info.value.message
    assert str(path) in message
    assert needle in message
    assert "\n" not in message


@pytest.mark.parametrize(
    "text,needle",
    [
        ("kind: Policy\n", "apiVersion: must be 'servetune/v1'"),
        ("apiVersion: servetune/v2\nkind: Policy\n", "apiVersion"),
        ("apiVersion: servetune/v1\nkind: SLOSet\n", "kind: expected 'Policy'"),
        ("- a\n- b\n", "expected a mapping"),
        ("apiVersion: servetune/v1\nkind: Policy\nbatching: [\n", "invalid YAML"),
        ("", "expected a mapping"),
    ],
)
def test_document_level_rejections(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(ServetuneError) as info:
        load_document(path, Policy)
    assert needle in info.value.message


def test_missing_file_is_a_user_error(tmp_path):
    with pytest.raises(ServetuneError, match="file not found"):
        load_document(tmp_path / "nope.yaml", Policy)


SLO_HEAD = "apiVersion: servetune/v1\nkind: SLOSet\n"


@pytest.mark.parametrize(
    "body,needle",
    [
        ("classes: {}\n", "classes"),
        ("classes:\n  default: {ttft_s: 1.0}\n", "exactly one of percentile"),
        ("classes:\n  default: {ttft_s: 1.0, percentile: 99, attainment: 0.9}\n",
         "exactly one of percentile"),
        ("classes:\n  default: {percentile: 99}\n", "at least one of ttft_s"),
        ("classes:\n  default: {ttft_s: -1, percentile: 99}\n", "classes.default.ttft_s"),
        ("classes:\n  default: {tpot_s: 0.1, attainment: 1.2}\n", "classes.default.attainment"),
        # an infinite limit is no limit: it would be written back as null
        ("classes:\n  default: {ttft_s: .inf, percentile: 99}\n", "classes.default.ttft_s"),
        ("classes:\n  chat: {tpot_s: .nan, percentile: 99}\n", "classes.chat.tpot_s"),
    ],
)
def test_slo_rejections(tmp_path, body, needle):
    path = write(tmp_path, SLO_HEAD + body)
    with pytest.raises(ServetuneError) as info:
        load_document(path, SLOSet)
    assert needle in info.value.message and str(path) in info.value.message


def test_slo_class_fallback():
    slo = SLOSet(classes={"default": {"ttft_s": 1, "percentile": 99},
                          "batch": {"e2e_s": 600, "attainment": 0.9}})
    assert slo.for_class("batch").limits() == {"e2e_s": 600}
    assert slo.for_class("chat").limits() == {"ttft_s": 1}
    lonely = SLOSet(classes={"chat": {"ttft_s": 1, "percentile": 99}})
    assert lonely.for_class("other").limits() == {"ttft_s": 1}
    picky = SLOSet(classes={"a": {"ttft_s": 1, "percentile": 99},
                            "b": {"ttft_s": 2, "percentile": 99}})
    with pytest.raises(KeyError):
        picky.for_class("c")


SPACE_HEAD = "apiVersion: servetune/v1\nkind: SearchSpace\n"


def test_space_normalises_paths_and_enumerates(tmp_path):
    path = write(tmp_path, SPACE_HEAD + "knobs:\n  max_num_seqs: [64, 128, 256]\n"
                 "  max_num_batched_tokens: [2048, 8192]\n  long_requests.max_seqs: [2, 4]\n")
    space = load_document(path, SearchSpace)
    assert list(space.knobs) == [
        "batching.max_num_seqs", "batching.max_num_batched_tokens", "long_requests.max_seqs"
    ]
    assert space.size() == 12
    points = list(space.points())
    assert len(points) == 12 and points[0] == {
        "batching.max_num_seqs": 64, "batching.max_num_batched_tokens": 2048,
        "long_requests.max_seqs": 2,
    }
    assert points[1]["long_requests.max_seqs"] == 4  # last knob varies fastest
    policies = [p for _, p in space.policies(Policy())]
    assert all(p is not None for p in policies)
    assert {p.batching.max_num_seqs for p in policies} == {64, 128, 256}


def test_space_marks_inconsistent_points():
    space = SearchSpace(knobs={"max_num_seqs": [64, 4096], "max_num_batched_tokens": [2048]})
    got = [(pt["batching.max_num_seqs"], pol is None) for pt, pol in space.policies(Policy())]
    assert got == [(64, False), (4096, True)]


@pytest.mark.parametrize(
    "body,needle",
    [
        ("knobs:\n  max_num_seqz: [1]\n", "unknown policy knob 'max_num_seqz'"),
        ("knobs:\n  max_num_seqs: []\n", "list at least one value"),
        ("knobs:\n  max_num_seqs: [0]\n", "value 0 is not allowed"),
        ("knobs:\n  kv_watermark: [0.5, 1.0]\n", "value 1.0 is not allowed"),
        ("knobs:\n  scheduling: [fcfs, lifo]\n", "value 'lifo' is not allowed"),
        ("knobs:\n  max_num_seqs: [8, 8]\n", "values repeat"),
        ("knobs:\n  max_num_seqs: [8]\n  batching.max_num_seqs: [16]\n", "given twice"),
    ],
)
def test_space_rejections(tmp_path, body, needle):
    path = write(tmp_path, SPACE_HEAD + body)
    with pytest.raises(ServetuneError) as info:
        load_document(path, SearchSpace)
    assert needle in info.value.message


def test_apply_knobs_validates_the_whole_policy():
    p = apply_knobs(Policy(), {"max_num_seqs": 64, "long_requests.threshold_tokens": 8000})
    assert p.batching.max_num_seqs == 64 and p.long_requests.enabled
    with pytest.raises(ValueError):
        apply_knobs(Policy(), {"max_num_seqs": 10_000})  # above the 8192-token budget


# --- fuzzing: whatever the bytes, the only error that escapes is ServetuneError -------

KINDS = [Policy, SLOSet, SearchSpace]
FIXTURE_OK = [HealthCheck.function_scoped_fixture]


@settings(max_examples=150, deadline=None, suppress_health_check=FIXTURE_OK)
@given(data=st.binary(max_size=300), kind=st.sampled_from(KINDS))
def test_fuzz_random_bytes(tmp_path, data, kind):
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(data)
    try:
        load_document(path, kind)
    except ServetuneError as err:
        assert "\n" not in err.message


def _mutate(value, draw):
    """Replace one leaf of a nested dict/list with a random scalar or structure."""
    leaves = []

    def walk(node, trail):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, trail + [k])
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, trail + [i])
        leaves.append(trail)

    walk(value, [])
    trail = draw(st.sampled_from(leaves))
    replacement = draw(
        st.one_of(
            st.none(), st.booleans(), st.integers(-(2**70), 2**70),
            st.floats(allow_nan=True, allow_infinity=True),
            st.text(string.printable, max_size=8), st.lists(st.integers(), max_size=3),
            st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
        )
    )
    if not trail:
        return replacement
    node = value
    for key in trail[:-1]:
        node = node[key]
    node[trail[-1]] = replacement
    return value


@settings(max_examples=300, deadline=None, suppress_health_check=FIXTURE_OK)
@given(data=st.data(), rel=st.sampled_from(sorted(SHIPPED) + ["space"]))
def test_fuzz_mutated_documents(tmp_path, data, rel):
    if rel == "space":
        kind = SearchSpace
        doc = yaml.safe_load(SPACE_HEAD + "knobs:\n  max_num_seqs: [64, 128]\n"
                             "  kv_watermark: [0.0, 0.05]\n")
    else:
        kind = SHIPPED[rel]
        doc = yaml.safe_load((REPO / rel).read_text())
    mutated = _mutate(doc, data.draw)
    path = tmp_path / "mutated.yaml"
    path.write_text(yaml.safe_dump(mutated))
    try:
        loaded = load_document(path, kind)
    except ServetuneError as err:
        assert "\n" not in err.message
    else:
        # Whatever loads must survive a round trip unchanged.
        path.write_text(document_to_yaml(loaded))
        assert load_document(path, kind) == loaded
