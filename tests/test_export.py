"""Engine config export: every emitted key is one the engine accepts (the engines' option
names, read from the sources ``docs/engines.md`` names, kept here as data), conversions
checked by hand, nothing dropped silently, the CLI's exit codes and atomic output."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from servetune.cli import app
from servetune.engines import ENGINE_NAMES
from servetune.engines import engine as engine_row
from servetune.errors import ServetuneError
from servetune.export import MemoryFacts, export_policy, memory_facts
from servetune.export.sglang import mem_fraction_static
from servetune.export.tgi import tgi_memory
from servetune.export.trtllm import free_gpu_memory_fraction
from servetune.schemas.base import dump_yaml
from servetune.schemas.policy import Policy

# --- the engines' option names, as data (numbers: docs/engines.md sections) ---------------

# 1.2 SchedulerConfig and 1.3 CacheConfig knobs, as `vllm serve --config` keys (kebab-case).
VLLM_KEYS = {
    "max-num-batched-tokens", "max-num-scheduled-tokens", "max-num-seqs",
    "max-num-queued-reqs", "max-num-queued-tokens", "long-prefill-token-threshold",
    "scheduling-policy", "enable-chunked-prefill", "scheduler-reserve-full-isl", "watermark",
    "prefill-schedule-interval", "async-scheduling", "disable-chunked-mm-input",
    "scheduler-cls", "disable-hybrid-kv-cache-manager", "stream-interval",
    "block-size", "gpu-memory-utilization", "kv-cache-memory-bytes", "num-gpu-blocks-override",
    "enable-prefix-caching", "kv-cache-dtype", "kv-offloading-size", "kv-offloading-backend",
    # prefix caching off (BooleanOptionalAction's --no- form) and the P/D connector
    "no-enable-prefix-caching", "kv-transfer-config",
}
VLLM_REMOVED = {"max-num-partial-prefills", "max-long-partial-prefills"}
VLLM_VALUES = {"scheduling-policy": {"fcfs", "priority"}}

# 2.1 SGLang server arguments (flag without `--` is the --config key).
SGLANG_KEYS = {
    "mem-fraction-static", "max-running-requests", "max-queued-requests", "max-total-tokens",
    "chunked-prefill-size", "max-prefill-tokens", "prefill-max-requests", "schedule-policy",
    "schedule-conservativeness", "enable-priority-scheduling",
    "schedule-low-priority-values-first", "priority-scheduling-preemption-threshold",
    "disable-priority-preemption", "default-priority-value", "retraction-policy", "page-size",
    "enable-mixed-chunk", "prefill-decode-interval", "num-continuous-decode-steps",
    "disable-radix-cache", "disable-overlap-schedule",
    # PD disaggregation (SGLang's pd_disaggregation page)
    "disaggregation-mode", "disaggregation-transfer-backend",
}
SGLANG_VALUES = {
    "schedule-policy": {"lpm", "random", "fcfs", "dfs-weight", "lof", "priority", "routing-key"},
    "retraction-policy": {"length", "priority"},
}

# 4. TensorRT-LLM LLM-API fields (top level, and the nested configs' fields).
TRTLLM_KEYS = {
    "max_batch_size", "max_num_tokens", "max_seq_len", "enable_chunked_prefill", "backend",
    "tp_size", "pp_size", "ep_size", "kv_cache_config", "scheduler_config",
    # disaggregated serving (TensorRT-LLM's disagg-serving page)
    "cache_transceiver_config", "disable_overlap_scheduler",
}
TRTLLM_NESTED = {
    "kv_cache_config": {"free_gpu_memory_fraction", "enable_block_reuse", "max_tokens",
                        "tokens_per_block"},
    "scheduler_config": {"capacity_scheduler_policy", "context_chunking_policy",
                         "waiting_queue_policy", "context_scheduling_policy",
                         "enable_prefix_aware_scheduling", "gen_preemption",
                         "use_python_scheduler", "dynamic_batch_config"},
    "cache_transceiver_config": {"backend", "max_tokens_in_buffer"},
}
TRTLLM_VALUES = {
    "capacity_scheduler_policy": {"GUARANTEED_NO_EVICT", "MAX_UTILIZATION", "STATIC_BATCH"},
    "context_chunking_policy": {"FIRST_COME_FIRST_SERVED", "EQUAL_PROGRESS"},
}
TRTLLM_TRANSCEIVER_BACKENDS = {"DEFAULT", "UCX", "NIXL", "MOONCAKE", "MPI"}

# 3. TGI launcher flags (env var = UPPER_SNAKE), plus PREFILL_CHUNKING (env only).
TGI_FLAGS = {
    "--max-concurrent-requests", "--max-input-tokens", "--max-input-length",
    "--max-total-tokens", "--max-batch-prefill-tokens", "--max-batch-total-tokens",
    "--max-batch-size", "--waiting-served-ratio", "--max-waiting-tokens",
    "--cuda-memory-fraction",
}
# TGI_WIGGLE_ROOM: the server's share of free memory for KV (models/globals.py), env only;
# PREFIX_CACHING: read by the launcher (launcher/src/main.rs resolve_attention), env only.
TGI_ENV = {f.lstrip("-").replace("-", "_").upper() for f in TGI_FLAGS} | {
    "PREFILL_CHUNKING", "TGI_WIGGLE_ROOM", "PREFIX_CACHING"}

# Which policy knob each engine expresses, and by which key (or keys: one of them). A knob
# that is not here (or whose keys are absent for the given policy) must be named in
# `unsupported`.
EXPRESSED = {
    "vllm": {
        "scheduling": "scheduling-policy",
        "batching.max_num_seqs": "max-num-seqs",
        "batching.max_num_batched_tokens": "max-num-batched-tokens",
        "batching.long_prefill_token_threshold": "long-prefill-token-threshold",
        "batching.enable_chunked_prefill": "enable-chunked-prefill",
        "admission.kv_watermark": "watermark",
        "admission.reserve_full_prompt": "scheduler-reserve-full-isl",
        "admission.max_queued_requests": "max-num-queued-reqs",
        "admission.max_queued_prompt_tokens": "max-num-queued-tokens",
        "caching.enable_prefix_caching": ("enable-prefix-caching", "no-enable-prefix-caching"),
    },
    "sglang": {
        "scheduling": "enable-priority-scheduling",
        "batching.max_num_seqs": "max-running-requests",
        "batching.max_num_batched_tokens": "chunked-prefill-size",
        "batching.enable_chunked_prefill": "chunked-prefill-size",
        "admission.max_queued_requests": "max-queued-requests",
        # off is written; on is SGLang's default, written as nothing
        "caching.enable_prefix_caching": ("disable-radix-cache", None),
    },
    "trtllm": {
        "batching.max_num_seqs": "max_batch_size",
        "batching.max_num_batched_tokens": "max_num_tokens",
        "batching.enable_chunked_prefill": "enable_chunked_prefill",
        "caching.enable_prefix_caching": "kv_cache_config.enable_block_reuse",
    },
    "tgi": {
        "batching.max_num_batched_tokens": "max-batch-prefill-tokens",
        "batching.enable_chunked_prefill": "PREFILL_CHUNKING",
        "admission.max_queued_requests": "max-concurrent-requests",
        "caching.enable_prefix_caching": "PREFIX_CACHING",
    },
}

# An H200-like profile: M = 150e9 B, W = 16e9 B, A = 6e9 B, u = 0.9, 1000 blocks of 16.
FACTS = {
    "gpu_memory_bytes": 150_000_000_000,
    "weight_bytes": 16_000_000_000,
    "activation_bytes": 6_000_000_000,
    "gpu_memory_utilization": 0.9,
    "block_size": 16,
    "kv_blocks": 1000,
}


def make_policy(**sections) -> Policy:
    data = {"apiVersion": "servetune/v1", "kind": "Policy", "name": "t",
            "metadata": {"profile": dict(FACTS)}}
    data.update(sections)
    return Policy.model_validate(data)


FULL = dict(
    scheduling="priority",
    batching={"max_num_seqs": 64, "max_num_batched_tokens": 2048,
              "long_prefill_token_threshold": 512, "enable_chunked_prefill": True},
    admission={"kv_watermark": 0.02, "reserve_full_prompt": False, "max_queued_requests": 256,
               "max_queued_prompt_tokens": 100_000},
    long_requests={"threshold_tokens": 8192, "reserved_seqs": 2, "max_seqs": 4,
                   "reserved_kv_fraction": 0.1, "max_kv_fraction": 0.5},
    classes={"chat": {"priority": 0}, "batch": {"priority": 5}},
)


def body(text: str) -> object:
    """The YAML data of an exported file (its comment header is ignored by YAML)."""
    return yaml.safe_load(text)


def check_keys(engine: str, result) -> None:
    """Every emitted key is in the engine's key table, with an allowed value."""
    if engine == "vllm":
        data = body(result.text)
        assert set(data) <= VLLM_KEYS, set(data) - VLLM_KEYS
        assert not set(data) & VLLM_REMOVED
        for key, allowed in VLLM_VALUES.items():
            if key in data:
                assert data[key] in allowed
        assert all(k == k.lower() and "_" not in k for k in data)
    elif engine == "sglang":
        data = body(result.text)
        assert set(data) <= SGLANG_KEYS, set(data) - SGLANG_KEYS
        for key, allowed in SGLANG_VALUES.items():
            if key in data:
                assert data[key] in allowed
    elif engine == "trtllm":
        data = body(result.text)
        assert set(data) <= TRTLLM_KEYS, set(data) - TRTLLM_KEYS
        for section, fields in TRTLLM_NESTED.items():
            if section in data:
                assert set(data[section]) <= fields, set(data[section]) - fields
        for key, allowed in TRTLLM_VALUES.items():
            if key in data.get("scheduler_config", {}):
                assert data["scheduler_config"][key] in allowed
        if "cache_transceiver_config" in data:
            assert data["cache_transceiver_config"]["backend"] in TRTLLM_TRANSCEIVER_BACKENDS
    else:
        flags = result.args[0::2]
        assert set(flags) <= TGI_FLAGS, set(flags) - TGI_FLAGS
        assert set(result.env) <= TGI_ENV, set(result.env) - TGI_ENV
        # a shell file: comments, `export NAME=value` lines and the TGI_ARGS assignment
        for line in result.text.splitlines():
            assert line.startswith(("#", "export ", "TGI_ARGS=")), line


