"""Per-class settings in the engine exports and the gateway rules file: each setting listed
once per engine with the policy's numbers, the rules' exact values, the file written only
when needed, valid, round-tripping and byte-identical across runs, policies without
per-class settings exported byte for byte as main did (``tests/export_golden``), and one
clear error for a bad ``--class-header``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_export import FACTS, FULL, body, check_keys, make_policy
from test_export_pd import SHIPPED, golden
from typer.testing import CliRunner

from servetune.cli import app
from servetune.engines import ENGINE_NAMES
from servetune.errors import ServetuneError
from servetune.export import export_policy
from servetune.export.classes import (
    GATEWAY_RULES_FILE,
    class_settings_instead,
    gateway_facts,
    gateway_rules_text,
)
from servetune.schemas.base import (
    document_from_data,
    document_to_yaml,
    dump_yaml,
    load_document,
    load_yaml,
)
from servetune.schemas.gateway import GatewayRules
from servetune.schemas.policy import Policy

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()

# Three SLO tiers on one engine: every per-class setting, with numbers to find again.
TIERS = dict(
    scheduling="priority",
    batching={"max_num_seqs": 64, "max_num_batched_tokens": 4096,
              "long_prefill_token_threshold": 512},
    classes={
        "chat": {"priority": 0, "reserved_seqs": 8, "max_queued_requests": 200},
        "longctx": {"priority": 2, "max_seqs": 4, "reserved_kv_fraction": 0.1,
                    "max_kv_fraction": 0.4, "long_prefill_token_threshold": 2048},
        "batch": {"priority": 5, "max_seqs": 16, "max_queued_requests": 1000,
                  "reserved_kv_fraction": 0.05},
    },
)
# (class, setting, value as the line writes it) for every per-class setting of TIERS but
# the priorities, which keep their one line of before.
TIERS_SETTINGS = [
    ("batch", "max_seqs", "16"), ("batch", "max_queued_requests", "1000"),
    ("batch", "reserved_kv_fraction", "0.05"),
    ("chat", "max_queued_requests", "200"), ("chat", "reserved_seqs", "8"),
    ("longctx", "max_seqs", "4"), ("longctx", "reserved_kv_fraction", "0.1"),
    ("longctx", "max_kv_fraction", "0.4"), ("longctx", "long_prefill_token_threshold", "2048"),
]


def tiers(**changes) -> Policy:
    return make_policy(**{**TIERS, **changes})


def class_lines(result) -> list[str]:
    return [line for line in result.unsupported
            if line.startswith("classes.") and not line.startswith("classes.*")]


def write_policy(folder: Path, policy: Policy) -> Path:
    path = folder / "policy.yaml"
    path.write_text(dump_yaml(policy.model_dump(mode="json")))
    return path


def export_cli(*args: str):
    return runner.invoke(app, ["export", *args])


# --- the engine files' lines --------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_each_class_setting_listed_once_with_its_number(engine):
    result = export_policy(tiers(), engine)
    lines = class_lines(result)
    for name, setting, value in TIERS_SETTINGS:
        token = f"classes.{name}.{setting} ({value})"
        hits = [line for line in lines if token in line]
        assert len(hits) == 1, (token, lines)
    # one line per class and setting group: batch limits + KV, chat limits + seats,
    # longctx limits + KV + chunk cap; in class-name order
    assert len(lines) == 7
    assert [line.split(".")[1] for line in lines] == sorted(line.split(".")[1] for line in lines)
    # the header of the file carries every line too
    comment = " ".join(line[1:].strip() for line in result.text.splitlines()
                       if line.startswith("#"))
    for line in lines:
        assert " ".join(line.split()) in comment
    check_keys(engine, result)


def test_vllm_lines_exact():
    lines = class_lines(export_policy(tiers(), "vllm"))
    assert lines == [
        "classes.batch.max_seqs (16), classes.batch.max_queued_requests (1000): vLLM has no "
        "per-class admission; at the gateway, send class batch at most 16 requests in flight "
        "per replica and queue the rest, and answer HTTP 503 to its arrivals beyond 1000 in "
        "flight and queued per replica",
        "classes.batch.reserved_kv_fraction (0.05): vLLM has no per-class reservations, and a "
        "gateway cannot count KV; route class batch to a replica pool of its own, `batch`, of "
        "at least 0.05 of the replicas, spilling into the main pool when it is full",
        "classes.chat.max_queued_requests (200): vLLM has no per-class admission; at the "
        "gateway, answer HTTP 503 to class chat's arrivals beyond 200 in flight and queued per "
        "replica",
        "classes.chat.reserved_seqs (8): vLLM keeps no seats for a class; at the gateway, send "
        "other requests to a replica only while they leave class chat's unused reserve of 8 of "
        "its 64 seats free (or give the class a replica pool of its own)",
        "classes.longctx.max_seqs (4): vLLM has no per-class admission; at the gateway, send "
        "class longctx at most 4 requests in flight per replica and queue the rest",
        "classes.longctx.reserved_kv_fraction (0.1), classes.longctx.max_kv_fraction (0.4): "
        "vLLM has no per-class reservations or KV caps, and a gateway cannot count KV; route "
        "class longctx to a replica pool of its own, `longctx`, of at least 0.1 and at most "
        "0.4 of the replicas, and never into the main pool",
        "classes.longctx.long_prefill_token_threshold (2048): vLLM's chunk cap is per engine, "
        "not per class; route class longctx to pool `longctx`, whose "
        "long-prefill-token-threshold is 2048",
    ]


@pytest.mark.parametrize("engine", ["sglang", "trtllm", "tgi"])
def test_engines_without_a_chunk_cap_say_so(engine):
    (line,) = [x for x in class_lines(export_policy(tiers(), engine))
               if "long_prefill_token_threshold" in x]
    title = gateway_facts(engine).title
    assert f"{title} has no per-request chunk cap" in line
    assert "route class longctx to a replica pool of its own, `longctx`" in line


@pytest.mark.parametrize("engine,status", [("vllm", 503), ("sglang", 503), ("trtllm", 503),
                                           ("tgi", 429)])
def test_overflow_status_is_the_engines_own(engine, status):
    result = export_policy(tiers(), engine)
    assert f"answer HTTP {status} to class chat's arrivals beyond 200" in " ".join(
        result.unsupported)
    assert result.gateway_rules.classes["chat"].overflow_status == status


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_class_settings_change_only_the_listed_lines(engine):
    """The class settings add lines and nothing else: the settings written and every
    other listed item are the policy's without them."""
    plain = tiers(classes={k: {"priority": v["priority"]} for k, v in TIERS["classes"].items()})
    a, b = export_policy(tiers(), engine), export_policy(plain, engine)
    assert a.settings == b.settings and a.env == b.env and a.args == b.args
    assert a.notes == b.notes
    assert [x for x in a.unsupported if x not in class_lines(a)] == b.unsupported
    assert class_lines(b) == []
    def uncommented(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith("#")]

    assert uncommented(a.text) == uncommented(b.text)


