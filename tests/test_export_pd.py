"""Prefix caching (``caching.enable_prefix_caching``) and per-role exports for
disaggregated prefill/decode: each engine's exact key and value, the role's exact
settings, TGI's refusal, and aggregated exports byte for byte as they were before either
existed (``tests/export_golden``, written by the code on main before this change)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from test_export import FACTS, FULL, body, check_keys, make_policy
from typer.testing import CliRunner

from servetune import __version__, knobs
from servetune.cli import app
from servetune.engines import ENGINE_NAMES
from servetune.errors import ServetuneError
from servetune.export import ROLES, export_policy
from servetune.schemas.base import document_to_yaml, dump_yaml, load_document
from servetune.schemas.policy import Policy

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "export_golden"
SHIPPED = ("vllm-serve-defaults", "vllm-serve-defaults-small-gpu")
CACHING = "caching.enable_prefix_caching"
runner = CliRunner()


def caching(value: bool | None) -> Policy:
    return make_policy(caching={"enable_prefix_caching": value})


def golden(name: str) -> str:
    return (GOLDEN / name).read_text().replace(
        "exported by servetune VERSION from", f"exported by servetune {__version__} from")


# --- aggregated exports: unchanged byte for byte --------------------------------------------

@pytest.mark.parametrize("engine", ENGINE_NAMES)
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_policy_exports_as_before(name, engine):
    policy = load_document(ROOT / "configs" / "policies" / f"{name}.yaml", Policy)
    assert policy.caching.enable_prefix_caching is None  # the section is optional
    assert export_policy(policy, engine, profile=FACTS).text == golden(f"{name}.{engine}")


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_full_policy_exports_as_before(engine):
    assert export_policy(make_policy(**FULL), engine).text == golden(f"full.{engine}")


def test_cli_without_role_writes_what_the_library_does(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(dump_yaml(make_policy(**FULL).model_dump(mode="json")))
    res = runner.invoke(app, ["export", "--policy", str(path), "--engine", "vllm"])
    assert res.exit_code == 0, res.output
    assert res.stdout == golden("full.vllm")


# --- the knob: the Policy, its YAML, the table ------------------------------------------------

def test_caching_round_trips_through_yaml(tmp_path):
    text = document_to_yaml(caching(False))
    assert "caching:\n  enable_prefix_caching: false\n" in text
    path = tmp_path / "p.yaml"
    path.write_text(text)
    again = load_document(path, Policy)
    assert again.caching.enable_prefix_caching is False
    assert document_to_yaml(again) == text
    assert again.knobs()[CACHING] is False
    # unset is written as null and read back as unset
    unset = document_to_yaml(Policy())
    assert "caching:\n  enable_prefix_caching: null\n" in unset


def test_caching_takes_booleans_only(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("apiVersion: servetune/v1\nkind: Policy\ncaching:\n"
                    "  enable_prefix_caching: maybe\n")
    with pytest.raises(ServetuneError, match="caching.enable_prefix_caching"):
        load_document(path, Policy)
    path.write_text("apiVersion: servetune/v1\nkind: Policy\ncaching:\n  prefix: true\n")
    with pytest.raises(ServetuneError, match="caching.prefix"):
        load_document(path, Policy)


def test_unset_prefix_caching_is_each_engines_default():
    # on in all four: vLLM CacheConfig, SGLang's radix cache, TensorRT-LLM block reuse, TGI's
    # launcher (knobs.py cites the sources)
    assert {e: knobs.value_for(CACHING, Policy(), e) for e in ENGINE_NAMES} == {
        "vllm": True, "sglang": True, "trtllm": True, "tgi": True}
    assert {e: knobs.value_for(CACHING, caching(False), e) for e in ENGINE_NAMES} == {
        e: False for e in ENGINE_NAMES}


def test_prefix_caching_is_not_searched_by_default_but_may_be():
    from servetune.schemas.space import SearchSpace

    assert CACHING not in knobs.default_space_knobs()
    space = SearchSpace(knobs={"enable_prefix_caching": [True, False]})
    assert list(space.knobs) == [CACHING]
    # a bare bool field (no constraints) validates its values, as the others do
    space = SearchSpace(knobs={"enable_chunked_prefill": [None, False]})
    assert space.knobs == {"batching.enable_chunked_prefill": [None, False]}
    with pytest.raises(ValueError, match="value 'yes' is not allowed"):
        SearchSpace(knobs={"enable_prefix_caching": ["yes"]})


# --- the knob as each engine takes it --------------------------------------------------------

@pytest.mark.parametrize(("value", "line"), [
    (True, "enable-prefix-caching: true\n"),
    (False, "no-enable-prefix-caching: true\n"),
])
def test_vllm_writes_prefix_caching_as_a_true_flag(value, line):
    result = export_policy(caching(value), "vllm")
    data = body(result.text)
    assert line in result.text
    written = {k: v for k, v in data.items() if "prefix-caching" in k}
    assert written == {line.split(":")[0]: True}


def test_sglang_writes_only_prefix_caching_off():
    assert "disable-radix-cache: true\n" in export_policy(caching(False), "sglang").text
    for value in (True, None):
        assert "radix" not in export_policy(caching(value), "sglang").text


@pytest.mark.parametrize("value", [True, False])
def test_trtllm_writes_block_reuse_in_the_kv_cache_config(value):
    result = export_policy(caching(value), "trtllm")
    assert body(result.text)["kv_cache_config"]["enable_block_reuse"] is value
    assert f"  enable_block_reuse: {str(value).lower()}\n" in result.text


@pytest.mark.parametrize(("value", "env"), [(True, "1"), (False, "0")])
def test_tgi_writes_the_prefix_caching_variable(value, env):
    result = export_policy(caching(value), "tgi")
    assert result.env["PREFIX_CACHING"] == env
    assert f"\nexport PREFIX_CACHING={env}\n" in result.text
    assert "PREFIX_CACHING" not in " ".join(result.args)  # no launcher flag
    assert ("(PREFILL_CHUNKING, PREFIX_CACHING and TGI_WIGGLE_ROOM have no flag)"
            in result.text)


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_unset_prefix_caching_writes_nothing(engine):
    result = export_policy(caching(None), engine)
    assert result.text == export_policy(make_policy(), engine).text
    for name in knobs.export_names(engine, CACHING):
        assert name.split(".")[-1] not in result.text


# --- roles ---------------------------------------------------------------------------------

ROLE_SETTINGS = {
    ("vllm", "prefill"): {
        "kv-transfer-config": '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}'},
    ("vllm", "decode"): {
        "kv-transfer-config": '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'},
    ("sglang", "prefill"): {"disaggregation-mode": "prefill",
                            "disaggregation-transfer-backend": "nixl"},
    ("sglang", "decode"): {"disaggregation-mode": "decode",
                           "disaggregation-transfer-backend": "nixl"},
    ("trtllm", "prefill"): {"cache_transceiver_config": {"backend": "NIXL"},
                            "disable_overlap_scheduler": True},
    ("trtllm", "decode"): {"cache_transceiver_config": {"backend": "NIXL"}},
}


@pytest.mark.parametrize(("engine", "role"), sorted(ROLE_SETTINGS))
def test_role_adds_exactly_the_engines_pd_settings(engine, role):
    for policy in (make_policy(), make_policy(**FULL), caching(False)):
        aggregated = body(export_policy(policy, engine).text)
        result = export_policy(policy, engine, role=role)
        data = body(result.text)
        check_keys(engine, result)
        added = {k: v for k, v in data.items() if k not in aggregated}
        assert added == ROLE_SETTINGS[engine, role]
        assert {k: data[k] for k in aggregated} == aggregated  # the rest as before
        assert result.settings == data
        assert f" config for a {role} instance exported by servetune " in (
            result.text.splitlines()[0])


@pytest.mark.parametrize("role", ROLES)
def test_vllm_role_connector_is_json_and_dynamo_is_named(role):
    result = export_policy(make_policy(), "vllm", role=role)
    config = json.loads(body(result.text)["kv-transfer-config"])
    assert config == {"kv_connector": "NixlConnector",
                      "kv_role": {"prefill": "kv_producer", "decode": "kv_consumer"}[role]}
    notes = " ".join(result.notes)
    assert f"python -m dynamo.vllm --model MODEL --disaggregation-mode {role}" in notes
    assert {"prefill": "--is-prefill-worker", "decode": "--is-decode-worker"}[role] in notes
    assert f"the {role} instance of a P/D pair" in result.text.splitlines()[1]


def test_roles_say_how_the_pair_is_joined():
    sglang = " ".join(export_policy(make_policy(), "sglang", role="decode").notes)
    assert "sglang_router.launch_router --pd-disaggregation" in sglang
    assert "URL under --decode" in sglang
    trtllm = " ".join(export_policy(make_policy(), "trtllm", role="prefill").notes)
    assert "under context_servers" in trtllm and "trtllm-serve disaggregated" in trtllm
    assert "max_tokens_in_buffer not set" in trtllm
    decode = " ".join(export_policy(make_policy(), "trtllm", role="decode").notes)
    assert "under generation_servers" in decode and "overlap" not in decode


@pytest.mark.parametrize("role", ROLES)
def test_tgi_refuses_a_role(role):
    with pytest.raises(ServetuneError, match="TGI has no disaggregated prefill/decode"):
        export_policy(make_policy(), "tgi", role=role)


def test_an_unknown_role_is_refused():
    with pytest.raises(ServetuneError, match="choose one of prefill, decode"):
        export_policy(make_policy(), "vllm", role="both")


def write_policy(tmp_path: Path, policy: Policy) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(dump_yaml(policy.model_dump(mode="json")))
    return path


def test_cli_tgi_role_fails_in_one_line_without_output(tmp_path):
    pol = write_policy(tmp_path, make_policy())
    out = tmp_path / "tgi.sh"
    res = runner.invoke(app, ["export", "--policy", str(pol), "--engine", "tgi",
                              "--role", "prefill", "-o", str(out)])
    assert res.exit_code == 2
    assert res.stdout == ""
    assert res.stderr.splitlines() == [
        "servetune: error: --role 'prefill': TGI has no disaggregated prefill/decode serving, "
        "so there is no TGI prefill or decode instance to configure; export the pair for vllm, "
        "sglang or trtllm, or export TGI without a role"]
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["policy.yaml"]


def test_cli_unknown_role_exits_2(tmp_path):
    pol = write_policy(tmp_path, make_policy())
    res = runner.invoke(app, ["export", "--policy", str(pol), "--engine", "vllm",
                              "--role", "mixed"])
    assert res.exit_code == 2
    assert "--role 'mixed' is not supported; choose one of prefill, decode" in res.stderr


def test_cli_role_writes_the_file_and_json(tmp_path):
    pol = write_policy(tmp_path, caching(False))
    out = tmp_path / "sglang-decode.yaml"
    res = runner.invoke(app, ["export", "--policy", str(pol), "--engine", "sglang",
                              "--role", "decode", "-o", str(out)])
    assert res.exit_code == 0, res.output
    data = yaml.safe_load(out.read_text())
    assert (data["disaggregation-mode"], data["disaggregation-transfer-backend"],
            data["disable-radix-cache"]) == ("decode", "nixl", True)
    res = runner.invoke(app, ["export", "--policy", str(pol), "--engine", "trtllm",
                              "--role", "prefill", "--json"])
    assert res.exit_code == 0, res.output
    settings = json.loads(res.stdout)["settings"]
    assert settings["cache_transceiver_config"] == {"backend": "NIXL"}
    assert settings["kv_cache_config"]["enable_block_reuse"] is False