def emitted(engine: str, result) -> set[str]:
    """The keys written: top-level ones, nested ones as dotted paths, TGI's variables."""
    if engine == "tgi":
        return set(result.settings) | set(result.env)
    nested = {f"{key}.{name}" for key, value in result.settings.items()
              if isinstance(value, dict) for name in value}
    return set(result.settings) | nested


def check_nothing_dropped(engine: str, policy: Policy, result) -> None:
    """Each knob that differs from the engine-neutral default is expressed or listed."""
    neutral = Policy().knobs()
    listed = " ".join(result.unsupported)
    for path, value in policy.knobs().items():
        if engine == "tgi" and path == "batching.max_num_seqs":
            assert path in listed  # TGI has no running-batch cap at all
            continue
        if value == neutral[path]:
            continue
        keys = EXPRESSED[engine].get(path)
        keys = (keys,) if isinstance(keys, str) else keys or ()
        if any(key in emitted(engine, result) for key in keys if key is not None):
            continue
        if engine == "sglang" and path == "caching.enable_prefix_caching" and value:
            continue  # on: SGLang's default (the radix cache), nothing to write
        token = "long_requests" if path.startswith("long_requests.") else path
        assert token in listed, f"{engine}: {path}={value!r} neither exported nor listed"
    if policy.scheduling == "priority" and policy.classes and engine in ("vllm", "sglang"):
        assert "classes.*.priority" in listed