def test_a_class_chunk_cap_equal_to_the_policys_needs_no_pool():
    policy = tiers(classes={"x": {"long_prefill_token_threshold": 512}})
    for engine in ENGINE_NAMES:
        result = export_policy(policy, engine)
        assert class_lines(result) == [] and result.gateway_rules is None


# --- the rules: exact values -----------------------------------------------------------------

def test_vllm_rules_exact():
    rules = export_policy(tiers(), "vllm").gateway_rules
    data = json.loads(rules.model_dump_json())
    assert data == {
        "apiVersion": "servetune/v1", "kind": "GatewayRules", "policy": "t", "engine": "vllm",
        "config_file": "vllm.yaml",
        "class_from": {"header": "x-servetune-class", "field": None},
        "limits_per": "replica", "seats_per_replica": 64, "priority_field": "priority",
        "classes": {
            "batch": {"priority": 5, "concurrency_limit": 16, "queue_limit": 1000,
                      "overflow_status": 503, "reserved_seqs": 0,
                      "reserved_kv_fraction": 0.05, "max_kv_fraction": 1.0,
                      "long_prefill_token_threshold": None, "pool": "batch"},
            "chat": {"priority": 0, "concurrency_limit": None, "queue_limit": 200,
                     "overflow_status": 503, "reserved_seqs": 8, "reserved_kv_fraction": 0.0,
                     "max_kv_fraction": 1.0, "long_prefill_token_threshold": None,
                     "pool": None},
            "longctx": {"priority": 2, "concurrency_limit": 4, "queue_limit": None,
                        "overflow_status": None, "reserved_seqs": 0,
                        "reserved_kv_fraction": 0.1, "max_kv_fraction": 0.4,
                        "long_prefill_token_threshold": 2048, "pool": "longctx"},
        },
        "pools": {
            "batch": {"classes": ["batch"], "min_share": 0.05, "max_share": None,
                      "spill_to_main": True, "policy_overrides": {}, "engine_overrides": {},
                      "settings": ["reserved_kv_fraction"]},
            "longctx": {"classes": ["longctx"], "min_share": 0.1, "max_share": 0.4,
                        "spill_to_main": False,
                        "policy_overrides": {"batching.long_prefill_token_threshold": 2048},
                        "engine_overrides": {"long-prefill-token-threshold": 2048},
                        "settings": ["reserved_kv_fraction", "max_kv_fraction",
                                     "long_prefill_token_threshold"]},
        },
    }


