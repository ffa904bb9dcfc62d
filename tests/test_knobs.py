"""The knob, engine and method tables: each list the code needs is the table's, and the
table says what the code does (exporters, fluid model, default space, simulator values)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from servetune import knobs
from servetune.engines import CONFIG_FILES, ENGINE_NAMES, ENGINES, GpuFacts, engine, kernel_id
from servetune.errors import ServetuneError
from servetune.export import export_policy
from servetune.knobs import KNOBS, Converted, NotExpressible, Plain
from servetune.models.fluid import Knobs
from servetune.schemas.base import load_document
from servetune.schemas.job import METHODS, OptimizeJob
from servetune.schemas.policy import Policy
from servetune.schemas.space import SearchSpace, knob_paths

ROOT = Path(__file__).resolve().parents[1]

PROFILE_FACTS = {
    "gpu_memory_bytes": 150_000_000_000, "weight_bytes": 16_000_000_000,
    "activation_bytes": 6_000_000_000, "gpu_memory_utilization": 0.9, "block_size": 16,
    "kv_blocks": 1000,
}

# Every knob away from its default (and every lane size set).
OFF_DEFAULT = {
    "scheduling": "priority",
    "batching": {"max_num_seqs": 64, "max_num_batched_tokens": 2048,
                 "long_prefill_token_threshold": 512, "enable_chunked_prefill": False},
    "admission": {"kv_watermark": 0.02, "reserve_full_prompt": False,
                  "max_queued_requests": 256, "max_queued_prompt_tokens": 100_000},
    "long_requests": {"threshold_tokens": 8192, "reserved_seqs": 2, "max_seqs": 4,
                      "reserved_kv_fraction": 0.1, "max_kv_fraction": 0.5},
    "caching": {"enable_prefix_caching": False},
}
# Other values of knobs whose export is spelled per value (prefix caching on and off).
OTHER_VALUES = {"caching.enable_prefix_caching": [True]}


def policy_with(**sections) -> Policy:
    return Policy.model_validate({"name": "t", "metadata": {"profile": PROFILE_FACTS},
                                  **sections})


def only_off_default(path: str) -> Policy:
    """The default policy with just ``path`` moved to its OFF_DEFAULT value (and lanes
    switched on when ``path`` is a lane size)."""
    if "." not in path:
        return policy_with(**{path: OFF_DEFAULT[path]})
    section, name = path.split(".")
    fields = {name: OFF_DEFAULT[section][name]}
    if section == "long_requests":
        fields["threshold_tokens"] = 8192
    return policy_with(**{section: fields})


def emitted(engine_name: str, result) -> dict[str, object]:
    """The keys (or flags and environment variables) an export wrote, with values; nested
    keys also as dotted paths (``kv_cache_config.enable_block_reuse``)."""
    if engine_name == "tgi":
        return {**dict(zip(result.args[0::2], result.args[1::2], strict=True)), **result.env}
    nested = {f"{key}.{name}": v for key, value in result.settings.items()
              if isinstance(value, dict) for name, v in value.items()}
    return {**result.settings, **nested}


# --- the knob table and the Policy ---------------------------------------------------------

def test_every_policy_knob_is_a_row_in_policy_order():
    assert [k.path for k in KNOBS] == list(Policy().knobs())
    assert [k.path for k in KNOBS] == knob_paths()


def test_values_read_the_policy():
    policy = policy_with(**OFF_DEFAULT)
    assert knobs.values(policy) == policy.knobs()
    assert knobs.values(Policy()) == {k.path: k.default for k in KNOBS}


def test_every_row_names_every_engine():
    for k in KNOBS:
        assert tuple(k.exports) == ENGINE_NAMES, k.path


def test_switches_and_equivalence_refer_to_knobs():
    for k in KNOBS:
        for other in (k.switch, k.off_at_or_above):
            assert other is None or other in knobs.BY_PATH


def test_fluid_knobs_are_the_modeled_rows():
    modeled = [k for k in KNOBS if k.modeled]
    assert [f.name for f in dataclasses.fields(Knobs)] == [k.name for k in modeled]
    assert Knobs.FIELDS == {k.path: k.name for k in modeled}
    policy = policy_with(**OFF_DEFAULT)
    assert Knobs.from_policy(policy).as_dotted() == {
        k.path: policy.knobs()[k.path] for k in modeled}


def test_default_space_is_the_shipped_file():
    from servetune.apps.optimize import default_space

    shipped = load_document(ROOT / "configs/spaces/default.yaml", SearchSpace)
    assert default_space().knobs == shipped.knobs
    assert list(default_space().knobs) == list(shipped.knobs)


def test_equivalence_key_turns_a_cap_at_or_above_the_budget_off():
    base = Knobs(256, 2048, 0, 0.01, 2048, None)
    key = knobs.equivalence_key
    for chunk in (2048, 4096):
        assert key(dataclasses.replace(base, long_prefill_token_threshold=chunk).as_dotted()) \
            == key(base.as_dotted()) == (256, 2048, 0, 0.01, 2048, None)
    assert key(dataclasses.replace(base, long_prefill_token_threshold=512).as_dotted()) \
        == (256, 2048, 512, 0.01, 2048, None)


def test_optimizer_dedupes_with_the_table_key():
    from servetune.solvers.loop import equivalence_key

    k = Knobs(64, 1024, 1024)
    assert equivalence_key(k) == knobs.equivalence_key(k.as_dotted()) == (
        64, 1024, 0, 0.0, None, None)


def test_nightly_compares_every_knob():
    from servetune.apps.nightly import same_knobs

    base = Policy()
    for k in KNOBS:
        other = only_off_default(k.path)
        assert not same_knobs(base, other), k.path
    renamed = base.model_copy(update={"name": "other", "metadata": {"x": 1}})
    assert same_knobs(base, renamed)


def test_summary_text_names_the_summary_knobs():
    dotted = policy_with(**OFF_DEFAULT).knobs()
    assert knobs.summary_text(dotted) == (
        "max_num_seqs 64, max_num_batched_tokens 2048, long_prefill_token_threshold 512, "
        "kv_watermark 0.02"
    )


def test_sim_values():
    assert knobs.sim_values(Policy(), 1000) == {
        "priority_scheduling": False, "max_seqs": 1024, "budget": 8192,
        "long_prefill_threshold": 0, "chunked_prefill": True, "watermark_blocks": 0,
        "reserve_full_prompt": True, "max_queued_requests": -1,
        "max_queued_prompt_tokens": -1, "lanes": False, "lane_reserved_seqs": 0,
        "lane_reserved_blocks": 0, "lane_max_seqs": 1024, "lane_max_blocks": 1000,
        "prefix_caching": True,
    }
    assert knobs.sim_values(policy_with(**OFF_DEFAULT), 1000) == {
        "priority_scheduling": True, "max_seqs": 64, "budget": 2048,
        "long_prefill_threshold": 512, "chunked_prefill": False, "watermark_blocks": 20,
        "reserve_full_prompt": False, "max_queued_requests": 256,
        "max_queued_prompt_tokens": 100_000, "lanes": True, "lane_reserved_seqs": 2,
        "lane_reserved_blocks": 100, "lane_max_seqs": 4, "lane_max_blocks": 500,
        "prefix_caching": False,
    }
    # lane sizes without the switch are simulated at their defaults
    sizes_only = policy_with(long_requests={"reserved_seqs": 3, "max_kv_fraction": 0.5})
    values = knobs.sim_values(sizes_only, 1000)
    assert (values["lanes"], values["lane_reserved_seqs"], values["lane_max_blocks"],
            values["lane_max_seqs"]) == (False, 0, 1000, 1024)


def test_only_the_knob_table_feeds_the_simulator_from_a_policy():
    # kernel_params packs the table's sim_values; a Params field that a policy changes but
    # the table does not name would be a knob that bypasses the table.
    from servetune.profiles.steptime import StepTimeModel
    from servetune.sim.engine import kernel_params

    def packed(policy: Policy) -> dict:
        params = kernel_params(policy, engine="vllm", kv_blocks=1000, block_size=16,
                               step_time=StepTimeModel())
        # (lane_limits: the lanes' table, built from the lane knobs and the policy's classes)
        return {f: v for f, v in params._asdict().items() if f not in ("step_coef",
                                                                       "step_pieces",
                                                                       "lane_limits")}

    default, changed = packed(Policy()), packed(policy_with(**OFF_DEFAULT))
    moved = {f for f in default if default[f] != changed[f]}
    assert moved == {k.sim_param for k in KNOBS}
    assert {f: changed[f] for f in moved} == knobs.sim_values(policy_with(**OFF_DEFAULT), 1000)


# --- the exporters follow the table -----------------------------------------------------

@pytest.mark.parametrize("engine_name", ENGINE_NAMES)
def test_plain_names_are_written_with_the_policy_value(engine_name):
    policy = policy_with(**OFF_DEFAULT)
    out = emitted(engine_name, export_policy(policy, engine_name))
    for k in KNOBS:
        cell = k.exports[engine_name]
        if isinstance(cell, Plain):
            value = k.value(policy)
            if engine_name == "tgi":
                assert out[cell.name] == str(value), k.path
            elif engine_name == "sglang" and k.path == "batching.max_num_seqs":
                pass  # capped by the queue cap (a conversion)
            else:
                assert out[cell.name] == value, k.path


@pytest.mark.parametrize("engine_name", ENGINE_NAMES)
def test_converted_names_are_written(engine_name):
    for k in KNOBS:
        cell = k.exports[engine_name]
        if isinstance(cell, Converted):
            out = emitted(engine_name, export_policy(only_off_default(k.path), engine_name))
            for value in OTHER_VALUES.get(k.path, []):
                section, name = k.path.split(".")
                other = policy_with(**{section: {name: value}})
                out |= emitted(engine_name, export_policy(other, engine_name))
            for name in cell.names:
                assert name in out, (k.path, name)


@pytest.mark.parametrize("engine_name", ENGINE_NAMES)
def test_not_expressible_knobs_are_listed_in_table_order(engine_name):
    rows = knobs.not_expressible(engine_name)
    for k in rows:
        result = export_policy(only_off_default(k.path), engine_name)
        token = "long_requests" if k.section == "long_requests" else k.path
        assert any(item.startswith(f"{token} (") for item in result.unsupported), k.path
    # every one at once: in the derived order (class priorities are the exporters' own)
    result = export_policy(policy_with(**OFF_DEFAULT), engine_name)
    listed = [item.split(" (")[0] for item in result.unsupported]
    expected = ["long_requests" if k.section == "long_requests" else k.path for k in rows]
    assert listed == expected
    # and at the defaults only what no policy can leave out
    listed = export_policy(policy_with(), engine_name).unsupported
    always = [k for k in rows if isinstance(k.exports[engine_name], NotExpressible)
              and k.exports[engine_name].always]
    assert [item.split(" (")[0] for item in listed] == [k.path for k in always]


def test_a_knob_without_advice_still_gets_listed():
    from servetune.export import unsupported_settings

    listed = unsupported_settings(only_off_default("admission.kv_watermark"), "tgi", {})
    assert listed == [
        "batching.max_num_seqs (1024): TGI has no such setting; enforce it outside the engine "
        "(a router rule or a gateway limit)",
        "admission.kv_watermark (0.02): TGI has no such setting; enforce it outside the engine "
        "(a router rule or a gateway limit)",
    ]


def test_tgi_lists_its_missing_batch_cap_first():
    assert knobs.not_expressible("tgi")[0].path == "batching.max_num_seqs"


def test_names_of_an_engine_without_a_row_are_refused():
    with pytest.raises(KeyError):
        knobs.plain_names("nope")


# --- the engine table -------------------------------------------------------------------

def test_every_engine_list_is_the_registry():
    from servetune.cli.simulate_cmd import ENGINE_CHOICES
    from servetune.export import FILENAMES
    from servetune.sim.api import ENGINE_NAMES as SIM_API_NAMES

    assert ENGINE_NAMES == ("vllm", "sglang", "trtllm", "tgi")
    for names in (SIM_API_NAMES, ENGINE_CHOICES):
        assert tuple(names) == ENGINE_NAMES
    assert typing.get_args(OptimizeJob.model_fields["engine"].annotation) == ENGINE_NAMES
    assert FILENAMES == CONFIG_FILES


def test_kernel_ids_are_the_kernels():
    from servetune.sim import _kernel as K

    for e in ENGINES:
        assert e.kernel_id == ENGINE_NAMES.index(e.name) == getattr(K, f"E_{e.name.upper()}")
        assert kernel_id(e.name) == e.kernel_id


@pytest.mark.parametrize("engine_name", ENGINE_NAMES)
def test_export_runs_the_registered_exporter_and_names_its_file(engine_name):
    result = export_policy(policy_with(), engine_name)
    assert result.engine == engine_name
    assert result.filename == engine(engine_name).config_file
    assert engine(engine_name).title in result.text.splitlines()[0]


def test_nightly_engines_are_checked_against_the_registry():
    from servetune.apps.nightly import parse_engines

    assert parse_engines(",".join(ENGINE_NAMES)) == list(ENGINE_NAMES)
    with pytest.raises(ServetuneError, match="vllm, sglang, trtllm, tgi"):
        parse_engines("vllm,nope")


GIB = 1 << 30


@pytest.mark.parametrize("gpu_name,memory_gib,expected", [
    # vllm serve (OPENAI_API_SERVER) in vLLM's get_batch_defaults: >= 70 GiB and not an A100
    ("NVIDIA H200", 139.8, (1024, 8192)),
    ("NVIDIA H100 80GB HBM3", 79.2, (1024, 8192)),
    ("NVIDIA A100-SXM4-80GB", 79.2, (256, 2048)),  # the A100 exception
    ("NVIDIA L40S", 44.4, (256, 2048)),
    ("NVIDIA H100 80GB HBM3", 69.9, (256, 2048)),  # just under the memory line
])
def test_vllm_defaults_follow_the_gpu(gpu_name, memory_gib, expected):
    d = engine("vllm").default_batching(GpuFacts(gpu_name, int(memory_gib * GIB), 10**6))
    assert (d.max_num_seqs, d.max_num_batched_tokens) == expected
    assert d.rule.startswith("vllm serve on a GPU with")


@pytest.mark.parametrize("memory_gib,kv_tokens,expected", [
    (139.8, 909_072, (4096, 8192)),  # H200: chunk 8192 below 160 GiB; pool bound 4096
    (139.8, 100, (50, 8192)),  # running requests bounded by KV tokens / 2
    (44.4, 10**6, (4096, 4096)),  # L40S: chunk 4096 below 60 GiB
    (30.0, 10**6, (4096, 4096)),  # max(chunk 2048, seats 4096)
    (180.0, 10**6, (4096, 16384)),  # B200-sized: 16384
])
def test_sglang_defaults_follow_the_gpu(memory_gib, kv_tokens, expected):
    d = engine("sglang").default_batching(GpuFacts("gpu", int(memory_gib * GIB), kv_tokens))
    assert (d.max_num_seqs, d.max_num_batched_tokens) == expected


def test_unmodelled_engine_defaults():
    assert engine("trtllm").default_batching is None
    assert engine("tgi").default_batching is None


@pytest.mark.parametrize("profile_file,policy_file", [
    ("h200-llama-3.1-8b.yaml", "vllm-serve-defaults.yaml"),
    ("h100-80gb-llama-3.1-8b.yaml", "vllm-serve-defaults.yaml"),
    ("a100-80gb-llama-3.1-8b.yaml", "vllm-serve-defaults-small-gpu.yaml"),
    ("a100-40gb-llama-3.1-8b.yaml", "vllm-serve-defaults-small-gpu.yaml"),
    ("l40s-llama-3.1-8b.yaml", "vllm-serve-defaults-small-gpu.yaml"),
])
def test_shipped_default_policies_are_the_rule_for_their_gpus(profile_file, policy_file):
    from servetune.apps.optimize import gpu_facts
    from servetune.profiles.shipped import load_profile

    d = engine("vllm").default_batching(gpu_facts(load_profile(ROOT / "gpu_profiles" /
                                                               profile_file)))
    policy = load_document(ROOT / "configs" / "policies" / policy_file, Policy)
    assert (policy.batching.max_num_seqs, policy.batching.max_num_batched_tokens) == (
        d.max_num_seqs, d.max_num_batched_tokens)


# --- the methods table ------------------------------------------------------------------

def test_methods_table_is_the_schema_list():
    from servetune.apps.optimize import METHOD_TABLE

    assert tuple(METHOD_TABLE) == METHODS
    assert typing.get_args(OptimizeJob.model_fields["method"].annotation) == METHODS
    assert [m.name for m in METHOD_TABLE.values() if not m.baseline] == ["milp"]
    assert all(m.help for m in METHOD_TABLE.values())


def test_unknown_method_names_the_choices():
    from servetune.apps.optimize import optimize

    with pytest.raises(ServetuneError, match="choose milp, grid, random or optuna"):
        optimize(None, None, None, method="nope")


@pytest.mark.parametrize(("path", "offered", "chosen", "expected"), [
    ("batching.max_num_seqs", [4, 8, 16], 4, ("low", 2)),
    ("batching.max_num_seqs", [4, 8, 16], 16, ("high", 32)),
    ("batching.max_num_seqs", [4, 8, 16], 8, None),  # inside
    ("batching.max_num_seqs", [1, 2], 1, None),  # the engine takes no fewer than 1
    ("batching.max_num_seqs", [8192, 16384], 16384, None),  # nor more than the range
    ("batching.max_num_seqs", [64], 64, None),  # one value: the user pinned it
    ("batching.max_num_batched_tokens", [256, 32768], 32768, ("high", 65536)),
    ("batching.long_prefill_token_threshold", [0, 512, 2048], 0, None),  # 0 is off
    ("batching.long_prefill_token_threshold", [0, 512, 2048], 512, ("low", 256)),
    ("admission.kv_watermark", [0.0, 0.01, 0.05], 0.0, None),
    ("admission.kv_watermark", [0.0, 0.01, 0.05], 0.05, ("high", 0.1)),
    ("admission.kv_watermark", [0.01, 0.4], 0.4, ("high", 0.5)),  # clipped to the range
    ("admission.max_queued_requests", [None, 2048], 2048, None),  # never widened
])
def test_the_value_beyond_an_edge_of_the_space(path, offered, chosen, expected):
    assert knobs.beyond_edge(path, offered, chosen) == expected


def test_the_default_space_spans_what_the_issue_asks():
    space = knobs.default_space_knobs()
    assert (min(space["batching.max_num_seqs"]), max(space["batching.max_num_seqs"])) == (4, 2048)
    tokens = space["batching.max_num_batched_tokens"]
    assert (min(tokens), max(tokens)) == (256, 32768)


def test_every_knob_feeds_a_kernel_parameter():
    from servetune.sim._kernel import Params

    assert {k.sim_param for k in KNOBS} <= set(Params._fields)



def test_prefix_caching_row_encodes_each_engines_default():
    # what sim_values gives the kernel once it has the parameter (test_sim_values then
    # checks it too): unset is on in every engine, a set value is that value everywhere
    row = knobs.knob("caching.enable_prefix_caching")
    off = policy_with(caching={"enable_prefix_caching": False})
    for engine_name in ENGINE_NAMES:
        assert row.sim_encode(row.value_for(Policy(), engine_name), Policy(), 1000) is True
        assert row.sim_encode(row.value_for(off, engine_name), off, 1000) is False


def test_chunked_prefill_unset_is_each_engines_default():
    # None in the policy: on in vLLM, SGLang and TGI, off in trtllm-serve (engines.md 4).
    unset = Policy()
    assert {e: knobs.value_for("batching.enable_chunked_prefill", unset, e)
            for e in ("vllm", "sglang", "trtllm", "tgi")} == {
        "vllm": True, "sglang": True, "trtllm": False, "tgi": True}
    assert knobs.sim_values(unset, 1000, "trtllm")["chunked_prefill"] is False
    assert knobs.sim_values(unset, 1000, "vllm")["chunked_prefill"] is True
    asked = policy_with(batching={"enable_chunked_prefill": True})
    assert knobs.sim_values(asked, 1000, "trtllm")["chunked_prefill"] is True


def test_short_text_labels_knobs_from_the_table():
    # the step shape always, the others when set; a path the table does not know as is
    dotted = {"batching.max_num_seqs": 32, "batching.max_num_batched_tokens": 1024,
              "batching.long_prefill_token_threshold": 0, "admission.kv_watermark": 0.01,
              "admission.max_queued_prompt_tokens": None, "admission.max_queued_requests": 64,
              "other.knob": 3}
    assert knobs.short_text(dotted) == (
        "seqs 32, tokens 1024, watermark 0.01, queue 64, other.knob 3")
    shape = {"batching.max_num_seqs": 0, "batching.long_prefill_token_threshold": 512}
    assert knobs.short_text(shape, sep="=", join=" ") == "seqs=0 chunk=512"