# --- the exporters ---------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_defaults_export_valid_keys_and_nothing_lost(engine):
    policy = make_policy()
    result = export_policy(policy, engine)
    check_keys(engine, result)
    check_nothing_dropped(engine, policy, result)
    assert result.filename
    # the header lists each unsupported item (as wrapped comment lines)
    comment = " ".join(line[1:].strip() for line in result.text.splitlines()
                       if line.startswith("#"))
    for item in result.unsupported:
        assert " ".join(item.split()) in comment


@pytest.mark.parametrize("engine", ENGINE_NAMES)
def test_full_policy_every_setting_expressed_or_listed(engine):
    policy = make_policy(**FULL)
    result = export_policy(policy, engine)
    check_keys(engine, result)
    check_nothing_dropped(engine, policy, result)
    if engine != "vllm":
        assert any(item.startswith("long_requests") for item in result.unsupported)


def test_vllm_exact_file():
    result = export_policy(make_policy(**FULL), "vllm")
    assert body(result.text) == {
        "max-num-seqs": 64,
        "max-num-batched-tokens": 2048,
        "long-prefill-token-threshold": 512,
        "enable-chunked-prefill": True,
        "scheduling-policy": "priority",
        "watermark": 0.02,
        "scheduler-reserve-full-isl": False,
        "max-num-queued-reqs": 256,
        "max-num-queued-tokens": 100_000,
        "gpu-memory-utilization": 0.9,
        "block-size": 16,
    }
    # lanes and class priorities are the two things vLLM cannot say
    assert len(result.unsupported) == 2
    assert "router rule" in result.unsupported[0] and "8192" in result.unsupported[0]
    assert "batch=5" in result.unsupported[1] and "chat=0" in result.unsupported[1]


def test_vllm_queue_caps_absent_when_unset():
    data = body(export_policy(make_policy(), "vllm").text)
    assert "max-num-queued-reqs" not in data and "max-num-queued-tokens" not in data
    assert data["scheduling-policy"] == "fcfs"