@pytest.mark.parametrize("engine", ["sglang", "trtllm", "tgi"])
def test_other_engines_pools_carry_no_chunk_override(engine):
    rules = export_policy(tiers(), engine).gateway_rules
    assert rules.pools["longctx"].engine_overrides == {}
    assert rules.pools["longctx"].policy_overrides == {}
    assert rules.priority_field == ("priority" if engine == "sglang" else None)
    assert rules.classes["batch"].priority == 5  # the gateway's queue order on FCFS engines


def test_pool_shares():
    # seats 3 of 64 = 0.046875, rounded up; KV 0.02: the seat share is the larger
    policy = tiers(classes={"a": {"reserved_seqs": 3, "reserved_kv_fraction": 0.02}})
    pool = export_policy(policy, "vllm").gateway_rules.pools["a"]
    assert (pool.min_share, pool.max_share, pool.spill_to_main) == (0.0469, None, True)
    # a cap below the seat share: the cap binds (as in the engine)
    policy = tiers(classes={"a": {"reserved_seqs": 32, "max_kv_fraction": 0.3}})
    pool = export_policy(policy, "vllm").gateway_rules.pools["a"]
    assert (pool.min_share, pool.max_share, pool.spill_to_main) == (0.3, 0.3, False)
    # a chunk cap alone: a pool sized by load, no spilling (the main pool caps otherwise)
    policy = tiers(classes={"a": {"long_prefill_token_threshold": 1024}})
    pool = export_policy(policy, "vllm").gateway_rules.pools["a"]
    assert (pool.min_share, pool.max_share, pool.spill_to_main) == (0.0, None, False)
    assert pool.engine_overrides == {"long-prefill-token-threshold": 1024}
    # seats alone: kept at the gateway, no pool
    rules = export_policy(tiers(classes={"a": {"reserved_seqs": 3}}), "vllm").gateway_rules
    assert rules.pools == {} and rules.classes["a"].reserved_seqs == 3


def test_fcfs_policy_sets_no_priorities():
    rules = export_policy(tiers(scheduling="fcfs"), "vllm").gateway_rules
    assert rules.priority_field is None
    assert {r.priority for r in rules.classes.values()} == {None}


def test_when_rules_are_needed():
    # priorities only matter under priority scheduling, and 0 is every request's default
    assert export_policy(make_policy(**{**FULL, "scheduling": "fcfs"}), "vllm"
                         ).gateway_rules is None
    zero = make_policy(scheduling="priority", classes={"a": {"priority": 0}})
    assert export_policy(zero, "vllm").gateway_rules is None
    full = export_policy(make_policy(**FULL), "vllm").gateway_rules
    assert {n: r.priority for n, r in full.classes.items()} == {"batch": 5, "chat": 0}
    assert full.pools == {}
    for cls in ({"max_seqs": 1}, {"max_queued_requests": 5}, {"reserved_seqs": 1},
                {"reserved_kv_fraction": 0.1}, {"max_kv_fraction": 0.9},
                {"long_prefill_token_threshold": 100}):
        assert export_policy(make_policy(classes={"a": cls}), "tgi").gateway_rules is not None


def test_role_exports_carry_the_rules_too():
    result = export_policy(tiers(), "vllm", role="prefill")
    assert result.gateway_rules == export_policy(tiers(), "vllm").gateway_rules