def test_sglang_exact_file_and_priority_convention():
    result = export_policy(make_policy(**FULL), "sglang")
    data = body(result.text)
    assert data["max-running-requests"] == 64
    assert data["chunked-prefill-size"] == 2048
    assert data["max-prefill-tokens"] == 2048
    # servetune (like vLLM) serves lower values first, SGLang higher: flipped by the flag
    assert data["enable-priority-scheduling"] is True
    assert data["schedule-low-priority-values-first"] is True
    assert data["retraction-policy"] == "priority"
    # the model preempts as SGLang does by default (threshold 10, preemption on)
    assert data["priority-scheduling-preemption-threshold"] == 10
    assert engine_row("sglang").priority_preemption_threshold == 10  # the simulator's too
    assert "disable-priority-preemption" not in data
    # waiting-queue cap = in-flight cap 256 - running cap 64
    assert data["max-queued-requests"] == 192
    # (0.9 * 150e9 - 6e9) / 150e9 = 129 / 150 = 0.86
    assert data["mem-fraction-static"] == 0.86
    assert data["max-total-tokens"] == 1000 * 16
    # the header names the SGLang changes whose options the file uses (no release pinned)
    header_text = " ".join(ln.lstrip("# ") for ln in result.text.splitlines()
                           if ln.startswith("#"))
    assert "`--config` (YAML config files, sgl-project/sglang PR #10534" in header_text
    assert "`enable-priority-scheduling` (priority scheduling with preemption" in header_text
    plain = export_policy(make_policy(), "sglang")
    assert "enable-priority-scheduling" not in plain.requires
    assert "PR #10534" in plain.requires
    assert "NVIDIA/TensorRT-LLM#4509" in export_policy(make_policy(), "trtllm").requires


def test_sglang_in_flight_cap_below_batch_width():
    # waiting + running <= 100 with 256 seats: at most 100 run, and the waiting cap is
    # floored at 1 (SGLang's cap counts waiting requests only)
    policy = make_policy(batching={"max_num_seqs": 256, "max_num_batched_tokens": 4096},
                         admission={"max_queued_requests": 100})
    data = body(export_policy(policy, "sglang").text)
    assert data["max-running-requests"] == 100 and data["max-queued-requests"] == 1


def test_sglang_chunking_off_is_minus_one():
    policy = make_policy(batching={"enable_chunked_prefill": False})
    assert body(export_policy(policy, "sglang").text)["chunked-prefill-size"] == -1


def test_sglang_without_activation_reserve_uses_utilization():
    assert mem_fraction_static(MemoryFacts(gpu_memory_utilization=0.92)) == 0.92


def test_trtllm_free_fraction_by_hand():
    # f = (u*M - W - A) / (M - W - A) = (135e9 - 22e9) / (128e9) = 113/128 = 0.8828125
    facts = memory_facts(make_policy())
    assert free_gpu_memory_fraction(facts) == pytest.approx(113 / 128, rel=1e-12)
    # without an activation reserve: (135 - 16) / (150 - 16) = 119/134
    no_act = MemoryFacts(gpu_memory_bytes=150_000_000_000, weight_bytes=16_000_000_000,
                         gpu_memory_utilization=0.9)
    assert free_gpu_memory_fraction(no_act) == pytest.approx(119 / 134, rel=1e-12)
    data = body(export_policy(make_policy(**FULL), "trtllm").text)
    assert data["kv_cache_config"]["free_gpu_memory_fraction"] == 0.8828
    assert data["kv_cache_config"]["max_tokens"] == 16_000
    assert data["kv_cache_config"]["tokens_per_block"] == 16
    assert data["max_batch_size"] == 64 and data["max_num_tokens"] == 2048
    assert data["scheduler_config"]["capacity_scheduler_policy"] == "GUARANTEED_NO_EVICT"


def test_trtllm_free_fraction_exceeds_total_share():
    # a share of what is left after weights is larger than the same bytes' share of total
    facts = MemoryFacts(gpu_memory_bytes=80_000_000_000, weight_bytes=16_000_000_000,
                        gpu_memory_utilization=0.9)
    assert free_gpu_memory_fraction(facts) > 0.9 - 16 / 80


def test_trtllm_needs_memory_facts():
    policy = make_policy(metadata={})
    with pytest.raises(ServetuneError) as err:
        export_policy(policy, "trtllm")
    msg = err.value.message
    assert "gpu_memory_bytes" in msg and "weight_bytes" in msg and "argument `profile`" in msg
    # an explicit profile mapping fills the gap
    result = export_policy(policy, "trtllm", profile=dict(FACTS))
    assert body(result.text)["kv_cache_config"]["free_gpu_memory_fraction"] == 0.8828