# --- no per-class settings: as before -------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINE_NAMES)
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_policies_export_as_on_main_without_rules(name, engine, tmp_path):
    path = ROOT / "configs" / "policies" / f"{name}.yaml"
    result = export_policy(load_document(path, Policy), engine, profile=FACTS)
    assert result.text == golden(f"{name}.{engine}")  # written by main's code
    assert result.gateway_rules is None
    # the command writes what the library does, and nothing beside it
    policy = load_document(path, Policy).model_copy(update={"metadata": {"profile": FACTS}})
    pol = write_policy(tmp_path, policy)
    out = tmp_path / "out" / "cfg"
    res = export_cli("--policy", str(pol), "--engine", engine, "-o", str(out))
    assert res.exit_code == 0, res.output
    assert out.read_text() == export_policy(policy, engine).text
    assert [p.name for p in out.parent.iterdir()] == ["cfg"]
    assert "gateway rules" not in res.output and GATEWAY_RULES_FILE not in res.output



# --- the rules file through the CLI -------------------------------------------------------

def test_cli_writes_rules_next_to_the_config_valid_and_round_tripping(tmp_path):
    pol = write_policy(tmp_path, tiers())
    out = tmp_path / "deploy" / "engine.yaml"
    res = export_cli("--policy", str(pol), "--engine", "vllm", "-o", str(out))
    assert res.exit_code == 0, res.output
    rules_path = out.parent / GATEWAY_RULES_FILE
    assert f"wrote {rules_path} (gateway rules)" in res.output
    assert sorted(p.name for p in out.parent.iterdir()) == ["engine.yaml", GATEWAY_RULES_FILE]
    text = rules_path.read_text()
    assert text.startswith("# Gateway rules exported by servetune")
    rules = load_document(rules_path, GatewayRules)  # validated on load
    assert rules.config_file == "engine.yaml"  # the config written beside it
    assert gateway_rules_text(rules) == text  # round trip, byte for byte
    assert document_to_yaml(rules) in text
    again = rules.model_copy(update={"config_file": "vllm.yaml"})
    assert again == export_policy(tiers(), "vllm").gateway_rules


def test_cli_output_is_byte_identical_across_runs(tmp_path):
    pol = write_policy(tmp_path, tiers())
    for run in ("a", "b"):
        res = export_cli("--policy", str(pol), "--engine", "sglang", "--class-field",
                         "metadata.tenant", "-o", str(tmp_path / run / "sglang.yaml"))
        assert res.exit_code == 0, res.output
    for name in ("sglang.yaml", GATEWAY_RULES_FILE):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    rules = load_document(tmp_path / "a" / GATEWAY_RULES_FILE, GatewayRules)
    assert (rules.class_from.header, rules.class_from.field) == (None, "metadata.tenant")


def test_cli_header_is_written_lower_case(tmp_path):
    pol = write_policy(tmp_path, tiers())
    res = export_cli("--policy", str(pol), "--engine", "vllm", "--class-header", "X-Tenant",
                     "-o", str(tmp_path / "v.yaml"))
    assert res.exit_code == 0, res.output
    rules = load_document(tmp_path / GATEWAY_RULES_FILE, GatewayRules)
    assert rules.class_from.header == "x-tenant"


def test_cli_json_carries_the_rules(tmp_path):
    pol = write_policy(tmp_path, tiers())
    out = tmp_path / "v.yaml"
    res = export_cli("--policy", str(pol), "--engine", "vllm", "-o", str(out), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["gateway_rules_file"] == str(tmp_path / GATEWAY_RULES_FILE)
    assert data["gateway_rules"]["pools"]["longctx"]["engine_overrides"] == {
        "long-prefill-token-threshold": 2048}
    assert GatewayRules.model_validate(data["gateway_rules"]).classes["chat"].queue_limit == 200
    plain = write_policy(tmp_path, make_policy())
    res = export_cli("--policy", str(plain), "--engine", "vllm", "--json")
    data = json.loads(res.stdout)
    assert data["gateway_rules"] is None and data["gateway_rules_file"] is None


def test_cli_stdout_writes_no_rules_unless_told(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pol = write_policy(tmp_path, tiers())
    res = export_cli("--policy", str(pol), "--engine", "vllm")
    assert res.exit_code == 0
    assert body(res.stdout)["max-num-seqs"] == 64  # stdout is the config alone
    assert "gateway rules not written" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy.yaml"]
    res = export_cli("--policy", str(pol), "--engine", "vllm", "--gateway-rules",
                     str(tmp_path / "rules" / "g.yaml"))
    assert res.exit_code == 0
    assert body(res.stdout)["max-num-seqs"] == 64
    assert load_document(tmp_path / "rules" / "g.yaml", GatewayRules).engine == "vllm"


def test_cli_warns_of_a_stale_rules_file(tmp_path):
    pol = write_policy(tmp_path, tiers())
    out = tmp_path / "v.yaml"
    assert export_cli("--policy", str(pol), "--engine", "vllm", "-o", str(out)).exit_code == 0
    plain = write_policy(tmp_path, make_policy())
    res = export_cli("--policy", str(plain), "--engine", "vllm", "-o", str(out))
    assert res.exit_code == 0
    assert "gateway-rules.yaml is left from an earlier export" in res.stderr
    assert (tmp_path / GATEWAY_RULES_FILE).exists()  # a user's file is not removed


@pytest.mark.parametrize("args,expected", [
    (["--class-header", "x tenant"], "--class-header 'x tenant' is not an HTTP header name"),
    (["--class-header", "tenant:id"], "--class-header 'tenant:id' is not an HTTP header name"),
    (["--class-header", ""], "--class-header '' is empty"),
    (["--class-header", "Content-Length"], "is a standard header that frames or routes"),
    (["--class-header", "x" * 129], "is longer than 128 characters"),
    (["--class-header", "x-t\u00e9"], "is not an HTTP header name"),
    (["--class-field", "1model"], "--class-field '1model' is not a request body field"),
    (["--class-field", "priority"], "the priority the gateway sets"),
    (["--class-header", "a", "--class-field", "b"], "give --class-header or --class-field"),
    (["--gateway-rules", "-"], "--gateway-rules -: the rules cannot share stdout"),
])
def test_bad_class_header_is_one_clear_error(tmp_path, args, expected):
    pol = write_policy(tmp_path, tiers())
    res = export_cli("--policy", str(pol), "--engine", "vllm", "-o",
                     str(tmp_path / "out" / "v.yaml"), *args)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("servetune: error: "), res.output
    assert expected in lines[0]
    assert "argument `" not in lines[0]  # the flag's name, not the library's
    assert not (tmp_path / "out").exists()


def test_library_errors_name_the_arguments():
    with pytest.raises(ServetuneError, match="argument `class_header` 'a b'"):
        export_policy(tiers(), "vllm", class_header="a b")


def test_rules_output_clashing_with_the_config_is_refused(tmp_path):
    pol = write_policy(tmp_path, tiers())
    out = tmp_path / "v.yaml"
    res = export_cli("--policy", str(pol), "--engine", "vllm", "-o", str(out),
                     "--gateway-rules", str(out))
    assert res.exit_code == 2 and "give each output its own file" in res.output
    assert not out.exists()
    # a policy that needs no rules too (it wrote the config, then warned about it)
    plain = tmp_path / "plain.yaml"
    plain.write_text("apiVersion: servetune/v1\nkind: Policy\nname: plain\n")
    res = export_cli("--policy", str(plain), "--engine", "vllm", "-o", str(out),
                     "--gateway-rules", str(out))
    assert res.exit_code == 2 and "give each output its own file" in res.output
    assert not out.exists()


# --- the schema --------------------------------------------------------------------------

def _rules_file(tmp_path: Path, edit) -> Path:
    data = json.loads(export_policy(tiers(), "vllm").gateway_rules.model_dump_json())
    edit(data)
    path = tmp_path / "g.yaml"
    path.write_text(dump_yaml(data))
    return path


@pytest.mark.parametrize("edit,expected", [
    (lambda d: d["classes"]["batch"].update(pool="nope"), "classes.batch.pool: no pool 'nope'"),
    (lambda d: d["pools"]["batch"].update(classes=["chat"]), "pools.batch.classes: lacks 'batch'"),
    (lambda d: d["pools"]["batch"].update(classes=["batch", "chat"]),
     "pools.batch.classes: 'chat' is not a class routed to pool 'batch'"),
    (lambda d: d["class_from"].update(header="a b"), "class_from.header: 'a b' is not an HTTP"),
    (lambda d: d["class_from"].update(field="model"), "give exactly one of header or field"),
    (lambda d: d["classes"]["chat"].update(overflow_status=None), "overflow_status is set"),
    (lambda d: d["classes"]["chat"].update(overflow_status=500), "overflow_status"),
    (lambda d: d["classes"]["chat"].update(reserved_seqs=64), "reserved_seqs kept at the gateway"),
    (lambda d: d["pools"]["longctx"].update(min_share=0.5), "min_share (0.5) must be <="),
    (lambda d: d.update(limits_per="fleet"), "limits_per"),
    (lambda d: d.update(extra=1), "extra: unknown key"),
])
def test_schema_refuses_inconsistent_rules(tmp_path, edit, expected):
    with pytest.raises(ServetuneError, match="g.yaml") as err:
        load_document(_rules_file(tmp_path, edit), GatewayRules)
    assert expected in str(err.value)


# --- properties ----------------------------------------------------------------------------

@st.composite
def class_policies(draw):
    seqs = 64
    names = draw(st.lists(st.sampled_from(["a", "b", "chat", "z-batch"]), min_size=1,
                          max_size=3, unique=True))
    classes = {}
    for name in names:
        max_seqs = draw(st.sampled_from([None, 1, 8]))
        reserved = draw(st.integers(0, 4 if max_seqs is None else min(max_seqs, 4)))
        max_kv = draw(st.sampled_from([1.0, 0.5, 0.25]))
        classes[name] = {
            "priority": draw(st.integers(-3, 3)),
            "reserved_seqs": reserved,
            "max_seqs": max_seqs,
            "reserved_kv_fraction": draw(st.sampled_from([0.0, 0.05, 0.2])),  # <= max_kv
            "max_kv_fraction": max_kv,
            "long_prefill_token_threshold": draw(st.sampled_from([None, 256, 512, 4096])),
            "max_queued_requests": draw(st.sampled_from([None, 1, 300])),
        }
    return make_policy(
        scheduling=draw(st.sampled_from(["fcfs", "priority"])),
        batching={"max_num_seqs": seqs, "max_num_batched_tokens": 8192,
                  "long_prefill_token_threshold": draw(st.sampled_from([0, 512]))},
        classes=classes,
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=class_policies())
def test_random_class_settings_listed_once_and_rules_valid(policy):
    for engine in ENGINE_NAMES:
        result = export_policy(policy, engine)
        lines = class_lines(result)
        assert lines == class_settings_instead(policy, gateway_facts(engine))
        joined = "\n".join(lines)
        for name, cp in policy.classes.items():
            for setting, value, default in (
                ("max_seqs", cp.max_seqs, None), ("max_queued_requests",
                                                  cp.max_queued_requests, None),
                ("reserved_seqs", cp.reserved_seqs, 0),
                ("reserved_kv_fraction", cp.reserved_kv_fraction, 0.0),
                ("max_kv_fraction", cp.max_kv_fraction, 1.0),
            ):
                token = f"classes.{name}.{setting} ({value:g})" if value is not None else None
                if value == default:
                    assert f"classes.{name}.{setting} (" not in joined
                else:
                    assert joined.count(token) == 1, (token, joined)
            cap = cp.long_prefill_token_threshold
            differs = cap is not None and cap != policy.batching.long_prefill_token_threshold
            assert joined.count(f"classes.{name}.long_prefill_token_threshold (") == differs
        rules = result.gateway_rules
        wanted = bool(lines) or (policy.scheduling == "priority" and any(
            cp.priority for cp in policy.classes.values()))
        assert (rules is not None) == wanted
        if rules is None:
            continue
        # valid (the model re-validates) and round-trips through its YAML
        text = gateway_rules_text(rules)
        again = document_from_data(load_yaml(text), GatewayRules, "g.yaml")
        assert again == rules and gateway_rules_text(again) == text
        for name, rule in rules.classes.items():
            cp = policy.classes[name]
            assert rule.concurrency_limit == cp.max_seqs
            assert rule.queue_limit == cp.max_queued_requests
            if rule.pool is not None:
                pool = rules.pools[rule.pool]
                assert pool.min_share >= min(cp.reserved_kv_fraction, cp.max_kv_fraction)
                assert pool.max_share is None or pool.max_share == cp.max_kv_fraction