def test_profile_argument_overrides_metadata():
    other = dict(FACTS, gpu_memory_utilization=0.8)
    data = body(export_policy(make_policy(), "vllm", profile=other).text)
    assert data["gpu-memory-utilization"] == 0.8


def test_metadata_profile_accepts_profile_summary_names():
    meta = {"gpu_memory_bytes": 150e9, "weight_bytes_per_gpu": 16e9,
            "activation_reserve_bytes": 6e9, "gpu_memory_utilization": 0.9}
    policy = make_policy(metadata={"profile": meta})
    assert memory_facts(policy).activation_bytes == 6_000_000_000


def test_bad_metadata_profile_is_one_clear_error():
    policy = make_policy(metadata={"profile": {"gpu_memory_utilization": "lots"}})
    with pytest.raises(ServetuneError, match="metadata.profile: gpu_memory_utilization"):
        export_policy(policy, "vllm")


def test_tgi_args_and_env_agree():
    result = export_policy(make_policy(**FULL), "tgi")
    args = result.args
    # (the memory fraction accounts for TGI's wiggle room: test_tgi_fraction_by_hand)
    assert args == ["--max-batch-prefill-tokens", "2048", "--max-concurrent-requests", "256",
                    "--cuda-memory-fraction", "0.9838"]
    assert result.env == {"MAX_BATCH_PREFILL_TOKENS": "2048", "MAX_CONCURRENT_REQUESTS": "256",
                          "CUDA_MEMORY_FRACTION": "0.9838", "PREFILL_CHUNKING": "1",
                          "TGI_WIGGLE_ROOM": "0.9"}
    # the shell file holds the same: parse its assignments like a shell would
    lines = [ln for ln in result.text.splitlines() if ln and not ln.startswith("#")]
    env = {}
    for line in lines:
        words = shlex.split(line)
        if words[0] == "export":
            name, value = words[1].split("=", 1)
            env[name] = value
        else:
            name, value = words[0].split("=", 1)
            assert name == "TGI_ARGS"
            assert shlex.split(value) == args
    assert env == result.env


def test_unknown_engine():
    with pytest.raises(ServetuneError, match="choose one of"):
        export_policy(make_policy(), "llamacpp")


def test_export_is_deterministic():
    for engine in ENGINE_NAMES:
        a = export_policy(make_policy(**FULL), engine).text
        b = export_policy(make_policy(**FULL), engine).text
        assert a == b


# --- property: random valid policies ------------------------------------------------------

@st.composite
def policies(draw):
    seqs = draw(st.sampled_from([1, 8, 64, 256, 1024]))
    tokens = draw(st.sampled_from([512, 2048, 8192, 16384]).filter(lambda t: t >= seqs))
    lanes = draw(st.booleans())
    long_requests = {}
    if lanes and seqs > 1:
        max_seqs = draw(st.integers(1, seqs))
        long_requests = {
            "threshold_tokens": draw(st.integers(1, 100_000)),
            "reserved_seqs": draw(st.integers(0, min(max_seqs, seqs - 1))),
            "max_seqs": max_seqs,
            "reserved_kv_fraction": draw(st.sampled_from([0.0, 0.1, 0.3])),
            "max_kv_fraction": draw(st.sampled_from([0.5, 1.0])),
        }
    return make_policy(
        scheduling=draw(st.sampled_from(["fcfs", "priority"])),
        batching={
            "max_num_seqs": seqs,
            "max_num_batched_tokens": tokens,
            "long_prefill_token_threshold": draw(st.sampled_from([0, 256, 4096])),
            "enable_chunked_prefill": draw(st.booleans()),
        },
        admission={
            "kv_watermark": draw(st.sampled_from([0.0, 0.01, 0.5])),
            "reserve_full_prompt": draw(st.booleans()),
            "max_queued_requests": draw(st.sampled_from([None, 1, 500])),
            "max_queued_prompt_tokens": draw(st.sampled_from([None, 1, 50_000])),
        },
        long_requests=long_requests,
        caching={"enable_prefix_caching": draw(st.sampled_from([None, True, False]))},
        classes=draw(st.sampled_from([{}, {"a": {"priority": 1}, "b": {"priority": -2}}])),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=policies())
def test_random_policies_valid_keys_nothing_dropped(policy):
    for engine in ENGINE_NAMES:
        result = export_policy(policy, engine)
        check_keys(engine, result)
        check_nothing_dropped(engine, policy, result)


# --- CLI -------------------------------------------------------------------------------------

runner = CliRunner()


def write_policy(tmp_path: Path, policy: Policy) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(dump_yaml(policy.model_dump(mode="json")))
    return path


def test_cli_writes_file_and_lists_unsupported(tmp_path):
    pol = write_policy(tmp_path, make_policy(**FULL))
    out = tmp_path / "out" / "vllm.yaml"
    res = runner.invoke(app, ["export", "--policy", str(pol), "--engine", "vllm", "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert body(out.read_text())["max-num-seqs"] == 64
    assert "not expressible in vllm (2)" in res.output
    assert "router rule" in res.output
    # no temp file left; the class priorities are the gateway's to set (test_export_classes)
    assert sorted(p.name for p in out.parent.iterdir()) == ["gateway-rules.yaml", "vllm.yaml"]


def test_cli_output_path_blocked_by_a_file_names_it(tmp_path):
    """-o below a file used to say "cannot write (File exists)"; it now names the file in
    the way, and a folder given as -o is refused as such."""
    pol = write_policy(tmp_path, make_policy())
    afile = tmp_path / "afile"
    afile.write_text("x")
    res = runner.invoke(app, ["export", "--policy", str(pol), "--engine", "vllm", "-o",
                              str(afile / "vllm.yaml")])
    assert res.exit_code == 2 and f"{afile} is a file, not a folder" in res.output
    res = runner.invoke(app, ["export", "--policy", str(pol), "--engine", "vllm", "-o",
                              str(tmp_path)])
    assert res.exit_code == 2 and "is a folder; give a file path" in res.output
    assert afile.read_text() == "x"


def test_cli_stdout_and_json(tmp_path):
    pol = write_policy(tmp_path, make_policy())
    res = runner.invoke(app, ["export", "--policy", str(pol), "--engine", "sglang"])
    assert res.exit_code == 0
    assert "max-running-requests: 1024" in res.output
    res = runner.invoke(app, ["export", "--policy", str(pol), "--engine", "tgi", "--json"])
    assert res.exit_code == 0
    import json

    data = json.loads(res.output[res.output.index("{"):res.output.rindex("}") + 1])
    assert data["env"]["PREFILL_CHUNKING"] == "1"
    assert any("max_num_seqs" in item for item in data["unsupported"])


def test_cli_user_errors_exit_2_without_output(tmp_path):
    pol = write_policy(tmp_path, make_policy(metadata={}))
    out = tmp_path / "trt.yaml"
    res = runner.invoke(app, ["export", "--policy", str(pol), "--engine", "trtllm",
                              "-o", str(out)])
    assert res.exit_code == 2
    assert "free_gpu_memory_fraction needs" in res.output
    assert "no --profile was given" in res.output and "pass --profile P.yaml" in res.output
    assert not out.exists()
    res = runner.invoke(app, ["export", "--policy", str(pol), "--engine", "vllm2"])
    assert res.exit_code == 2 and "choose one of" in res.output
    res = runner.invoke(app, ["export", "--policy", str(tmp_path / "nope.yaml"),
                              "--engine", "vllm"])
    assert res.exit_code == 2 and "file not found" in res.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: servetune/v1\nkind: Policy\nbatching: {max_num_seqs: 0}\n")
    res = runner.invoke(app, ["export", "--policy", str(bad), "--engine", "vllm"])
    assert res.exit_code == 2 and "batching.max_num_seqs" in res.output
    assert "Traceback" not in res.output


def test_profile_document_gives_memory_facts():
    from servetune.profiles.schema import Hardware, MemoryBudget, ModelArch, Profile

    profile = Profile(
        name="h200-test",
        hardware=Hardware(name="H200", memory_bytes=150_000_000_000,
                          hbm_bandwidth_Bps=4.8e12, peak_flops=989e12),
        model=ModelArch(name="llama-3.1-8b", layers=32, hidden=4096, intermediate=14336,
                        heads=32, kv_heads=8, head_dim=128, vocab=128256,
                        params=8_030_261_248),
        memory=MemoryBudget(gpu_memory_utilization=0.9,
                            activation_reserve_bytes=6_000_000_000),
    )
    facts = memory_facts(make_policy(metadata={}), profile)
    weights = 8_030_261_248 * 2
    assert facts.weight_bytes == weights
    assert facts.block_size == 16 and facts.kv_blocks == profile.kv_blocks()
    expected = (0.9 * 150e9 - weights - 6e9) / (150e9 - weights - 6e9)
    assert free_gpu_memory_fraction(facts) == pytest.approx(expected, rel=1e-9)
    data = body(export_policy(make_policy(metadata={}), "sglang", profile=profile).text)
    # the pool in tokens: usable blocks x 16; KV bytes/token for Llama-3.1-8B = 131072
    blocks = int((0.9 * 150e9 - weights - 6e9) // (131_072 * 16)) - 1
    assert data["max-total-tokens"] == blocks * 16


@settings(max_examples=80, deadline=None)
@given(meta=st.dictionaries(
    st.sampled_from(["gpu_memory_bytes", "weight_bytes", "gpu_memory_utilization",
                     "activation_bytes", "block_size", "kv_blocks", "weight_bytes_per_gpu",
                     "kv_blocks_override",
                     "other"]),
    st.one_of(st.none(), st.booleans(), st.integers(-10, 10**12), st.text(max_size=5),
              st.floats(allow_nan=True, allow_infinity=True), st.lists(st.integers())),
))
def test_any_metadata_profile_exports_or_fails_cleanly(meta):
    policy = make_policy(metadata={"profile": meta})
    for engine in ENGINE_NAMES:
        try:
            result = export_policy(policy, engine)
        except ServetuneError as err:
            assert "\n" not in err.message
            continue
        check_keys(engine, result)


def test_fractional_memory_bytes_fail_cleanly():
    """Hypothesis found gpu_memory_bytes 0.5: it passed the "> 0" check, became 0 bytes and
    divided by zero in SGLang's mem-fraction-static."""
    policy = make_policy(metadata={"profile": {
        "gpu_memory_utilization": 1, "activation_bytes": 0, "gpu_memory_bytes": 0.5}})
    with pytest.raises(ServetuneError, match="gpu_memory_bytes: must be positive"):
        export_policy(policy, "sglang")


def test_cli_profile_option_with_shipped_profile(tmp_path):
    profile = Path(__file__).resolve().parents[1] / "gpu_profiles" / "h200-llama-3.1-8b.yaml"
    if not profile.exists():
        pytest.skip("shipped profile missing")
    from servetune.profiles.shipped import load_profile

    prof = load_profile(profile)
    pol = write_policy(tmp_path, make_policy(metadata={}))
    out = tmp_path / "trt.yaml"
    res = runner.invoke(app, ["export", "--policy", str(pol), "--engine", "trtllm",
                              "--profile", str(profile), "-o", str(out)])
    assert res.exit_code == 0, res.output
    data = body(out.read_text())
    s = prof.memory_summary()
    total, weights = s["gpu_memory_bytes"], s["weight_bytes_per_gpu"]
    act = s["activation_reserve_bytes"]
    u = prof.gpu_memory_utilization
    expected = (u * total - weights - act) / (total - weights - act)
    assert data["kv_cache_config"]["free_gpu_memory_fraction"] == round(expected, 4)
    assert data["kv_cache_config"]["max_tokens"] == prof.kv_tokens()


def test_profile_with_fixed_pool_pins_vllm_blocks():
    from servetune.profiles.schema import MemoryBudget, Profile

    profile = Profile(name="replay", memory=MemoryBudget(kv_blocks_override=101))
    data = body(export_policy(make_policy(metadata={}), "vllm", profile=profile).text)
    assert data["num-gpu-blocks-override"] == 101 and data["block-size"] == 16
    assert "gpu-memory-utilization" not in data
    # usable blocks = override - the null block; SGLang gets them in tokens
    sg = body(export_policy(make_policy(metadata={}), "sglang", profile=profile).text)
    assert sg["max-total-tokens"] == 100 * 16
    with pytest.raises(ServetuneError, match="hardware and model sections"):
        export_policy(make_policy(metadata={}), "trtllm", profile=profile)


def test_trtllm_starts_from_chunked_prefill_off():
    # trtllm-serve's --enable_chunked_prefill is off by default (engines.md 4): a policy
    # that leaves it unset exports false and says why; one that asks for it gets it.
    out = export_policy(make_policy(), "trtllm")
    assert out.settings["enable_chunked_prefill"] is False
    assert any("trtllm-serve's default" in n and "8192" in n for n in out.notes)
    asked = export_policy(make_policy(batching={"enable_chunked_prefill": True}), "trtllm")
    assert asked.settings["enable_chunked_prefill"] is True
    assert not any("enable_chunked_prefill is false" in n for n in asked.notes)
    # the other engines' defaults are on
    assert export_policy(make_policy(), "vllm").settings["enable-chunked-prefill"] is True
    assert export_policy(make_policy(), "sglang").settings["chunked-prefill-size"] == 8192
    assert export_policy(make_policy(), "tgi").env["PREFILL_CHUNKING"] == "1"


def test_tgi_fraction_by_hand():
    # TGI gives KV w * (f*M - W - A) bytes (w = TGI_WIGGLE_ROOM 0.90). FACTS: u*M - W - A =
    # 0.9*150e9 - 16e9 - 6e9 = 113e9 tuned. f = (22e9 + 113e9 / 0.9) / 150e9
    # = 147.5556e9 / 150e9 = 0.983704, rounded up: 0.9838 (u itself, 0.9, gave
    # 0.9 * 113e9 = 101.7e9: 10% less).
    mem = tgi_memory(MemoryFacts(**{k: v for k, v in FACTS.items()}))
    assert mem is not None and mem.fraction == 0.9838 and mem.kv_share == 1.0
    assert mem.needed == pytest.approx(0.983704, abs=1e-6)
    assert 0.9 * (0.9838 * 150e9 - 22e9) >= 113e9 > 0.9 * (0.9837 * 150e9 - 22e9)
    out = export_policy(make_policy(), "tgi")
    assert out.args[out.args.index("--cuda-memory-fraction") + 1] == "0.9838"
    assert out.env["TGI_WIGGLE_ROOM"] == "0.9"
    assert any("TGI's KV pool is the tuned one" in n for n in out.notes)


def test_tgi_fraction_beyond_one_is_capped_and_said():
    # M = 100e9, W = 20e9, A = 5e9, u = 0.95: tuned 95e9 - 25e9 = 70e9. f = (25e9 +
    # 70e9 / 0.9) / 100e9 = 1.0278 > 1: TGI takes 1.0 and gets 0.9 * (100e9 - 25e9)
    # = 67.5e9 = 96.43% of the tuned pool: 964 of 1000 blocks.
    facts = {"gpu_memory_bytes": 100_000_000_000, "weight_bytes": 20_000_000_000,
             "activation_bytes": 5_000_000_000, "gpu_memory_utilization": 0.95,
             "block_size": 16, "kv_blocks": 1000}
    mem = tgi_memory(MemoryFacts(**facts))
    assert mem is not None and mem.fraction == 1.0 and not mem.reaches_tuned_pool
    assert mem.needed == pytest.approx(1.027778, abs=1e-6)
    assert mem.kv_share == pytest.approx(67.5 / 70)
    out = export_policy(make_policy(metadata={"profile": facts}), "tgi")
    assert out.env["CUDA_MEMORY_FRACTION"] == "1"
    header_text = " ".join(line.lstrip("# ") for line in
                           out.text.split("# Environment variables")[0].splitlines())
    assert "KV POOL SMALLER THAN TUNED" in header_text
    assert "1.0278" in header_text and "96.4%" in header_text
    assert "about 964 of 1000 blocks" in header_text and "nightly's TGI gate" in header_text


def test_tgi_fraction_without_gpu_memory_says_the_pool_is_smaller():
    # Only u known: the fraction cannot be solved for; u gives w = 90% of the pool.
    out = export_policy(make_policy(metadata={"profile": {"gpu_memory_utilization": 0.9}}),
                        "tgi")
    assert out.env["CUDA_MEMORY_FRACTION"] == "0.9"
    assert any("about 90% of the tuned one" in n for n in out.notes)


def test_export_warns_when_tuned_for_another_engine_or_gpu(tmp_path):
    import yaml as _yaml

    meta = dict(FACTS, gpu="NVIDIA A100-SXM4-80GB")
    policy = tmp_path / "p.yaml"
    policy.write_text(_yaml.safe_dump({
        "apiVersion": "servetune/v1", "kind": "Policy", "name": "tuned",
        "metadata": {"engine": "vllm", "profile": meta}}))
    out = tmp_path / "sglang.yaml"
    res = CliRunner().invoke(app, ["export", "--policy", str(policy), "--engine", "sglang",
                                   "--profile", "gpu_profiles/h200-llama-3.1-8b.yaml",
                                   "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "warning: policy 'tuned' was tuned under servetune's 'vllm' engine model" in res.stderr
    assert "tuned on GPU 'NVIDIA A100-SXM4-80GB'" in res.stderr
    text = out.read_text()
    assert text.startswith("# WARNING: policy 'tuned' was tuned under")
    assert "weight bytes per GPU" in text  # 16e9 here, the profile's model differs
    # the same engine and no profile: nothing to warn about
    same = export_policy(make_policy(metadata={"engine": "vllm", "profile": dict(FACTS)}),
                         "vllm")
    assert same.warnings == [] and not same.text.startswith("# WARNING")
    # the file states the minimum vLLM version its options need
    assert "Requires: vLLM >= 0.6.0" in same.text
    capped = export_policy(make_policy(**FULL), "vllm")
    assert "vLLM >= 0.29.0 (`max-num-queued-reqs`" in " ".join(
        ln.lstrip("# ") for ln in capped.text.splitlines())
